"""Measure the GPU heuristics behind aotc's Triton kernels against their alternatives, one run.

    PYTHONPATH=. python bench/gpu_variants.py      # on a GPU machine -> bench/results/gpu_variants.json

Parts (each alternative in the same process, or in fresh processes where caches would mix):
- `warm_compile`: cold compile + first step of the examples' GPT block and MLP with warm
  compiles (runtime/precompile.py) on and off, each in a fresh process with an empty Triton cache;
  with the seconds first launches spent waiting for warm compiles and in total.
- `persistent_rnumel`: softmax and LayerNorm forward+backward over rows of 4096 with rows up to
  2048 (today's `PERSISTENT_RNUMEL`) or 4096 elements reduced in registers.
- `pointwise_blocks`: the 10-op pointwise chain's forward with each pointwise block
  configuration alone (no autotuning), as a fraction of the copy bandwidth.
- `gpt_kernels`: the costliest GPU kernels of a GPT block training step, aotc and Inductor.
- `split_target`: LayerNorm forward+backward with its weight and bias gradients' sums split
  for 16384, 65536 or 262144 partial results.

`--parts` picks parts (default: warm_compile,split_target,gpt_kernels); a run keeps the parts of the
results file it does not run, so results from several runs sit side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _child_compile(model: str, warm: bool) -> dict[str, Any]:
    import copy

    import torch
    import torch.nn.functional as F

    import aotc
    from aotc.runtime import kernels as K
    from aotc.runtime import precompile

    if not warm:
        precompile.warm = lambda kernels, device: 0  # type: ignore[assignment]
    from examples.gpt_block import Block
    from examples.mlp import MLP

    torch.manual_seed(0)
    if model == "gpt_block":
        base, x = Block(768, 12).cuda(), torch.randn(8, 1024, 768, device="cuda")
        target = torch.randn_like(x)

        def loss_of(y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(y, target)
    else:
        base, x = MLP(4096, 4096, 1000).cuda(), torch.randn(8192, 4096, device="cuda")
        labels = torch.randint(0, 1000, (8192,), device="cuda")

        def loss_of(y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(y, labels)

    m = aotc.compile(copy.deepcopy(base), backend="triton")
    params = list(m.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        loss_of(m(x)).backward()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    steady = (time.perf_counter() - t0) / 10
    return {
        "first_call_seconds": first,
        "step_seconds": steady,
        "compile_seconds": first - steady,
        "first_launch_warm_configs": K.FIRST_LAUNCH["warm"],
        "first_launch_total_seconds": K.FIRST_LAUNCH["total"],
        "first_launches": K.FIRST_LAUNCH["launches"],
    }


def warm_compile() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in ("gpt_block", "mlp"):
        for warm in (True, False):
            env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="aotc-var-")}
            env["AOTC_CACHE"] = "0"
            proc = subprocess.run(
                [sys.executable, __file__, "--child", f"compile:{model}:{int(warm)}"],
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            key = f"{model}_{'warm' if warm else 'cold'}"
            try:
                out[key] = json.loads(proc.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                out[key] = {"error": proc.stderr[-2000:]}
            print(key, out[key], flush=True)
    return out


def _bench(fn: Any, reps: int = 50) -> float:
    from gpu import time_call

    return time_call(fn, "cuda", reps)


def _record(out: dict[str, Any], key: str, step: Any, ideal: float, bw: float) -> None:
    """Time `step` into `out[key]` as a fraction of the copy bandwidth `bw`, or its error."""
    try:
        secs = _bench(step)
        out[key] = {"seconds": secs, "fraction_of_copy_bw": ideal / secs / bw}
    except Exception as e:  # noqa: BLE001 - recorded, the next variant runs
        out[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
    print(key, out[key], flush=True)


def _copy_bw(dtype: Any) -> float:
    import torch

    src = torch.randn(2**26, device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _bench(lambda: dst.copy_(src))


def _row_inputs(dtype: Any, rows: int, cols: int) -> tuple[float, int, int, tuple[Any, ...]]:
    """The copy bandwidth at `dtype`, its element size, rows * cols, and (x, weight, bias,
    cotangent) of a [rows, cols] normalization."""
    import torch

    esize = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(cols, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(cols, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(rows, cols, device="cuda", dtype=dtype)
    return _copy_bw(dtype), esize, rows * cols, (x, w, b, g)


def persistent_rnumel() -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import aotc
    from aotc.passes import codegen

    out: dict[str, Any] = {}
    original = codegen.PERSISTENT_RNUMEL
    rows, cols = 16384, 4096
    for dtype in (torch.float32, torch.bfloat16):
        bw, esize, m, (x, w, b, g) = _row_inputs(dtype, rows, cols)
        cases = {
            "softmax": (lambda t: torch.softmax(t, -1), [x], 5 * m * esize),
            "layer_norm": (
                lambda t, w, b: F.layer_norm(t, (cols,), w, b),
                [x, w, b],
                5 * m * esize + 2 * rows * 4 + 4 * cols * esize,
            ),
        }
        for limit in (2048, 4096):
            codegen.PERSISTENT_RNUMEL = limit  # restored below
            for name, (fn, args, ideal) in cases.items():
                f = aotc.compile(fn, backend="triton", capture="trace")

                def step(f: Any = f, args: list[Any] = args) -> None:
                    for a in args:
                        a.grad = None
                    f(*args).backward(g)

                key = f"{name}_{str(dtype).split('.')[-1]}_persistent{limit}"
                _record(out, key, step, ideal, bw)
    codegen.PERSISTENT_RNUMEL = original
    return out


def pointwise_blocks() -> dict[str, Any]:
    import torch
    from gpu import chain10

    import aotc
    from aotc.runtime import kernels as K

    out: dict[str, Any] = {}
    original = K.candidate_configs
    for dtype in (torch.float32, torch.bfloat16):
        bw = _copy_bw(dtype)
        x = torch.randn(2**26, device="cuda", dtype=dtype)
        ideal = 2 * x.numel() * x.element_size()
        for cfg in (
            (1024, 1, 4),
            (512, 1, 4),
            (2048, 1, 8),
            (2048, 1, 4),
            (4096, 1, 8),
            (4096, 1, 16),
        ):
            K.candidate_configs = lambda *a, cfg=cfg, **k: [cfg]  # type: ignore[assignment]
            K._BEST.clear()
            f = aotc.compile(chain10, backend="triton", capture="trace")
            with torch.no_grad():
                secs = _bench(lambda f=f: f(x))
            key = f"{str(dtype).split('.')[-1]}_{cfg[0]}x{cfg[2]}w"
            out[key] = {"seconds": secs, "fraction_of_copy_bw": ideal / secs / bw}
            print(key, out[key], flush=True)
    K.candidate_configs = original
    return out


def split_target() -> dict[str, Any]:
    """LayerNorm forward+backward (rows of 4096) with the split of its weight and bias gradient
    sums aiming at 16384, 65536 or 262144 partial results (passes.split_reduction)."""
    import torch
    import torch.nn.functional as F

    import aotc
    from aotc.passes import split_reduction

    out: dict[str, Any] = {}
    original = split_reduction.TARGET_RESULTS
    rows, cols = 16384, 4096
    for dtype in (torch.float32, torch.bfloat16):
        bw, esize, m, (x, w, b, g) = _row_inputs(dtype, rows, cols)
        ideal = 5 * m * esize + 2 * rows * 4 + 4 * cols * esize
        for target in (16384, 65536, 262144):
            split_reduction.TARGET_RESULTS = target
            f = aotc.compile(
                lambda t, w, b: F.layer_norm(t, (cols,), w, b), backend="triton", capture="trace"
            )

            def step(f: Any = f) -> None:
                for a in (x, w, b):
                    a.grad = None
                f(x, w, b).backward(g)

            key = f"layer_norm_{str(dtype).split('.')[-1]}_target{target}"
            _record(out, key, step, ideal, bw)
    split_reduction.TARGET_RESULTS = original
    return out


def gpt_kernels() -> dict[str, Any]:
    """Where a GPT block training step spends GPU time: the 15 costliest kernels of aotc's and
    Inductor's step (torch.profiler, 5 steps), with each system's total kernel time."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    import aotc
    from examples.gpt_block import Block

    torch.manual_seed(0)
    base, x = Block(768, 12).cuda(), torch.randn(8, 1024, 768, device="cuda")
    target = torch.randn_like(x)
    out: dict[str, Any] = {}
    for name, model in (
        ("aotc", aotc.compile(copy.deepcopy(base), backend="triton")),
        ("inductor", torch.compile(copy.deepcopy(base))),
    ):
        params = list(model.parameters())

        def step(model: Any = model, params: list[Any] = params) -> None:
            for p in params:
                p.grad = None
            F.mse_loss(model(x), target).backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        rows = []
        total = 0.0
        for evt in prof.key_averages():
            us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            if us <= 0:
                continue
            total += us / 5
            rows.append((us / 5, evt.key[:90], evt.count // 5))
        rows.sort(reverse=True)
        out[name] = {
            "kernel_us_per_step": total,
            "top": [{"us": round(us, 1), "kernel": k, "calls": c} for us, k, c in rows[:15]],
        }
        print(name, json.dumps(out[name], indent=1), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", default=None)
    p.add_argument("--parts", default="warm_compile,split_target,gpt_kernels")
    args = p.parse_args()
    if args.child:
        _, model, warm = args.child.split(":")
        print(json.dumps(_child_compile(model, bool(int(warm)))))
        return
    import torch
    from common import write_results

    parts = {
        "warm_compile": warm_compile,
        "persistent_rnumel": persistent_rnumel,
        "pointwise_blocks": pointwise_blocks,
        "split_target": split_target,
        "gpt_kernels": gpt_kernels,
    }
    path = Path(__file__).resolve().parent / "results" / "gpu_variants.json"
    results: dict[str, Any] = json.loads(path.read_text())["results"] if path.exists() else {}
    for name in args.parts.split(","):
        try:
            results[name] = parts[name]()
        except Exception as e:  # noqa: BLE001 - recorded, the next part runs
            results[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        write_results("gpu_variants", results, device=torch.cuda.get_device_name())
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
