"""Shared helpers for the aotc benchmarks: timing with warmup and medians, and JSON results.

Every benchmark writes bench/results/<name>.json with the benchmark name, a timestamp, the torch
and Python versions, a machine description, the device, the results, and a `ratio` per comparison.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_compiler  # noqa: E402

RESULTS_DIR = REPO_ROOT / "bench" / "results"


def _noop(gm: Any, _example_inputs: Any) -> Any:
    return gm


# fw/bw compiler for AOTAutograd that runs the fx graph as is (no codegen): `lambda gm, _: gm`,
# wrapped with make_boxed_compiler (what functorch.compile.nop is). Unwrapped, AOTAutograd calls
# it through a legacy unboxed path that issues a warnings.warn() on every call, which would inflate
# its per-call overhead and is not how AOTAutograd is meant to be driven.
noop_compiler = make_boxed_compiler(_noop)


def reset_state() -> None:
    """Drop global compile caches (dynamo, if anything imported it) between repetitions."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def time_once(fn: Callable[[], object]) -> float:
    """Seconds for one call of fn."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_median(fn: Callable[[], object], reps: int = 15, warmup: int = 3) -> float:
    """Median seconds of `reps` calls of fn after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    return median([time_once(fn) for _ in range(reps)])


def interleaved_rounds(
    systems: dict[str, Callable[[int], object]],
    iters: int,
    rounds: int,
    warmup_iters: int = 200,
) -> dict[str, list[float]]:
    """Per-call mean seconds, one per round, for each system.

    `systems[name](n)` runs n calls (the loop lives in the callee so the harness adds as little as
    possible). Systems alternate inside every round, order rotated each round, so drifts in
    machine load hit all of them alike. Take the median of the returned per-round means.
    """
    for run_n in systems.values():
        run_n(warmup_iters)
    names = list(systems)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            run_n = systems[n]
            t0 = time.perf_counter_ns()
            run_n(iters)
            out[n].append((time.perf_counter_ns() - t0) / 1e9 / iters)
    return out


def machine() -> dict[str, Any]:
    return {
        "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
    }


def ratio(a: float, b: float) -> float:
    return float(a / b) if b else float("nan")


def write_results(name: str, results: Any, goal: str | None = None, **extra: Any) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": name,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "machine": machine(),
        "device": "cpu",
    }
    if goal is not None:
        doc["goal"] = goal
    doc.update(extra)
    doc["results"] = results
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


def fmt_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in header]] + [
        [f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, seq: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)
