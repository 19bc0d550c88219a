"""The kernel launcher's per-cell cuts answer as the ipykernel and jupyter_client code they
replace, run in a fresh interpreter (the launcher patches those modules on import) with this
environment's ipykernel 7 and jupyter_client 8; the Apptainer image's ipykernel 6 runs them in
``test_ipython_session.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import rolloutd.daemon.sessions.kernel_launcher as launcher_module

LAUNCHER = Path(launcher_module.__file__)


def run_with_launcher(code: str) -> str:
    script = f"import runpy\nlauncher = runpy.run_path({str(LAUNCHER)!r})\n" + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_header_dates_parse_as_dateutil_parses_them() -> None:
    out = run_with_launcher("""
        from dateutil.parser import parse
        from jupyter_client import jsonutil
        for text in ["2026-12-06T01:02:03.123456+00:00", "2026-12-06T01:02:03Z", "2026-12-06T01:02:03.5-05:30",
                     "2026-12-06T01:02:03+0100"]:
            assert jsonutil.parse_date(text) == parse(text), text
        print("ok")
    """)
    assert out == "ok\n"


def test_the_signature_check_is_remembered_per_function_not_for_all() -> None:
    out = run_with_launcher("""
        from ipykernel import ipkernel, kernelbase
        class Shell:
            def with_id(self, code, *, cell_id=None): ...
            def without(self, code): ...
        first, second = Shell(), Shell()
        for _ in range(2):  # the second round answers from the cache
            assert kernelbase._accepts_parameters(first.with_id, ["cell_id", "cell_meta"]) == \\
                {"cell_id": True, "cell_meta": False}
            assert ipkernel._accepts_parameters(second.without, ["cell_id"]) == {"cell_id": False}
        print("ok")
    """)
    assert out == "ok\n"


def test_cells_left_untokenized_are_those_ipythons_token_transforms_leave_alone() -> None:
    """The launcher skips IPython's token transforms for cells without the characters their syntax
    starts with; on these cells, that gives what the transforms give."""
    out = run_with_launcher(r"""
        from IPython.core.inputtransformer2 import TransformerManager
        manager = TransformerManager()
        assert [t.__name__ for t in manager.token_transformers] == launcher["_TOKEN_TRANSFORMERS"]
        cells = ["x = 1\n", "if a != b:\n    pass\n", "s = 'a' / 2\n", "f(a,\n  /b)\n", "x = 'done'\n",
                 "a = !ls\n", "!ls\n", "%time 1\n", "b = %pwd\n", "len?\n", "/f a b\n", ",f a b\n", ";f a b\n",
                 "s = '%d' % 3\n", "q = 'why?'\n", "def f():\n    return 1\n", "x = 1  # a comment\n"]
        skipped = 0
        for cell in cells:
            lines = cell.splitlines(keepends=True)
            stock = launcher["_stock_token_transforms"](manager, lines)
            assert launcher["_token_transforms_where_needed"](manager, lines) == stock, cell
            skipped += launcher["_TOKEN_SYNTAX"].search(cell) is None
        print(skipped)
    """)
    assert out == "6\n"  # the plain cells, but the one with a line starting with / (conservatively)
