"""str_replace_editor through a real local sandbox's shell: every command, undo, and the errors the
model is told about (files are checked on the host side of the sandbox's workspace)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rolloutd.daemon.agents.editor import (
    READ_CHUNK_BYTES,
    SandboxEditor,
    insert_after,
    replace_once,
)
from rolloutd.daemon.sandbox.base import SandboxSpec
from rolloutd.daemon.sandbox.local import LocalBackend
from rolloutd.daemon.sandbox.lease import Lease, open_lease
from rolloutd.native_io.errors import ToolCallError

SOURCE = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture
async def lease(short_tmp: Path) -> AsyncIterator[Lease]:
    lease = await open_lease(LocalBackend(short_tmp).create(SandboxSpec(ipython=False)))
    (lease.sandbox.workspace / "pkg").mkdir()
    (lease.sandbox.workspace / "pkg" / "calc.py").write_text(SOURCE)
    (lease.sandbox.workspace / ".hidden").mkdir()
    try:
        yield lease
    finally:
        await lease.destroy()


def editor_for(lease: Lease) -> SandboxEditor:
    return SandboxEditor(lambda command: lease.run(command, timeout_s=10), lease.sandbox.workspace_inside)


async def test_view_file_range_and_directory(lease: Lease) -> None:
    editor = editor_for(lease)
    whole = await editor.execute({"command": "view", "path": "pkg/calc.py"})
    assert whole.splitlines()[1:3] == ["     1\tdef add(a, b):", "     2\t    return a - b"]
    assert len(whole.splitlines()) == 1 + len(SOURCE.split("\n"))
    part = await editor.execute({"command": "view", "path": "pkg/calc.py", "view_range": [5, 6]})
    assert part.splitlines()[1:] == ["     5\tdef sub(a, b):", "     6\t    return a - b"]
    to_end = await editor.execute({"command": "view", "path": "pkg/calc.py", "view_range": [6, -1]})
    assert to_end.splitlines()[1:] == ["     6\t    return a - b", "     7\t"]
    listing = await editor.execute({"command": "view", "path": "."})
    assert "pkg/calc.py" in listing and ".hidden" not in listing
    absolute = await editor.execute({"command": "view", "path": f"{lease.sandbox.workspace_inside}/pkg/calc.py"})
    assert absolute.splitlines()[1:] == whole.splitlines()[1:]


@pytest.mark.parametrize("view_range, message", [([0, 2], "start 0 is outside"), ([3, 2], "end 2 must be"),
                                                 ([1, 99], "end 99 must be"), ([1], "must be [start, end]")])
async def test_view_range_errors(lease: Lease, view_range: list[int], message: str) -> None:
    with pytest.raises(ToolCallError, match=message.replace("[", r"\[").replace("]", r"\]")):
        await editor_for(lease).execute({"command": "view", "path": "pkg/calc.py", "view_range": view_range})


async def test_str_replace_insert_and_undo_in_order(lease: Lease) -> None:
    editor = editor_for(lease)
    host = lease.sandbox.workspace / "pkg" / "calc.py"
    out = await editor.execute({"command": "str_replace", "path": "pkg/calc.py",
                                "old_str": "def add(a, b):\n    return a - b", "new_str": "def add(a, b):\n    return a + b"})
    assert "has been edited" in out and "     2\t    return a + b" in out
    after_replace = SOURCE.replace("return a - b", "return a + b", 1)
    assert host.read_text() == after_replace
    await editor.execute({"command": "insert", "path": "pkg/calc.py", "insert_line": 0, "new_str": '"""Calc."""'})
    assert host.read_text() == '"""Calc."""\n' + after_replace
    await editor.execute({"command": "insert", "path": "pkg/calc.py", "insert_line": 8, "new_str": "# end"})
    assert host.read_text() == '"""Calc."""\n' + after_replace + "\n# end"
    await editor.execute({"command": "undo_edit", "path": "pkg/calc.py"})
    assert host.read_text() == '"""Calc."""\n' + after_replace
    await editor.execute({"command": "undo_edit", "path": "pkg/calc.py"})
    assert host.read_text() == after_replace
    undone = await editor.execute({"command": "undo_edit", "path": "pkg/calc.py"})
    assert host.read_text() == SOURCE and "     2\t    return a - b" in undone
    with pytest.raises(ToolCallError, match="No edit of pkg/calc.py to undo"):
        await editor.execute({"command": "undo_edit", "path": "pkg/calc.py"})


async def test_create_refuses_to_overwrite_and_undo_removes(lease: Lease) -> None:
    editor = editor_for(lease)
    text = "x = 'it''s'\n$HOME `date` \\n\n"
    assert await editor.execute({"command": "create", "path": "new dir/a b.py", "file_text": text}) \
        == "File created: new dir/a b.py"
    created = lease.sandbox.workspace / "new dir" / "a b.py"
    assert created.read_text() == text
    with pytest.raises(ToolCallError, match="already exists"):
        await editor.execute({"command": "create", "path": "new dir/a b.py", "file_text": "other"})
    with pytest.raises(ToolCallError, match="already exists"):
        await editor.execute({"command": "create", "path": "pkg", "file_text": "other"})
    await editor.execute({"command": "str_replace", "path": "new dir/a b.py", "old_str": "$HOME", "new_str": "~"})
    await editor.execute({"command": "undo_edit", "path": "new dir/a b.py"})
    assert created.read_text() == text
    assert "removed" in await editor.execute({"command": "undo_edit", "path": "new dir/a b.py"})
    assert not created.exists()


async def test_edit_errors_leave_the_file_alone(lease: Lease) -> None:
    editor = editor_for(lease)
    host = lease.sandbox.workspace / "pkg" / "calc.py"
    cases = [
        ({"command": "str_replace", "path": "pkg/calc.py", "old_str": "return a * b"}, "did not appear verbatim"),
        ({"command": "str_replace", "path": "pkg/calc.py", "old_str": "return a - b"}, r"occurs 2 times .*lines 2, 6"),
        ({"command": "str_replace", "path": "pkg/calc.py", "old_str": ""}, "old_str is empty"),
        ({"command": "insert", "path": "pkg/calc.py", "insert_line": 8, "new_str": "x"}, r"outside 0\.\.7"),
        ({"command": "insert", "path": "pkg/calc.py", "insert_line": -1, "new_str": "x"}, "outside"),
        ({"command": "insert", "path": "pkg/calc.py", "new_str": "x"}, "needs the argument.*insert_line"),
        ({"command": "create", "path": "c.py"}, "needs the argument.*file_text"),
        ({"command": "str_replace", "path": "missing.py", "old_str": "a"}, "does not exist"),
        ({"command": "view", "path": "missing.py"}, "does not exist"),
        ({"command": "str_replace", "path": "pkg", "old_str": "a"}, "is a directory"),
        ({"command": "view", "path": "pkg", "view_range": [1, 2]}, "files only"),
    ]
    for arguments, message in cases:
        with pytest.raises(ToolCallError, match=message):
            await editor.execute(arguments)
    assert host.read_text() == SOURCE


async def test_large_and_binary_files(lease: Lease) -> None:
    editor = editor_for(lease)
    big = "".join(f"line {i} {'é' * (i % 7)}\n" for i in range(20_000))
    assert len(big.encode()) > 3 * READ_CHUNK_BYTES
    (lease.sandbox.workspace / "big.txt").write_text(big)
    await editor.execute({"command": "str_replace", "path": "big.txt", "old_str": "line 19999 ", "new_str": "last "})
    assert (lease.sandbox.workspace / "big.txt").read_text() == big.replace("line 19999 ", "last ")
    (lease.sandbox.workspace / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ToolCallError, match="not UTF-8"):
        await editor.execute({"command": "view", "path": "blob.bin"})
    (lease.sandbox.workspace / "empty.py").write_text("")
    await editor.execute({"command": "insert", "path": "empty.py", "insert_line": 0, "new_str": "x = 1"})
    assert (lease.sandbox.workspace / "empty.py").read_text() == "x = 1\n"


def test_pure_rules_match_the_oracle_replay() -> None:
    assert replace_once("a b a", "b", "c") == "a c a"
    assert insert_after("1\n2", 1, "x\ny") == "1\nx\ny\n2"
    assert insert_after("1\n2\n", 3, "z") == "1\n2\n\nz"
    with pytest.raises(ToolCallError):
        insert_after("1", True, "x")  # type: ignore[arg-type]  # JSON true is not a line number
