"""The wire under hostile input: every malformed message gets an error answer; the daemon lives."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgpack
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon_fixtures import node_daemon
from rolloutd.client.sync_client import RolloutClient
from rolloutd.native_io.framing import PROTOCOL_VERSION
from rolloutd.native_io.wire import MsgType

REQUEST = bytes((MsgType.REQUEST,))
NO_SUCH_TYPE = b"\x09"
assert NO_SUCH_TYPE[0] not in set(MsgType)


class RawPeer:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        self.sock.connect(address)

    def ask(self, frames: list[bytes], timeout_s: float = 5.0) -> tuple[int, dict] | None:
        self.sock.send_multipart(frames)
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        reply = self.sock.recv_multipart()
        return reply[0][0], msgpack.unpackb(reply[1], raw=False)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def header(**fields: object) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def test_specific_bad_messages_get_specific_errors(short_tmp: Path) -> None:
    env = {"ROLLOUTD_MAX_MESSAGE_BYTES": "100000"}
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "0", env=env) as address:
        peer = RawPeer(address)
        try:
            cases = [
                ([REQUEST], "BAD_REQUEST"),
                ([REQUEST, b"\xc1not msgpack"], "BAD_REQUEST"),
                ([NO_SUCH_TYPE, header(id="a")], "BAD_REQUEST"),
                ([REQUEST, msgpack.packb({"v": 99, "id": "b", "op": "status"})], "UNSUPPORTED_VERSION"),
                ([REQUEST, header(id="c", op="no.such.op", args={})], "BAD_REQUEST"),
                ([REQUEST, header(id="d", op="sandbox.run", args={"sandbox_id": "x", "command": 5})], "BAD_REQUEST"),
                ([REQUEST, header(id="e", op="sandbox.run", args={"sandbox_id": "x", "command": "ls", "bogus": 1})],
                 "BAD_REQUEST"),
                ([REQUEST, header(id="f", op="sandbox.run", args={"command": "ls"})], "BAD_REQUEST"),
                ([REQUEST, header(id="", op="status")], "BAD_REQUEST"),
                ([REQUEST, header(id="g", op="status"), b"x" * 200_000], "MESSAGE_TOO_LARGE"),
                ([REQUEST, header(id="h", op="sandbox.run", args={"sandbox_id": "nope", "command": "ls"})],
                 "SANDBOX_LOST"),
            ]
            named = [  # a bad value is refused naming its field, before anything runs
                (header(id="j", op="sandbox.run", args={"sandbox_id": "x", "command": "ls", "timeout_s": float("nan")}),
                 "args.timeout_s"),
                (header(id="k", op="rollout", args={"task": {"instance_id": "wordwrap-001"}, "timeout_s": float("inf")}),
                 "args.timeout_s"),
                (header(id="l", op="rollout", args={"task": {"instance_id": "wordwrap-001"}, "n": -1}), "n must be"),
                (header(id="m", op="rollout", args={"task": {"instance_id": "wordwrap-001"}, "infra_retries": 50}),
                 "infra_retries"),
            ]
            cases += [([REQUEST, h], "BAD_REQUEST") for h, _ in named]
            for frames, code in cases:
                answer = peer.ask(frames)
                assert answer is not None, f"no answer to {frames[:2]!r}"
                assert answer[0] == 3 and answer[1]["code"] == code, (frames[:2], answer)
                assert answer[1]["message"]
            for h, field_name in named:
                answer = peer.ask([REQUEST, h])
                assert answer is not None and field_name in answer[1]["message"], answer
            ok = peer.ask([REQUEST, header(id="i", op="status", args={})])
            assert ok is not None and ok[0] == 2 and ok[1]["id"] == "i"
        finally:
            peer.close()


def test_fuzzed_frames_never_kill_the_daemon(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "0") as address:
        peer = RawPeer(address)
        seen = {"answers": 0}
        values = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=20),
                           st.binary(max_size=20), st.lists(st.integers(-1000, 1000), max_size=3))
        headers = st.one_of(
            st.binary(max_size=64),
            st.dictionaries(st.sampled_from(["v", "id", "op", "args", "arrays", "x"]), values, max_size=5).map(
                lambda d: msgpack.packb(d, use_bin_type=True)),
            st.builds(lambda op, args: header(id=uuid.uuid4().hex, op=op, args=args),
                      st.sampled_from(["sandbox.run", "sandbox.open", "sandbox.close", "nope"]),
                      st.dictionaries(st.sampled_from(["sandbox_id", "command", "timeout_s", "image", "zzz"]),
                                      values, max_size=3)),
        )
        # Every type but CANCEL (4) and RELEASE (5), which are answered by silence by design.
        types = st.sampled_from([b"", b"\x00", REQUEST, bytes((MsgType.REPLY,)), bytes((MsgType.ERROR,)),
                                 bytes((MsgType.STARTED,)), b"\xff", REQUEST * 2])

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(types, headers, st.lists(st.binary(max_size=32), max_size=3), st.booleans())
        def one(type_frame: bytes, head: bytes, extra: list[bytes], truncated: bool) -> None:
            frames = [type_frame] if truncated else [type_frame, head, *extra]
            answer = peer.ask(frames, timeout_s=10)
            assert answer is not None, f"no answer to {frames!r}"
            assert answer[0] in (MsgType.REPLY, MsgType.ERROR)
            seen["answers"] += 1

        try:
            one()
        finally:
            peer.close()
        assert seen["answers"] >= 150
        with RolloutClient(address) as client:
            assert all(w["ready"] for w in client.status()["workers"])
