"""The built-in agent's tools as OpenAI function schemas, and the Hermes tool-call parser.

A model turn calls a tool the way Qwen2.5/Hermes templates teach it::

    some reasoning
    <tool_call>
    {"name": "bash", "arguments": {"command": "ls"}}
    </tool_call>

:func:`parse_tool_call` accepts exactly one such block and checks its arguments against the
schema; anything else raises :class:`ToolCallError` whose message is written for the model (the
agent sends it back as the observation) and whose ``details["kind"]`` says what went wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutd.native_io.errors import ConfigError, ToolCallError

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
CALL_FORMAT = '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments>}}\n</tool_call>'

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "array": (list,),
                                            "object": (dict,), "boolean": (bool,), "number": (int, float)}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    properties: dict[str, dict[str, Any]] = field(default_factory=dict)
    """JSON-schema properties of the arguments (types: string, integer, array of integers)."""
    required: tuple[str, ...] = ()

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema, as chat templates take it in ``tools``."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": self.properties, "required": list(self.required)}}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


BASH = ToolSpec(
    "bash",
    "Run a bash command in the repository's persistent shell (the working directory and environment "
    "carry over between calls). Output is stdout and stderr interleaved; long output is cut in the middle.",
    {"command": {"type": "string", "description": "The command line(s) to run."}},
    ("command",),
)
IPYTHON = ToolSpec(
    "ipython",
    "Run Python code in a persistent IPython kernel started in the repository root; variables and "
    "imports persist between calls. The value of the last expression is shown.",
    {"code": {"type": "string", "description": "The Python code to run."}},
    ("code",),
)
EDITOR = ToolSpec(
    "str_replace_editor",
    "View, create and edit files. `view` shows a file with line numbers (optionally only view_range "
    "[start, end], end -1 for the last line) or lists a directory two levels deep. `create` writes a "
    "new file (refuses to overwrite). `str_replace` replaces old_str, which must occur exactly once, "
    "with new_str. `insert` inserts new_str after line insert_line (0 for the top). `undo_edit` "
    "reverts the last edit of the file. Paths are relative to the repository root or absolute.",
    {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
                    "description": "The operation."},
        "path": {"type": "string", "description": "The file or directory."},
        "file_text": {"type": "string", "description": "create: the content of the new file."},
        "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
        "new_str": {"type": "string", "description": "str_replace: the replacement (default empty); "
                                                     "insert: the text to insert."},
        "insert_line": {"type": "integer", "description": "insert: the line after which to insert."},
        "view_range": {"type": "array", "items": {"type": "integer"},
                       "description": "view: [start, end] line numbers, 1-based, end -1 for the end."},
    },
    ("command", "path"),
)
SUBMIT = ToolSpec("submit", "Finish the task: call this once the fix is in place. Takes no arguments.")

CODEACT_TOOLS: tuple[ToolSpec, ...] = (BASH, IPYTHON, EDITOR, SUBMIT)


def check_tool_names(names: object) -> None:
    """ConfigError unless ``names`` is a list of built-in tool names that includes submit."""
    known = [s.name for s in CODEACT_TOOLS]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"agent config tools must be a list of tool names ({known}), got {names!r}")
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ConfigError(f"agent config tools: unknown tool(s) {unknown}; the built-in tools are {known}")
    if SUBMIT.name not in names:
        raise ConfigError("agent config tools must include 'submit' (the only way a trajectory completes)")


def _check_type(value: object, schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    types = _JSON_TYPES.get(str(kind), (object,))
    # JSON true/false are Python bools, which are ints too.
    if isinstance(value, bool) and kind != "boolean":
        return False
    if not isinstance(value, types):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    items = schema.get("items")
    if isinstance(value, list) and items is not None:
        return all(_check_type(v, items) for v in value)
    return True


def _describe(schema: Mapping[str, Any]) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    if schema.get("type") == "array" and "items" in schema:
        return f"an array of {schema['items'].get('type', 'values')}s"
    return f"a {schema.get('type', 'value')}"


def parse_tool_call(text: str, tools: Mapping[str, ToolSpec]) -> ToolCall:
    """The one tool call in a model turn's text, checked against ``tools``."""
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        if OPEN_TAG in text:
            raise ToolCallError(f"Your tool call has no closing {CLOSE_TAG} tag. Write it as:\n{CALL_FORMAT}",
                                details={"kind": "unterminated"})
        raise ToolCallError(f"Your reply did not call a tool. Every reply must end with exactly one tool call:\n"
                            f"{CALL_FORMAT}\nCall submit when the task is done.", details={"kind": "no_call"})
    if len(blocks) > 1:
        raise ToolCallError(f"Your reply has {len(blocks)} tool calls; call exactly one tool per reply. "
                            "None of them was run.", details={"kind": "multiple"})
    body = blocks[0].strip()
    try:
        call = json.loads(body)
    except ValueError as e:
        raise ToolCallError(f"The tool call is not valid JSON ({e}). Write it as:\n{CALL_FORMAT}",
                            details={"kind": "bad_json"}) from e
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('The tool call must be a JSON object with "name" (a string) and "arguments" '
                            f"(an object):\n{CALL_FORMAT}", details={"kind": "bad_json"})
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        raise ToolCallError(f'The tool call has unexpected keys {extra}; only "name" and "arguments" are '
                            "allowed.", details={"kind": "bad_json"})
    name = call["name"]
    spec = tools.get(name)
    if spec is None:
        raise ToolCallError(f"Unknown tool {name!r}. The tools are: {', '.join(tools)}.",
                            details={"kind": "unknown_tool"})
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ToolCallError(f"The arguments of {name} are a string that is not JSON ({e}).",
                                details={"kind": "bad_json"}) from e
    if not isinstance(arguments, dict):
        raise ToolCallError(f'"arguments" of {name} must be a JSON object, got {type(arguments).__name__}.',
                            details={"kind": "bad_arguments"})
    missing = [a for a in spec.required if a not in arguments]
    if missing:
        raise ToolCallError(f"{name} needs the argument(s) {', '.join(missing)}.",
                            details={"kind": "bad_arguments"})
    unknown = sorted(set(arguments) - set(spec.properties))
    if unknown:
        allowed = ", ".join(spec.properties) or "none"
        raise ToolCallError(f"{name} has no argument(s) {', '.join(unknown)} (allowed: {allowed}).",
                            details={"kind": "bad_arguments"})
    for arg, value in arguments.items():
        schema = spec.properties[arg]
        if not _check_type(value, schema):
            raise ToolCallError(f"{name}: argument {arg} must be {_describe(schema)}, got {json.dumps(value)[:80]}.",
                                details={"kind": "bad_arguments"})
    return ToolCall(name, arguments)
