"""Every message between trainers, the node daemon, its workers and the router.

Frames: ``[type][msgpack header][array frames...]`` (see ``rolloutd.native_io.framing``).
A REQUEST header is ``{"v", "id", "op", "args", "arrays"}``; ``args`` must match the op's
dataclass below exactly (unknown fields and wrong types are refused). The daemon answers every
accepted id exactly once, with REPLY ``{"v", "id", "result", "refs"}`` or ERROR
``{"v", "id", "code", "message", "details"}``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

from rolloutd.native_io.errors import BadRequest
from rolloutd.native_io.framing import encode


class MsgType(IntEnum):
    REQUEST = 1
    """client -> daemon: run ``op`` with ``args``."""
    REPLY = 2
    """daemon -> client: the final success answer to ``id``."""
    ERROR = 3
    """daemon -> client: the final failure answer to ``id``."""
    CANCEL = 4
    """client -> daemon: cancel ``id`` (its final answer then says CANCELLED)."""
    RELEASE = 5
    """client -> daemon, then supervisor -> worker: ``segments`` are no longer needed (no answer)."""
    CENSUS = 6
    """supervisor -> worker: processes per ``keys`` (``counts``), one /proc pass for the node's
    sandbox watchdogs (no answer)."""
    STARTED = 16
    """worker -> supervisor: execution of ``id`` began (it will not be re-dispatched)."""
    HELLO = 17
    """worker -> supervisor: ready, with ``index`` and ``pid``."""
    STATS = 18
    """worker -> supervisor: periodic ``stats`` (pool, queues, memory)."""
    NODE = 32
    """node <-> router: membership; the header's ``kind`` names one of ``NODE_KINDS`` below."""


CLIENT_TYPES = frozenset({MsgType.REQUEST, MsgType.CANCEL, MsgType.RELEASE})
WORKER_TYPES = frozenset({MsgType.REPLY, MsgType.ERROR, MsgType.STARTED, MsgType.HELLO, MsgType.STATS})
FINAL_TYPES = frozenset({MsgType.REPLY, MsgType.ERROR})


# --- request arguments, one dataclass per op ---------------------------------------------


@dataclass
class StatusArgs:
    pass


@dataclass
class SandboxOpenArgs:
    image: str = "default"
    """``default``, a SIF path, a sandbox folder or ``docker://...`` (converted once)."""
    network: bool = False
    ipython: bool = True
    writable: Literal["tmpfs", "overlay"] = "tmpfs"
    timeout_s: float = 300.0
    """How long to wait for a sandbox when none is warm."""


@dataclass
class SandboxRunArgs:
    sandbox_id: str
    command: str
    timeout_s: float | None = None
    """Wall-time limit of the command; None uses the sandbox's default."""


@dataclass
class SandboxIPythonArgs:
    sandbox_id: str
    code: str
    timeout_s: float | None = None


@dataclass
class SandboxCloseArgs:
    sandbox_id: str


@dataclass
class MakeArraysArgs:
    """Synthetic token arrays of a given size (benches and tests of the array transports)."""

    n_tokens: int
    n_trajectories: int = 1
    encoding: Literal["native", "msgpack", "pickle"] = "native"
    """``native``: shared memory or raw frames. The others are baselines for the bench: arrays
    as msgpack lists inside the header, or one pickled frame."""


@dataclass
class TaskRef:
    """Which task to roll out: ``inline`` (a full record), or ``instance_id`` from ``dataset``."""

    instance_id: str = ""
    dataset: str = "bundled"
    """``bundled`` or an absolute path to a JSONL file on the node."""
    inline: dict[str, Any] | None = None


@dataclass
class RolloutOptions:
    """How to roll out a task: every field of a rollout request but the task itself, with its
    default. One definition, shared by the wire message (:class:`RolloutArgs`) and the client's
    ``RolloutRequest``."""

    n: int = 1
    """Samples of this task; each gets its own sandbox, all share the task's prepared set-up."""
    agent: str = "codeact"
    agent_config: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    """Per-turn sampling params: max_tokens, temperature, top_p, top_k, seed (sample i uses seed + i)."""
    timeout_s: float = 1800.0
    """Stage time a sample may use in total (queue waits are not counted)."""
    init_timeout_s: float = 600.0
    run_timeout_s: float = 1800.0
    eval_timeout_s: float = 600.0
    priority: int = 0
    """Higher goes first in every stage queue."""
    network: bool = False
    """Network inside the sandboxes (off by default)."""
    ipython: bool = True
    infra_retries: int = 1
    """Times a sample that infrastructure ended (``ended_by`` sandbox, inference or daemon) is run
    again, within its ``timeout_s``: a batch of n comes back with n samples the model ended, or
    says which were not (``RolloutResult.shortfall``). 0 turns refills off."""


@dataclass
class RolloutArgs(RolloutOptions):
    """The ``rollout`` op's args: the task and how to roll it out."""

    task: TaskRef = field(kw_only=True)


@dataclass
class InferenceServerArgs:
    address: str
    """e.g. ``http://host:8000`` (protocol detected), ``vllm+http://...``, ``sglang+http://...``."""
    api_key: str = ""
    """Bearer token for this server (``inference.add_server``); empty = the node's
    ``inference_api_key``. Never part of a reply or the status."""


@dataclass
class WeightVersionArgs:
    version: str
    """Recorded on every turn generated from now on by servers whose protocol reports none (vLLM)."""


@dataclass
class PauseArgs:
    mode: Literal["keep", "abort", "wait"] = "keep"


@dataclass
class SleepArgs:
    """Sleep, then say where it ran: work that is not CPU-bound (dispatch tests and benches)."""

    seconds: float
    n_tokens: int = 0
    """Also return synthetic token arrays of this many tokens (as ``debug.make_arrays``)."""


OPS: dict[str, type] = {
    "status": StatusArgs,
    "sandbox.open": SandboxOpenArgs,
    "sandbox.run": SandboxRunArgs,
    "sandbox.ipython": SandboxIPythonArgs,
    "sandbox.close": SandboxCloseArgs,
    "debug.make_arrays": MakeArraysArgs,
    "rollout": RolloutArgs,
    "inference.add_server": InferenceServerArgs,
    "inference.remove_server": InferenceServerArgs,
    "inference.set_weight_version": WeightVersionArgs,
    "inference.pause": PauseArgs,
    "inference.resume": StatusArgs,
    "debug.sleep": SleepArgs,
}
"""Ops a node answers, and the dataclass their ``args`` must match."""

PINNED_OPS = frozenset({"sandbox.run", "sandbox.ipython", "sandbox.close"})
"""Ops that must go to the worker that owns ``args["sandbox_id"]``."""

DIRECT_OPS = frozenset({"sandbox.run", "sandbox.ipython"})
"""Ops a client on the node may send straight to that worker, on the link ``sandbox.open`` names
(``daemon/node/client_links.py``); the lease itself (open, close) always goes to the node."""

BROADCAST_OPS = frozenset({"inference.add_server", "inference.remove_server", "inference.set_weight_version",
                           "inference.pause", "inference.resume"})
"""Ops every worker must apply (each runs its own inference pool); answered once all have."""



# --- results -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExecuteResult:
    """What one IPython cell produced."""

    status: str
    """``ok`` or ``error``."""
    stdout: str
    stderr: str
    result: str | None
    """``text/plain`` of the cell's value (``Out[n]``), if any."""
    error: dict[str, Any] | None = None
    """``{"ename", "evalue", "traceback"}`` (traceback without colour codes) when status is error."""
    truncated: bool = False
    duration_s: float = 0.0
    displays: list[str] = field(default_factory=list)
    kernel_restarted: bool = False


# --- node <-> router membership -------------------------------------------------------------
# Frames: [empty envelope][NODE][header {"v", "kind", ...fields of the kind's dataclass}].
# Requests and answers between router and node travel as [request id][type][header][buffers...]
# (the id as envelope lets the router route an answer without decoding its header).


@dataclass
class NodeCapacity:
    """What a node offers; sent with ``register`` and every ``heartbeat``."""

    slots: int
    """Requests (rollout samples) the router may have in flight on this node at once; 0 = not ready."""
    workers_ready: int
    in_flight: int
    """Requests the node itself holds (running or queued), whoever sent them."""
    free: dict[str, int] = field(default_factory=dict)
    """Free slots per pipeline stage (``init``, ``run``, ``eval``) when the node reports stages."""
    images: list[str] = field(default_factory=list)
    """Images this node keeps warm sandboxes of."""


@dataclass
class NodeRegister:
    """node -> router: join (again); the router answers ``welcome``."""

    name: str
    """Stable name of the node (a restarted node keeps it; its old incarnation is dropped)."""
    incarnation: str
    """Random per process start: answers from an older process are never taken for this one's."""
    host: str
    pid: int
    capacity: NodeCapacity
    draining: bool = False
    token: str = ""
    """Over ipc, the proof of the name a router issued it (kept in its run folder across restarts);
    over TCP the node's CURVE key is the proof."""
    running: list[str] = field(default_factory=list)
    """Ids a router sent it that it is still working on."""
    finished: list[str] = field(default_factory=list)
    """Ids whose answers it keeps until a router acknowledges them (``RouterAck``)."""


@dataclass
class NodeHeartbeat:
    """node -> router, every ``heartbeat_interval_s`` and at once when draining changes."""

    capacity: NodeCapacity
    draining: bool = False
    """True: finish what it has, take nothing new (ops on its open sandboxes still come)."""


@dataclass
class NodeBye:
    """node -> router: leaving now; the router re-dispatches what it had there."""

    reason: str = ""


@dataclass
class RouterWelcome:
    """router -> node: registered; heartbeat at this interval or be dropped after the timeout."""

    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    token: str = ""
    """The node's proof of its name from now on (ipc)."""


@dataclass
class RouterRefused:
    """router -> node: not registered (its name is held by a live node that proved it first)."""

    reason: str


@dataclass
class RouterAck:
    """router -> node: these answers reached their trainers; the node need keep them no longer."""

    ids: list[str]


@dataclass
class RouterUnknown:
    """router -> node: a heartbeat from a node it does not know (it restarted, or dropped the
    node for silence); the node registers again."""

    reason: str = ""


@dataclass
class RouterPing:
    """router -> node: a probe whose only use is to fail on a connection that is gone."""


NODE_KINDS: dict[str, type] = {
    "register": NodeRegister,
    "heartbeat": NodeHeartbeat,
    "bye": NodeBye,
    "welcome": RouterWelcome,
    "unknown": RouterUnknown,
    "ping": RouterPing,
    "refused": RouterRefused,
    "ack": RouterAck,
}
_KIND_OF = {cls: kind for kind, cls in NODE_KINDS.items()}


def node_message(msg: Any) -> list[bytes]:
    """The frames (type onward) of a membership message."""
    return encode(MsgType.NODE, {"kind": _KIND_OF[type(msg)], **to_fields(msg)})


def parse_node_message(header: dict[str, Any]) -> Any:
    """The membership dataclass a NODE header carries, or BadRequest."""
    kind = header.get("kind")
    if kind not in NODE_KINDS:
        raise BadRequest(f"unknown node message kind {kind!r}; known: {sorted(NODE_KINDS)}")
    fields = {k: v for k, v in header.items() if k not in ("v", "kind")}
    return from_fields(NODE_KINDS[kind], fields, where=f"node message {kind}")


# --- schema checking ---------------------------------------------------------------------------


def parse_args(op: Any, args: Any) -> Any:
    """The op's args dataclass built from ``args``, or BadRequest naming what is wrong."""
    if not isinstance(op, str) or op not in OPS:
        raise BadRequest(f"unknown op {op!r}; this daemon knows {sorted(OPS)}")
    return from_fields(OPS[op], args if args is not None else {}, where=f"{op} args")


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], frozenset[str], tuple[str, ...]]:
    """(type hints, field names, required names) of a dataclass, computed once per class."""
    fields = dataclasses.fields(cls)
    required = tuple(f.name for f in fields
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return typing.get_type_hints(cls), frozenset(f.name for f in fields), required


def from_fields(cls: type, data: Any, *, where: str) -> Any:
    if not isinstance(data, dict):
        raise BadRequest(f"{where} must be a map, got {type(data).__name__}")
    hints, names, required = _schema(cls)
    unknown = sorted(set(data) - names)
    if unknown:
        raise BadRequest(f"{where}: unknown field(s) {unknown}; allowed: {sorted(names)}")
    for name in required:
        if name not in data:
            raise BadRequest(f"{where}: missing required field {name!r}")
    return cls(**{name: _check(hints[name], value, f"{where}.{name}") for name, value in data.items()})


@functools.cache
def _kind(tp: Any) -> tuple[str, tuple[Any, ...]]:
    """What ``_check`` does for type ``tp``, worked out once per type: ``typing``'s introspection
    costs more than the checks themselves, and every request is checked on the node."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any", ()
    if origin in (typing.Union, types.UnionType):
        return "union", typing.get_args(tp)
    if tp is type(None):
        return "none", ()
    if origin is Literal:
        return "literal", typing.get_args(tp)
    if origin is list:
        return "list", typing.get_args(tp)
    if origin is dict:
        return "dict", typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return "dataclass", ()
    if tp is float:
        return "float", ()
    if tp is int:
        return "int", ()
    return "type", ()


def _check(tp: Any, value: Any, where: str) -> Any:
    kind, args = _kind(tp)
    if kind == "any":
        return value
    if kind == "union":
        if value is None and type(None) in args:
            return None
        for option in args:
            try:
                return _check(option, value, where)
            except BadRequest:
                continue
        raise BadRequest(f"{where}: {value!r} is not a valid {tp}")
    if kind == "none":
        if value is None:
            return None
        raise BadRequest(f"{where}: expected null")
    if kind == "literal":
        if value in args:
            return value
        raise BadRequest(f"{where}: {value!r} is not one of {list(args)}")
    if kind == "list":
        if not isinstance(value, list):
            raise BadRequest(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = args
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind == "dict":
        if not isinstance(value, dict):
            raise BadRequest(f"{where}: expected a map, got {type(value).__name__}")
        k_tp, v_tp = args
        return {_check(k_tp, k, where): _check(v_tp, v, f"{where}[{k!r}]") for k, v in value.items()}
    if kind == "dataclass":
        return from_fields(tp, value, where=where)
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # NaN compares false with every limit: it would mean none
                raise BadRequest(f"{where}: must be a finite number, got {value!r}")
            return float(value)
    elif kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise BadRequest(f"{where}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__} {value!r:.60}")


_SCALARS = (str, int, float, bool, type(None), bytes)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def to_fields(obj: Any) -> dict[str, Any]:
    """``dataclasses.asdict(obj)``, at a fraction of its cost for the flat records that most
    answers are (it deep-copies every value through several calls)."""
    return {name: _plain(getattr(obj, name)) for name in _field_names(type(obj))}


def _plain(value: Any) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_fields(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return copy.deepcopy(value)  # as asdict does with what it does not know
