"""Dynamic shapes and whole models: recompile counts, compile time and step time.

1. Recompile counts: one training step (forward + backward) of a 1-layer GPT for each of 10
   different batch sizes, through aotc.compile (static / dynamic=True) and torch.compile with
   backend="aotc" (dynamic=False / automatic dynamic / dynamic=True). Counted: aotc entries
   (aotc.compile) or Dynamo graphs handed to the backend (torch.compile).
2. Compile time (first training step after a reset; Inductor's caches off) and step time
   (interleaved rounds, median of per-round medians) of the test models (tests/e2e/models.py) for aotc.compile, torch.compile(backend=
   "aotc"), torch.compile(backend="aot_eager") and Inductor (torch.compile default), with eager's
   step time as the reference, all in the same run. Ratios are against aot_eager and Inductor.
3. Per-call overhead of a tiny training call for each entry point, against aot_eager.

Run from the repo root: .venv/bin/python bench/dynamic.py [--steps N] [--models gpt,llama,...]
Writes bench/results/dynamic.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Inductor compiles in a pool of worker processes that keep running after its first compile; on a
# small machine they slow down every later measurement. Compile in-process instead.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # cold compile times

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from common import fmt_table, median, ratio, write_results  # noqa: E402

import aotc  # noqa: E402
import aotc.backend  # noqa: E402
from tests.e2e import models as M  # noqa: E402

BATCH_SIZES = [3, 5, 2, 8, 4, 7, 6, 9, 11, 10]
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[..., tuple[torch.Tensor, ...]]]] = {
    "gpt": (lambda: M.GPT(layers=2, dropout=0.0), M.gpt_batch),
    "bert": (lambda: M.BERT(layers=2, dropout=0.0), M.bert_batch),
    "llama": (M.LlamaBlock, M.llama_batch),
    "conv_bn": (M.ConvNet, M.conv_batch),
    "lstm_loop": (M.LSTMLoop, M.lstm_batch),
}


def _step(model: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...]) -> None:
    model(*batch).backward()


def _backend_graphs() -> int:
    return aotc.backend.stats["ahead"] + aotc.backend.stats["fallback"]


def recompile_counts() -> dict[str, Any]:
    results: dict[str, Any] = {"batch_sizes": BATCH_SIZES}
    systems: dict[str, Callable[[torch.nn.Module], Any]] = {
        "aotc.compile static": lambda m: aotc.compile(m),
        "aotc.compile dynamic=True": lambda m: aotc.compile(m, dynamic=True),
        "torch.compile aotc dynamic=False": lambda m: torch.compile(
            m, backend="aotc", dynamic=False
        ),
        "torch.compile aotc automatic dynamic": lambda m: torch.compile(m, backend="aotc"),
        "torch.compile aotc dynamic=True": lambda m: torch.compile(m, backend="aotc", dynamic=True),
    }
    for name, make in systems.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = M.GPT(layers=1, dropout=0.0)
        compiled = make(model)
        before = _backend_graphs()
        start = time.perf_counter()
        for b in BATCH_SIZES:
            _step(compiled, M.gpt_batch(b))
        seconds = time.perf_counter() - start
        count = (
            len(compiled.records)
            if isinstance(compiled, aotc.CompiledModule)
            else _backend_graphs() - before
        )
        results[name] = {"compilations": count, "seconds_for_10_steps": seconds}
    return results


def _systems() -> dict[str, Callable[[torch.nn.Module], Any]]:
    return {
        "eager": lambda m: m,
        "aotc.compile": lambda m: aotc.compile(m),
        "torch.compile(aotc)": lambda m: torch.compile(m, backend="aotc"),
        "torch.compile(aot_eager)": lambda m: torch.compile(m, backend="aot_eager"),
        "inductor": lambda m: torch.compile(m),
    }


def model_times(names: list[str], steps: int, rounds: int) -> dict[str, Any]:
    """Compile every system first (timing the first step), then time steps in `rounds`
    interleaved rounds (each system `steps` steps per round); step time is the median over rounds
    of per-round medians, so load changes on a shared machine hit every system alike."""
    results: dict[str, Any] = {}
    for model_name in names:
        make_model, make_batch = MODELS[model_name]
        torch.manual_seed(0)
        base = make_model()
        batch = make_batch()
        row: dict[str, Any] = {}
        compiled: dict[str, Any] = {}
        for system, wrap in _systems().items():
            torch._dynamo.reset()
            fn = wrap(copy.deepcopy(base))
            start = time.perf_counter()
            _step(fn, batch)
            row[system] = {"first_step_s": time.perf_counter() - start}
            for _ in range(3):
                _step(fn, batch)
            compiled[system] = fn
        per_round: dict[str, list[float]] = {s: [] for s in compiled}
        for _ in range(rounds):
            for system, fn in compiled.items():
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    _step(fn, batch)
                    times.append(time.perf_counter() - t0)
                per_round[system].append(median(times))
        for system, meds in per_round.items():
            row[system]["step_ms"] = median(meds) * 1e3
        for system in ("aotc.compile", "torch.compile(aotc)"):
            for base_name in ("torch.compile(aot_eager)", "inductor"):
                row[system][f"compile_ratio_vs_{base_name}"] = ratio(
                    row[system]["first_step_s"], row[base_name]["first_step_s"]
                )
                row[system][f"step_ratio_vs_{base_name}"] = ratio(
                    row[system]["step_ms"], row[base_name]["step_ms"]
                )
        results[model_name] = row
        print(
            f"[{model_name}] "
            + ", ".join(
                f"{s}: first {v['first_step_s']:.2f} s, step {v['step_ms']:.2f} ms"
                for s, v in row.items()
            ),
            flush=True,
        )
    return results


def call_overhead(iters: int, rounds: int) -> dict[str, Any]:
    """Per-call time of a tiny training call (`(x * w).sin().sum()` forward + backward): what
    each system adds on top of two ATen ops. torch.compile(aotc) runs its entry behind Dynamo's
    guards only; aotc.compile checks its own key (and, with dynamic=True, the shape guard)."""

    def tiny(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * w).sin().sum()

    systems = {
        "eager": tiny,
        "aotc.compile": aotc.compile(tiny),
        "aotc.compile dynamic=True": aotc.compile(tiny, dynamic=True),
        "torch.compile(aotc)": torch.compile(tiny, backend="aotc"),
        "torch.compile(aot_eager)": torch.compile(tiny, backend="aot_eager"),
    }
    x, w = torch.randn(8), torch.randn(8, requires_grad=True)
    per_round: dict[str, list[float]] = {name: [] for name in systems}
    for fn in systems.values():
        for _ in range(20):
            fn(x, w).backward()
    for _ in range(rounds):
        for name, fn in systems.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn(x, w).backward()
            per_round[name].append((time.perf_counter() - start) / iters)
    results: dict[str, Any] = {
        name: {"us_per_call": median(v) * 1e6} for name, v in per_round.items()
    }
    base = results["torch.compile(aot_eager)"]["us_per_call"]
    for name in results:
        results[name]["ratio_vs_torch.compile(aot_eager)"] = ratio(
            results[name]["us_per_call"], base
        )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per system and round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)
    torch._dynamo.config.cache_size_limit = 64
    counts = recompile_counts()
    print(
        fmt_table(
            ["system", "compilations for 10 batch sizes", "seconds"],
            [
                (k, v["compilations"], v["seconds_for_10_steps"])
                for k, v in counts.items()
                if isinstance(v, dict)
            ],
        ),
        flush=True,
    )
    overhead = call_overhead(iters=300, rounds=args.rounds)
    print(
        fmt_table(
            ["system", "us per tiny fwd+bwd call", "vs aot_eager"],
            [
                (k, v["us_per_call"], v["ratio_vs_torch.compile(aot_eager)"])
                for k, v in overhead.items()
            ],
        ),
        flush=True,
    )
    times = model_times(args.models.split(","), args.steps, args.rounds)
    rows = []
    for model_name, row in times.items():
        for system, v in row.items():
            rows.append((model_name, system, v["first_step_s"], v["step_ms"]))
    print(fmt_table(["model", "system", "first step (s)", "step (ms)"], rows))
    path = write_results(
        "dynamic",
        {"recompiles": counts, "call_overhead": overhead, "models": times},
        goal="one compilation for all batch sizes with dynamic shapes; compile and step time "
        "against aot_eager and Inductor measured in the same run",
        steps=args.steps,
        rounds=args.rounds,
        note="shared CPU machine under load from other jobs: step times are noisy; compile "
        "times are cold (Inductor's caches disabled)",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
