"""No coroutine of rolloutd blocks its event loop with a sleep, a tree removal or copy, or a
subprocess run: those go through ``asyncio.sleep``, ``asyncio.to_thread`` or
``asyncio.create_subprocess_exec``. Read from the source with ast, so a new one fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("native_io", "client", "daemon", "cli")
BLOCKING = frozenset({("time", "sleep"), ("shutil", "rmtree"), ("shutil", "copytree"), ("subprocess", "run"),
                      ("subprocess", "check_call"), ("subprocess", "check_output")})


def blocking_calls_in_coroutines(source: str, where: str) -> list[str]:
    """``module.function(...)`` calls of BLOCKING made directly in an ``async def`` (not in a
    function nested in it, which may run in a thread, and not handed to ``to_thread`` uncalled)."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.AsyncFunctionDef):
            continue
        nested = {id(m) for n in ast.walk(fn) if isinstance(n, (ast.FunctionDef, ast.Lambda)) for m in ast.walk(n)}
        for call in ast.walk(fn):
            if id(call) in nested or not isinstance(call, ast.Call):
                continue
            f = call.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in BLOCKING:
                found.append(f"{where}:{call.lineno}: {f.value.id}.{f.attr}() in async def {fn.name}")
    return found


def test_no_coroutine_blocks_the_loop() -> None:
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found += blocking_calls_in_coroutines(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


def test_the_check_bites() -> None:
    source = ("import shutil, time\n"
              "async def f():\n    time.sleep(1)\n    await g(shutil.rmtree)\n"
              "    def in_thread():\n        shutil.rmtree('x')\n")
    assert blocking_calls_in_coroutines(source, "m.py") == ["m.py:3: time.sleep() in async def f"]
