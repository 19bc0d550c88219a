"""Only the daemon's user may use it: the run folder is private and SO_PEERCRED is checked."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_fixtures import node_daemon
from os_users import TEST_USER as USER
from os_users import ensure_test_user

pytestmark = pytest.mark.unprivileged

RAW_CLIENT = """
import sys, zmq, msgpack
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(sys.argv[1])
s.send_multipart([b"\\x01", msgpack.packb({"v": 1, "id": "x", "op": "status", "args": {}})])
if not s.poll(10000):
    print("NO ANSWER"); sys.exit(0)
r = s.recv_multipart(); h = msgpack.unpackb(r[1], raw=False)
print(r[0][0], h.get("code"), h.get("message"))
"""

CLIENT = """
import sys
from rolloutd.client.sync_client import RolloutClient
from rolloutd.native_io.errors import RolloutdError
try:
    RolloutClient(sys.argv[1]).status()
    print("ALLOWED")
except RolloutdError as e:
    print(e.code, e)
"""


def _as_other_user(code: str, address: str) -> str:
    ensure_test_user()
    out = subprocess.run(["runuser", "-u", USER, "--", sys.executable, "-c", code, address],
                         capture_output=True, text=True, timeout=60, cwd="/tmp")
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_private_run_folder_blocks_other_users(short_tmp: Path) -> None:
    os.chmod(short_tmp, 0o755)  # only the daemon's own run folder below is private
    run_dir = short_tmp / "rd"
    with node_daemon(run_dir, "--backend", "local", "--workers", "1", "--warm", "0") as address:
        out = _as_other_user(CLIENT, address)
        assert out.startswith("PERMISSION_DENIED"), out


def test_socket_opened_up_by_mistake_still_refuses_other_users(short_tmp: Path) -> None:
    os.chmod(short_tmp, 0o755)
    run_dir = short_tmp / "rd"
    with node_daemon(run_dir, "--backend", "local", "--workers", "1", "--warm", "0") as address:
        # Simulate an admin error: folder and socket readable by everyone. SO_PEERCRED still holds.
        os.chmod(run_dir, 0o755)
        os.chmod(run_dir / "node.sock", 0o666)
        out = _as_other_user(RAW_CLIENT, address)
        assert out.startswith("3 PERMISSION_DENIED"), out
        assert str(pwd.getpwnam(USER).pw_uid) in out


RAW_LINK_CLIENT = """
import socket, struct, sys, msgpack
frames = [b"\\x01", msgpack.packb({"v": 1, "id": "x", "op": "sandbox.run", "args": {"sandbox_id": "s", "command": "id"}})]
s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])
try:  # the worker may have refused and closed already
    s.sendall(struct.pack("<I", 2) + b"".join(struct.pack("<Q", len(f)) for f in frames) + b"".join(frames))
except (BrokenPipeError, ConnectionResetError):
    pass
data = b""
while len(data) < 20 or len(data) < 20 + sum(struct.unpack_from("<2Q", data, 4)):
    chunk = s.recv(65536)
    if not chunk:
        print("CLOSED WITHOUT AN ANSWER", data); sys.exit(0)
    data += chunk
n1, n2 = struct.unpack_from("<2Q", data, 4)
print(data[20], msgpack.unpackb(data[20 + n1:20 + n1 + n2], raw=False).get("code"))
"""


def test_worker_link_opened_up_by_mistake_still_refuses_other_users(short_tmp: Path) -> None:
    os.chmod(short_tmp, 0o755)
    run_dir = short_tmp / "rd"
    with node_daemon(run_dir, "--backend", "local", "--workers", "1", "--warm", "0"):
        (link,) = run_dir.glob("w0-*.sock")
        os.chmod(run_dir, 0o755)
        os.chmod(link, 0o666)
        out = _as_other_user(RAW_LINK_CLIENT, str(link))
        assert out == "3 PERMISSION_DENIED", out
