"""Capture modes (issue #12): compile time and step time of `aotc.compile` in the default mode
(through Dynamo) and in strict mode (`capture="trace"`) against `torch.compile(backend="aotc")`,
`torch.compile(backend="aot_eager")` and Inductor on the Hugging Face models of the tests, all in
the same run; and the per-call overhead of a tiny training call.

1. Models (tests/e2e/hf_models.py: GPT-2, BERT, Llama with its DynamicCache, T5, ViT from small
   configs): for each system a fresh copy, its first training step (forward + backward) timed
   after `torch._dynamo.reset()` with aotc's disk cache off (a cold compile; Inductor's caches are
   off too), then step time in interleaved rounds (median over rounds of per-round medians), eager
   as the reference. The default mode's warm start is also timed: a new Dynamo session whose
   graphs all come from aotc's disk cache (what a restarted process pays; Dynamo's own tracing
   stays). Strict mode reports its error where it refuses a model.
2. Per-call overhead of a tiny fwd+bwd call `(x * w).sin().sum()` on 8 elements: eager, the
   default mode, strict mode, `torch.compile(backend="aotc")` and aot_eager, interleaved rounds,
   median of per-round means. Also the default mode on a module (`aotc.compile(nn.Linear)`)
   against `torch.compile(nn.Linear, backend="aotc")`.

Compile times follow a warm-up compile of a smaller model through every aotc/AOTAutograd system
(first-use costs would otherwise fall on whichever system runs first); one intra-op thread.

Run from the repo root: python bench/capture.py [--models gpt2,bert,...] [--rounds R]
Writes bench/results/capture.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # cold compile times
os.environ.setdefault("AOTC_CACHE_DIR", tempfile.mkdtemp(prefix="aotc-bench-capture-"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from common import fmt_table, interleaved_rounds, median, ratio, write_results  # noqa: E402

import aotc  # noqa: E402
from tests.e2e.hf_models import MODELS  # noqa: E402

SYSTEMS: dict[str, Callable[[torch.nn.Module], Any]] = {
    "eager": lambda m: m,
    "aotc default": lambda m: aotc.compile(m, cache=False),
    "aotc strict": lambda m: aotc.compile(m, capture="trace", cache=False),
    "torch.compile(aotc)": lambda m: torch.compile(m, backend="aotc", options={"cache": False}),
    "torch.compile(aot_eager)": lambda m: torch.compile(m, backend="aot_eager"),
    "inductor": lambda m: torch.compile(m),
}


def _step(model: Callable[..., Any], batch: dict[str, Any]) -> None:
    model(**batch).loss.backward()


def warm_up(size: dict[str, int]) -> None:
    """First-use costs (imports, decomposition tables, Dynamo's own caches) are paid once per
    process by whichever system compiles first: pay them before timing, on a smaller model,
    through every aotc/AOTAutograd system (Inductor's first use is part of its compile time)."""
    small = dict(size, layers=1)
    torch.manual_seed(0)
    base, make_batch = MODELS["gpt2"](**small)
    batch = make_batch()
    for system in (
        "aotc default",
        "aotc strict",
        "torch.compile(aotc)",
        "torch.compile(aot_eager)",
    ):
        torch._dynamo.reset()
        try:
            _step(SYSTEMS[system](copy.deepcopy(base)), batch)
        except Exception:  # noqa: BLE001 strict mode may refuse the model
            pass


def model_times(names: list[str], steps: int, rounds: int, size: dict[str, int]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    warm_up(size)
    for name in names:
        torch.manual_seed(0)
        base, make_batch = MODELS[name](**size)
        torch.manual_seed(1)
        batch = make_batch()
        row: dict[str, Any] = {}
        compiled: dict[str, Any] = {}
        # One reset per model: a reset drops every system's compiled frames, so a later reset
        # would make the timing rounds recompile the systems compiled before it.
        torch._dynamo.reset()
        for system, wrap in SYSTEMS.items():
            fn = wrap(copy.deepcopy(base))
            start = time.perf_counter()
            try:
                _step(fn, batch)
            except Exception as e:  # noqa: BLE001 strict mode may refuse a model: report it
                row[system] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            row[system] = {"first_step_s": time.perf_counter() - start}
            for _ in range(2):
                _step(fn, batch)
            compiled[system] = fn
        per_round: dict[str, list[float]] = {s: [] for s in compiled}
        for r in range(rounds):
            order = list(compiled)
            order = order[r % len(order) :] + order[: r % len(order)]
            for system in order:
                fn = compiled[system]
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    _step(fn, batch)
                    times.append(time.perf_counter() - t0)
                per_round[system].append(median(times))
        for system, meds in per_round.items():
            row[system]["step_ms"] = median(meds) * 1e3
        row["aotc default"]["warm_first_step_s"] = _warm_start(base, batch)  # resets Dynamo
        ref = row["torch.compile(aotc)"]
        for system in ("aotc default", "aotc strict", "torch.compile(aotc)"):
            if "error" in row[system]:
                continue
            for base_name in ("torch.compile(aotc)", "torch.compile(aot_eager)", "inductor"):
                if base_name == system or "error" in row[base_name]:
                    continue
                row[system][f"compile_ratio_vs_{base_name}"] = ratio(
                    row[system]["first_step_s"], row[base_name]["first_step_s"]
                )
                row[system][f"step_ratio_vs_{base_name}"] = ratio(
                    row[system]["step_ms"], row[base_name]["step_ms"]
                )
        row["aotc default"]["warm_vs_cold"] = ratio(
            row["aotc default"]["warm_first_step_s"], row["aotc default"]["first_step_s"]
        )
        del ref
        results[name] = row
        print(
            f"[{name}] "
            + "; ".join(
                f"{s}: "
                + (
                    v["error"][:60]
                    if "error" in v
                    else f"first {v['first_step_s']:.2f} s, step {v['step_ms']:.2f} ms"
                )
                for s, v in row.items()
            ),
            flush=True,
        )
    return results


def _warm_start(base: torch.nn.Module, batch: dict[str, Any]) -> float:
    """First step of the default mode when every graph is in aotc's disk cache: one cold run fills
    it, then a new Dynamo session compiles the same model again."""
    for _ in range(2):
        torch._dynamo.reset()
        fn = aotc.compile(copy.deepcopy(base))
        start = time.perf_counter()
        _step(fn, batch)
        seconds = time.perf_counter() - start
    stages = [sorted(r.stage_seconds) for r in aotc.inspect(fn)]
    assert all("cache_load" in s and "trace" not in s for s in stages), stages
    return seconds


def call_overhead(iters: int, rounds: int) -> dict[str, Any]:
    def make() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def tiny(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (x * w).sin().sum()

        return tiny

    fns = {
        "eager": make(),
        "aotc default": aotc.compile(make()),
        "aotc strict": aotc.compile(make(), capture="trace"),
        "torch.compile(aotc)": torch.compile(make(), backend="aotc"),
        "torch.compile(aot_eager)": torch.compile(make(), backend="aot_eager"),
    }
    x, w = torch.randn(8), torch.randn(8, requires_grad=True)
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    modules = {
        "module: eager": lin,
        "module: aotc default": aotc.compile(copy.deepcopy(lin)),
        "module: torch.compile(aotc)": torch.compile(copy.deepcopy(lin), backend="aotc"),
    }
    xm = torch.randn(2, 8)

    def loop_fn(fn: Callable[..., torch.Tensor]) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                fn(x, w).backward()

        return run

    def loop_module(m: Callable[..., torch.Tensor]) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                m(xm).sum().backward()

        return run

    systems = {k: loop_fn(f) for k, f in fns.items()}
    systems.update({k: loop_module(m) for k, m in modules.items()})
    per_round = interleaved_rounds(systems, iters, rounds)
    us = {k: median(v) * 1e6 for k, v in per_round.items()}
    out: dict[str, Any] = {k: {"us_per_call": v} for k, v in us.items()}
    for k in fns:
        out[k]["ratio_vs_eager"] = ratio(us[k], us["eager"])
        out[k]["ratio_vs_torch.compile(aotc)"] = ratio(us[k], us["torch.compile(aotc)"])
        out[k]["ratio_vs_strict"] = ratio(us[k], us["aotc strict"])
    for k in modules:
        out[k]["ratio_vs_eager"] = ratio(us[k], us["module: eager"])
        out[k]["ratio_vs_torch.compile(aotc)"] = ratio(us[k], us["module: torch.compile(aotc)"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--overhead-rounds", type=int, default=15)
    p.add_argument("--skip-models", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)
    # One intra-op thread: on a shared, loaded machine OpenMP's spinning threads slow every
    # system down erratically; the comparison is about compile and per-call costs anyway.
    torch.set_num_threads(args.threads)
    size = {"layers": args.layers, "hidden": args.hidden, "batch": args.batch, "seq": args.seq}
    overhead = call_overhead(args.iters, args.overhead_rounds)
    print(
        fmt_table(
            ["system", "us/call", "vs eager", "vs torch.compile(aotc)"],
            [
                [k, v["us_per_call"], v["ratio_vs_eager"], v["ratio_vs_torch.compile(aotc)"]]
                for k, v in overhead.items()
            ],
        ),
        flush=True,
    )
    models = (
        {}
        if args.skip_models
        else model_times(args.models.split(","), args.steps, args.rounds, size)
    )
    path = write_results(
        "capture",
        {"call_overhead": overhead, "models": models},
        goal="default mode per-call overhead close to torch.compile(backend='aotc')",
        model_size=size,
        torch_threads=args.threads,
        note="shared, loaded 2-core CPU machine: timings are noisy; ratios are same-run",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
