"""IPython kernels inside sandboxes: started on the first cell, execute, errors, interrupt,
restart, ipc only."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import sys
from collections.abc import AsyncIterator

import psutil
import pytest
from support.waits import async_wait_until

from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxSpec
from rolloutd.daemon.sandbox.lease import Lease, open_lease
from rolloutd.daemon.sessions import ipython
from rolloutd.daemon.sessions.ipython import _CONNECTED_SOCKETS, KernelSession
from rolloutd.daemon.sessions.jupyter_wire import KernelChannels, KernelMessage
from rolloutd.native_io.errors import CommandTimeout, KernelDied, KernelError

KERNEL_SPAWN_S = 30.0
"""How long a kernel's process may take to be spawned (not ready) in a sandbox on a loaded node."""


@pytest.fixture
async def lease(backend: SandboxBackend) -> AsyncIterator[Lease]:
    lease = await open_lease(backend.create(SandboxSpec(ipython=True)))
    yield lease
    await lease.destroy()


async def test_kernel_starts_on_the_first_cell_once(lease: Lease) -> None:
    assert lease.kernel is None and not (lease.sandbox.run_dir / "kernel.json").exists()
    before = set(lease.sandbox.process_ids())
    first, second = await asyncio.gather(lease.ipython("1"), lease.ipython("2"))
    assert (first.result, second.result) == ("1", "2")
    kernel, waited = lease.kernel, lease.kernel_start_s
    assert kernel is not None and kernel.pid is not None and kernel.restarts == 0 and waited > 0
    assert set(lease.sandbox.process_ids()) > before
    assert await lease.start_kernel() is kernel and lease.kernel_start_s == waited


async def test_a_kernel_that_cannot_start_fails_its_cell_and_the_next_cell_retries(
        lease: Lease, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(type(lease.sandbox), "python", property(lambda self: "/nonexistent/python3"))
        with pytest.raises(KernelError, match="exited during start-up"):
            await lease.ipython("1")
    assert lease.kernel is None
    assert (await lease.run("echo shell-ok")).output.strip() == "shell-ok"
    assert (await lease.ipython("6 * 7")).result == "42"


async def test_a_kernel_that_never_opens_its_sockets_fails_within_its_ready_timeout(
        lease: Lease, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait for the kernel's socket files is bounded by ``ready_timeout_s``, and the stuck
    process does not outlive the failed start."""
    monkeypatch.setattr(type(lease.sandbox), "python", property(lambda self: "sleep 600; :"))
    session = KernelSession(lease.sandbox, ready_timeout_s=1.0, name="mute")
    with pytest.raises(KernelError, match=r"did not open its sockets within 1.0 s \(ready_timeout_s\)"):
        await session.start()
    assert not any("sleep" in " ".join(psutil.Process(pid).cmdline()) for pid in lease.sandbox.process_ids())


async def test_channels_connect_once_the_kernels_sockets_exist(lease: Lease, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connected earlier, ZeroMQ would retry each connect on a timer until the kernel binds (see
    ``native_io.file_events``)."""
    missing_at_connect: list[list[str]] = []

    def channels(connection: dict[str, object]) -> KernelChannels:
        missing_at_connect.append([n for n in _CONNECTED_SOCKETS if not (lease.sandbox.run_dir / n).exists()])
        return KernelChannels(connection)

    monkeypatch.setattr(ipython, "KernelChannels", channels)
    assert (await lease.ipython("6 * 7")).result == "42"
    assert missing_at_connect == [[]]


async def test_a_kernel_starts_where_its_folder_cannot_be_watched(
        lease: Lease, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_instance_left(*args: object) -> None:
        raise OSError(errno.EMFILE, "inotify_init1: Too many open files")

    monkeypatch.setattr(ipython, "NamesAppear", no_instance_left)
    assert (await lease.ipython("6 * 7")).result == "42"
    assert "connecting to the kernel without waiting for its sockets" in caplog.text


async def test_destroy_while_the_kernel_starts_leaves_no_process(backend: SandboxBackend) -> None:
    lease = await open_lease(backend.create(SandboxSpec(ipython=True)))
    cell = asyncio.create_task(lease.ipython("1"))
    await async_wait_until(lambda: lease.kernel is not None and lease.kernel.pid is not None, KERNEL_SPAWN_S,
                           "the kernel's process started", poll_s=0.005)
    await lease.destroy()
    with pytest.raises(KernelError):
        await cell
    assert lease.kernel is None and lease.sandbox.process_ids() == []


async def test_execute_stdout_stderr_result(lease: Lease) -> None:
    r = await lease.ipython("import sys\nprint('out')\nprint('err', file=sys.stderr)\n6 * 7")
    assert (r.status, r.stdout, r.stderr, r.result) == ("ok", "out\n", "err\n", "42")


async def test_every_cells_output_arrives_with_it(lease: Lease) -> None:
    """The launcher skips the kernel's end-of-cell flushes when nothing is pending: output written
    by the cell, by a thread it started and without a newline still comes with its own cell, and
    a silent cell after a loud one gets none of it."""
    await lease.ipython("import sys, threading")
    for i in range(30):
        code = (f"print({i}); sys.stderr.write('e{i}')" if i % 3 == 0 else
                f"t = threading.Thread(target=lambda: sys.stdout.write('t{i}')); t.start(); t.join()" if i % 3 == 1
                else "x = 1")
        r = await lease.ipython(code)
        expected = ((f"{i}\n", f"e{i}") if i % 3 == 0 else (f"t{i}", "") if i % 3 == 1 else ("", ""))
        assert (r.stdout, r.stderr) == expected, (i, r)


async def test_each_cell_is_transformed_once_and_runs_as_transformed(lease: Lease) -> None:
    """ipykernel and IPython's run_cell both transform a cell; the launcher keeps the first
    result for the second. Magics, shell escapes and top-level await still work."""
    await lease.ipython("calls = []\ndef count(lines):\n    calls.append(1)\n    return lines\n"
                        "get_ipython().input_transformers_cleanup.append(count)")
    await lease.ipython("x = 1")
    assert (await lease.ipython("len(calls)")).result == "2", "a cell was transformed more than once"
    escaped = await lease.ipython("!echo from-the-shell\nlines = !echo captured\nlines[0]")
    # The shell escape's output comes through a PTY: \r\n.
    assert (escaped.stdout.strip(), escaped.result) == ("from-the-shell", "'captured'"), escaped.error
    # A top-level await of a zero-second sleep: the cell runs as a coroutine, and nothing waits.
    awaited = await lease.ipython("import asyncio\nawait asyncio.sleep(0)\n6 * 7")
    assert awaited.result == "42", awaited.error
    assert (await lease.ipython("len(calls)")).result == "5"


async def test_whether_a_cell_is_a_coroutine_is_compiled_for_once_and_only_if_it_says_await_or_async(
        lease: Lease) -> None:
    """ipykernel and IPython's run_cell both ask (IPython compiles the whole cell for it, named
    "<>"); the launcher keeps the first answer for the second, and answers no without compiling
    for a cell with neither word."""
    await lease.ipython("import builtins\nasked = []\n_compile = builtins.compile\n"
                        "def counting(source, filename, *args, **kwargs):\n"
                        "    if filename == '<>':\n        asked.append(source)\n"
                        "    return _compile(source, filename, *args, **kwargs)\n"
                        "builtins.compile = counting")
    await lease.ipython("x = 1")
    # A top-level await of a zero-second sleep: a cell that is a coroutine, and nothing waits.
    assert (await lease.ipython("import asyncio\nawait asyncio.sleep(0)\n6 * 7")).result == "42"
    counts = "builtins.compile = _compile\n[sum(c.startswith(s) for c in asked) for s in ('x = 1', 'import asyncio')]"
    assert (await lease.ipython(counts)).result == "[0, 1]"


async def test_the_statements_before_a_cells_last_are_compiled_as_one_and_run_as_they_were(lease: Lease) -> None:
    """IPython compiles and runs each top-level statement on its own; the launcher compiles those
    before the last as one block. What they do, print and raise is what it was: the last
    expression is shown, a runtime error stops the cell at its own line, and a statement that
    fails only when compiled leaves the statements before it run."""
    await lease.ipython("import builtins\ncompiled = []\n_compile = builtins.compile\n"
                        "def counting(source, filename, *args, **kwargs):\n"
                        "    if filename != '<>':\n        compiled.append(type(source).__name__)\n"
                        "    return _compile(source, filename, *args, **kwargs)\n"
                        "builtins.compile = counting")
    cell = ("total = 0\nfor i in range(4):\n    total += i\nprint('total', total)\n"
            "def twice(v):\n    return 2 * v\nclass Box:\n    size: int = 3\nlabel: str = 'box'\ntwice(total)")
    r = await lease.ipython(cell)
    assert (r.status, r.stdout, r.result) == ("ok", "total 6\n", "12"), r
    seen = await lease.ipython("builtins.compile = _compile\n"
                               "compiled[:3], Box.__qualname__, __annotations__['label'], twice.__name__")
    # The cell parsed, its six statements before the last compiled as one module, the last on its own.
    assert seen.result == "(['str', 'Module', 'Interactive'], 'Box', str, 'twice')", seen
    failed = await lease.ipython("a = 1\nprint('before')\nb = 1 / 0\nc = 3\nc")
    assert (failed.status, failed.stdout, failed.error["ename"]) == ("error", "before\n", "ZeroDivisionError")
    assert "----> 3 b = 1 / 0" in "\n".join(failed.error["traceback"]), failed.error["traceback"]
    assert (await lease.ipython("'c' in dir(), a")).result == "(False, 1)"
    late = await lease.ipython("first = 1\nsecond = 2\nreturn 3\nthird = 4\nthird")
    assert (late.status, late.error["ename"]) == ("error", "SyntaxError"), late
    assert (await lease.ipython("first + second, 'third' in dir()")).result == "(3, False)"


async def test_an_interrupt_while_the_leading_statements_compile_ends_the_cell_with_an_answer(lease: Lease) -> None:
    """The interrupt (the daemon's, on a time-out) lands in the one compile of the statements
    before the last: it is not taken for a block that does not compile (which would run the cell
    statement by statement); the cell ends with KeyboardInterrupt, none of it ran, the kernel goes on."""
    await lease.ipython("import ast\ncaching = type(get_ipython().compile)\n_call = caching.__call__\n"
                        "def interrupted(self, source, *args):\n"
                        "    if isinstance(source, ast.Module) and isinstance(source.body[0], ast.If):\n"
                        "        caching.__call__ = _call\n        raise KeyboardInterrupt\n"
                        "    return _call(self, source, *args)\n"
                        "caching.__call__ = interrupted")
    r = await lease.ipython("ran = 1\nran = 2\nran", timeout_s=10)
    assert (r.status, r.error and r.error["ename"], r.kernel_restarted) == ("error", "KeyboardInterrupt", False)
    assert (await lease.ipython("'ran' in dir()")).result == "False"


async def test_cells_without_ipython_syntax_are_not_tokenized_and_its_syntax_still_works(lease: Lease) -> None:
    """Finding IPython's syntax tokenizes the cell in pure Python; the launcher skips that where none
    of the characters it starts with is in the cell."""
    # The next cells' tokenizations, seen from inside the kernel.
    await lease.ipython("import IPython.core.inputtransformer2 as t2\ntokenized = []\n"
                        "_by_line = t2.make_tokens_by_line\ndef counting(lines):\n"
                        "    tokenized.append(''.join(lines))\n    return _by_line(lines)\n"
                        "t2.make_tokens_by_line = counting")
    plain = "total = 0\nfor i in range(3):\n    if i != 1:\n        total += i\ntotal"
    assert (await lease.ipython(plain)).result == "2"
    assert (await lease.ipython("r = '%d' % 4\nr")).result == "'4'"
    # This cell has a '%' too: it is the last one tokenized.
    seen = (await lease.ipython("earlier = tokenized[:-1]\n"
                                "[\"'%d'\" in c for c in earlier], any('total' in c for c in earlier)")).result
    assert seen == "([True], False)", seen
    for code, result in (("here = %pwd\nhere == __import__('os').getcwd()", "True"), ("/len 'abc'", "3"),
                         (",str abc", "'abc'"), ("out = !echo hi\nout[0]", "'hi'")):
        r = await lease.ipython(code)
        assert (r.status, r.result) == ("ok", result), (code, r)
    broken = await lease.ipython("if True:\n    x = 1\n  y = 2")
    assert broken.error is not None and broken.error["ename"] == "IndentationError", broken


async def test_cell_files_are_named_by_a_hash_in_c_and_tracebacks_still_show_the_cell(lease: Lease) -> None:
    """ipykernel's pure-Python murmur2 of each cell's code, for its (hidden) debugger, is replaced
    by blake2b; the file names stay unique per code, and a traceback still shows the cell's line."""
    named = await lease.ipython("import hashlib\ncode = 'y = 2'\n"
                                "name = get_ipython().compile.get_code_name(code, code, 1)\n"
                                "(name.endswith(hashlib.blake2b(code.encode(), digest_size=8).hexdigest() + '.py'), "
                                "name != get_ipython().compile.get_code_name('y = 3', 'y = 3', 1))")
    assert named.result == "(True, True)", named.error
    failed = await lease.ipython("a = 1\nb = 0\na / b")
    assert failed.error is not None and "a / b" in "\n".join(failed.error["traceback"])


async def test_state_persists_between_cells(lease: Lease) -> None:
    await lease.ipython("counter = [1, 2]")
    assert (await lease.ipython("counter.append(3); len(counter)")).result == "3"


async def test_error_with_clean_traceback(lease: Lease) -> None:
    r = await lease.ipython("def f():\n    return 1 / 0\nf()")
    assert r.status == "error"
    assert r.error is not None and r.error["ename"] == "ZeroDivisionError"
    text = "\n".join(r.error["traceback"])
    assert "return 1 / 0" in text and "\x1b[" not in text


async def test_timeout_interrupts_and_keeps_state(lease: Lease) -> None:
    await lease.ipython("kept = 'yes'")
    with pytest.raises(CommandTimeout) as e:
        await lease.ipython("import time\nprint('started', flush=True)\ntime.sleep(30)", timeout_s=1.0)
    assert e.value.details["kernel_restarted"] is False
    assert (await lease.ipython("kept")).result == "'yes'"


async def test_kernel_ignoring_interrupt_is_restarted(lease: Lease) -> None:
    kernel = await lease.start_kernel()
    await lease.ipython("kept = 1")
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: time.sleep(0.01)"
    with pytest.raises(CommandTimeout) as e:
        await lease.ipython(code, timeout_s=0.5)
    assert e.value.details["kernel_restarted"] is True
    r = await lease.ipython("'kept' in dir()")
    assert r.result == "False" and kernel.restarts == 1


async def test_dead_kernel_is_reported_and_restarted(lease: Lease) -> None:
    with pytest.raises(KernelDied):
        await lease.ipython("import os\nos._exit(3)", timeout_s=10)
    assert (await lease.ipython("1 + 1")).result == "2"


async def test_kernel_uses_ipc_only(lease: Lease) -> None:
    kernel = await lease.start_kernel()
    assert kernel.pid is not None
    info = json.loads((lease.sandbox.run_dir / "kernel.json").read_text())
    assert info["transport"] == "ipc"
    assert (lease.sandbox.run_dir / "k-1").is_socket()
    tree = psutil.Process(kernel.pid)
    procs = [tree, *tree.children(recursive=True)]
    for p in procs:
        assert p.net_connections(kind="inet") == [], f"{p.cmdline()} opened a TCP/UDP socket"


async def test_kernel_starts_without_debugger_and_jedi_but_cells_can_import_them(lease: Lease) -> None:
    loaded = await lease.ipython("import sys\nsorted(m for m in ('debugpy', 'jedi') if m in sys.modules)")
    assert loaded.result == "[]", "the kernel loaded debugpy or jedi at start-up"
    imported = await lease.ipython("import debugpy, jedi\n(debugpy.__name__, jedi.__name__)")
    assert (imported.status, imported.result) == ("ok", "('debugpy', 'jedi')"), imported.error


async def test_kernel_starts_without_the_terminal_shell_but_cells_can_use_it(lease: Lease) -> None:
    """IPython 8 imports its terminal shell with itself, for ``IPython.embed``; the launcher puts
    that off until a cell asks for it (IPython 9 does so itself)."""
    loaded = await lease.ipython("import sys\nsorted(m for m in ('prompt_toolkit', 'IPython.terminal.embed') "
                                 "if m in sys.modules)")
    assert loaded.result == "[]", "the kernel loaded the terminal shell at start-up"
    used = await lease.ipython("import IPython\nfrom IPython import embed\nimport IPython.terminal.embed as e\n"
                               "(embed is IPython.embed is e.embed, e.InteractiveShellEmbed.__name__)")
    assert (used.status, used.result) == ("ok", "(True, 'InteractiveShellEmbed')"), used.error


@contextlib.asynccontextmanager
async def kernel_channels(lease: Lease) -> AsyncIterator[KernelChannels]:
    """The lease's kernel's own channels, once its iopub delivers (a SUB socket joins late: a
    kernel_info's idle shows this one has), with nothing left unread."""
    kernel = await lease.start_kernel()
    ch = KernelChannels(kernel.connection)
    try:
        async def joined() -> None:
            while True:
                probe = ch.send(ch.shell, "kernel_info_request", {})
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(idle_of(ch, probe, []), 0.5)
        await asyncio.wait_for(joined(), KERNEL_SPAWN_S)
        ch.drain(ch.shell_replies)
        ch.drain(ch.iopub_messages)
        yield ch
    finally:
        ch.close()


async def idle_of(ch: KernelChannels, msg_id: str, published: list[KernelMessage]) -> None:
    """Read iopub into ``published`` up to ``msg_id``'s idle status."""
    while not (published and published[-1].msg_type == "status" and published[-1].parent_id == msg_id):
        published.append(await ch.next(ch.iopub_messages, KERNEL_SPAWN_S))


async def test_cells_sent_at_once_are_answered_in_order_each_with_its_output(lease: Lease) -> None:
    """The launcher sends a reply as soon as it is made and queues requests without waking its
    own loop: cells sent at once still get their replies in order, and each cell's output comes
    before its idle status (then no output is taken for the next cell's)."""
    async with kernel_channels(lease) as ch:
        sent = [ch.execute(f"print('cell-{i}')") for i in range(8)]
        replies: list[KernelMessage] = []
        while len(replies) < len(sent):  # the probes' replies may come after their idle status
            reply = await ch.next(ch.shell_replies, KERNEL_SPAWN_S)
            replies += [reply] if reply.msg_type == "execute_reply" else []
        published: list[KernelMessage] = []
        await idle_of(ch, sent[-1], published)
    assert [r.parent_id for r in replies] == sent
    counts = [r.content["execution_count"] for r in replies]
    assert all(r.content["status"] == "ok" for r in replies) and counts == sorted(set(counts))
    done: set[str | None] = set()
    output: dict[str | None, str] = {}
    for msg in published:
        if msg.msg_type == "stream":  # a cell's output may come in more than one message
            assert msg.parent_id not in done, f"output of {msg.parent_id} after its idle status"
            output[msg.parent_id] = output.get(msg.parent_id, "") + msg.content["text"]
        elif msg.msg_type == "status" and msg.content["execution_state"] == "idle":
            done.add(msg.parent_id)
    assert done >= set(sent)
    assert [output.get(msg_id) for msg_id in sent] == [f"cell-{i}\n" for i in range(len(sent))]


async def test_output_of_a_running_cell_streams_out_before_the_cell_ends(lease: Lease) -> None:
    """The launcher sets up the kernel's timed flush (every 0.2 s while output waits) without its
    IO thread's queue: output written without a flush still leaves while the cell runs on."""
    async with kernel_channels(lease) as ch:
        # Time is what is tested: the cell must still be running when its first output arrives.
        msg_id = ch.execute("import time\nprint('early')\ntime.sleep(3)\nprint('late')")
        published: list[KernelMessage] = []
        while not any(m.msg_type == "stream" for m in published):
            published.append(await ch.next(ch.iopub_messages, KERNEL_SPAWN_S))
        first = published[-1]
        await idle_of(ch, msg_id, published)
    assert (first.parent_id, first.content["text"]) == (msg_id, "early\n")
    assert "".join(m.content["text"] for m in published if m.msg_type == "stream") == "early\nlate\n"


async def test_output_across_timed_flushes_arrives_whole_and_in_order(lease: Lease,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Output flushed by the cell's own thread (at once) and by the IO thread's timed flushes,
    made here to come every 0.2 ms instead of 0.2 s, with the interpreter switching threads every
    microsecond, so the two meet often: no piece is lost or overtaken, no message is garbled (two
    threads on one socket), and the cell never hangs (a thread that holds the socket lock waiting
    for the IO thread, which waits for that lock)."""
    code = ("import sys\nsys.setswitchinterval(1e-6)\nsys.stdout.flush_interval = 0.0002\nfor i in range(4000):\n"
            "    print(i, flush=i % 3 == 0)\nsys.stdout.flush_interval = 0.2\nsys.setswitchinterval(0.005)")
    for _ in range(8):
        r = await lease.ipython(code, timeout_s=30)
        assert r.stdout == "".join(f"{k}\n" for k in range(4000)), r.truncated
    assert not [r.message for r in caplog.records if "dropping a kernel message" in r.message]


STOPPED_AT_MOST_S = 60.0
"""How long the stopped-reader test's cell, and this process's stop, may last on a loaded node."""

_STOPPED_WHILE_THE_CELL_PRINTS = """
import os, signal, sys, time
pid, go, done, limit_s = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
os.kill(pid, signal.SIGSTOP)
try:
    open(go, "w").close()
    deadline = time.monotonic() + limit_s
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.01)  # a poll of the cell's file, to the deadline: the stopped test cannot signal
finally:
    os.kill(pid, signal.SIGCONT)
"""
"""Stops the process given (this test's) while the cell prints, and lets it go on once the cell
has printed all (or after ``STOPPED_AT_MOST_S``: the test then fails on what it lost, never stays
stopped)."""


async def test_output_printed_while_the_reader_is_stopped_arrives_whole(lease: Lease) -> None:
    """The kernel keeps what its reader has not taken yet: stock ZeroMQ sockets hold 1,000
    messages a peer and then drop output without a word. This process (the reader) is stopped
    while the cell prints 10,000 flushed lines, one message each."""
    host, inside = lease.sandbox.workspace, lease.sandbox.workspace_inside
    # The cell polls for the helper's file (a condition: the helper makes it once this process is stopped),
    # to the cell's own deadline (timeout_s).
    code = (f"import os, time\nopen('{inside}/ready', 'w').close()\n"
            f"while not os.path.exists('{inside}/go'): time.sleep(0.001)  # polled to the cell's timeout\n"
            f"for i in range(10000): print(i, flush=True)\nopen('{inside}/done', 'w').close()")
    cell = asyncio.ensure_future(lease.ipython(code, timeout_s=STOPPED_AT_MOST_S))
    await async_wait_until(lambda: (host / "ready").exists() or cell.done(), KERNEL_SPAWN_S + 10, "the cell's start")
    if cell.done():  # failed before it printed: nothing to stop this process for
        cell.result()
    stopper = await asyncio.create_subprocess_exec(sys.executable, "-c", _STOPPED_WHILE_THE_CELL_PRINTS,
                                                   str(os.getpid()), str(host / "go"), str(host / "done"),
                                                   str(STOPPED_AT_MOST_S))
    r = await cell
    assert await stopper.wait() == 0
    assert r.stdout == "".join(f"{k}\n" for k in range(10000)), (r.truncated, len(r.stdout.splitlines()))
