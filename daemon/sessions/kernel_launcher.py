"""Starts an IPython kernel that opens no TCP socket at all.

Runs inside the sandbox with the image's own python3 and ipykernel (it imports nothing of
rolloutd): the daemon copies this file into the sandbox's run folder. Stock ipykernel binds a
TCP port on 127.0.0.1 to collect output from forked children; with ipc transport everywhere
else, that port would be the only network listener of a sandbox. Output of forked children
then goes to the kernel log instead of the cell.
"""

import sys

import ipykernel.kernelapp as kernelapp


class _IOPubWithoutPipe(kernelapp.IOPubThread):  # type: ignore[name-defined,misc]
    def __init__(self, socket, pipe=False, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(socket, pipe=False, **kwargs)


kernelapp.IOPubThread = _IOPubWithoutPipe  # type: ignore[attr-defined]

if __name__ == "__main__":
    kernelapp.IPKernelApp.launch_instance(argv=sys.argv[1:])
