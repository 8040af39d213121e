"""Generated kernels of the examples and the model tests, measured without a GPU.

    PYTHONPATH=. python bench/kernels.py            # -> bench/results/kernels.json
    PYTHONPATH=. python bench/kernels.py --no-compile   # skip the sm_90/sm_80 compiles

For each program (examples/mlp.py, examples/gpt_block.py with and without SDPA, and the models of
tests/e2e/models.py), one training step runs through `aotc.compile(backend="triton")` on CPU
(kernels in Triton's interpreter) and every lowered graph (forward, backward) reports:
- coverage: pointwise/reduction/indexing/scan nodes of the decomposed graph that run as generated
  kernels, and the ATen ops of the others (passes.kernel_figures);
- static memory traffic: bytes the generated kernels read and write against the minimum for the
  graph (each graph input read once, each output written once), plus the ATen calls' bytes and
  the kernels' own minimum given those ATen calls (`fusion_min_bytes`);
- each kernel compiled for sm_90 and sm_80 (default block configuration, Triton's compiler, no
  GPU): failures, the most registers, kernels with spills or low occupancy (runtime.cuda_check).
Ratios are of byte counts, so they do not depend on the machine.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import fmt_table, write_results  # noqa: E402

import aotc  # noqa: E402
from aotc.passes.kernelize import KERNEL_LISTENERS  # noqa: E402
from aotc.runtime import cuda_check  # noqa: E402
from aotc.runtime.kernels import CompiledGraph  # noqa: E402


def _programs() -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], tuple[Any, ...]]]]:
    from examples.gpt_block import Block
    from examples.mlp import MLP
    from tests.e2e import models as m

    return {
        "examples/mlp": (lambda: MLP(781, 64, 10), lambda: (torch.randn(37, 781),)),
        "examples/gpt_block": (
            lambda: Block(64, 4, use_sdpa=False),
            lambda: (torch.randn(3, 17, 64),),
        ),
        "examples/gpt_block_sdpa": (
            lambda: Block(64, 4, use_sdpa=True),
            lambda: (torch.randn(3, 17, 64),),
        ),
        "models/gpt": (m.GPT, m.gpt_batch),
        "models/bert": (m.BERT, m.bert_batch),
        "models/llama_block": (m.LlamaBlock, m.llama_batch),
        "models/convnet": (m.ConvNet, m.conv_batch),
        "models/lstm_loop": (m.LSTMLoop, m.lstm_batch),
        "models/dropout_mlp": (m.DropoutMLP, m.mlp_batch),
    }


def measure(
    make_model: Callable[[], torch.nn.Module], make_batch: Callable[[], tuple[Any, ...]]
) -> list[CompiledGraph]:
    """The lowered graphs of one training step of the model through backend="triton"."""
    seen: list[CompiledGraph] = []
    KERNEL_LISTENERS.append(seen.append)
    try:
        torch.manual_seed(0)
        model = copy.deepcopy(make_model())
        compiled = aotc.compile(model, backend="triton", cache=False)
        out = compiled(*make_batch())
        loss = out if isinstance(out, torch.Tensor) else sum(o.float().sum() for o in out)
        if loss.requires_grad:
            loss.float().sum().backward()
    finally:
        KERNEL_LISTENERS.remove(seen.append)
    return seen


def summarize(graphs: list[CompiledGraph], compile_kernels: bool) -> dict[str, Any]:
    figs = [g.figures for g in graphs if g.figures is not None]
    eligible = sum(f.eligible_ops for f in figs)
    in_kernels = sum(f.kernel_ops for f in figs)
    fallback: Counter[str] = Counter()
    for f in figs:
        fallback.update(dict(f.fallback_ops))
    static = [f for f in figs if f.kernel_bytes is not None]
    kernel_bytes = sum(f.kernel_bytes or 0 for f in static)
    aten_bytes = sum(f.aten_bytes or 0 for f in static)
    min_bytes = sum(f.min_bytes or 0 for f in static)
    fusion_min = sum(f.fusion_min_bytes or 0 for f in static)
    out: dict[str, Any] = {
        "graphs": len(graphs),
        "kernels": sum(len(g.kernels) for g in graphs),
        "eligible_ops": eligible,
        "kernel_ops": in_kernels,
        "coverage": round(in_kernels / eligible, 4) if eligible else 1.0,
        "fallback_ops": dict(sorted(fallback.items())),
        "kernel_bytes": kernel_bytes,
        "aten_bytes": aten_bytes,
        "min_bytes": min_bytes,
        "fusion_min_bytes": fusion_min,
        "ratio": {
            "traffic_vs_min": round((kernel_bytes + aten_bytes) / min_bytes, 3)
            if min_bytes
            else None,
            "kernel_vs_fusion_min": round(kernel_bytes / fusion_min, 3) if fusion_min else None,
        },
        "per_graph": [
            {
                "kernels": len(g.kernels),
                "coverage": round(g.figures.coverage, 4),
                "kernel_bytes": g.figures.kernel_bytes,
                "aten_bytes": g.figures.aten_bytes,
                "min_bytes": g.figures.min_bytes,
                "fusion_min_bytes": g.figures.fusion_min_bytes,
            }
            for g in graphs
            if g.figures is not None
        ],
    }
    if compile_kernels:
        kernels = [k for g in graphs for k in g.gpu_kernels]
        results = cuda_check.compile_kernels(kernels, every_config=False)
        for target in cuda_check.DEFAULT_TARGETS:
            mine = [r for r in results if r.target is target]
            ok = [r for r in mine if r.resources is not None]
            out[target.value] = {
                "compiled": sum(1 for r in mine if r.ok),
                "failed": [f"{r.kernel}: {r.error}" for r in mine if not r.ok],
                "max_registers": max((r.resources.registers for r in ok), default=0),  # type: ignore[union-attr]
                "spilling": sorted(r.kernel for r in ok if r.resources.spill_stores),  # type: ignore[union-attr]
                "low_occupancy": sorted(
                    r.kernel
                    for r in ok
                    if r.resources.occupancy < cuda_check.LOW_OCCUPANCY  # type: ignore[union-attr]
                ),
            }
    return out


def table(results: dict[str, Any]) -> str:
    rows = []
    for name, r in results.items():
        rows.append(
            [
                name,
                r["kernels"],
                f"{r['kernel_ops']}/{r['eligible_ops']}",
                f"{r['coverage']:.0%}",
                r["ratio"]["traffic_vs_min"],
                r["ratio"]["kernel_vs_fusion_min"],
                ", ".join(r["fallback_ops"]) or "-",
            ]
        )
    return fmt_table(
        [
            "program",
            "kernels",
            "ops in kernels",
            "coverage",
            "traffic/min",
            "kernel/fusion-min",
            "still ATen (pointwise/reduction)",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-compile", action="store_true", help="skip the sm_90/sm_80 compiles")
    p.add_argument("--only", nargs="*", help="program names to run (default: all)")
    args = p.parse_args(argv)
    results: dict[str, Any] = {}
    for name, (make_model, make_batch) in _programs().items():
        if args.only and name not in args.only:
            continue
        results[name] = summarize(measure(make_model, make_batch), not args.no_compile)
        print(
            f"{name}: {results[name]['kernels']} kernels, coverage {results[name]['coverage']:.0%}"
        )
    eligible = sum(r["eligible_ops"] for r in results.values())
    total = {
        "eligible_ops": eligible,
        "kernel_ops": sum(r["kernel_ops"] for r in results.values()),
        "coverage": round(sum(r["kernel_ops"] for r in results.values()) / eligible, 4),
    }
    print(table(results))
    print(
        f"all programs: {total['kernel_ops']}/{eligible} ops in kernels ({total['coverage']:.0%})"
    )
    path = write_results(
        "kernels",
        results,
        goal="pointwise/reduction ops in generated kernels; kernel traffic near the minimum; "
        "every kernel compiles for sm_90 and sm_80",
        total=total,
        targets=[t.value for t in cuda_check.DEFAULT_TARGETS],
    )
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
