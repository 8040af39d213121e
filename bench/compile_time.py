"""Cold compile time (first call + first backward): aotc vs AOTAutograd with no-op compilers.

A cold compile is what a user pays the first time a program runs: aotc's whole-program tracer
(`capture="trace"`, like AOTAutograd's `aot_function` a trace of the whole program without
Dynamo; the default capture adds Dynamo's own tracing, see bench/capture.py) with its default
options, so the persistent cache is on and empty (a fresh cache directory per repetition: the
lookup, whose key family is not stored so it runs no key trace, and the store of the entry are
on the clock, Note [Keys of programs never stored] in aotc/cachekey.py); `aotc_key_traced`, the
same with the family marked as stored (a directory holding another program of the same input
signature and options, e.g. this one before an edit), so the key trace and its verification run
as they did before that Note; and, for reference, aotc with `cache=False`. AOTAutograd runs with no-op compilers (`fw_compiler=bw_compiler=nop`), so
both sides measure tracing + partitioning + wrapper construction, not code generation.

Workloads: the three of earlier runs (an MLP function, a GPT block module, a 10-op pointwise
function) and the five of bench/partition.py (pointwise chain, LayerNorm+GELU MLP, softmax
cross-entropy, 2-block GPT stack, conv net with BatchNorm).

Method: `--procs` fresh worker processes (1 torch thread each). In each, every workload is first
compiled once per system untimed (one-time costs: imports, op registrations), then `--reps`
repetitions, systems interleaved (order alternating), each building a new compiled object and
timing `loss = compiled(*inputs); loss.backward()`. Reported: the median over all repetitions of
all processes, and the ratio of medians from the same run.

Run from the repo root: .venv/bin/python bench/compile_time.py [--procs P] [--reps N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from aotc import persist  # noqa: E402

GOAL = (
    "cold compile (first call + first backward, cache on and empty) "
    "aotc/aot_autograd <= 1.0 per workload"
)
SYSTEMS = ("aotc", "aotc_key_traced", "aotc_no_cache", "aot_autograd")


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


class Workload:
    """`fn()` gives a fresh function (functions) or the shared module (modules: the compiled
    wrapper is fresh each repetition; parameters are not what is being compiled)."""

    def __init__(
        self, name: str, fn: Callable[[], Any], inputs: Callable[[], tuple[Any, ...]]
    ) -> None:
        self.name, self.fn, self.inputs = name, fn, inputs

    def build(self, system: str, cache_dir: str | None) -> Callable[..., torch.Tensor]:
        target = self.fn()
        if system in ("aotc", "aotc_key_traced"):
            return aotc.compile(target, capture="trace", cache_dir=cache_dir)
        if system == "aotc_no_cache":
            return aotc.compile(target, capture="trace", cache=False)
        if isinstance(target, nn.Module):
            return aot_module(target, noop_compiler, noop_compiler)
        return aot_function(target, noop_compiler, noop_compiler)


def _fresh(fn: Callable[..., torch.Tensor]) -> Callable[[], Callable[..., torch.Tensor]]:
    def make() -> Callable[..., torch.Tensor]:
        def fresh(*args: Any) -> torch.Tensor:  # a new function object: no shared cache
            return fn(*args)

        fresh.__qualname__ = fn.__name__
        return fresh

    return make


def workloads() -> list[Workload]:
    import partition as part  # bench/partition.py: the step-time and saved-bytes workloads

    torch.manual_seed(0)
    block = Block()
    out = [
        Workload("mlp_fn", make_mlp_fn, mlp_inputs),
        Workload("gpt_block_module", lambda: block, block_inputs),
        Workload("pointwise10_fn", make_pointwise_fn, pointwise_inputs),
    ]
    for wl in part.workloads():
        module = wl.fn if isinstance(wl.fn, nn.Module) else None
        fn = (lambda m=module: m) if module is not None else _fresh(wl.fn)
        out.append(Workload(wl.name, fn, wl.inputs))
    return out


# --------------------------------------------------------------------------- measuring


def _zero_grads(wl: Workload, inputs: tuple[Any, ...]) -> None:
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None
    target = wl.fn()
    if isinstance(target, nn.Module):
        target.zero_grad(set_to_none=True)


def measure_once(wl: Workload, system: str) -> tuple[float, dict[str, float]]:
    """Seconds of the first call + backward of a fresh compile, and aotc's stage times."""
    inputs = wl.inputs()
    cached = system in ("aotc", "aotc_key_traced")
    cache_dir = tempfile.mkdtemp(prefix="aotc-bench-cold-") if cached else None
    # aotc_key_traced: the cache directory holds an entry of the program's key family (another
    # program of the same input signature and options, e.g. this one before an edit), so the
    # lookup runs the key trace (Note [Keys of programs never stored] in aotc/cachekey.py).
    stored = persist._family_stored
    if system == "aotc_key_traced":
        persist._family_stored = lambda options, family: True  # type: ignore[assignment]
    try:
        reset_state()
        gc.collect()
        compiled = wl.build(system, cache_dir)
        t0 = time.perf_counter()
        loss = compiled(*inputs)
        loss.backward()
        dt = time.perf_counter() - t0
        persist._family_stored = stored  # type: ignore[assignment]
        if cached:
            aotc.cache_flush()  # the entry's deferred store, outside the timed window
        stages: dict[str, float] = {}
        if system.startswith("aotc"):
            records = aotc.inspect(compiled)
            stages = dict(records[0].stage_seconds) if records else {}
        _zero_grads(wl, inputs)
        return dt, stages
    finally:
        persist._family_stored = stored  # type: ignore[assignment]
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)


def worker(reps: int, only: list[str] | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for wl in workloads():
        if only and wl.name not in only:
            continue
        for system in SYSTEMS:  # one-time costs off the clock
            measure_once(wl, system)
        times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        stages: list[dict[str, float]] = []
        traced: list[dict[str, float]] = []
        for r in range(reps):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                dt, st = measure_once(wl, system)
                times[system].append(dt)
                if system == "aotc":
                    stages.append(st)
                elif system == "aotc_key_traced":
                    traced.append(st)
        out[wl.name] = {"times": times, "stages": stages, "traced_stages": traced}
    return out


def run(procs: int, reps: int, only: list[str] | None, verbose: bool = True) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {}
    stage_samples: dict[str, list[dict[str, float]]] = {}
    traced_samples: dict[str, list[dict[str, float]]] = {}
    per_proc: dict[str, list[dict[str, float]]] = {}
    for p in range(procs):
        cmd = [sys.executable, __file__, "--worker", "--reps", str(reps)]
        if only:
            cmd += ["--only", *only]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"worker {p} failed:\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        for name, r in result.items():
            for system, ts in r["times"].items():
                samples.setdefault(name, {}).setdefault(system, []).extend(ts)
            stage_samples.setdefault(name, []).extend(r["stages"])
            traced_samples.setdefault(name, []).extend(r["traced_stages"])
            per_proc.setdefault(name, []).append(
                {s: median(ts) * 1e3 for s, ts in r["times"].items()}
            )
        if verbose:
            print(f"  worker {p + 1}/{procs} done", flush=True)
    results: dict[str, Any] = {}
    for name, by_system in samples.items():
        med = {s: median(ts) * 1e3 for s, ts in by_system.items()}
        stage_med, traced_med = (
            {k: median([st.get(k, 0.0) for st in runs]) * 1e3 for k in (runs[0] if runs else {})}
            for runs in (stage_samples[name], traced_samples[name])
        )
        results[name] = {
            "median_ms": med,
            "samples_ms": {s: [round(t * 1e3, 3) for t in ts] for s, ts in by_system.items()},
            "per_process_median_ms": per_proc[name],
            "ratio": {
                "aotc/aot_autograd": ratio(med["aotc"], med["aot_autograd"]),
                "aotc_no_cache/aot_autograd": ratio(med["aotc_no_cache"], med["aot_autograd"]),
                "aotc_key_traced/aot_autograd": ratio(med["aotc_key_traced"], med["aot_autograd"]),
                "aotc/aotc_no_cache": ratio(med["aotc"], med["aotc_no_cache"]),
            },
            "aotc_stage_median_ms": stage_med,
            "aotc_key_traced_stage_median_ms": traced_med,
            "reps": len(by_system["aotc"]),
            "meets_goal": med["aotc"] <= med["aot_autograd"],
        }
        if verbose:
            print(
                f"  {name:24s} aotc {med['aotc']:8.2f} ms  (key traced "
                f"{med['aotc_key_traced']:8.2f}, no cache {med['aotc_no_cache']:8.2f})"
                f"  aot_autograd {med['aot_autograd']:8.2f} ms  ratio "
                f"{med['aotc'] / med['aot_autograd']:.3f}",
                flush=True,
            )
    return results


def table(results: dict[str, Any]) -> str:
    rows = []
    for name, r in results.items():
        m = r["median_ms"]
        rows.append(
            [
                name,
                m["aotc"],
                m["aotc_key_traced"],
                m["aotc_no_cache"],
                m["aot_autograd"],
                r["ratio"]["aotc/aot_autograd"],
                r["aotc_stage_median_ms"].get("cache_key", 0.0),
                "yes" if r["meets_goal"] else "NO",
            ]
        )
    return fmt_table(
        [
            "cold compile (1st call+bwd)",
            "aotc ms",
            "key traced ms",
            "no cache ms",
            "aot_autograd ms",
            "aotc/aot",
            "key ms",
            "<=1.0",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=3, help="fresh worker processes")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per process and system")
    p.add_argument("--only", nargs="*", help="workload names (default: all)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="compile_time", help="results file name under bench/results")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(max(1, args.reps), args.only)))
        return {}
    procs, reps = max(1, args.procs), max(1, args.reps)
    print(f"compile_time: {procs} processes x {reps} reps per system, interleaved", flush=True)
    results = run(procs, reps, args.only)
    path = write_results(
        args.out,
        results,
        goal=GOAL,
        method=(
            f"{procs} fresh processes (1 torch thread) x {reps} reps; each workload compiled "
            "once per system untimed first; then wall time of first call + first backward of a "
            "fresh compiled object, systems interleaved; aotc with the cache on and a fresh "
            "empty cache directory per rep (its entry is written on a background thread, "
            "flushed after the timed window; aotc_key_traced: the same, with the key family "
            "marked as stored, so the key trace runs; aotc_no_cache: cache=False); "
            "AOTAutograd with "
            "boxed no-op fw/bw compilers; median over all reps of all processes"
        ),
    )
    print(table(results))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
