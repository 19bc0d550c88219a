"""The persistent PTY shell, in every sandbox backend: framing, limits, recovery."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import select
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxLimits, SandboxSpec
from rolloutd.daemon.sandbox.lease import Lease, open_lease
from rolloutd.native_io.errors import CommandTimeout
from rolloutd.native_io.procfs import live_processes
from rolloutd.native_io.pty_command import Turns
from rolloutd.native_io.pty_session import CommandResult, PtySession, PtyShellConfig, default_shell_argv

from os_users import ensure_test_user
from support.waits import async_wait_until

STARTED_TIMEOUT_S = 10.0
LATE_OUTPUT_TIMEOUT_S = 10.0
NEXT_COMMAND_TIMEOUT_S = 15.0
"""For the command after a cancelled ``sleep 30``: half the sleep, room for a loaded machine."""
TURN_TIMEOUT_S = 5.0
"""For a waiter the turn was given to: no process involved, a loaded machine's scheduling only."""


@pytest.fixture(params=["awaited", "started_now"])
async def lease(request: pytest.FixtureRequest, backend: SandboxBackend) -> AsyncIterator[Lease]:
    """A lease whose ``run`` either awaits the command (``Lease.run``) or, as a worker does for a
    client's command, starts it at once when the shell is free (``Lease.run_now``): both must
    behave the same in every test here."""
    spec = SandboxSpec(ipython=False, limits=SandboxLimits(max_output_bytes=4096))
    lease = await open_lease(backend.create(spec))
    if request.param == "started_now":
        lease.run = functools.partial(run_started_now, lease)  # type: ignore[method-assign]
    yield lease
    await lease.destroy()


async def run_started_now(lease: Lease, command: str, *, timeout_s: float | None = None) -> CommandResult:
    """``Lease.run`` through ``Lease.run_now``, as the worker calls it: the outcome comes to a
    callback, a cancel goes to the handle; a busy shell gets the awaited path."""
    outcome: asyncio.Future[CommandResult] = asyncio.get_running_loop().create_future()

    def done(result: CommandResult | BaseException) -> None:
        if isinstance(result, BaseException):
            outcome.set_exception(result)
        else:
            outcome.set_result(result)

    handle = lease.run_now(command, timeout_s=timeout_s, done=done)
    if handle is None:
        return await Lease.run(lease, command, timeout_s=timeout_s)
    try:
        return await asyncio.shield(outcome)
    except asyncio.CancelledError:
        if outcome.done():
            raise
        handle.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await outcome  # answered once the command is interrupted
        raise


async def test_exit_code_and_output(lease: Lease) -> None:
    r = await lease.run("echo hi; echo err >&2; exit_code_probe() { return 3; }; exit_code_probe")
    assert r.exit_code == 3
    assert r.output == "hi\nerr\n"
    assert not r.truncated and r.output_bytes == 7


async def test_cwd_and_environment_persist(lease: Lease) -> None:
    await lease.run("mkdir -p sub && cd sub && export ROLLOUTD_PROBE=42")
    r = await lease.run('pwd; echo "$ROLLOUTD_PROBE"')
    assert r.output.splitlines() == [f"{lease.sandbox.workspace_inside}/sub", "42"]


async def test_multiline_and_heredoc(lease: Lease) -> None:
    cmd = "for i in 1 2; do\n  echo line$i\ndone\ncat <<'EOF'\n$NOT_EXPANDED `nor this`\nEOF\n"
    r = await lease.run(cmd)
    assert r.output == "line1\nline2\n$NOT_EXPANDED `nor this`\n"


async def test_command_reading_stdin_gets_eof(lease: Lease) -> None:
    r = await lease.run("cat; read -r x; echo read_rc=$?", timeout_s=5)
    assert r.output == "read_rc=1\n"


async def test_background_job_does_not_block(lease: Lease) -> None:
    r = await lease.run("sleep 30 &\necho started")
    assert r.output == "started\n" and r.exit_code == 0
    assert (await lease.run("jobs -p | wc -l")).output.strip() == "1"


async def test_binary_and_invalid_utf8(lease: Lease) -> None:
    r = await lease.run(r"printf 'ok\xff\xfe\x00end'")
    assert r.output_bytes == 8  # o k \xff \xfe \x00 e n d
    assert r.output.startswith("ok") and r.output.endswith("end") and "\ufffd" in r.output


async def test_very_long_line_is_capped_with_total(lease: Lease) -> None:
    r = await lease.run("head -c 300000 /dev/zero | tr '\\0' a")
    assert r.truncated and r.output_bytes == 300000
    assert r.output.startswith("a" * 2000) and r.output.endswith("a" * 2000)
    assert "bytes omitted" in r.output


async def test_long_command_text(lease: Lease) -> None:
    # Longer than the PTY line discipline's 4 KiB line limit.
    payload = "x" * 20000
    r = await lease.run(f"echo {payload} | wc -c")
    assert r.output.strip() == "20001"


async def test_a_shorter_command_runs_alone_after_a_longer_one(lease: Lease) -> None:
    # The command file is rewritten in place: nothing of the longer command may be left after it.
    assert (await lease.run("echo first; echo and-a-long-tail-that-must-not-run-again")).exit_code == 0
    r = await lease.run("echo b")
    assert (r.output, r.exit_code) == ("b\n", 0)
    assert (await lease.run("echo first; echo x")).output == "first\nx\n"


async def test_output_written_between_commands_is_not_the_next_ones(lease: Lease) -> None:
    # A background job writes after its command ended; the next command is sent before the loop
    # has read that (select waits here without running the loop): it must not get it.
    assert (await lease.run("(sleep 0.2; echo late) &")).exit_code == 0
    fd = lease.shell._fd
    assert fd is not None
    readable, _, _ = select.select([fd], [], [], LATE_OUTPUT_TIMEOUT_S)
    assert readable, f"the background job wrote nothing within {LATE_OUTPUT_TIMEOUT_S} s"
    assert (await lease.run("echo next")).output == "next\n"


async def test_timeout_interrupts_and_shell_survives(lease: Lease) -> None:
    await lease.run("export KEEP=1")
    with pytest.raises(CommandTimeout) as e:
        await lease.run("echo before; sleep 20", timeout_s=0.5)
    assert e.value.details["shell_restarted"] is False
    assert "before" in e.value.details["output"]
    assert (await lease.run('echo "$KEEP"')).output == "1\n"


async def test_shells_get_default_signals_where_the_daemon_ignores_them(backend: SandboxBackend) -> None:
    # A daemon (or test run) started in the background by a script ignores SIGINT and SIGQUIT,
    # under nohup SIGHUP: its shells must not inherit that, or the ^C of a timed-out command
    # would not stop it and every time-out would cost the shell.
    spec = SandboxSpec(ipython=False, limits=SandboxLimits(max_output_bytes=4096))
    ignored = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
    before = [signal.signal(sig, signal.SIG_IGN) for sig in ignored]
    try:
        lease = await open_lease(backend.create(spec))
    finally:
        for sig, handler in zip(ignored, before):
            signal.signal(sig, handler)
    try:
        mask = int((await lease.run("sed -n 's/^SigIgn:\\t//p' /proc/self/status")).output, 16)
        assert mask & sum(1 << (sig - 1) for sig in ignored) == 0, f"SigIgn {mask:#x}"
        await lease.run("export KEEP=1")
        with pytest.raises(CommandTimeout) as e:
            await lease.run("sleep 20", timeout_s=0.5)
        assert e.value.details["shell_restarted"] is False
        assert (await lease.run('echo "$KEEP"')).output == "1\n"
    finally:
        await lease.destroy()


async def test_timeout_ignoring_sigint_respawns_shell(lease: Lease) -> None:
    await lease.run("export KEEP=1")
    with pytest.raises(CommandTimeout) as e:
        await lease.run("trap '' INT; sleep 20", timeout_s=0.3)
    assert e.value.details["shell_restarted"] is True
    r = await lease.run('echo "alive:$KEEP"')
    assert r.output == "alive:\n"
    assert lease.shell.restarts == 1


async def test_a_cancelled_command_is_interrupted_and_the_next_runs_once(lease: Lease) -> None:
    # A cancelled request (its client gave up on it) must not leave its command holding the
    # shell: the next command would wait behind it, and the cancelled command's queued line
    # would source the next command's file a second time.
    await lease.run("export KEEP=1")
    running = asyncio.ensure_future(lease.run("sleep 30; echo late"))
    await async_wait_until(lambda: any(p.comm == "sleep" and p.session == lease.shell.pid for p in live_processes()),
                           STARTED_TIMEOUT_S, "the command's sleep running")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    r = await asyncio.wait_for(lease.run('echo x >> n; wc -l < n; echo "$KEEP"'), NEXT_COMMAND_TIMEOUT_S)
    assert r.output == "1\n1\n" and not r.shell_restarted
    assert (await lease.run("cat n")).output == "x\n"


async def test_exit_restarts_shell(lease: Lease) -> None:
    r = await lease.run("echo bye; exit 7")
    assert r.exit_code == 7 and r.shell_restarted and r.output == "bye\n"
    assert (await lease.run("echo back")).output == "back\n"


async def test_syntax_error_is_an_exit_code_not_a_crash(lease: Lease) -> None:
    r = await lease.run("if then fi")
    assert r.exit_code == 2 and "syntax error" in r.output
    assert (await lease.run("echo fine")).output == "fine\n"


async def test_output_cannot_fake_the_sentinel(lease: Lease) -> None:
    r = await lease.run(r"printf '\036RLD0123456789abcdef:0\036\nafter\n'")
    assert r.output.endswith("after\n") and r.exit_code == 0


async def test_interrupt_before_the_shell_read_the_command_cancels_it(lease: Lease, tmp_path: Path) -> None:
    # A loaded node: the timeout's ^C lands before the shell has even read the command line. The
    # command must not run afterwards (its sleep would outlast the grace and cost the shell its
    # state), and the shell must come back.
    await lease.run("export KEEP=1")
    marker = tmp_path / "ran"
    frozen = [p.pid for p in live_processes() if p.session == lease.shell.pid]
    _signal_all(frozen, signal.SIGSTOP)
    # Thawed once the ^C is written (at the 0.3 s timeout), well inside the 1 s interrupt grace.
    thaw = asyncio.get_running_loop().call_later(0.5, _signal_all, frozen, signal.SIGCONT)
    try:
        with pytest.raises(CommandTimeout) as e:
            await lease.run(f"touch {marker}; sleep 20", timeout_s=0.3)
    finally:
        thaw.cancel()
        _signal_all(frozen, signal.SIGCONT)
    assert e.value.details["shell_restarted"] is False
    assert (await lease.run('echo "$KEEP"')).output == "1\n"
    assert not marker.exists()


async def test_a_fork_that_fails_ends_the_command_not_the_session() -> None:
    # Every sandbox of a node runs as one user, whose process count RLIMIT_NPROC caps: a shell at
    # that cap cannot fork. An interactive bash whose fork fails gives up the rest of its input
    # line; the command must still end (with bash's error), not wait out its time-out.
    user = ensure_test_user()
    folder = Path(tempfile.mkdtemp(prefix="rld-nproc-"))  # pytest's tmp_path is closed to other users
    os.chown(folder, user.pw_uid, user.pw_gid)  # the shell's user reads the command files root writes
    argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--",
            *default_shell_argv()]
    shell = PtySession(PtyShellConfig(argv=argv, command_dir_host=folder, command_dir_shell=str(folder)))
    await shell.start()
    try:
        await shell.run("ulimit -u 1", timeout_s=10)  # the shell itself is one: no fork now
        r = await shell.run("/bin/true; echo unreachable", timeout_s=FORK_FAILS_WITHIN_S + 60)
        assert r.exit_code != 0 and "bash: fork: Resource temporarily unavailable" in r.output, r
        assert r.duration_s < FORK_FAILS_WITHIN_S, r
        # The session goes on. bash may report on the failed job while it runs the next command
        # ("bash: wait_for: No record of process N", 2 runs in 16 beside CPU burners): its own
        # notice, printed during that command, so that command's output.
        lines = (await shell.run("echo still here", timeout_s=10)).output.splitlines()
        assert lines[-1:] == ["still here"] and all(line.startswith("bash: ") for line in lines[:-1]), lines
    finally:
        await shell.close()
        shutil.rmtree(folder)


FORK_FAILS_WITHIN_S = 45.0
"""bash retries a failed fork with sleeps of 1, 2, 4 and 8 s before it gives up (15 s here)."""


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def test_turns_go_in_arrival_order_and_a_cancelled_waiter_passes_its_turn_on() -> None:
    turns = Turns()
    assert turns.take_now() and not turns.take_now()
    order: list[str] = []

    async def take(name: str) -> None:
        await turns.take()
        order.append(name)

    first, second, third = (asyncio.ensure_future(take(n)) for n in ("first", "second", "third"))
    await async_wait_until(lambda: turns.waiting == 3, TURN_TIMEOUT_S, "three callers queued behind the turn")
    second.cancel()
    turns.give()
    await asyncio.wait_for(first, TURN_TIMEOUT_S)
    assert order == ["first"] and not turns.take_now()
    turns.give()
    await asyncio.wait_for(third, TURN_TIMEOUT_S)
    assert order == ["first", "third"]
    turns.give()
    assert not turns.locked() and turns.take_now()
    with pytest.raises(asyncio.CancelledError):
        await second


async def test_a_turn_handed_to_a_cancelled_waiter_goes_to_the_next() -> None:
    turns = Turns()
    assert turns.take_now()
    handed, nxt = asyncio.ensure_future(turns.take()), asyncio.ensure_future(turns.take())
    await async_wait_until(lambda: turns.waiting == 2, TURN_TIMEOUT_S, "two callers queued behind the turn")
    turns.give()  # the turn is handed to the first waiter ...
    handed.cancel()  # ... which is cancelled before it runs
    await asyncio.wait_for(nxt, TURN_TIMEOUT_S)
    assert turns.locked() and not turns.take_now()
    turns.give()
    assert not turns.locked()


async def test_a_waiter_cancelled_and_skipped_at_once_leaves_the_turn_free() -> None:
    turns = Turns()
    assert turns.take_now()
    waiter = asyncio.ensure_future(turns.take())
    await async_wait_until(lambda: turns.waiting == 1, TURN_TIMEOUT_S, "a caller queued behind the turn")
    waiter.cancel()
    turns.give()  # skips the cancelled waiter before its task has run
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiter, TURN_TIMEOUT_S)
    assert not turns.locked() and turns.waiting == 0


async def test_a_command_started_now_is_not_started_on_a_busy_shell(lease: Lease) -> None:
    running = asyncio.ensure_future(Lease.run(lease, "sleep 0.5; echo first >> order"))
    await async_wait_until(lambda: lease.shell._lock.locked(), STARTED_TIMEOUT_S, "the first command's turn")
    assert lease.run_now("echo second >> order", timeout_s=10, done=lambda _: None) is None
    await running
    assert (await lease.run("cat order")).output == "first\n"
