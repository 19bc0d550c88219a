"""A pytest plugin the SWE evaluator loads into the task's test run (``-p``): each test's outcome
under its exact node id, written as JSON where ``ROLLOUTD_PYTEST_REPORT`` says.

Grading reads this report rather than pytest's text: a summary line cut at the first space lost
parametrised ids such as ``test_eval[1 + 1]``. This file is copied into the sandbox and must run
with the sandbox's Python and pytest alone (nothing of rolloutd is importable there).
"""

from __future__ import annotations

import json
import os
from typing import Any

_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report: Any) -> None:
    """``passed``, ``failed``, ``skipped``, ``xfailed``, ``xpassed``, or ``error`` (its set-up or
    tear-down failed: a test that passed and then broke its tear-down is not a pass)."""
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            _outcomes[report.nodeid] = "xpassed" if report.passed else "xfailed"
        else:
            _outcomes[report.nodeid] = report.outcome
    elif report.failed:
        _outcomes[report.nodeid] = "error"
    elif report.when == "setup" and report.skipped:
        _outcomes[report.nodeid] = "xfailed" if hasattr(report, "wasxfail") else "skipped"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("ROLLOUTD_PYTEST_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"outcomes": _outcomes, "exitstatus": int(exitstatus)}, f)
