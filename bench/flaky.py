"""Tests that once failed under load, run again and again on cores kept busy.

Each round runs the selected tests in a fresh pytest process while one CPU burner per core
spins beside it, as a full ``make test`` on a 2-core node does to them. A test is reliable here
when it passes in every round; any failure is printed with its message.

    python bench/flaky.py [--quick] [--rounds N] [--json PATH] [-- TEST ...]

Reports ``rounds``, ``runs`` (test runs in all), ``failures`` and, per test, its passes and
failures. ``leak_reports`` are counted apart: the autouse leak check (tests/conftest.py) counts
Apptainer instances machine-wide, so on a node shared with other test runs it also reports theirs;
such a test passed, and its teardown names PIDs that may be anyone's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

from common import burners, check_targets, print_table, standard_args, write_json

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_TESTS = [
    "tests/test_pty_session.py::test_timeout_interrupts_and_shell_survives",
    "tests/test_pty_session.py::test_timeout_ignoring_sigint_respawns_shell",
    "tests/test_pty_session.py::test_interrupt_before_the_shell_read_the_command_cancels_it",
    "tests/test_pool.py::test_fork_bomb_is_contained",
    "tests/test_pool.py::test_watchdog_uses_a_given_census_while_fresh",
    "tests/test_agent_codeact.py::test_command_timeout_and_failures_are_observations",
    "tests/test_ipython_session.py::test_timeout_interrupts_and_keeps_state",
]

ROUND_TIMEOUT_S = 600.0
LEAK_CHECK = "test leaked Apptainer instances"


def one_round(tests: list[str], report: Path) -> list[tuple[str, str | None]]:
    """(test id, failure message or None) for every test run in this round."""
    try:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                        *tests], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=ROUND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return [("(the round)", f"pytest did not finish within {ROUND_TIMEOUT_S:.0f} s (ROUND_TIMEOUT_S)")]
    if not report.exists():
        return [("(the round)", "pytest wrote no report: it could not collect or start")]
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        if case.find("skipped") is not None:
            continue
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        out.append((test_id, None if bad is None else (bad.get("message") or "")[:300]))
    return out


def main() -> None:
    p = standard_args(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, help="rounds to run (default 20, 3 with --quick)")
    p.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="busy processes beside the tests")
    p.add_argument("tests", nargs="*", default=DEFAULT_TESTS)
    args = p.parse_args()
    rounds = args.rounds or (3 if args.quick else 20)
    passes: Counter[str] = Counter()
    fails: Counter[str] = Counter()
    leaks: Counter[str] = Counter()
    started = time.monotonic()
    with burners(args.burners), tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for test_id, failure in one_round(args.tests, Path(tmp) / f"round-{r}.xml"):
                if failure is None:
                    passes[test_id] += 1
                elif failure.startswith("failed on teardown") and LEAK_CHECK in failure:
                    leaks[test_id] += 1
                    print(f"round {r + 1}: leak check (machine-wide) after {test_id}: {failure}", flush=True)
                else:
                    fails[test_id] += 1
                    print(f"round {r + 1}: FAILED {test_id}: {failure}", flush=True)
            print(f"round {r + 1}/{rounds} done, {sum(fails.values())} failures so far", flush=True)
    names = sorted(set(passes) | set(fails) | set(leaks))
    print_table(f"{rounds} rounds beside {args.burners} CPU burners ({time.monotonic() - started:.0f} s)",
                ["test", "passed", "failed", "leak_reports"], [[n, passes[n], fails[n], leaks[n]] for n in names])
    results: dict[str, Any] = {"rounds": rounds, "burners": args.burners,
                               "runs": sum(passes.values()) + sum(fails.values()) + sum(leaks.values()),
                               "failures": sum(fails.values()), "leak_reports": sum(leaks.values()),
                               "tests": {n: {"passed": passes[n], "failed": fails[n], "leak_reports": leaks[n]}
                                         for n in names}}
    write_json(args.json, results)
    ok = check_targets([("every test passes in every round", results["failures"] == 0 and results["runs"] > 0)])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
