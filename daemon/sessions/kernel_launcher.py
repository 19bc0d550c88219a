"""Starts an IPython kernel that opens no TCP socket at all.

Runs inside the sandbox with the image's own python3 and ipykernel (it imports nothing of
rolloutd): the daemon copies this file into the sandbox's run folder. Stock ipykernel binds a
TCP port on 127.0.0.1 to collect output from forked children; with ipc transport everywhere
else, that port would be the only network listener of a sandbox. Output of forked children
then goes to the kernel log instead of the cell.

Two optional packages are hidden while the kernel starts up: the debugger (debugpy) and jedi, which
IPython uses for tab completion. Importing them is a fifth or more of a kernel's start-up CPU,
paid in every sandbox, and an agent's cells use neither: the kernel then answers as one where they
are not installed (an empty ``debug_reply``, IPython's own completion). Cells can still import
both.
"""

import sys

_HIDDEN = ("debugpy", "jedi")
for _name in _HIDDEN:
    sys.modules[_name] = None  # type: ignore[assignment]  # `import` raises ImportError

import ipykernel.kernelapp as kernelapp  # noqa: E402


class _IOPubWithoutPipe(kernelapp.IOPubThread):  # type: ignore[name-defined,misc]
    def __init__(self, socket, pipe=False, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(socket, pipe=False, **kwargs)


kernelapp.IOPubThread = _IOPubWithoutPipe  # type: ignore[attr-defined]

if __name__ == "__main__":
    app = kernelapp.IPKernelApp.instance()
    app.initialize(sys.argv[1:])  # ipykernel 7 imports its debugger here, not with kernelapp
    for _name in _HIDDEN:
        if sys.modules.get(_name, 0) is None:
            del sys.modules[_name]
    app.start()
