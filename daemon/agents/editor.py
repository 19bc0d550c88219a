"""``str_replace_editor``: SWE-agent's file editor, working through the sandbox's shell.

File contents travel as base64 through ``ctx.run`` (``base64 < file`` out, ``base64 -d > file``
in), so the editor works in any image with coreutils or busybox, on any path the shell can reach,
whatever the bytes; the daemon never touches the sandbox's files directly. The edit rules are the
pure functions below, which ``tests/test_bundled_tasks.py`` also uses to replay the oracles:

- ``view``: a file with ``cat -n``-style line numbers (``view_range`` [start, end], end -1 for the
  last line), or a directory listed two levels deep (hidden entries left out);
- ``create``: a new file (parent folders made); refuses an existing path;
- ``str_replace``: ``old_str`` must occur exactly once; ``new_str`` defaults to empty;
- ``insert``: ``new_str``'s lines go after line ``insert_line`` (0 = top);
- ``undo_edit``: restores the content before the file's last edit (a created file is removed).
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import shlex
from collections.abc import Awaitable, Callable
from typing import Any

from rolloutd.native_io.errors import ToolCallError
from rolloutd.native_io.output import tail
from rolloutd.native_io.pty_session import CommandResult

EDITOR_REQUIRED_ARGS: dict[str, frozenset[str]] = {
    "view": frozenset(),
    "create": frozenset({"file_text"}),
    "str_replace": frozenset({"old_str"}),
    "insert": frozenset({"insert_line", "new_str"}),
    "undo_edit": frozenset(),
}
SNIPPET_LINES = 4
# Raw bytes per read command: its base64 (~50 KB with line breaks) stays under the shell's
# default 64 KiB output cap.
READ_CHUNK_BYTES = 36 * 1024

RunCommand = Callable[[str], Awaitable[CommandResult]]


# --- pure edit rules -----------------------------------------------------------------------------


def number_lines(text: str, first: int = 1) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(text.split("\n"), start=first))


def view_text(text: str, view_range: list[int] | None) -> tuple[str, int]:
    """(the lines to show, the number of the first one)."""
    if view_range is None:
        return text, 1
    lines = text.split("\n")
    if len(view_range) != 2:
        raise ToolCallError(f"view_range must be [start, end], got {view_range}")
    start, end = view_range
    if not 1 <= start <= len(lines):
        raise ToolCallError(f"view_range start {start} is outside the file's lines 1..{len(lines)}")
    if end == -1:
        end = len(lines)
    if not start <= end <= len(lines):
        raise ToolCallError(f"view_range end {view_range[1]} must be -1 or lie in {start}..{len(lines)} "
                            f"(the file has {len(lines)} lines)")
    return "\n".join(lines[start - 1:end]), start


def replace_once(text: str, old_str: str, new_str: str, path: str = "the file") -> str:
    """``text`` with its single occurrence of ``old_str`` replaced."""
    if not old_str:
        raise ToolCallError("old_str is empty; give the exact text to replace")
    count = text.count(old_str)
    if count == 0:
        raise ToolCallError(f"No replacement was made: old_str did not appear verbatim in {path}.")
    if count > 1:
        lines = sorted({text.count("\n", 0, i) + 1 for i in _find_all(text, old_str)})
        raise ToolCallError(f"No replacement was made: old_str occurs {count} times in {path} (lines "
                            f"{', '.join(map(str, lines))}); include more context to make it unique.")
    return text.replace(old_str, new_str)


def insert_after(text: str, insert_line: int, new_str: str, path: str = "the file") -> str:
    """``text`` with ``new_str``'s lines inserted after line ``insert_line`` (0 = top)."""
    lines = text.split("\n")
    if isinstance(insert_line, bool) or not isinstance(insert_line, int) or not 0 <= insert_line <= len(lines):
        raise ToolCallError(f"insert_line {insert_line!r} is outside 0..{len(lines)}, the valid range for {path}")
    lines[insert_line:insert_line] = new_str.split("\n")
    return "\n".join(lines)


def _find_all(text: str, sub: str) -> list[int]:
    found, i = [], text.find(sub)
    while i != -1:
        found.append(i)
        i = text.find(sub, i + 1)
    return found


def _snippet(text: str, first_line: int, last_line: int) -> str:
    lines = text.split("\n")
    start = max(1, first_line - SNIPPET_LINES)
    end = min(len(lines), last_line + SNIPPET_LINES)
    return number_lines("\n".join(lines[start - 1:end]), start)


# --- the editor over a sandbox shell ---------------------------------------------------------------


class SandboxEditor:
    """One trajectory's editor: file I/O through ``run`` and the undo history of each path."""

    def __init__(self, run: RunCommand, workdir: str) -> None:
        self._run = run
        self.workdir = workdir
        self._history: dict[str, list[str | None]] = {}

    def resolve(self, path: str) -> str:
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(self.workdir, path))

    async def execute(self, arguments: dict[str, Any]) -> str:
        """Run one editor command; returns the observation text, raises ToolCallError."""
        command, path = arguments["command"], arguments["path"]
        missing = sorted(EDITOR_REQUIRED_ARGS[command] - set(arguments))
        if missing:
            raise ToolCallError(f"str_replace_editor {command} needs the argument(s) {', '.join(missing)}")
        target = self.resolve(path)
        if command == "view":
            return await self._view(path, target, arguments.get("view_range"))
        if command == "create":
            if await self._kind(target) != "missing":
                raise ToolCallError(f"{path} already exists; create does not overwrite. Use str_replace to edit it.")
            await self._write(target, arguments["file_text"])
            self._history.setdefault(target, []).append(None)
            return f"File created: {path}"
        if command == "undo_edit":
            return await self._undo(path, target)
        text = await self._read_file(path, target)
        if command == "str_replace":
            old, new = arguments["old_str"], arguments.get("new_str", "")
            edited = replace_once(text, old, new, path)
            first = text[:text.index(old)].count("\n") + 1
            last = first + new.count("\n")
        else:
            line = arguments["insert_line"]
            new = arguments["new_str"]
            edited = insert_after(text, line, new, path)
            first, last = line + 1, line + 1 + new.count("\n")
        await self._write(target, edited)
        self._history.setdefault(target, []).append(text)
        return (f"The file {path} has been edited. A snippet of the result:\n{_snippet(edited, first, last)}\n"
                "Review the change; use undo_edit to revert it if it is wrong.")

    async def _view(self, path: str, target: str, view_range: list[int] | None) -> str:
        kind = await self._kind(target)
        if kind == "dir":
            if view_range is not None:
                raise ToolCallError(f"view_range applies to files only; {path} is a directory")
            listing = await self._shell(f"find {shlex.quote(target)} -maxdepth 2 -not -path '*/.*' | sort")
            return f"Files and directories up to 2 levels deep in {path}, hidden items excluded:\n{listing.output}"
        text = await self._read_file(path, target, kind)
        shown, first = view_text(text, view_range)
        return f"Here's the result of running `cat -n` on {path}:\n{number_lines(shown, first)}"

    async def _undo(self, path: str, target: str) -> str:
        history = self._history.get(target)
        if not history:
            raise ToolCallError(f"No edit of {path} to undo.")
        previous = history.pop()
        if previous is None:
            await self._shell(f"rm -f {shlex.quote(target)}")
            return f"Undid the creation of {path}; the file is removed."
        await self._write(target, previous)
        return f"Last edit of {path} undone. Its content is now:\n{number_lines(previous)}"

    async def _shell(self, command: str) -> CommandResult:
        result = await self._run(command)
        if result.exit_code != 0:
            raise ToolCallError(f"the editor's file operation failed (exit {result.exit_code}): {tail(result.output)}")
        return result

    async def _kind(self, target: str) -> str:
        q = shlex.quote(target)
        out = await self._shell(f"if [ -d {q} ]; then echo dir; elif [ -e {q} ]; then echo file; else echo missing; fi")
        return out.output.strip()

    async def _read_file(self, path: str, target: str, kind: str | None = None) -> str:
        kind = kind or await self._kind(target)
        if kind == "missing":
            raise ToolCallError(f"{path} does not exist (resolved to {target}).")
        if kind == "dir":
            raise ToolCallError(f"{path} is a directory; this command needs a file.")
        q = shlex.quote(target)
        size = int((await self._shell(f"wc -c < {q}")).output.strip() or 0)
        parts = []
        for block in range(-(-size // READ_CHUNK_BYTES)):
            # stderr is dropped: the terminal would mix it into the base64 text.
            result = await self._shell(f"dd if={q} bs={READ_CHUNK_BYTES} skip={block} count=1 2>/dev/null | base64")
            if result.truncated:
                raise ToolCallError(f"reading {path} hit the sandbox's output limit (max_output_bytes); "
                                    "view it with bash instead")
            try:
                parts.append(base64.b64decode("".join(result.output.split()), validate=True))
            except binascii.Error as e:
                raise ToolCallError(f"reading {path} through the shell returned something other than base64 "
                                    f"({e}): {result.output[:200]!r}") from e
        data = b"".join(parts)
        if len(data) != size:
            raise ToolCallError(f"could not read {path}: got {len(data)} of its {size} bytes (is it readable?)")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ToolCallError(f"{path} is not UTF-8 text ({e}); use bash to inspect binary files.") from e

    async def _write(self, target: str, text: str) -> None:
        q = shlex.quote(target)
        payload = base64.b64encode(text.encode("utf-8")).decode("ascii")
        parent = shlex.quote(posixpath.dirname(target) or "/")
        await self._shell(f"mkdir -p {parent} && printf '%s' '{payload}' | base64 -d > {q} 2>/dev/null")
