"""Calls per second of a compiled function from 1, 2 and 8 threads (tiny workload), vs eager.

f(x, y) = (x * y).sum() on 4-element tensors, x requires grad, forward + backward per call (the
tiny workload of bench/overhead.py). Each thread has its own inputs; all threads share one
compiled function (one entry). Reported: total calls/second over all threads (median of rounds)
for aotc and eager, and aotc/eager. On CPython the GIL serializes the Python parts of a call,
so more threads are not expected to add throughput here; the figure shows that the shared
compiled function neither serializes on a lock nor slows down under contention.

Run from the repo root: .venv/bin/python bench/threads.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import fmt_table, median, ratio, write_results

import aotc

THREADS = (1, 2, 8)


def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * y).sum()


def throughput(fn, threads: int, calls: int) -> float:
    barrier = threading.Barrier(threads + 1)
    done = []

    def body() -> None:
        x, y = torch.randn(4, requires_grad=True), torch.randn(4)
        barrier.wait()
        for _ in range(calls):
            fn(x, y).backward()
        done.append(1)

    ts = [threading.Thread(target=body) for _ in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - start
    assert len(done) == threads
    return threads * calls / elapsed


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    compiled = aotc.compile(f, cache=False)
    compiled(torch.randn(4, requires_grad=True), torch.randn(4)).backward()
    results = {}
    for n in THREADS:
        rates = {"aotc": [], "eager": []}
        for _ in range(args.rounds):
            rates["aotc"].append(throughput(compiled, n, args.calls))
            rates["eager"].append(throughput(f, n, args.calls))
        aotc_rate, eager_rate = median(rates["aotc"]), median(rates["eager"])
        results[f"{n}_threads"] = {
            "aotc_calls_per_s": round(aotc_rate),
            "eager_calls_per_s": round(eager_rate),
            "aotc_over_eager": ratio(aotc_rate, eager_rate),
        }
    assert len(aotc.inspect(compiled)) == 1
    write_results(
        "threads",
        results,
        "throughput of one shared compiled function from 1/2/8 threads, fwd+bwd on tiny inputs",
        calls_per_thread=args.calls,
        rounds=args.rounds,
    )
    print(table(results))
    return results


def table(results: dict) -> str:
    rows = [
        (k, v["aotc_calls_per_s"], v["eager_calls_per_s"], f"{v['aotc_over_eager']:.2f}")
        for k, v in results.items()
    ]
    return "calls/second, fwd+bwd tiny\n" + fmt_table(
        ("threads", "aotc", "eager", "aotc/eager"), rows
    )


if __name__ == "__main__":
    main()
