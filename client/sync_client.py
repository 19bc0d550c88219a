"""The blocking client: a thin layer that runs the asyncio client on a private event loop.

The loop runs in the caller's thread, only during a call, so a call costs no thread hand-off.
One ``RolloutClient`` per thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from rolloutd.native_io.pty_session import CommandResult
from rolloutd.native_io.wire import ExecuteResult

from .async_client import (
    AsyncRolloutClient,
    AsyncSandbox,
    CommandRequest,
    Reply,
    RolloutRequest,
    RolloutResult,
    timed_out,
)

T = TypeVar("T")


class RolloutClient:
    def __init__(self, address: str | None = None, **kwargs: Any) -> None:
        self._loop = _new_loop()
        self._async = AsyncRolloutClient(address, **kwargs)
        try:
            self._run(self._async.connect())
        except BaseException:
            self._loop.close()
            raise

    @property
    def address(self) -> str:
        return self._async.address

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._async.close())
            self._loop.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, op: str, args: dict[str, Any] | None = None, **kwargs: Any) -> Reply:
        return self._run(self._async.request(op, args, **kwargs))

    def release(self, reply: Reply | RolloutResult) -> None:
        self._run(self._async.release(reply))

    def status(self, **kwargs: Any) -> dict[str, Any]:
        return self._run(self._async.status(**kwargs))

    def submit(self, requests: list[RolloutRequest]) -> list[str]:
        return self._run(self._async.submit(requests))

    def as_completed(self, ids: list[str], *, timeout_s: float | None = None) -> Iterator[RolloutResult]:
        agen = self._async.as_completed(ids, timeout_s=timeout_s)
        while True:
            try:
                yield self._run(agen.__anext__())
            except StopAsyncIteration:
                return

    def results(self, ids: list[str], *, timeout_s: float | None = None) -> dict[str, RolloutResult]:
        return self._run(self._async.results(ids, timeout_s=timeout_s))

    def cancel(self, request_id: str) -> None:
        self._run(self._async.cancel(request_id))

    def add_inference_server(self, address: str, api_key: str | None = None) -> dict[str, Any]:
        return self._run(self._async.add_inference_server(address, api_key))

    def remove_inference_server(self, address: str) -> dict[str, Any]:
        return self._run(self._async.remove_inference_server(address))

    def set_weight_version(self, version: str) -> dict[str, Any]:
        return self._run(self._async.set_weight_version(version))

    def pause_inference(self, mode: str = "keep") -> dict[str, Any]:
        return self._run(self._async.pause_inference(mode))

    def resume_inference(self) -> dict[str, Any]:
        return self._run(self._async.resume_inference())

    def open_sandbox(self, **kwargs: Any) -> "Sandbox":
        return Sandbox(self, self._run(self._async.open_sandbox(**kwargs)))

    def _command(self, req: CommandRequest) -> Reply:
        """A sandbox command; on its worker's open link, answered without entering the event loop
        (``UnixLink.read_until``): the loop's rounds for a call cost about as much client CPU as
        the rest of it (~70 of ~150 us a command)."""
        a = self._async
        started = a.start_on_open_link(req.op, req.args, req.link, self._loop) if req.link else None
        if started is None:
            return self._run(a.request(req.op, req.args, timeout_s=req.wait_s, link=req.link))
        rid, fut, link = started
        limit = a.timeout_s if req.wait_s is None else req.wait_s
        try:
            if link.read_until(fut.done, limit):
                return fut.result()
            self._run(a.cancel(rid))
            raise timed_out(req.op, limit)
        except KeyboardInterrupt:
            self._run(a.cancel(rid))
            raise
        finally:
            a.finished(rid)


class Sandbox:
    def __init__(self, client: RolloutClient, inner: AsyncSandbox) -> None:
        self._client = client
        self._inner = inner
        self.id = inner.id
        self.info = inner.info

    def run(self, command: str, *, timeout_s: float | None = None) -> CommandResult:
        return CommandResult(**self._client._command(self._inner.run_request(command, timeout_s)).result)

    def ipython(self, code: str, *, timeout_s: float | None = None) -> ExecuteResult:
        return ExecuteResult(**self._client._command(self._inner.ipython_request(code, timeout_s)).result)

    def close(self) -> None:
        self._client._run(self._inner.close())

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    # The stock loop, not uvloop: its run_until_complete costs ~20 us against ~60 us, and a
    # blocking client enters the loop once per call.
    return asyncio.new_event_loop()
