"""Per-call overhead on tiny inputs: eager vs aotc (both capture modes) vs AOTAutograd vs a
hand-written autograd.Function of the same math.

f(x, y) = (x * y).sum() on 4-element tensors, x requires grad. Modes:
  fwd_no_grad  forward under torch.no_grad() (inference entries for aotc and AOTAutograd)
  fwd_grad     forward with grad enabled, output discarded without backward
  fwd_bwd      out = f(x, y); out.backward()
Systems:
  eager               f itself
  function            a hand-written torch.autograd.Function (saves y; backward g.expand(4) * y):
                      the floor of any runtime built on one custom autograd node
  aotc_trace          aotc.compile(f, capture="trace"): aotc's own tracer and guards
  aotc_default        aotc.compile(f): the default capture mode (Dynamo) as users call it
  aotc_dynamo_run     a component figure, not a user path: Dynamo's own guard (the compiled
                      frame's guard manager, checked on the call's locals) + the `run` closure
                      aotc/backend.py returns for the graph (the floor of aotc_default)
  torch_compile_aotc  torch.compile(f, backend="aotc") called as users call it (adds the
                      `torch.compile` wrapper's Python frames to aotc_dynamo_run)
  torch_compile_eager torch.compile(f, backend="eager"): Dynamo's per-call cost with no compiler
  aot_autograd        aot_function(f, nop, nop) (functorch.compile.nop)
Each mode gets its own compiled objects, compiled (warmed up) in that mode.

Method: `--procs` fresh processes, 1 torch thread each; in each, all systems run interleaved
inside every round (order rotated); a process reports the median over rounds of per-round mean
us/call and its ratios against eager; the result is the median over processes (of times and of
same-process ratios). `--instructions` adds a deterministic count: each fwd+bwd system run under
callgrind (valgrind), instructions per call, when valgrind is installed (minutes).

Run from the repo root: .venv/bin/python bench/overhead.py [--procs P] [--iters N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import fmt_table, interleaved_rounds, median, noop_compiler, write_results  # noqa: E402

TARGET_RATIO = 1.3
GOAL = (
    f"fwd_bwd: aotc_trace/eager and aotc_default/eager <= {TARGET_RATIO} "
    "(tiny inputs, CPU, 1 torch thread, median over fresh processes)"
)
SYSTEMS = (
    "eager",
    "function",
    "aotc_trace",
    "aotc_default",
    "aotc_dynamo_run",
    "torch_compile_aotc",
    "torch_compile_eager",
    "aot_autograd",
)
MODES = ("fwd_no_grad", "fwd_grad", "fwd_bwd")


def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * y).sum()


class HandWritten(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return (x * y).sum()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        return g.expand(4) * y, None


def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, requires_grad=True), torch.randn(4)


def _fresh() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """f with a code object of its own: Dynamo caches compiled frames per code object, so each
    compiled system and mode must not share one."""
    namespace: dict[str, Any] = {}
    exec(compile("def f(x, y):\n    return (x * y).sum()\n", "<overhead f>", "exec"), namespace)  # noqa: S102
    return namespace["f"]  # type: ignore[no-any-return]


def _dynamo_run(mode: str, x: torch.Tensor, y: torch.Tensor) -> Callable[..., torch.Tensor]:
    """Dynamo's guard for the compiled frame + the run closure aotc's backend returned."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    import aotc.backend

    runs: list[Callable[..., Any]] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        run = aotc.backend.aotc_backend(gm, example_inputs)
        runs.append(run)
        return run

    fn = _fresh()
    compiled = torch.compile(fn, backend=capture)
    _warm(compiled, mode, x, y)
    (entry,) = _debug_get_cache_entry_list(fn.__code__)
    manager = entry.guard_manager
    check = getattr(manager, "root", manager).check
    (run,) = runs
    frame_locals = {"x": x, "y": y}

    def guarded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not check(frame_locals):
            raise AssertionError("Dynamo's guard failed")
        return run(a, b)[0]  # type: ignore[no-any-return]

    return guarded


def _warm(fn: Callable[..., torch.Tensor], mode: str, x: torch.Tensor, y: torch.Tensor) -> None:
    if mode == "fwd_no_grad":
        with torch.no_grad():
            fn(x, y)
    else:
        fn(x, y).backward()
        x.grad = None


def build(system: str, mode: str, x: torch.Tensor, y: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A callable for `system`, compiled (first call made) in `mode`'s grad mode."""
    import aotc

    if system == "eager":
        return f
    if system == "function":
        return HandWritten.apply  # type: ignore[no-any-return]
    if system == "aotc_dynamo_run":
        return _dynamo_run(mode, x, y)
    if system == "aotc_trace":
        fn: Callable[..., torch.Tensor] = aotc.compile(_fresh(), capture="trace", cache=False)
    elif system == "aotc_default":
        fn = aotc.compile(_fresh(), cache=False)
    elif system == "torch_compile_aotc":
        fn = torch.compile(_fresh(), backend="aotc")
    elif system == "torch_compile_eager":
        fn = torch.compile(_fresh(), backend="eager")
    else:
        from torch._functorch.aot_autograd import aot_function

        fn = aot_function(_fresh(), noop_compiler, noop_compiler)
    _warm(fn, mode, x, y)
    return fn


def loop_for(mode: str, fn: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    if mode == "fwd_no_grad":

        def run_n(n: int) -> None:
            with torch.no_grad():
                for _ in range(n):
                    fn(x, y)

    elif mode == "fwd_grad":

        def run_n(n: int) -> None:
            for _ in range(n):
                fn(x, y)

    else:

        def run_n(n: int) -> None:
            for _ in range(n):
                fn(x, y).backward()

    return run_n


def check_correct(fns: dict[str, Callable[..., torch.Tensor]]) -> None:
    x, y = make_inputs()
    grads = {}
    for name, fn in fns.items():
        x.grad = None
        out = fn(x, y)
        out.backward()
        grads[name] = (out.detach().clone(), x.grad.clone())
    ref = grads["eager"]
    for name, (out, g) in grads.items():
        torch.testing.assert_close(out, ref[0], msg=f"{name}: output differs from eager")
        torch.testing.assert_close(g, ref[1], msg=f"{name}: grad differs from eager")


def quiesce() -> list[str]:
    """Before the timed rounds: no aotc cache store left queued (its timer thread would encode and
    write an entry while some system's round runs, see Note [Deferred cache stores] in
    aotc/persist.py), a full collection so that no system's round inherits the compiles' garbage,
    and the names of the threads still alive besides this one (reported)."""
    import gc
    import threading

    import aotc

    aotc.cache_flush()
    gc.collect()
    return sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())


def worker(iters: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = make_inputs()
    out: dict[str, Any] = {}
    for mode in MODES:
        fns = {s: build(s, mode, x, y) for s in SYSTEMS}
        if mode == "fwd_bwd":
            check_correct(fns)
        x.grad = None
        out.setdefault("threads", {})[mode] = quiesce()
        samples = interleaved_rounds(
            {s: loop_for(mode, fns[s], x, y) for s in SYSTEMS}, iters=iters, rounds=rounds
        )
        x.grad = None
        out[mode] = {s: median(v) * 1e6 for s, v in samples.items()}
    return out


# --------------------------------------------------------------------------- instructions

_CALLGRIND_WRAPPERS = (  # each system's loop runs inside its own C iterator (see _instructions)
    "starmap_next",
    "takewhile_next",
    "dropwhile_next",
    "filterfalse_next",
    "accumulate_next",
    "functools_reduce",
    "groupby_next",
)


def instruction_worker(n: int) -> None:
    """Under callgrind: run each fwd+bwd system `n` times inside a distinct C iterator, so the
    iterator's inclusive instruction count is that system's."""
    import functools
    import itertools

    torch.set_num_threads(1)
    x, y = make_inputs()
    systems = [s for s in SYSTEMS if s != "torch_compile_eager"]
    assert len(systems) <= len(_CALLGRIND_WRAPPERS)
    wrappers: list[Callable[[Callable[[], None]], object]] = [
        lambda g: list(itertools.starmap(lambda: (g(), 0)[1], itertools.repeat((), n))),
        lambda g: list(itertools.takewhile(lambda _: (g(), True)[1], range(n))),
        lambda g: list(itertools.dropwhile(lambda _: (g(), True)[1], range(n))),
        lambda g: list(itertools.filterfalse(lambda _: (g(), False)[1], range(n))),
        lambda g: list(itertools.accumulate(range(n), lambda a, b: (g(), a)[1])),
        lambda g: functools.reduce(lambda a, b: (g(), a)[1], range(n), 0),
        lambda g: list(itertools.groupby(range(n), key=lambda k: (g(), k)[1])),
    ]
    for system, wrap, cname in zip(systems, wrappers, _CALLGRIND_WRAPPERS):
        fn = build(system, "fwd_bwd", x, y)

        def step(fn: Callable[..., torch.Tensor] = fn) -> None:
            fn(x, y).backward()

        for _ in range(50):
            step()
        print(f"SYSTEM {cname} {system}", flush=True)
        wrap(step)


def instructions(n: int = 300) -> dict[str, float] | None:
    """Instructions per fwd+bwd call per system (callgrind), or None without valgrind."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "callgrind.out")
        env = dict(os.environ, AOTC_CACHE="0", AOTC_GPU_CHECK="0")
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            *[f"--toggle-collect=*{c}*" for c in _CALLGRIND_WRAPPERS],
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--instruction-worker",
            str(n),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"callgrind run failed:\n{done.stderr[-3000:]}")
        names = dict(re.findall(r"SYSTEM (\S+) (\S+)", done.stdout))
        text = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", out], capture_output=True, text=True
        ).stdout
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?\S+:(\S+)", line)
        if not m:
            continue
        for cname, system in names.items():
            if m.group(2).startswith(cname) and system not in counts:
                counts[system] = int(m.group(1).replace(",", "")) / n
    return counts


# --------------------------------------------------------------------------- driver


def run(procs: int, iters: int, rounds: int, verbose: bool = True) -> dict[str, Any]:
    per_proc: list[dict[str, Any]] = []
    for p in range(procs):
        cmd = [sys.executable, __file__, "--worker", "--iters", str(iters), "--rounds", str(rounds)]
        # No disk cache (every system compiles in memory; nothing stored or read behind a round)
        # and no background CUDA compile check: only the calls are measured.
        env = dict(os.environ, OMP_NUM_THREADS="1", AOTC_CACHE="0", AOTC_GPU_CHECK="0")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"worker {p} failed:\n{done.stderr[-4000:]}")
        per_proc.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if verbose:
            fb = per_proc[-1]["fwd_bwd"]
            print(
                f"  process {p + 1}/{procs} fwd_bwd: "
                + "  ".join(f"{s} {fb[s]:.1f}" for s in SYSTEMS),
                flush=True,
            )
    results: dict[str, Any] = {}
    for mode in MODES:
        med = {s: median([pp[mode][s] for pp in per_proc]) for s in SYSTEMS}
        ratios = {
            f"{s}/eager": median([pp[mode][s] / pp[mode]["eager"] for pp in per_proc])
            for s in SYSTEMS
            if s != "eager"
        }
        ratios["aotc_trace/aot_autograd"] = median(
            [pp[mode]["aotc_trace"] / pp[mode]["aot_autograd"] for pp in per_proc]
        )
        ratios["aotc_trace/function"] = median(
            [pp[mode]["aotc_trace"] / pp[mode]["function"] for pp in per_proc]
        )
        entry: dict[str, Any] = {
            "median_us_per_call": med,
            "ratio": ratios,
            "per_process_us": [pp[mode] for pp in per_proc],
            # Threads alive (besides the measuring one) when the rounds started, per process.
            "other_threads": [pp["threads"][mode] for pp in per_proc],
        }
        if mode == "fwd_bwd":
            entry["meets_goal"] = bool(
                ratios["aotc_trace/eager"] <= TARGET_RATIO
                and ratios["aotc_default/eager"] <= TARGET_RATIO
            )
        results[mode] = entry
    return results


def table(results: dict[str, Any]) -> str:
    rows = []
    for mode, r in results.items():
        m, q = r["median_us_per_call"], r["ratio"]
        rows.append(
            [
                mode,
                m["eager"],
                m["function"],
                m["aotc_trace"],
                m["aotc_default"],
                m["aotc_dynamo_run"],
                m["torch_compile_aotc"],
                m["aot_autograd"],
                q["aotc_trace/eager"],
                q["aotc_default/eager"],
                q["aotc_dynamo_run/eager"],
                q["function/eager"],
            ]
        )
    return fmt_table(
        [
            "us/call",
            "eager",
            "function",
            "aotc trace",
            "aotc default",
            "dynamo run",
            "torch.compile",
            "aot_autograd",
            "trace/eager",
            "default/eager",
            "dyn run/eager",
            "fn/eager",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=5, help="fresh processes")
    p.add_argument("--iters", type=int, default=1000, help="calls per round")
    p.add_argument("--rounds", type=int, default=21, help="interleaved rounds per process")
    p.add_argument("--instructions", action="store_true", help="add callgrind counts (slow)")
    p.add_argument("--out", default="overhead", help="results file name under bench/results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--instruction-worker", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.instruction_worker:
        instruction_worker(args.instruction_worker)
        return {}
    if args.worker:
        print(json.dumps(worker(args.iters, args.rounds)))
        return {}
    print(
        f"overhead: {args.procs} processes x {args.rounds} rounds x {args.iters} calls",
        flush=True,
    )
    results = run(max(1, args.procs), args.iters, args.rounds)
    extra: dict[str, Any] = {}
    if args.instructions:
        counts = instructions()
        if counts is not None:
            extra["fwd_bwd_instructions_per_call"] = counts
            extra["fwd_bwd_instruction_ratio"] = {
                f"{s}/eager": counts[s] / counts["eager"] for s in counts if s != "eager"
            }
    path = write_results(
        args.out,
        results,
        goal=GOAL,
        workload="f(x, y) = (x * y).sum(), x: randn(4, requires_grad=True), y: randn(4)",
        method=(
            f"{args.procs} fresh processes (1 torch thread) x {args.rounds} rounds x "
            f"{args.iters} calls, systems interleaved (order rotated); per process the median "
            "of per-round mean us/call; reported: median over processes of times and of "
            "same-process ratios. Instructions (if present): callgrind, per fwd+bwd call"
        ),
        **extra,
    )
    print(table(results))
    if "fwd_bwd_instructions_per_call" in extra:
        print("\nfwd+bwd instructions per call (callgrind):")
        for s, v in extra["fwd_bwd_instructions_per_call"].items():
            ratio = extra["fwd_bwd_instruction_ratio"].get(f"{s}/eager", 1.0)
            print(f"  {s:20s} {v / 1e3:8.1f} K  ({ratio:.2f}x eager)")
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
