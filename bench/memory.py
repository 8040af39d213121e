"""Memory after 1,000 training steps vs after 10: a compiled MLP trained with SGD.

Measured in this process after gc: resident set size (RSS, from /proc/self/statm) and the number
of live torch.Tensor objects, after 10 steps and after 1,000 steps, for aotc and (separately, in
the same run) for eager. A leak of one tensor per step would show as +990 tensors. RSS on CPU
includes allocator caching, so a small growth there is noise unless tensors grow too.

Run from the repo root: .venv/bin/python bench/memory.py [--steps N]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import fmt_table, write_results

import aotc


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensors() -> int:
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def measure(compile_it: bool, steps: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    fn = aotc.compile(model, cache=False) if compile_it else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    marks = {}
    for step in range(1, steps + 1):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(fn(x), y).backward()
        opt.step()
        if step in (10, steps):
            gc.collect()
            marks[step] = {"rss_mb": round(rss_bytes() / 2**20, 2), "live_tensors": live_tensors()}
    first, last = marks[10], marks[steps]
    return {
        "after_10": first,
        f"after_{steps}": last,
        "rss_growth_mb": round(last["rss_mb"] - first["rss_mb"], 2),
        "tensor_growth": last["live_tensors"] - first["live_tensors"],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args(argv)
    results = {"eager": measure(False, args.steps), "aotc": measure(True, args.steps)}
    results["aotc_no_tensor_growth"] = results["aotc"]["tensor_growth"] <= 0
    write_results(
        "memory",
        results,
        "1,000 training steps do not grow memory (live tensors, RSS)",
        steps=args.steps,
    )
    print(table(results, args.steps))
    return results


def table(results: dict, steps: int = 1000) -> str:
    rows = [
        (
            k,
            r["after_10"]["live_tensors"],
            r[f"after_{steps}"]["live_tensors"],
            r["after_10"]["rss_mb"],
            r[f"after_{steps}"]["rss_mb"],
            r["rss_growth_mb"],
        )
        for k, r in results.items()
        if isinstance(r, dict)
    ]
    return f"memory after 10 vs {steps} steps\n" + fmt_table(
        ("system", "tensors@10", f"tensors@{steps}", "RSS MB@10", f"RSS MB@{steps}", "RSS growth"),
        rows,
    )


if __name__ == "__main__":
    main()
