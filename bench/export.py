"""aotc.load of an exported artifact vs a cold compile, and the per-call overhead of a loaded
artifact vs the compiled function, measured in the same run.

Examples: `tiny` (a 3-op training step of two small tensors: per-call overhead dominates),
`mlp` (examples/mlp.py's MLP, a module bound at load time), both with the ATen backend, and
`tiny_dyn_triton` (a small pointwise+reduction training step exported with dynamic=True and
backend="triton" at 8x16, measured at 12x16: Triton kernels with symbolic sizes, run by Triton's
interpreter on CPU, so its absolute times are the interpreter's). For each:
- `cold_s`: a fresh process compiles with strict capture (`aotc.compile(capture="trace",
  cache=False)`) and makes the first call (compile + one forward);
- `load_s`: a fresh process loads the exported artifact (`aotc.load`) and makes the first call;
  `load_imports_compiler` says whether that process imported aotc.passes (it must not);
- both children import torch first and report it apart (`import_s`);
- `call_us`: in this process, median per-call time of forward+backward of the compiled function and
  of the loaded artifact on the same inputs (interleaved rounds), and their ratio.
Reported: medians over --reps child runs. CPU.

Run from the repo root: .venv/bin/python bench/export.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import fmt_table, interleaved_rounds, median, ratio, write_results  # noqa: E402

import aotc  # noqa: E402

GOAL = "aotc.load + first call well under a cold compile; loaded per-call time ~ compiled"

# aotc.compile / aotc.export options and calls per timed round, per example
OPTIONS: dict[str, dict[str, object]] = {
    "tiny": {},
    "mlp": {},
    "tiny_dyn_triton": {"dynamic": True, "backend": "triton"},
}
ITERS = {"tiny": 200, "mlp": 100, "tiny_dyn_triton": 20}

SETUP = r"""
import torch
torch.manual_seed(0)
export_args = None
if {name!r} == "tiny":
    def program(x, w):
        return (x * w).sin().sum()
    target, args, module = program, (torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)), None
elif {name!r} == "tiny_dyn_triton":
    def program(x, w):
        y = x * torch.sigmoid(x) + w
        return y.softmax(-1).sum(0)
    target, module = program, None
    args = (torch.randn(12, 16), torch.randn(16, requires_grad=True))
    export_args = (torch.randn(8, 16), torch.randn(16, requires_grad=True))
else:
    from examples.mlp import MLP
    module = MLP()
    target, args = module, (torch.randn(32, 781),)
"""

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, torch._dynamo
sys.path.insert(0, {root!r})
import aotc
import_s = time.perf_counter() - t0
{setup}
start = time.perf_counter()
if {mode!r} == "cold":
    fn = aotc.compile(target, capture="trace", cache=False, **{options!r})
else:
    fn = aotc.load({path!r}, module=module)
out = fn(*args)
first_call_s = time.perf_counter() - start
out = out if isinstance(out, torch.Tensor) else out[0]
out.sum().backward()
print(json.dumps({{"first_call_s": first_call_s, "import_s": import_s,
                  "compiler": "aotc.passes" in sys.modules}}))
"""


def _child(name: str, mode: str, path: str) -> dict[str, object]:
    code = CHILD.format(
        root=str(ROOT), setup=SETUP.format(name=name), mode=mode, path=path, options=OPTIONS[name]
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _per_call(name: str, path: str, rounds: int) -> dict[str, float]:
    scope: dict[str, object] = {}
    exec(SETUP.format(name=name), scope)  # noqa: S102 - the bench's own example setup
    target, args, module = scope["target"], scope["args"], scope["module"]
    compiled = aotc.compile(target, capture="trace", cache=False, **OPTIONS[name])
    loaded = aotc.load(path, module=module)

    def runner(fn):
        def run(n: int) -> None:
            for _ in range(n):
                out = fn(*args)
                (out if isinstance(out, torch.Tensor) else out[0]).sum().backward()

        return run

    times = interleaved_rounds(
        {"compiled": runner(compiled), "loaded": runner(loaded)},
        ITERS[name],
        rounds,
        max(ITERS[name] // 4, 2),
    )
    c, lo = median(times["compiled"]), median(times["loaded"])
    return {"compiled_us": c * 1e6, "loaded_us": lo * 1e6, "loaded_vs_compiled": ratio(lo, c)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--examples", default=",".join(OPTIONS))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.examples.split(","):
            scope: dict[str, object] = {}
            exec(SETUP.format(name=name), scope)  # noqa: S102
            path = os.path.join(tmp, name)
            example = scope["export_args"] or scope["args"]
            aotc.export(scope["target"], *example, path=path, **OPTIONS[name])  # type: ignore[arg-type,misc]
            cold = [_child(name, "cold", path) for _ in range(args.reps)]
            load = [_child(name, "load", path) for _ in range(args.reps)]
            cold_s = median([float(r["first_call_s"]) for r in cold])
            load_s = median([float(r["first_call_s"]) for r in load])
            results[name] = {
                "cold_s": cold_s,
                "load_s": load_s,
                "load_vs_cold": ratio(load_s, cold_s),
                "import_s": median([float(r["import_s"]) for r in cold + load]),
                "load_imports_compiler": any(bool(r["compiler"]) for r in load),
                "options": {k: str(v) for k, v in OPTIONS[name].items()},
                "iters_per_round": ITERS[name],
                **_per_call(name, path, args.rounds),
            }
    path = write_results("export", results, GOAL, reps=args.reps, rounds=args.rounds)
    rows = [
        [
            n,
            r["cold_s"] * 1e3,
            r["load_s"] * 1e3,
            r["load_vs_cold"],
            r["compiled_us"],
            r["loaded_us"],
            r["loaded_vs_compiled"],
        ]
        for n, r in results.items()
    ]
    header = ["example", "cold ms", "load ms", "load/cold", "compiled us", "loaded us", "ratio"]
    print(fmt_table(header, rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
