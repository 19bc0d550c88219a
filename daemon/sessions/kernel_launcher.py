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

Two waits per cell that deliver nothing are cut (``bench/command_latency.py`` shows a cell's
time against jupyter_client on the same kernel): the kernel flushes stdout and stderr twice per
cell, and each flush waits for a round trip through its IO thread even when nothing was written
(then nothing is pending, and what was written earlier is already queued on that thread ahead of
the idle status); and ipykernel sleeps 0.5 ms per cell (``_execute_sleep``, its own FIXME for
flushes that once got lost; the launch command sets it to 0).
"""

import sys

_HIDDEN = ("debugpy", "jedi")
for _name in _HIDDEN:
    sys.modules[_name] = None  # type: ignore[assignment]  # `import` raises ImportError

import ipykernel.kernelapp as kernelapp  # noqa: E402
from ipykernel import iostream  # noqa: E402

_stock_flush = iostream.OutStream.flush


def _flush_when_pending(self):  # type: ignore[no-untyped-def]
    # A build without these flags flushes as stock ipykernel does.
    if getattr(self, "_flush_pending", True) or getattr(self, "_subprocess_flush_pending", True):
        _stock_flush(self)


iostream.OutStream.flush = _flush_when_pending  # type: ignore[method-assign]


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
