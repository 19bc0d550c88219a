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
both. IPython 8's terminal shell (prompt_toolkit and all), which it imports with itself for
``IPython.embed`` alone, is put off until a cell uses it, as IPython 9 does itself: a kernel's start
and first cell 509 -> 411 ms, its CPU 475 -> 380 ms.

Two waits per cell that deliver nothing are cut (``bench/command_latency.py`` shows a cell's
time against jupyter_client on the same kernel): the kernel flushes stdout and stderr twice per
cell, and each flush waits for a round trip through its IO thread even when nothing was written
(then nothing is pending, and what was written earlier is already queued on that thread ahead of
the idle status); and ipykernel sleeps 0.5 ms per cell (``_execute_sleep``, its own FIXME for
flushes that once got lost; the launch command sets it to 0).

Four more costs per cell that buy nothing here are cut (the first three took the kernel's CPU
per cell from 1.62 to 1.27 ms, measured against a stock kernel in the same run): the date in each
request's header is parsed with ``datetime.fromisoformat`` rather than dateutil; whether
``do_execute`` and ``run_cell`` take a cell id is read from their signatures once, not on every
cell; the cell's code is not echoed back on iopub (``execute_input``), which only a shared
notebook front-end reads; and the kernel's logger drops debug lines before formatting them.

Four more costs per cell that carry nothing are cut (together they took the kernel's CPU per
cell from 2.17 to 1.51 ms and a cell from 2.21 to 1.75 ms p50, against the launcher without them
in the same run, two kernels in turn):

- ipykernel 6 sends every shell request's "flush the control queue" to the control thread and
  back, and then does not wait for the answer (``_flush_control_queue`` is a coroutine whose
  future is returned, not awaited): two thread hand-offs for no ordering at all. The control
  thread still serves its socket on its own loop; the daemon waits for an interrupt's answer
  before it sends the next cell anyway;
- a shell request is queued with a wake-up of the kernel's own loop through its self-pipe, from
  that loop's own thread, where the queue's put already wakes the waiting reader;
- the reply is queued on the shell stream and sent on a later loop round (another self-pipe
  wake-up), or by the flush at the end of the request: it is sent at once when nothing is queued
  ahead of it;
- the busy status that opens every request: the daemon reads only idle (the kernel's sockets
  are the daemon's alone, as for ``execute_input``). It costs a message through the IO thread,
  and one more for the daemon to read and check.

And the idle status (any iopub message sent while nothing waits for the IO thread) goes out from
the thread that made it, not through the IO thread: -0.17 ms a cell p50 and -0.19 ms of the
kernel's CPU (p50 1.84 -> 1.67 ms, CPU 1.60 -> 1.42 ms: means of two runs against the launcher
without it). The IO thread holds a lock while it runs its queue, and a direct send takes that
lock and finds the queue empty, so the socket is used by one thread at a time and nothing
overtakes what was queued before it (stream output flushed at the end of a cell is queued, and
its idle status then too). Not with ipykernel 7, whose iopub socket is an XPUB that its IO thread
also serves outside the queue (subscriptions). A thread may queue while it holds the lock, so
the IO thread's wake-up never blocks: a full wake-up pipe holds unread wake-ups that run every
queued event.

Output takes that path too. Stock ipykernel sends a cell's output through the IO thread and waits
for that thread at the end of the cell, and sets up the timed flush (every 0.2 s, so a long cell's
output streams) through the IO thread's queue, which then sends the idle status too. Here the
end-of-cell flush sends from the cell's own thread (at once when the queue is empty, else queued
behind it), and the timed flush is set up with the IO loop's thread-safe callback. Taking the
buffer and sending it is one step under the same lock on every thread, so a timed flush cannot
take earlier output and send it after later output the cell's thread sent. A ``print`` cell:
p50 3.37 -> 2.96 and 3.17 -> 2.76 ms, kernel CPU 3.01 -> 2.62 and 2.88 -> 2.45 ms, two runs
against the launcher without it.

ipykernel transforms each cell (IPython's input transformers: magics, shell escapes) to see whether
it must run as a coroutine, and IPython's ``run_cell`` then transforms it again; the second call
takes the first one's result: a six-line cell 2.79 -> 2.57 ms p50, the kernel's CPU 0.22 ms less.
Both also ask whether it must run as a coroutine, which compiles the whole cell; the second
asking takes the first answer: a 41-line cell 7.43 -> 7.02 and 6.81 -> 6.42 ms p50, the kernel's
CPU 0.37-0.44 ms less; ``x = 1`` 2-3% less. Finding IPython's own syntax in a cell (``!cmd``,
``%magic``, ``obj?``) tokenizes it in pure Python; a cell without any of the characters that syntax
starts with is not tokenized: the 41-line cell 6.94 -> 4.47 ms p50 with the change before, a
six-line one 2.73 -> 2.48 ms. And a cell without the words ``await`` and ``async`` is not compiled
to see whether it is a coroutine at all (the 41-line cell 3.59 -> 3.20 ms p50).
The statements before a cell's last are compiled and run as one block, where IPython compiles and
runs each on its own (a 41-line cell 6.88 -> 6.38 and 4.95 -> 4.70 ms p50, the kernel's CPU 0.34-0.54
ms less; a six-line cell and ``x = 1`` unchanged).
And ipykernel names the file of each cell's code by a murmur2 hash in pure Python, for its
debugger: blake2b names it here (a 41-line cell 8.29 -> 7.89 ms p50, CPU 7.35 -> 6.97 ms).
"""

import ast
import functools
import hashlib
import importlib
import inspect
import os
import re
import sys
import threading
import types
from datetime import datetime

_HIDDEN = ("debugpy", "jedi")
for _name in _HIDDEN:
    sys.modules[_name] = None  # type: ignore[assignment]  # `import` raises ImportError

_EMBED = "IPython.terminal.embed"


def _embed_when_called(*args, **kwargs):  # type: ignore[no-untyped-def]
    """``IPython.embed`` while the kernel starts: the terminal shell, imported when called."""
    return importlib.import_module(_EMBED).embed(*args, **kwargs)


# IPython 8 imports its terminal shell (prompt_toolkit and all) as it is imported itself, for
# IPython.embed alone, which a kernel never calls: ~0.1 s of a kernel's CPU and start-up. IPython
# 9 makes that import lazy itself. The stand-in goes once the kernel is up (_embed_on_access).
_embed_later = types.ModuleType(_EMBED)
_embed_later.embed = _embed_when_called  # type: ignore[attr-defined]
sys.modules[_EMBED] = _embed_later


def _embed_on_access():  # type: ignore[no-untyped-def]
    """From now on ``IPython.terminal.embed`` is the real module, and ``IPython.embed`` its
    function, imported on first access as IPython 9 does (a call through the stand-in would
    hand the terminal shell the stand-in's frame instead of the caller's)."""
    if sys.modules.get(_EMBED) is _embed_later:
        del sys.modules[_EMBED]
    ipython = sys.modules.get("IPython")
    if ipython is None or vars(ipython).get("embed") is not _embed_when_called:
        return
    del ipython.embed

    def __getattr__(name):  # type: ignore[no-untyped-def]
        if name == "embed":
            return importlib.import_module(_EMBED).embed
        raise AttributeError(f"module 'IPython' has no attribute {name!r}")

    ipython.__getattr__ = __getattr__


import ipykernel.kernelapp as kernelapp  # noqa: E402
from ipykernel import compiler, iostream, ipkernel, kernelbase  # noqa: E402
import zmq  # noqa: E402
from IPython.core import inputtransformer2, interactiveshell  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from jupyter_client import jsonutil  # noqa: E402

_stock_flush = iostream.OutStream.flush
_stock_flush_now = iostream.OutStream._flush


def _socket_lock_of(stream):  # type: ignore[no-untyped-def]
    """The lock of the stream's IO thread when the caller may send through it (this launcher's
    thread, running, in the kernel's own process: a forked child inherits the lock in whatever
    state a parent thread held it); else None."""
    pub = stream.pub_thread
    lock = getattr(pub, "_socket_lock", None)
    if lock is None or pub.thread is None or not pub.thread.is_alive() or not stream._is_master_process():
        return None
    return lock


def _flush_now_locked(self):  # type: ignore[no-untyped-def]
    # Taking the buffer and handing its text on is one step under the socket lock, on every
    # thread: the IO thread's timed flush could otherwise take an earlier piece of output and
    # queue it after a later piece the cell's thread took and sent at once.
    lock = _socket_lock_of(self)
    if lock is None:
        _stock_flush_now(self)
        return
    with lock:
        _stock_flush_now(self)


def _flush_on_this_thread(self):  # type: ignore[no-untyped-def]
    # A build without these flags flushes as stock ipykernel does.
    if not (getattr(self, "_flush_pending", True) or getattr(self, "_subprocess_flush_pending", True)):
        return
    lock = _socket_lock_of(self)
    if lock is None:
        _stock_flush(self)
        return
    # Sent from here: at once when the IO thread's queue is empty, else queued behind it.
    with lock:
        _stock_flush_now(self)


_stock_schedule_flush = iostream.OutStream._schedule_flush


def _schedule_flush_off_the_queue(self):  # type: ignore[no-untyped-def]
    # The timed flush (output of a long cell streams out every flush_interval) is set up through
    # the IO loop's own thread-safe callback, not the IO thread's queue: a queue that is not
    # empty sends the cell's output and idle status through the IO thread, not at once.
    if self._flush_pending or _socket_lock_of(self) is None:
        _stock_schedule_flush(self)
        return
    self._flush_pending = True
    self._io_loop.add_callback(self._io_loop.call_later, self.flush_interval, self._flush)


iostream.OutStream._schedule_flush = _schedule_flush_off_the_queue  # type: ignore[method-assign]
iostream.OutStream._flush = _flush_now_locked  # type: ignore[method-assign]
iostream.OutStream.flush = _flush_on_this_thread  # type: ignore[method-assign]


class _IOPubThread(kernelapp.IOPubThread):  # type: ignore[name-defined,misc]
    """Without the TCP pipe for forked children's output (see the module's note), and sending at
    once when nothing waits in its queue."""

    def __init__(self, socket, pipe=False, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(socket, pipe=False, **kwargs)
        self._socket_lock = threading.RLock()
        """Held by whichever thread uses the socket: the IO thread while it runs its events, or
        another thread sending at once (a ZeroMQ socket may change threads behind a lock), or
        any thread flushing output. Reentrant: a flush holds it while its own send takes it."""
        self._sends_at_once = getattr(self, "_xpub_stream", None) is None
        """Whether other threads may send on the socket themselves: not where the socket is an
        XPUB that the IO thread also serves outside its queue (ipykernel 7 reads subscriptions
        and sends welcome messages there), since a ZeroMQ socket serves one thread at a time."""

    def _handle_event(self, msg):  # type: ignore[no-untyped-def]
        with self._socket_lock:
            super()._handle_event(msg)

    def schedule(self, f):  # type: ignore[no-untyped-def]
        # As stock, but the wake-up never blocks: a thread may schedule while it holds the lock
        # (a flush queues its output behind the queue), and a full pipe would then wait for the
        # IO thread, which waits for the lock. A full pipe holds wake-ups not yet read, and the
        # first of them runs every event queued by then, this one too.
        if not self.thread.is_alive():
            super().schedule(f)
            return
        self._events.append(f)
        try:
            self._event_pipe.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass

    def send_multipart(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        # Sent now, on the caller's thread, when nothing is queued for the IO thread: with the
        # lock held and the queue empty, everything scheduled before has gone out, so the order
        # holds. The IO thread itself, a forked child (whose IO thread is gone), a busy queue and
        # an XPUB socket take the stock path.
        if self._sends_at_once and threading.current_thread() is not self.thread and self.thread.is_alive():
            with self._socket_lock:
                if not self._events:
                    self._really_send(*args, **kwargs)
                    return
        super().send_multipart(*args, **kwargs)


kernelapp.IOPubThread = _IOPubThread  # type: ignore[attr-defined]

_stock_bind_socket = kernelapp.IPKernelApp._bind_socket


def _bind_socket_dropping_nothing(self, s, port):  # type: ignore[no-untyped-def]
    # Stock ZeroMQ sockets hold 1,000 messages a peer and then drop what they send without a word
    # (iopub's PUB) or fail it: a cell that prints fast while the daemon reads slowly lost lines of
    # output. With no mark, what the daemon has not read yet waits in the kernel's memory, inside
    # the sandbox's limits. Set before binding: a bound socket gives the connections it accepts the
    # options it had when it was bound.
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    return _stock_bind_socket(self, s, port)


kernelapp.IPKernelApp._bind_socket = _bind_socket_dropping_nothing

_stock_dateutil_parse = jsonutil._dateutil_parse


def _parse_iso_date(text):  # type: ignore[no-untyped-def]
    # Only strings that already matched jsonutil's ISO 8601 pattern get here.
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return _stock_dateutil_parse(text)


jsonutil._dateutil_parse = _parse_iso_date


def _by_function(check):  # type: ignore[no-untyped-def]
    """``check(method, *names)`` remembered per function: a bound method is made anew on every
    access, and its signature is what the check reads."""

    @functools.lru_cache(maxsize=64)
    def on_function(function, *names):  # type: ignore[no-untyped-def]
        return check(function, *[list(n) for n in names])

    def on_method(method, *names):  # type: ignore[no-untyped-def]
        result = on_function(getattr(method, "__func__", method), *[tuple(n) for n in names])
        return dict(result) if isinstance(result, dict) else result  # callers get their own

    return on_method


# ipykernel 6 names it _accepts_cell_id, 7 _accepts_parameters.
for _check in ("_accepts_cell_id", "_accepts_parameters"):
    if hasattr(kernelbase, _check):
        _cached = _by_function(getattr(kernelbase, _check))
        for _module in (kernelbase, ipkernel):
            if hasattr(_module, _check):
                setattr(_module, _check, _cached)


def _cell_file_name(code):  # type: ignore[no-untyped-def]
    # ipykernel names the file of each cell's code by a murmur2 hash computed in pure Python, for
    # its debugger (hidden here) to find the cell again: 0.35 ms a 2,000-character cell, each
    # cell. blake2b, in C, names it as uniquely.
    name = os.environ.get("IPYKERNEL_CELL_NAME")
    if name is not None:
        return name
    digest = hashlib.blake2b(code.encode(errors="surrogatepass"), digest_size=8).hexdigest()
    return f"{compiler.get_tmp_directory()}{os.sep}{digest}.py"


compiler.get_file_name = _cell_file_name


def _answered_twice(fn):  # type: ignore[no-untyped-def]
    """``fn`` whose result is kept for the next call with the very same last argument, that one call
    only. ipykernel transforms each cell and asks whether it must run as a coroutine (which compiles
    the whole cell), then IPython's run_cell does both again for the same string, with nothing run
    in between."""
    kept = None

    @functools.wraps(fn)
    def once(*args):  # type: ignore[no-untyped-def]
        nonlocal kept
        last, kept = kept, None
        if last is not None and last[0] is args[-1]:
            return last[1]
        result = fn(*args)
        kept = (args[-1], result)
        return result
    return once


InteractiveShell.transform_cell = _answered_twice(InteractiveShell.transform_cell)

_stock_should_be_async = getattr(interactiveshell, "_should_be_async", None)


def _should_be_async(cell):  # type: ignore[no-untyped-def]
    # Only a cell with a top-level await, async for or async with runs as a coroutine, and telling
    # compiles the whole cell: one without either word cannot be one.
    return ("await" in cell or "async" in cell) and _stock_should_be_async(cell)


if _stock_should_be_async is not None:
    interactiveshell._should_be_async = _answered_twice(_should_be_async)

_TOKEN_TRANSFORMERS = ["MagicAssign", "SystemAssign", "EscapedCommand", "HelpEnd"]
_TOKEN_SYNTAX = re.compile(r"[%?]|!(?!=)|^[ \t]*[,;/]", re.MULTILINE)
"""Where one of those can start: ``a = %magic``, ``a = !cmd``, an escape (``!``, ``?``, ``%``,
``,``, ``;``, ``/``) first on a line, ``obj?``. ``!=`` is an operator."""
_stock_token_transforms = getattr(inputtransformer2.TransformerManager, "do_token_transforms", None)


def _token_transforms_where_needed(self, lines):  # type: ignore[no-untyped-def]
    # Finding IPython's syntax tokenizes the cell in pure Python, a third of a 41-line cell's time;
    # a cell with none of the characters that syntax starts with has none.
    if [t.__name__ for t in self.token_transformers] == _TOKEN_TRANSFORMERS \
            and _TOKEN_SYNTAX.search("".join(lines)) is None:
        return lines
    return _stock_token_transforms(self, lines)


if _stock_token_transforms is not None:
    inputtransformer2.TransformerManager.do_token_transforms = _token_transforms_where_needed

_stock_run_ast_nodes = InteractiveShell.run_ast_nodes
_SHOWING_THE_LAST_AT_MOST = ("last_expr", "last_expr_or_assign", "none")
"""Interactivities that display no statement but the last one."""


async def _run_leading_statements_as_one(  # type: ignore[no-untyped-def]
        self, nodelist, cell_name, interactivity="last_expr", compiler=compile, result=None):
    # IPython compiles and runs each top-level statement of a cell on its own, each with its own
    # run_code and bookkeeping. The statements before the last, which nothing displays, are
    # compiled and run here as one block (an ``if True:``, whose line numbers are the cell's own).
    # A block that does not compile as one (a statement that fails only when compiled, such as a
    # ``return`` outside a function, after statements that must still run; a __future__ import),
    # and a coroutine, take the stock path, statement by statement. An interrupt during the compile
    # is not a failure to compile: it goes up to IPython's run_cell, which ends the cell with it.
    if len(nodelist) > 2 and interactivity in _SHOWING_THE_LAST_AT_MOST and hasattr(compiler, "extra_flags"):
        head = nodelist[:-1]
        block = ast.If(test=ast.Constant(True), body=head, orelse=[])
        for node in (block, block.test):
            ast.copy_location(node, head[0])
            node.end_lineno, node.end_col_offset = head[-1].end_lineno, head[-1].end_col_offset
        try:
            with compiler.extra_flags(getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0) if self.autoawait else 0):
                code = compiler(ast.Module([block], []), cell_name, "exec")
        except Exception:
            code = None
        if code is not None and not code.co_flags & inspect.CO_COROUTINE:
            if await self.run_code(code, result):
                return True
            nodelist = nodelist[-1:]
    return await _stock_run_ast_nodes(self, nodelist, cell_name, interactivity, compiler, result)


if inspect.iscoroutinefunction(_stock_run_ast_nodes):
    InteractiveShell.run_ast_nodes = _run_leading_statements_as_one


def _no_execute_input(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    # The cell's code echoed back on iopub: the daemon sent that code and reads none of it.
    return None


kernelbase.Kernel._publish_execute_input = _no_execute_input

if inspect.iscoroutinefunction(getattr(kernelbase.Kernel, "_flush_control_queue", None)):
    # Only where the flush is a coroutine: there ``await`` returns its future unawaited.
    async def _no_control_round_trip(self):  # type: ignore[no-untyped-def]
        return None

    kernelbase.Kernel._flush_control_queue = _no_control_round_trip


if hasattr(kernelbase.Kernel, "schedule_dispatch") and hasattr(kernelbase.Kernel, "_message_counter"):
    def _schedule_dispatch(self, dispatch, *args):  # type: ignore[no-untyped-def]
        # Called on the loop's own thread (the shell stream's callback): no wake-up needed.
        self.msg_queue.put_nowait((next(self._message_counter), dispatch, args))

    kernelbase.Kernel.schedule_dispatch = _schedule_dispatch

_stock_publish_status = kernelbase.Kernel._publish_status


def _no_busy_status(self, status, channel, parent=None):  # type: ignore[no-untyped-def]
    if status != "busy":
        _stock_publish_status(self, status, channel, parent)


kernelbase.Kernel._publish_status = _no_busy_status


def _send_replies_at_once(kernel):  # type: ignore[no-untyped-def]
    """The shell stream sends a reply now when nothing is queued ahead of it (order kept). Only
    where the loop's thread owns that stream (ipykernel 7 may serve it from a thread of its own)."""
    stream = getattr(kernel, "shell_stream", None)
    if getattr(kernel, "shell_channel_thread", None) is not None or not hasattr(stream, "sending"):
        return
    queued = stream.send_multipart

    def send_multipart(msg, flags=0, copy=True, track=False, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs or track or stream.sending():
            return queued(msg, flags, copy, track, **kwargs)
        try:
            stream.socket.send_multipart(msg, flags | zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            queued(msg, flags, copy, track)
            return
        # ZeroMQ's fd is edge-triggered and any operation on the socket may take its edge: a
        # request that came meanwhile would then wake nobody. The stream checks after its own
        # sends; after this one, requests already here are taken in now.
        if stream.socket.events & zmq.POLLIN:
            stream.flush(zmq.POLLIN)

    stream.send_multipart = send_multipart


if __name__ == "__main__":
    app = kernelapp.IPKernelApp.instance()
    app.initialize(sys.argv[1:])  # ipykernel 7 imports its debugger here, not with kernelapp
    # traitlets leaves the logger at DEBUG and filters in the handler: every debug line of every
    # message (the whole reply, formatted) would be built and then dropped.
    app.log.setLevel(app.log_level)
    for _name in _HIDDEN:
        if sys.modules.get(_name, 0) is None:
            del sys.modules[_name]
    _embed_on_access()
    _send_replies_at_once(app.kernel)
    app.start()
