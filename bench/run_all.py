"""Run every aotc benchmark and print a compact summary (`make bench`).

Run from the repo root: .venv/bin/python bench/run_all.py [--quick] [--instructions]
Results go to bench/results/compile_time.json, overhead.json, partition.json, cache.json,
threads.json and memory.json.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cache as cache_bench
import compile_time
import memory as memory_bench
import overhead
import partition as partition_bench
import threads as threads_bench


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    p.add_argument(
        "--instructions", action="store_true", help="add callgrind counts to overhead.json"
    )
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)

    ct_args = ["--procs", "1", "--reps", "3"] if args.quick else []
    oh_args = ["--procs", "2", "--iters", "300", "--rounds", "3"] if args.quick else []
    if args.instructions:
        oh_args.append("--instructions")
    pt_args = ["--quick"] if args.quick else []

    ct = compile_time.main(ct_args)
    print()
    oh = overhead.main(oh_args)
    print()
    pt = partition_bench.main(pt_args)
    print()
    ca = cache_bench.main(["--reps", "1"] if args.quick else [])
    print()
    th = threads_bench.main(["--calls", "300", "--rounds", "3"] if args.quick else [])
    print()
    me = memory_bench.main(["--steps", "200"] if args.quick else [])

    print("\n=== summary (medians; CPU) ===")
    print(compile_time.table(ct))
    print()
    print(overhead.table(oh))
    print()
    print(partition_bench.table(pt))
    print()
    print(cache_bench.table(ca))
    print()
    print(threads_bench.table(th))
    print()
    print(memory_bench.table(me, 200 if args.quick else 1000))
    fb = oh["fwd_bwd"]
    ok_ct = all(r["meets_goal"] for r in ct.values())
    print(
        f"\ngoals: cold compile ratio <= 1.0 on all workloads: {'yes' if ok_ct else 'NO'}; "
        f"fwd+bwd aotc/eager <= {overhead.TARGET_RATIO:g} (both capture modes): "
        f"{'yes' if fb['meets_goal'] else 'NO'}; saved bytes <= eager's, step time within "
        f"{partition_bench.STEP_NOISE:g}x of eager, scaling partition < "
        f"{partition_bench.SCALING_GOAL_S:g} s: "
        f"{'yes' if pt['all_goals_met'] else 'NO'}; warm start < 10% of cold: "
        f"{'yes' if all(r['meets_goal'] for r in ca.values()) else 'NO'}; no tensor growth "
        f"over training steps: {'yes' if me['aotc_no_tensor_growth'] else 'NO'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
