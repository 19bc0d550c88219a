"""Helpers shared by the benches: percentiles, tables with units, JSON output."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil


def percentile(samples: Sequence[float], q: float) -> float:
    data = sorted(samples)
    if not data:
        return float("nan")
    k = min(len(data) - 1, max(0, int(round(q / 100 * (len(data) - 1)))))
    return data[k]


def summary_ms(samples_s: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(samples_s, 50) * 1e3,
        "p99_ms": percentile(samples_s, 99) * 1e3,
        "mean_ms": statistics.fmean(samples_s) * 1e3 if samples_s else float("nan"),
        "n": len(samples_s),
    }


def time_calls(fn: Callable[[], Any], n: int, warmup: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


async def time_calls_async(fn: Callable[[], Any], n: int, warmup: int = 10) -> list[float]:
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


async def interleaved_async(fns: dict[str, Callable[[], Any]], n: int, warmup: int = 10) -> dict[str, list[float]]:
    """``n`` timed calls of each coroutine function, one of each in turn, so drift in machine load
    (these machines are noisy) hits every path alike."""
    for fn in fns.values():
        for _ in range(warmup):
            await fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            await fn()
            out[name].append(time.perf_counter() - t0)
    return out


async def loop_lag(until: asyncio.Future[Any], tick_s: float = 0.005) -> list[float]:
    """How late each tick of a ``tick_s`` timer fires until ``until`` is done: the time the
    event loop was held by something else (or the process had no CPU)."""
    lags = []
    while not until.done():
        t0 = time.perf_counter()
        await asyncio.sleep(tick_s)
        lags.append(time.perf_counter() - t0 - tick_s)
    return lags


def daemon_cpu_s(status: dict[str, Any]) -> float:
    """User and system CPU seconds of a node daemon's supervisor and workers (not their sandboxes),
    from its ``status``."""
    total = 0.0
    for pid in [status["pid"], *(w["pid"] for w in status["workers"])]:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    sys.stdout.flush()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def standard_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer samples; finishes in under 40 s")
    p.add_argument("--json", type=Path, help="write the flat results object to this file")
    return p


@contextlib.contextmanager
def burners(count: int) -> Iterator[None]:
    """``count`` busy processes (a pure-Python loop each) while inside."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


def check_targets(targets: Sequence[tuple[str, bool]]) -> bool:
    print("\nTargets")
    ok = True
    for name, passed in targets:
        print(f"  [{'PASS' if passed else 'FAIL'}] {name}")
        ok &= passed
    return ok


@dataclass
class Panel:
    """One chart of a bench's PNG: y against x for each named series."""

    xlabel: str
    ylabel: str
    series: dict[str, tuple[Sequence[float], Sequence[float]]]
    log_x: bool = False


def plot_panels(path: Path, title: str, panels: Sequence[Panel]) -> None:
    """Write ``panels`` side by side to the PNG ``path`` (matplotlib: the ``bench`` extra)."""
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"writing {path} needs matplotlib: pip install -e '.[bench]' (make setup installs it)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        markers = iter("os^dv")
        for name, (xs, ys) in panel.series.items():
            ax.plot(xs, ys, f"{next(markers)}-", label=name)
        ax.set(xlabel=panel.xlabel, ylabel=panel.ylabel, xscale="log" if panel.log_x else "linear", ylim=(0, None))
        if len(panel.series) > 1:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
