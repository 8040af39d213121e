"""Compile time of the first call, including the first backward: aotc vs AOTAutograd.

AOTAutograd runs with no-op compilers (`fw_compiler=bw_compiler=lambda gm, _: gm`), so both
sides measure tracing + partitioning + wrapper construction, not code generation.
aotc runs with its on-disk cache off (cold compiles; bench/cache.py measures warm starts). Each
repetition builds a new function / module wrapper (aotc caches per compiled object; AOTAutograd
caches per aot_function object), resets torch._dynamo if it is loaded, and times
`loss = compiled(*inputs); loss.backward()`. Systems are interleaved inside every repetition.

Run from the repo root: .venv/bin/python bench/compile_time.py [--reps N]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import (  # noqa: E402
    CausalSelfAttention,
    fmt_table,
    median,
    noop_compiler,
    ratio,
    reset_state,
    write_results,
)
from torch._functorch.aot_autograd import aot_function, aot_module  # noqa: E402

import aotc  # noqa: E402

GOAL = "compile time (first call + first backward) ratio aotc/aot_autograd <= 1.0 per workload"


# --------------------------------------------------------------------------- workloads


def make_mlp_fn() -> Callable[..., torch.Tensor]:
    def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return ((x @ w1).relu() @ w2).sum()

    return mlp


def mlp_inputs() -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(8, 16),
        torch.randn(16, 32, requires_grad=True),
        torch.randn(32, 4, requires_grad=True),
    )


def make_pointwise_fn() -> Callable[..., torch.Tensor]:
    def pointwise10(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()  # 1
        y = y.cos()  # 2
        y = y * 2.0  # 3
        y = y + 1.0  # 4
        y = y.exp()  # 5
        y = y.tanh()  # 6
        y = y.sigmoid()  # 7
        y = y - 0.5  # 8
        y = y.abs()  # 9
        y = y.sqrt()  # 10
        return y.sum()

    return pointwise10


def pointwise_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(64, 64, requires_grad=True),)


class Block(nn.Module):
    """GPT-style pre-LN transformer block."""

    def __init__(self, d_model: int = 64, n_heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, seq)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x.sum()


def block_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(4, 32, 64),)


# --------------------------------------------------------------------------- systems

# Each builder returns a fresh compiled callable. The module builders share one module instance
# per process (wrappers are fresh each repetition; parameters are not what is being compiled).
_BLOCK = None


def _block() -> nn.Module:
    global _BLOCK
    if _BLOCK is None:
        torch.manual_seed(0)
        _BLOCK = Block()
    return _BLOCK


WORKLOADS: dict[str, dict[str, object]] = {
    "mlp_fn": {
        "inputs": mlp_inputs,
        "aotc": lambda: aotc.compile(make_mlp_fn(), cache=False),
        "aot_autograd": lambda: aot_function(make_mlp_fn(), noop_compiler, noop_compiler),
    },
    "gpt_block_module": {
        "inputs": block_inputs,
        "aotc": lambda: aotc.compile(_block(), cache=False),
        "aot_autograd": lambda: aot_module(_block(), noop_compiler, noop_compiler),
    },
    "pointwise10_fn": {
        "inputs": pointwise_inputs,
        "aotc": lambda: aotc.compile(make_pointwise_fn(), cache=False),
        "aot_autograd": lambda: aot_function(make_pointwise_fn(), noop_compiler, noop_compiler),
    },
}

SYSTEMS = ("aotc", "aot_autograd")


def _zero_grads(inputs: tuple[torch.Tensor, ...]) -> None:
    for t in inputs:
        t.grad = None
    if _BLOCK is not None:
        _BLOCK.zero_grad(set_to_none=True)


def measure_once(workload: dict[str, object], system: str) -> tuple[float, object]:
    inputs = workload["inputs"]()  # type: ignore[operator]
    reset_state()
    gc.collect()
    compiled = workload[system]()  # type: ignore[operator]
    t0 = time.perf_counter()
    loss = compiled(*inputs)
    loss.backward()
    dt = time.perf_counter() - t0
    _zero_grads(inputs)
    return dt, compiled


def _aotc_stages(compiled: object) -> dict[str, float]:
    try:
        recs = aotc.inspect(compiled)
    except Exception:  # pragma: no cover - diagnostics only
        return {}
    if not recs:
        return {}
    return dict(recs[0].stage_seconds)


def run(reps: int = 9, warmup: int = 1, verbose: bool = True) -> dict[str, object]:
    results: dict[str, object] = {}
    for wname, workload in WORKLOADS.items():
        for _ in range(warmup):  # one-time costs (lazy imports, op registration) off the clock
            for system in SYSTEMS:
                measure_once(workload, system)
        times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        stages: list[dict[str, float]] = []
        for r in range(reps):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                dt, compiled = measure_once(workload, system)
                times[system].append(dt)
                if system == "aotc":
                    stages.append(_aotc_stages(compiled))
        med = {s: median(times[s]) * 1e3 for s in SYSTEMS}
        stage_med = {
            k: median([st[k] for st in stages if k in st]) * 1e3
            for k in (stages[0] if stages else {})
        }
        results[wname] = {
            "median_ms": med,
            "samples_ms": {s: [round(t * 1e3, 3) for t in times[s]] for s in SYSTEMS},
            "ratio": {"aotc/aot_autograd": ratio(med["aotc"], med["aot_autograd"])},
            "aotc_stage_median_ms": stage_med,
            "aotc_compile_seconds_median_ms": sum(stage_med.values()),
            "reps": reps,
            "meets_goal": med["aotc"] <= med["aot_autograd"],
        }
        if verbose:
            print(
                f"  {wname:18s} aotc {med['aotc']:8.2f} ms   aot_autograd "
                f"{med['aot_autograd']:8.2f} ms   ratio {med['aotc'] / med['aot_autograd']:.3f}",
                flush=True,
            )
    return results


def table(results: dict[str, object]) -> str:
    rows = []
    for wname, r in results.items():
        m = r["median_ms"]  # type: ignore[index]
        rows.append(
            [
                wname,
                m["aotc"],
                m["aot_autograd"],
                r["ratio"]["aotc/aot_autograd"],  # type: ignore[index]
                "yes" if r["meets_goal"] else "NO",  # type: ignore[index]
            ]
        )
    return fmt_table(
        ["compile (1st call+bwd)", "aotc ms", "aot_autograd ms", "aotc/aot", "<=1.0"], rows
    )


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=9, help="timed repetitions per system (>= 5)")
    args = p.parse_args(argv)
    reps = max(5, args.reps)
    print(f"compile_time: {reps} reps per system, interleaved", flush=True)
    results = run(reps=reps)
    path = write_results(
        "compile_time",
        results,
        goal=GOAL,
        method=(
            "median over reps of wall time of first call + first backward, fresh compiled "
            "object each rep, systems interleaved; AOTAutograd with no-op fw/bw compilers"
        ),
    )
    print(table(results))
    print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return results


if __name__ == "__main__":
    main()
