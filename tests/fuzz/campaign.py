"""The fuzz campaign: many random programs, every mode, with counts and shrunk failures.

    PYTHONPATH=. nice -n 10 python -m tests.fuzz.campaign --programs 2000 --seed 0 \
        --modes trace,default,dynamo,triton --out /tmp/aotc-fuzz

Prints one line per program that does not match eager, and at the end (and into
`<out>/summary.json`) how many programs ran per mode, how many matched, how many aotc refused
(UnsupportedError, by reason) and how many differed; each difference is shrunk and written to
`<out>/<mode>_<seed>.py`, a runnable program. Modes `trace_hit`, `default_hit` and `triton_hit` check a
disk-cache hit instead of the cold compile: the program is compiled and called once, then
compiled again, which loads the stored entry (tests/fuzz/compare.py).
"""

from __future__ import annotations

import os

# Triton reads this when imported: generated kernels run in its interpreter on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
# A campaign never fills the user's compile cache.
if "AOTC_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["AOTC_CACHE_DIR"] = tempfile.mkdtemp(prefix="aotc-fuzz-cache-")

import argparse
import collections
import json
import logging
import re
import sys
import time
import warnings

import torch

from tests.fuzz.compare import Outcome, Verdict, check
from tests.fuzz.generate import Program, generate
from tests.fuzz.shrink import shrink


def run_program(program: Program, mode: str) -> Outcome:
    try:
        f, make_inputs = program.compile()
        return check(f, make_inputs, program.backward, program.write_outputs, mode)
    except Exception as e:  # noqa: BLE001 the harness itself failed: report as a difference
        return Outcome(Verdict.DIFFERS, f"harness: {type(e).__name__}: {e}")


def reason_bucket(detail: str) -> str:
    """A refusal reason without paths, line numbers and values, for counting."""
    text = re.sub(r"at [^ ]+:\d+ \([^)]*\)", "at <line>", detail)
    text = re.sub(r"\d+", "N", text)
    return text[:140]


def shrink_failure(program: Program, mode: str, outcome: Outcome) -> Program:
    def still_fails(candidate: Program) -> bool:
        return run_program(candidate, mode).verdict is outcome.verdict

    return shrink(program, still_fails)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="trace,default,dynamo,triton")
    parser.add_argument("--out", default="/tmp/aotc-fuzz")
    parser.add_argument("--progress", type=int, default=50, help="print counts every n programs")
    parser.add_argument(
        "--device", default="cpu", help="the default device the programs' tensors are made on"
    )
    parser.add_argument(
        "--every", type=int, default=5, help="run the modes other than trace every n-th program"
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    warnings.simplefilter("ignore")
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    if args.device != "cpu":
        torch.set_default_device(args.device)
    modes = args.modes.split(",")
    counts: dict[str, collections.Counter[str]] = {m: collections.Counter() for m in modes}
    refusals: dict[str, collections.Counter[str]] = {m: collections.Counter() for m in modes}
    differences: list[dict[str, object]] = []
    start = time.time()
    for seed in range(args.seed, args.seed + args.programs):
        try:
            program = generate(seed)
        except Exception as e:  # noqa: BLE001 generator bug: count it, go on
            counts["generator"] = counts.get("generator", collections.Counter())
            counts["generator"]["error"] += 1
            print(f"seed {seed}: generator failed: {e}", flush=True)
            continue
        for mode in modes:
            if mode != "trace" and seed % args.every:
                continue
            outcome = run_program(program, mode)
            counts[mode][outcome.verdict.value] += 1
            if outcome.verdict is Verdict.REFUSED:
                refusals[mode][reason_bucket(outcome.detail)] += 1
            elif outcome.verdict is Verdict.DIFFERS:
                small = shrink_failure(program, mode, outcome)
                path = os.path.join(args.out, f"{mode}_{seed}.py")
                with open(path, "w") as f:
                    f.write(small.source(mode))
                differences.append({"seed": seed, "mode": mode, "detail": outcome.detail})
                print(f"seed {seed} {mode}: DIFFERS {outcome.detail[:200]} -> {path}", flush=True)
        if (seed - args.seed + 1) % args.progress == 0:
            print(
                f"{seed - args.seed + 1} programs, {time.time() - start:.0f} s: "
                f"{ {m: dict(c) for m, c in counts.items()} }",
                flush=True,
            )
    summary = {
        "programs": args.programs,
        "seconds": round(time.time() - start, 1),
        "counts": {m: dict(c) for m, c in counts.items()},
        "refusals": {m: dict(c.most_common()) for m, c in refusals.items()},
        "differences": differences,
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
