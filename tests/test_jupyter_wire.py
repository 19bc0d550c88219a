"""The Jupyter wire codec against jupyter_client's own Session: each side reads what the other
signs, and a tampered or wrongly keyed message is dropped."""

from __future__ import annotations

import pytest
from jupyter_client.session import Session

from rolloutd.daemon.sessions.jupyter_wire import DELIMITER, MessageSigner

KEY = b"0123456789abcdef0123456789abcdef"


def test_jupyter_client_accepts_our_request() -> None:
    msg_id, frames = MessageSigner(KEY).request("execute_request", {"code": "print('é')", "silent": False})
    at = frames.index(DELIMITER)
    msg = Session(key=KEY, signature_scheme="hmac-sha256").deserialize(frames[at + 1:])
    assert msg["header"]["msg_type"] == "execute_request"
    assert msg["header"]["msg_id"] == msg_id
    assert msg["header"]["version"] == "5.3"
    assert msg["content"] == {"code": "print('é')", "silent": False}


def _kernel_reply(key: bytes, parent_id: str) -> list[bytes]:
    """A status message as ipykernel publishes it on iopub (topic frame first)."""
    session = Session(key=key, signature_scheme="hmac-sha256")
    msg = session.msg("status", content={"execution_state": "idle"}, parent={"msg_id": parent_id})
    return [b"kernel.abc.status", *session.serialize(msg)]


def test_we_read_what_jupyter_client_signs() -> None:
    signer = MessageSigner(KEY)
    msg_id, _ = signer.request("kernel_info_request", {})
    msg = signer.parse(_kernel_reply(KEY, msg_id))
    assert msg is not None
    assert (msg.msg_type, msg.parent_id, msg.content) == ("status", msg_id, {"execution_state": "idle"})


@pytest.mark.parametrize("damage", ["tampered content", "other key", "missing frames"])
def test_bad_messages_are_dropped(damage: str) -> None:
    frames = _kernel_reply(b"other key" if damage == "other key" else KEY, "x")
    if damage == "tampered content":
        frames[-1] = frames[-1].replace(b"idle", b"busy")
    if damage == "missing frames":
        frames = frames[:-2]
    assert MessageSigner(KEY).parse(frames) is None
