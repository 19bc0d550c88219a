"""A huge request costs its own OpenAI-proxy session, not the node: how long another session's
turns take while one session sends a multi-megabyte message, against the same session's turns
with nothing beside it (the baseline, measured in the same run).

Two proxy sessions share one event loop (uvloop), as the blackbox agents of one worker do, each
with the scripted reference policy over real HTTP and the official ``openai`` SDK as its harness.
Session B runs turns one after another (each request extends its conversation by a user message);
session A sends one heavy request after another while B's turns are timed:

- ``4MB_bytes_bound``: a 4 MB message with max_context_tokens=32768: refused on its size alone.
- ``4MB_counted``: the same message with a context its size cannot rule out: its tokens are
  counted through the tokenizer's batch call (the GIL released) in a worker thread, then refused.
- ``fits_<size>``: a message that fits a large context: rendered and encoded in a worker thread.
  The ledger's encode holds the GIL (the Rust tokenizer's single-text call), so this row shows
  what a message that is really served costs the others.

Target: B's median turn latency beside A within 2x of its unloaded median (the heavy rows that
are refused; the ``fits`` row is reported, not targeted).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import check_targets, loop_lag, percentile, print_table, standard_args, write_json  # noqa: E402
from agent_support import reference_tokenizer  # noqa: E402
from openai_proxy_inprocess import conversation, proxy, turn  # noqa: E402
from rolloutd.daemon.openai_proxy.admission import longest_token_bytes  # noqa: E402

TARGET_RATIO = 2.0


class BSession:
    """Session B: one conversation, extended by a user message per turn."""

    def __init__(self, p: Any) -> None:
        self.p = p
        self.messages = conversation("p-2")

    async def turns(self, n: int, until: asyncio.Future[Any] | None = None) -> list[float]:
        """Latencies of ``n`` turns, or (with ``until``) of turns until it is done, at least ``n``."""
        out: list[float] = []
        while len(out) < n or (until is not None and not until.done()):
            t0 = time.perf_counter()
            choice = await turn(self.p, self.messages, tools=None)
            out.append(time.perf_counter() - t0)
            self.messages += [{"role": "assistant", "content": choice.message.content},
                              {"role": "user", "content": f"Continue ({len(self.messages)})."}]
        return out


async def a_heavy(state: Path, text: str, max_context: int, repeats: int) -> tuple[list[float], str]:
    """A's heavy requests, one after another: (seconds each, how the last ended). The body is
    serialised once, up front: a harness runs in its own process, so only the proxy's work on
    it belongs on this loop."""
    async with proxy(state, max_context_tokens=max_context, max_tokens_per_turn=8) as a, a.raw() as raw:
        messages = conversation("heavy")
        messages[1] = {**messages[1], "content": messages[1]["content"] + "\n" + text}
        body = json.dumps({"model": "m", "messages": messages}).encode()
        times, outcome = [], ""
        for _ in range(repeats):
            t0 = time.perf_counter()
            answer = await raw.post("/v1/chat/completions", content=body, timeout=600,
                                    headers={"Content-Type": "application/json"})
            times.append(time.perf_counter() - t0)
            outcome = "served" if answer.status_code == 200 else answer.json()["error"]["code"]
            a.session.stop_reason = None  # a refusal ends A's trajectory; the bench wants more of them
        return times, outcome


async def bench(quick: bool) -> dict[str, Any]:
    megabytes = 4 if not quick else 1
    huge = "word " * (megabytes * 1024 * 1024 // 5)
    fits = "word " * (8 * 1024 // 5)  # about 1600 tokens: within the reference policy's context
    # A context the message's bytes alone rule out (32768 tokens for 4 MB of the reference tokenizer).
    bytes_bound = min(32768, len(huge) // (2 * longest_token_bytes(reference_tokenizer())))
    rounds = 3 if quick else 6
    cases = {f"{megabytes}MB_bytes_bound": (huge, bytes_bound, 5),
             f"{megabytes}MB_counted": (huge, len(huge) // 64 + 1024, 1),
             f"fits_{len(fits) // 1024}KB": (fits, 4 * 1024 * 1024, 3)}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rld-") as tmp:
        state_a, state_b = Path(tmp) / "a", Path(tmp) / "b"
        state_a.mkdir()
        state_b.mkdir()
        async with proxy(state_b, max_tokens_per_turn=32, max_requests=100_000, max_context_tokens=1 << 20) as b:
            session_b = BSession(b)
            await session_b.turns(3)  # warm-up
            for name, (text, max_context, repeats) in cases.items():
                base: list[float] = []
                loaded: list[float] = []
                lags: list[float] = []
                a_times: list[float] = []
                ended = ""
                # Rounds of unloaded then loaded turns: these machines' load drifts.
                for _ in range(rounds):
                    base += await session_b.turns(4)
                    heavy = asyncio.ensure_future(a_heavy(state_a, text, max_context, repeats))
                    lag = asyncio.ensure_future(loop_lag(heavy))
                    loaded += await session_b.turns(2, until=heavy)
                    times, ended = await heavy
                    a_times += times
                    lags += await lag
                results[name] = {"b_unloaded_p50_ms": percentile(base, 50) * 1e3,
                                 "b_p50_ms": percentile(loaded, 50) * 1e3, "b_max_ms": max(loaded) * 1e3,
                                 "b_turns": len(loaded), "a_request_s": percentile(a_times, 50), "a_outcome": ended,
                                 "ratio_p50": percentile(loaded, 50) / percentile(base, 50),
                                 "loop_lag_p99_ms": percentile(lags, 99) * 1e3, "loop_lag_max_ms": max(lags) * 1e3}
    return results


def main() -> int:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    try:
        import uvloop
        factory: Any = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        results = runner.run(bench(args.quick))
    rows = [[name, r["a_outcome"], r["a_request_s"], r["b_turns"], r["b_unloaded_p50_ms"], r["b_p50_ms"],
             r["b_max_ms"], r["ratio_p50"], r["loop_lag_p99_ms"], r["loop_lag_max_ms"]] for name, r in results.items()]
    print_table("Session B's turns beside session A's heavy requests",
                ["A's request", "A ended", "A p50 s", "B turns", "B unloaded p50 ms", "B p50 ms", "B max ms",
                 "B p50 / unloaded", "loop lag p99 ms", "loop lag max ms"], rows)
    write_json(args.json, results)
    refused = [(f"{name}: B p50 within {TARGET_RATIO}x unloaded", r["ratio_p50"] <= TARGET_RATIO)
               for name, r in results.items() if r["a_outcome"] != "served"]
    return 0 if check_targets(refused) else 1


if __name__ == "__main__":
    raise SystemExit(main())
