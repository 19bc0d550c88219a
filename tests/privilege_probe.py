"""What a sandbox tries against its host: the writes that host root could make. Each line is
``name: result``; under a daemon run by anyone, every write must be denied."""

from __future__ import annotations

PROBE = r"""
echo "uid_map: $(tr -s ' ' < /proc/self/uid_map | sed 's/^ //')"
echo "capeff: $(grep CapEff /proc/self/status | cut -f2)"
(echo core > /proc/sys/kernel/core_pattern) 2>/dev/null && echo "core_pattern: written" || echo "core_pattern: denied"
(echo never > /sys/kernel/mm/transparent_hugepage/enabled) 2>/dev/null && echo "thp: written" || echo "thp: denied"
mkdir /sys/fs/cgroup/rld-probe 2>/dev/null && { rmdir /sys/fs/cgroup/rld-probe; echo "cgroup: made"; } || echo "cgroup: denied"
"""


def parse(output: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in output.strip().splitlines())


def assert_unprivileged(output: str, host_uid: int) -> None:
    """The sandbox's root is ``host_uid`` (not 0) on the host, with no capability there."""
    seen = parse(output)
    assert host_uid != 0
    inside, outside, count = seen["uid_map"].split()
    assert (outside, count) == (str(host_uid), "1"), seen  # one id, and not root's
    assert int(seen["capeff"], 16) == 0, seen
    assert (seen["core_pattern"], seen["thp"], seen["cgroup"]) == ("denied", "denied", "denied"), seen
