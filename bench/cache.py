"""Cold vs warm compile time of the examples, each run in a fresh subprocess.

Per example (examples/mlp.py's MLP, examples/gpt_block.py's Block) and backend (--backends;
rows named `example[triton]` for the Triton backend, whose warm start runs the stored kernels of
this user's signed entry; on a machine without CUDA the kernels run in Triton's interpreter, and
compile times are CPU times of aotc's Python stages, not GPU compile times): `cold` compiles into an
empty cache directory, `warm` is a new process compiling the same model with the entry present,
`no_cache` runs with AOTC_CACHE=0 (the pipeline without the key trace). Measured in the child:
the wall time of the first compiled call (compile + one forward) and aotc's own per-stage compile
time. Every child imports torch._dynamo before timing: FakeTensorMode imports it (~2 s), and so
does any script that takes an eager torch.optim step, so it is process start-up, not compile
work; `import_s` reports it separately. So are, for `[triton]` rows, the imports of triton and
its interpreter (every process using that backend pays them once), and one `gc.collect()` after
the imports: the first full collection of a process that just imported torch and Dynamo walks
every object they made (100-250 ms on this machine) and otherwise lands in whichever compile
stage happens to trigger it, cold or warm. Reported: medians over --reps runs, and warm/cold.

Run from the repo root: .venv/bin/python bench/cache.py [--reps N]
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

from common import fmt_table, median, ratio, write_results

GOAL = "warm start (new process, same function, cache hit) < 5% of the cold compile time"
TARGET = 0.05

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, torch._dynamo
if {backend!r} == "triton":
    import triton, triton.language, triton.runtime.interpreter
sys.path.insert(0, {root!r})
import aotc, gc
gc.collect()
import_s = time.perf_counter() - t0
name = {name!r}
torch.manual_seed(0)
if name == "mlp":
    from examples.mlp import MLP
    model, x = MLP(), torch.randn(32, 781)
else:
    from examples.gpt_block import Block
    model, x = Block(), torch.randn(4, 32, 64)
compiled = aotc.compile(model, backend={backend!r})
start = time.perf_counter()
out = compiled(x)
first_call_s = time.perf_counter() - start
out.sum().backward()
torch.testing.assert_close(out, model(x))
rec = aotc.inspect(compiled)[0]
print(json.dumps({{"first_call_s": first_call_s, "import_s": import_s,
                  "kernels": [k.source for k in rec.kernels],
                  "stages": rec.stage_seconds, "hit": "cache_load" in rec.stage_seconds}}))
"""


def child(name: str, cache_dir: str, enabled: bool, backend: str) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        AOTC_CACHE_DIR=cache_dir,
        AOTC_CACHE="1" if enabled else "0",
    )
    code = CHILD.format(root=str(ROOT), name=name, backend=backend)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--backends",
        default="aten,triton",
        help="comma-separated; 'triton' without CUDA runs Triton's interpreter",
    )
    args = p.parse_args(argv)
    results: dict = {}
    cases = [
        (name, backend) for backend in args.backends.split(",") for name in ("mlp", "gpt_block")
    ]
    for name, backend in cases:
        runs: dict[str, list[dict]] = {"cold": [], "warm": [], "no_cache": []}
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory(prefix="aotc-bench-cache-") as d:
                runs["cold"].append(child(name, d, True, backend))
                runs["warm"].append(child(name, d, True, backend))
                runs["no_cache"].append(child(name, d, False, backend))
        assert not any(r["hit"] for r in runs["cold"]) and all(r["hit"] for r in runs["warm"])
        # A hit runs exactly the cold compile's kernels (none for the ATen backend).
        assert all(w["kernels"] == c["kernels"] for c, w in zip(runs["cold"], runs["warm"]))
        assert (backend == "aten") == (not runs["cold"][0]["kernels"])
        row = {}
        for kind, rs in runs.items():
            row[kind] = {
                "first_call_s": median([r["first_call_s"] for r in rs]),
                "compile_s": median([sum(r["stages"].values()) for r in rs]),
                "stages_ms": {
                    k: round(1e3 * median([r["stages"].get(k, 0.0) for r in rs]), 2)
                    for k in rs[0]["stages"]
                },
                "import_s": median([r["import_s"] for r in rs]),
            }
        row["warm_over_cold_compile"] = ratio(row["warm"]["compile_s"], row["cold"]["compile_s"])
        row["warm_over_cold_first_call"] = ratio(
            row["warm"]["first_call_s"], row["cold"]["first_call_s"]
        )
        row["warm_over_no_cache_compile"] = ratio(
            row["warm"]["compile_s"], row["no_cache"]["compile_s"]
        )
        row["meets_goal"] = row["warm_over_cold_compile"] < TARGET
        row["backend"] = backend
        row["kernels"] = len(runs["cold"][0]["kernels"])
        for r in (x for rs in runs.values() for x in rs):
            del r["kernels"]
        results[name if backend == "aten" else f"{name}[{backend}]"] = row
    write_results("cache", results, GOAL, reps=args.reps)
    print(table(results))
    return results


def table(results: dict) -> str:
    rows = [
        (
            name,
            f"{r['cold']['compile_s'] * 1e3:.0f}",
            f"{r['no_cache']['compile_s'] * 1e3:.0f}",
            f"{r['warm']['compile_s'] * 1e3:.0f}",
            f"{r['warm_over_cold_compile']:.3f}",
            f"{r['warm']['stages_ms']}",
        )
        for name, r in results.items()
    ]
    return "compile time (ms, fresh processes)\n" + fmt_table(
        ("example", "cold", "no cache", "warm", "warm/cold", "warm stages (ms)"), rows
    )


if __name__ == "__main__":
    main()
