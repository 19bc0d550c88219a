"""LoopSocket over real ipc sockets: whole multipart messages both ways, and a bad frame sends nothing."""

from __future__ import annotations

import asyncio
import select
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from rolloutd.native_io.zmq_loop import LoopSocket

ANSWER_TIMEOUT_S = 5.0
COMMAND_THROTTLE_S = 0.01


async def _pair(short_tmp: Path) -> tuple[LoopSocket, LoopSocket, asyncio.Queue[list[bytes]]]:
    ctx = zmq.Context.instance()
    address = f"ipc://{short_tmp}/loop.sock"
    received: asyncio.Queue[list[bytes]] = asyncio.Queue()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)

    def on_router(frames: list[Any]) -> None:
        received.put_nowait([f.bytes for f in frames])

    return LoopSocket(router, on_router), LoopSocket(dealer, lambda frames: None), received


async def test_multipart_messages_arrive_whole_and_in_order(short_tmp: Path) -> None:
    router, dealer, received = await _pair(short_tmp)
    try:
        big = np.arange(100_000, dtype=np.int32)
        sent = [[b"one"], [b"", b"two", b"frames"], [b"head", memoryview(b"view"), big, b"tail"]]
        for message in sent:
            dealer.send(message)
        for message in sent:
            got = await asyncio.wait_for(received.get(), 5)
            identity, *frames = got
            assert identity and frames == [bytes(memoryview(f)) for f in message]
    finally:
        dealer.close()
        router.close()


async def test_a_frame_that_is_not_a_buffer_sends_nothing(short_tmp: Path) -> None:
    router, dealer, received = await _pair(short_tmp)
    try:
        with pytest.raises(TypeError):
            dealer.send([b"first", "a str is not a buffer", b"third"])
        dealer.send([b"next", b"message"])
        _, *frames = await asyncio.wait_for(received.get(), 5)
        # A half-sent message would have swallowed this one's frames.
        assert frames == [b"next", b"message"]
        # Messages from one peer arrive in order: stray frames of the refused one would come before this.
        dealer.send([b"marker"])
        _, *frames = await asyncio.wait_for(received.get(), 5)
        assert frames == [b"marker"]
    finally:
        dealer.close()
        router.close()


async def test_a_message_that_comes_in_while_a_send_fails_is_still_read(short_tmp: Path) -> None:
    # A send that fails (a ROUTER_MANDATORY peer gone) still processes the socket's pending
    # commands, which takes the edge off its FD: a message that came in just before must then be
    # read anyway, or the socket serves nothing more until another one arrives (the router's
    # trainers' status calls went unanswered this way once an answer found its trainer gone).
    router, dealer, received = await _pair(short_tmp)
    router.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        dealer.send([b"hello"])
        await asyncio.wait_for(received.get(), ANSWER_TIMEOUT_S)
        dealer.send([b"came", b"in"])  # no await from here to the failed send: the loop does not read it
        fd = router.sock.getsockopt(zmq.FD)
        assert select.select([fd], [], [], ANSWER_TIMEOUT_S)[0], "the message never reached the router"
        # libzmq skips a send's command processing within ~1 ms of the last one: time itself is
        # what the failed send below must get past.
        time.sleep(COMMAND_THROTTLE_S)
        with pytest.raises(zmq.ZMQError):
            router.send([b"gone-peer", b"answer"])
        _, *frames = await asyncio.wait_for(received.get(), ANSWER_TIMEOUT_S)
        assert frames == [b"came", b"in"]
    finally:
        dealer.close()
        router.close()
