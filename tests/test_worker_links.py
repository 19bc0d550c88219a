"""A sandbox's commands on the link to the worker that holds it (daemon/node/client_links.py,
client/worker_links.py): only for a client on the node, exactly once, only the commands of a
lease, and every pending command answered when the node stops. The blocking client reads its
answers off the link without its event loop (UnixLink.read_until): there too a time-out or an
interrupt cancels the command, and a dying worker fails it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest

from daemon_fixtures import CLI, node_daemon
from support.waits import async_poll, wait_until
from rolloutd.client.async_client import AsyncRolloutClient
from rolloutd.client.sync_client import RolloutClient
from rolloutd.native_io.errors import DuplicateRequest, OperationTimeout, ShuttingDown, WorkerLost

STATS_TIMEOUT_S = 5.0
"""Workers report their counters once a second."""
RAW_TIMEOUT_S = 10.0
NEXT_COMMAND_TIMEOUT_S = 1.0
"""The limit of the command after a cancelled ``sleep 30``; its caller waits 15 s more (``_wait_s``
in client/async_client.py), half the sleep: it fails if the sleep still holds the shell."""


def raw_exchange(path: str, frames: list[bytes]) -> dict:
    """One message on a worker link in its own framing (unix_link.py), and the header of the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(RAW_TIMEOUT_S)
        s.connect(path)
        s.sendall(struct.pack("<I", len(frames)) + b"".join(struct.pack("<Q", len(f)) for f in frames)
                  + b"".join(frames))
        data = b""
        while True:
            chunk = s.recv(1 << 16)
            assert chunk, "the worker closed the link without an answer"
            data += chunk
            if len(data) >= 4:
                (count,) = struct.unpack_from("<I", data)
                lens = struct.unpack_from(f"<{count}Q", data, 4) if len(data) >= 4 + 8 * count else None
                if lens is not None and len(data) >= 4 + 8 * count + sum(lens):
                    break
        head = 4 + 8 * count
        return msgpack.unpackb(data[head + lens[0]: head + lens[0] + lens[1]], raw=False)


async def test_commands_go_on_the_link_exactly_once(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1") as address:
        async with AsyncRolloutClient(address) as c:
            async with await c.open_sandbox(ipython=False) as sb:
                link = sb.info["link"]
                assert Path(link).parent == short_tmp and (Path(link).stat().st_mode & 0o777) == 0o600
                assert (await sb.run("echo hi")).output == "hi\n"
                # One id asked by two clients while it runs, and once more after: one run, one
                # answer for all (a client joins its own repeats itself: two clients reach the link).
                args = {"sandbox_id": sb.id, "command": "sleep 0.5; echo x >> n; wc -l < n", "timeout_s": 30}
                async with AsyncRolloutClient(address) as other:
                    first, second = await asyncio.gather(
                        c.request("sandbox.run", args, request_id="once", link=link),
                        other.request("sandbox.run", args, request_id="once", link=link))
                again = await c.request("sandbox.run", args, request_id="once", link=link)
                assert first.result["output"] == second.result["output"] == again.result["output"] == "1\n"
                assert (await sb.run("wc -l < n")).output == "1\n"
                # The link's own book: three commands accepted, the two repeats joined or answered again.
                await async_poll(c.status, lambda st: st["workers"][0]["client_links"]["duplicates"] == 2,
                                 STATS_TIMEOUT_S, "the worker's report of the two repeats")
                assert (await c.status())["workers"][0]["client_links"]["requests"] == 3
                # The id asking something else is refused, naming the field, as on the node's socket.
                with pytest.raises(DuplicateRequest, match="args.command"):
                    await c.request("sandbox.run", {**args, "command": "echo other"}, request_id="once", link=link)
                # A link carries a lease's commands only; anything else goes to the node.
                for op, args in (("sandbox.open", {}), ("status", {})):
                    header = raw_exchange(link, [b"\x01", msgpack.packb({"v": 1, "id": "x", "op": op, "args": args})])
                    assert header["code"] == "BAD_REQUEST" and "node's socket" in header["message"], header
                header = raw_exchange(link, [b"\x01", b"\xc1"])  # not msgpack
                assert header["code"] == "BAD_REQUEST", header
                assert (await sb.run("echo still")).output == "still\n"


async def test_commands_sent_together_run_one_at_a_time_in_order(short_tmp: Path) -> None:
    """The first starts at once on the free shell (``Lease.run_now``), the others wait their turn
    in tasks: none may start while another holds the shell, and all run in the order sent."""
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1") as address:
        async with AsyncRolloutClient(address) as c:
            async with await c.open_sandbox(ipython=False) as sb:
                results = await asyncio.gather(sb.run("sleep 0.3; echo 1 >> order"), sb.run("echo 2 >> order"),
                                               sb.run("sleep 0.1; echo 3 >> order"), sb.run("echo 4 >> order"))
                assert [r.exit_code for r in results] == [0, 0, 0, 0]
                assert (await sb.run("cat order")).output == "1\n2\n3\n4\n"


async def test_no_link_for_a_client_that_takes_arrays_as_frames(short_tmp: Path) -> None:
    """Such a client may be on another host (the node makes every TCP and router client one)."""
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1") as address:
        async with AsyncRolloutClient(address, arrays="frames") as c:
            async with await c.open_sandbox(ipython=False) as sb:
                assert "link" not in sb.info
                assert (await sb.run("echo hi")).output == "hi\n"


async def test_a_stopping_node_answers_what_runs_on_links(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1", stop_rung=None) as address:
        async with AsyncRolloutClient(address) as c:
            sb = await c.open_sandbox(ipython=False)
            running = asyncio.ensure_future(sb.run("sleep 30"))
            await async_poll(c.status, lambda st: st["workers"][0]["in_flight"] == 1, STATS_TIMEOUT_S,
                             "the command running on the worker")
            stop = await asyncio.create_subprocess_exec(*CLI, "node", "stop", "--run-dir", str(short_tmp))
            with pytest.raises(ShuttingDown):
                await asyncio.wait_for(running, 30)
            assert await asyncio.wait_for(stop.wait(), 60) == 0


def in_flight(address: str) -> int:
    with RolloutClient(address) as c:
        return c.status()["workers"][0]["in_flight"]


def link_requests(client: RolloutClient) -> int:
    return client.status()["workers"][0]["client_links"]["requests"]


def test_the_blocking_client_reads_answers_off_the_link(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1") as address:
        with RolloutClient(address) as c, c.open_sandbox(ipython=False) as sb:
            assert sb.info["link"]
            assert sb.run("echo 0").output == "0\n"  # opens the link, on the event loop
            with monkeypatch.context() as m:
                m.setattr(c, "_run", lambda coro: pytest.fail(f"the event loop was entered for {coro!r}"))
                outputs = [sb.run(f"echo {i}").output for i in range(1, 20)]
                assert sb.run("exit 3").exit_code == 3
            assert outputs == [f"{i}\n" for i in range(1, 20)]
            wait_until(lambda: link_requests(c) == 21, STATS_TIMEOUT_S, "the worker's count of 21 link requests")


def test_the_blocking_client_cancels_a_command_it_gives_up_on(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1") as address:
        with RolloutClient(address, timeout_s=1.0) as c, c.open_sandbox(ipython=False) as sb:
            sb.run("true")  # the link is open: what follows takes the blocking path
            with pytest.raises(OperationTimeout, match="sandbox.run got no answer within 1.0 s"):
                sb.run("sleep 30")
            # The shell is free, so the sleep was cancelled and stopped.
            assert sb.run("echo next", timeout_s=NEXT_COMMAND_TIMEOUT_S).output == "next\n"


@contextmanager
def interrupt_after(seconds: float) -> Iterator[None]:
    """A ^C (SIGINT to this process: KeyboardInterrupt in the main thread) ``seconds`` from now.
    Not SIGALRM: pytest-timeout's own timer is the interval timer. Python's own handler for the
    while: a test run started in the background by a script ignores SIGINT."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGINT, previous)


def test_an_interrupted_blocking_command_is_cancelled(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1") as address:
        with RolloutClient(address) as c, c.open_sandbox(ipython=False) as sb:
            sb.run("true")
            with pytest.raises(KeyboardInterrupt), interrupt_after(0.5):
                sb.run("sleep 30")
            # The sleep no longer holds the shell.
            assert sb.run("echo next", timeout_s=NEXT_COMMAND_TIMEOUT_S).output == "next\n"


def test_a_blocking_command_fails_when_its_worker_dies(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1") as address:
        with RolloutClient(address) as c:
            sb = c.open_sandbox(ipython=False)  # not closed: its worker dies with it
            sb.run("true")
            worker_pid = c.status()["workers"][0]["pid"]

            def kill_once_running() -> None:
                wait_until(lambda: in_flight(address) == 1, STATS_TIMEOUT_S, "the command running on the worker")
                os.kill(worker_pid, signal.SIGKILL)

            killer = threading.Thread(target=kill_once_running)
            killer.start()
            try:
                with pytest.raises(WorkerLost, match="its link closed"):
                    sb.run("sleep 30")
            finally:
                killer.join()
