"""Symbolic sizes through generated Triton kernels: compilations, Triton compiles and time.

One training step (forward + backward) of the GPT block (examples/gpt_block.py, small) for each of
several sequence lengths, through `aotc.compile(..., backend="triton")` static (one compilation
per length) and with `dynamic=True` (one compilation for all). Counted: aotc compilations
(records), generated kernel sources, Triton compiles (kernel module loads), and the wall time of
all steps (compiles included). On CPU the kernels run in Triton's interpreter, so the times say
little about kernel speed; the counts are the point.

Run from the repo root: .venv/bin/python bench/triton_dynamic.py
Writes bench/results/triton_dynamic.json.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import fmt_table, write_results

import aotc
import aotc.runtime.kernels as rk
from examples.gpt_block import Block

LENGTHS = [3, 5, 7, 9, 12]


def run(dynamic: bool, device: str) -> dict[str, Any]:
    loads = [0]
    real = importlib.util.spec_from_file_location

    def spec(name: str, *args: Any, **kwargs: Any) -> Any:
        loads[0] += name.startswith("aotc_kernel_")
        return real(name, *args, **kwargs)

    rk._KERNELS.clear()
    rk._BEST.clear()
    importlib.util.spec_from_file_location = spec  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        model = aotc.compile(
            Block(16, 2, use_sdpa=False).to(device), dynamic=dynamic, backend="triton"
        )
        start = time.perf_counter()
        for t in LENGTHS:
            model(torch.randn(2, t, 16, device=device)).sum().backward()
        seconds = time.perf_counter() - start
    finally:
        importlib.util.spec_from_file_location = real  # type: ignore[assignment]
    recs = aotc.inspect(model)
    sources = {k.key for r in recs for k in r.kernels}
    return {
        "compilations": len(recs),
        "kernel_sources": len(sources),
        "triton_compiles": loads[0],
        "seconds_all_steps": round(seconds, 3),
    }


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {
        "sequence_lengths": LENGTHS,
        "device": device,
        "static": run(False, device),
        "dynamic": run(True, device),
    }
    rows = [
        [k, *[results[m][k] for m in ("static", "dynamic")]]
        for k in ("compilations", "kernel_sources", "triton_compiles", "seconds_all_steps")
    ]
    print(fmt_table(["GPT block, 5 lengths", "static", "dynamic=True"], rows))
    path = write_results(
        "triton_dynamic",
        results,
        device=device,
        note="CPU runs use Triton's interpreter; times include compiles",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
