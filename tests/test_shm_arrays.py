"""Token arrays through shared memory: zero-copy mapping, release, reclaim, resource tracker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from daemon_fixtures import node_daemon
from support.waits import wait_until
from rolloutd.client.sync_client import RolloutClient
from rolloutd.native_io import shm

SHM = Path("/dev/shm")
RELEASE_S = 5.0
"""How long a released segment may take to show as free in the node's status."""
RECLAIM_S = 10.0
"""How long the node may take to notice a killed client and reclaim its segments."""


def test_arrays_are_mapped_without_copy(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "0", "--debug-ops") as address:
        with RolloutClient(address) as client:
            reply = client.request("debug.make_arrays", {"n_tokens": 300_000, "n_trajectories": 3})
            ids = reply.arrays["response_ids"]
            assert ids.dtype == np.int32 and ids.shape == (300_000,)
            assert list(reply.arrays["offsets"]) == [0, 100_000, 200_000, 300_000]
            assert ids[200_000] == 2 and ids[-1] == 100_001
            assert reply.arrays["response_logprobs"].dtype == np.float32
            # A view over the mapped segment, not a copy: numpy does not own the memory.
            assert not ids.flags.owndata and not ids.flags.writeable
            (segment,) = reply.segments
            assert (SHM / segment).exists()
            assert client.status()["shm_segments"] == 1
            client.release(reply)
            # Released segments go back to the worker's arena and are refilled by the next reply.
            wait_until(lambda: client.status()["shm_segments"] == 0, RELEASE_S, "the released segment back in the arena")
            again = client.request("debug.make_arrays", {"n_tokens": 1000, "n_trajectories": 1})
            assert again.segments == [segment]
            assert again.arrays["response_ids"][999] == 999


def test_frames_transport_gives_the_same_arrays(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "0", "--debug-ops") as address:
        with RolloutClient(address, arrays="frames") as frames, RolloutClient(address) as shared:
            a = frames.request("debug.make_arrays", {"n_tokens": 5000, "n_trajectories": 2})
            b = shared.request("debug.make_arrays", {"n_tokens": 5000, "n_trajectories": 2})
            assert a.segments == [] and b.segments
            assert a.arrays.keys() == b.arrays.keys()
            for key in a.arrays:
                np.testing.assert_array_equal(a.arrays[key], b.arrays[key])


CLIENT_THAT_DIES = """
import os, sys, time
from rolloutd.client.sync_client import RolloutClient
c = RolloutClient(sys.argv[1])
r = c.request("debug.make_arrays", {"n_tokens": 50000})
print(r.segments[0], flush=True)
time.sleep(60)
"""


def test_segments_of_a_killed_client_are_reclaimed(short_tmp: Path) -> None:
    env = {"ROLLOUTD_SHM_LEASE_TIMEOUT_S": "1"}
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "0", "--debug-ops", env=env) as address:
        proc = subprocess.Popen([sys.executable, "-c", CLIENT_THAT_DIES, address], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        segment = proc.stdout.readline().strip()
        assert (SHM / segment).exists()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        with RolloutClient(address) as client:
            wait_until(lambda: client.status()["counters"]["segments_reclaimed"], RECLAIM_S,
                       "the killed client's segment reclaimed")
        with RolloutClient(address) as client:
            st = client.status()
            assert st["counters"]["segments_reclaimed"] == 1 and st["shm_segments"] == 0


def test_reader_exit_does_not_unlink_the_writers_segment(short_tmp: Path) -> None:
    arena = shm.SegmentArena(f"rld-test-{os.getpid()}-")
    refs = arena.write({"x": np.arange(10, dtype=np.int32)})
    name = refs[0].segment
    assert name is not None
    try:
        code = (
            "import sys, pickle; from rolloutd.native_io import shm, framing;"
            "refs=[framing.ArrayRef.from_wire(r) for r in pickle.loads(bytes.fromhex(sys.argv[1]))];"
            "a=shm.SegmentMaps().map(refs); assert int(a['x'].sum()) == 45"
        )
        import pickle

        arg = pickle.dumps([r.to_wire() for r in refs]).hex()
        subprocess.run([sys.executable, "-c", code, arg], check=True)
        assert (SHM / name).exists(), "a reader's exit removed the segment"
    finally:
        arena.close()
    assert not (SHM / name).exists()


def test_reader_keeps_a_refilled_segment_mapped_and_remaps_a_replaced_one() -> None:
    arena = shm.SegmentArena(f"rld-test-{os.getpid()}-maps-")
    maps = shm.SegmentMaps()
    try:
        first_refs = arena.write({"x": np.arange(10, dtype=np.int32)})
        first = maps.map(first_refs)["x"]
        first_name = first_refs[0].segment
        assert first_name is not None
        arena.free([first_name])
        refs = arena.write({"x": np.arange(10, 20, dtype=np.int32)})
        again = maps.map(refs)["x"]
        assert refs[0].segment == first_name, "the arena did not reuse the released segment"
        assert again.base is first.base, "a refilled segment was mapped a second time"
        assert int(again.sum()) == sum(range(10, 20))
        # Another file under the same name (a restarted writer): the old mapping must not be used.
        shm.unlink(first_name)
        fd = os.open(SHM / first_name, os.O_RDWR | os.O_CREAT, 0o600)
        os.write(fd, np.full(16, 7, dtype=np.int32).tobytes())
        os.close(fd)
        replaced = maps.map(refs)["x"]
        assert replaced.base is not first.base and int(replaced.sum()) == 70
        assert int(first.sum()) == sum(range(10, 20)), "arrays from the old mapping changed under the caller"
    finally:
        arena.close()


def test_a_kept_answer_holds_its_arrays_not_the_segment_they_were_in() -> None:
    """What the supervisor keeps for a repeated id: the arrays copied into frames, so a segment
    refilled by a later reply does not change it; too large or gone, nothing is kept."""
    from rolloutd.native_io import framing

    arena = shm.SegmentArena(f"rld-test-{os.getpid()}-keep-")
    try:
        ids = np.arange(100, dtype=np.int32)
        refs = arena.write({"ids": ids, "mask": np.ones(100, dtype=np.uint8)})
        reply = framing.encode(3, {"id": "r", "result": {"n": 1}, "refs": [r.to_wire() for r in refs]})
        kept = shm.self_contained(reply, max_bytes=1 << 20)
        assert kept is not None and shm.self_contained(reply, max_bytes=200) is None
        name = refs[0].segment
        assert name is not None
        arena.free([name])
        again = arena.write({"ids": np.full(100, 9, dtype=np.int32), "mask": np.zeros(100, dtype=np.uint8)})
        assert again[0].segment == name, "the arena did not reuse the released segment"
        msg_type, header, buffers = framing.decode(kept, max_bytes=1 << 30, known_types=frozenset({3}))
        wire = [framing.ArrayRef.from_wire(r) for r in header["refs"]]
        assert msg_type == 3 and header["result"] == {"n": 1} and all(r.segment is None for r in wire)
        arrays = framing.arrays_from_frames(wire, buffers)
        assert arrays["ids"].tolist() == ids.tolist() and arrays["mask"].tolist() == [1] * 100
        shm.unlink(name)
        assert shm.self_contained(reply, max_bytes=None) is None  # its segment is gone
    finally:
        arena.close()
