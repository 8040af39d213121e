"""The GPU suite for generated Triton kernels (issue #4): one command on a CUDA machine.

    PYTHONPATH=. python bench/gpu.py            # on a GPU machine -> bench/results/gpu.json
    PYTHONPATH=. python bench/gpu.py --smoke    # tiny sizes; on CPU runs aotc's kernels in
                                                # Triton's interpreter -> gpu_smoke.json

Measures, in one process and one run, against eager and Inductor (`torch.compile` default):
- copy bandwidth of the device (`dst.copy_(src)`, 2^26 float32), the denominator below;
- memory-bound work: a chain of 10 pointwise ops on 2^26 elements (forward, and forward+backward),
  softmax and LayerNorm forward+backward at transformer sizes. Achieved bandwidth is the ideal
  traffic (every input read once, every output written once, what the backward needs from the
  forward counted once) divided by the time, as a fraction of the copy bandwidth (goal >= 0.85);
- training steps (forward + loss + backward) of the examples' models at GPU sizes: time ratios
  aotc/eager and aotc/Inductor (goal <= 1.0), and compile time aotc/Inductor (goal <= 0.33).
  Compile time is the first call's time minus a steady call's, each system starting from empty
  on-disk caches (a fresh TRITON_CACHE_DIR, Inductor's caches and aotc's cache disabled).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Cold compiles for every system: set before torch/triton are imported.
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="aotc-bench-triton-"))
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
os.environ.setdefault("AOTC_CACHE", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import fmt_table, median, ratio, write_results  # noqa: E402

import aotc  # noqa: E402

BW_GOAL = 0.85
STEP_GOAL = 1.0
COMPILE_GOAL = 0.33


# --- timing ---------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device: str, reps: int, warmup: int = 3) -> float:
    """Median seconds per call; CUDA events on the GPU, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return median(samples)


def first_call_seconds(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


_SAVE: Callable[[], None] = lambda: None  # noqa: E731 set by main: writes what is measured so far


@contextlib.contextmanager
def _recorded(res: dict[str, Any], name: str) -> Iterator[None]:
    """One case's failure is recorded in its results (the rest of the suite goes on), and the
    results so far are written after every case (a run cut short still leaves its figures)."""
    t0 = time.perf_counter()
    try:
        yield
    except Exception as e:  # noqa: BLE001 a benchmark case, not the program: record and go on
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback_tail"] = traceback.format_exc()[-3000:]
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    finally:
        res["case_seconds"] = round(time.perf_counter() - t0, 2)
        torch._dynamo.reset()
        _SAVE()


# --- systems --------------------------------------------------------------------------------


def _trace_fallback(res: dict[str, Any], error: Exception, make: Callable[[], Any]) -> Any:
    """aotc's default capture failed on this machine's torch: record why, and compile `fn` with
    the whole-program tracer instead (the generated kernels are the same)."""
    res["aotc_default_capture_error"] = f"{type(error).__name__}: {error}"[:1000]
    res["aotc_capture"] = "trace"
    print(f"aotc default capture failed ({type(error).__name__}); measuring capture='trace'")
    torch._dynamo.reset()
    return make()


def make_systems(fn: Callable[..., Any], backend: str) -> dict[str, Callable[..., Any]]:
    return {
        "eager": fn,
        "inductor": torch.compile(fn),
        "aotc": aotc.compile(fn, backend=backend),
    }


def num_kernels(compiled: Any) -> int:
    return sum(len(getattr(rec, "kernels", ())) for rec in aotc.inspect(compiled))


# --- memory-bound workloads -----------------------------------------------------------------


def chain10(x: torch.Tensor) -> torch.Tensor:
    y = x * 1.5
    y = y + 0.25
    y = torch.sin(y)
    y = y * y
    y = y - 0.5
    y = torch.exp(y)
    y = y / 3.0
    y = torch.tanh(y)
    y = y * x
    return torch.sigmoid(y)


def softmax_last(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b)


def memory_bound(
    device: str, dtype: torch.dtype, smoke: bool, reps: int, out: dict[str, Any]
) -> dict[str, Any]:
    n = 2**12 if smoke else 2**26
    rows, cols = (8, 96) if smoke else (16384, 4096)  # (batch*seq, hidden) of a transformer
    esize = torch.empty((), dtype=dtype).element_size()
    src = torch.randn(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy_s = time_call(lambda: dst.copy_(src), device, reps)
    copy_bw = 2 * n * esize / copy_s
    out["copy"] = {"bytes": 2 * n * esize, "seconds": copy_s, "bw_GBps": copy_bw / 1e9}

    def case(
        name: str,
        fn: Callable[..., Any],
        args: list[torch.Tensor],
        backward: bool,
        ideal_bytes: int,
    ) -> None:
        def runner(f: Callable[..., Any]) -> Callable[[], object]:
            if not backward:
                return lambda: f(*args)

            def step() -> None:
                for a in args:
                    a.grad = None
                f(*args).backward(grad)

            return step

        res: dict[str, Any] = {"ideal_bytes": ideal_bytes}
        out[name] = res
        with _recorded(res, name):
            systems = make_systems(fn, "triton")
            grad = torch.randn_like(fn(*args)) if backward else None
            for sys_name, f in systems.items():
                with torch.set_grad_enabled(backward):
                    try:
                        secs = time_call(runner(f), device, reps)
                    except Exception as e:
                        if sys_name != "aotc":
                            raise
                        # the default capture failed: measure the kernels through the tracer
                        systems["aotc"] = _trace_fallback(
                            res, e, lambda: aotc.compile(fn, backend="triton", capture="trace")
                        )
                        secs = time_call(runner(systems["aotc"]), device, reps)
                bw = ideal_bytes / secs
                res[sys_name] = {
                    "seconds": secs,
                    "bw_GBps": bw / 1e9,
                    "fraction_of_copy_bw": bw / copy_bw,
                }
            res["aotc_kernels"] = num_kernels(systems["aotc"])
            res["aotc_over_inductor_time"] = ratio(
                res["aotc"]["seconds"], res["inductor"]["seconds"]
            )
            res["meets_goal"] = res["aotc"]["fraction_of_copy_bw"] >= BW_GOAL

    x = torch.randn(n, device=device, dtype=dtype)
    case("chain10_fwd", chain10, [x], False, 2 * n * esize)
    xg = x.clone().requires_grad_()
    # fwd: read x, write y; bwd: read x, grad_y, write grad_x (the chain is recomputed from x)
    case("chain10_fwd_bwd", chain10, [xg], True, 5 * n * esize)
    xs = torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True)
    m = rows * cols
    # fwd: read x, write y; bwd: read y, grad_y, write grad_x
    case("softmax_fwd_bwd", softmax_last, [xs], True, 5 * m * esize)
    w = torch.randn(cols, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(cols, device=device, dtype=dtype, requires_grad=True)
    # fwd: read x, write y (+ per-row stats); bwd: read x, grad_y, write grad_x (+ dw, db)
    case(
        "layer_norm_fwd_bwd",
        layer_norm,
        [xs, w, b],
        True,
        5 * m * esize + 2 * rows * 4 + 4 * cols * esize,
    )
    return out


# --- training steps -------------------------------------------------------------------------


def training_steps(device: str, smoke: bool, reps: int, out: dict[str, Any]) -> dict[str, Any]:
    from examples.gpt_block import Block
    from examples.mlp import MLP

    if smoke:
        configs = {
            "mlp": (lambda: MLP(33, 16, 10), lambda: torch.randn(24, 33), 10),
            "gpt_block": (lambda: Block(32, 4), lambda: torch.randn(2, 8, 32), None),
        }
    else:
        configs = {
            "mlp": (lambda: MLP(4096, 4096, 1000), lambda: torch.randn(8192, 4096), 1000),
            "gpt_block": (lambda: Block(768, 12), lambda: torch.randn(8, 1024, 768), None),
        }
    for name, (make_model, make_x, classes) in configs.items():
        torch.manual_seed(0)
        base = make_model().to(device)
        x = make_x().to(device)
        target = (
            torch.randint(0, classes, (x.shape[0],), device=device)
            if classes
            else torch.randn_like(x)
        )

        def loss_of(y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(y, target) if classes else F.mse_loss(y, target)

        import copy

        models = {
            "eager": base,
            "inductor": torch.compile(copy.deepcopy(base)),
            "aotc": aotc.compile(copy.deepcopy(base), backend="triton"),
        }
        res: dict[str, Any] = {"input_shape": list(x.shape)}
        out[name] = res
        with _recorded(res, name):
            _train_case(
                res,
                models,
                step_of=lambda model: _step(model, x, loss_of),
                make_trace=lambda: aotc.compile(
                    copy.deepcopy(base), backend="triton", capture="trace"
                ),
                device=device,
                reps=reps,
            )
    return out


def _step(
    model: Any, x: torch.Tensor, loss_of: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[], None]:
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        loss_of(model(x)).backward()

    return step


def _train_case(
    res: dict[str, Any],
    models: dict[str, Any],
    step_of: Callable[[Any], Callable[[], None]],
    make_trace: Callable[[], Any],
    device: str,
    reps: int,
) -> None:
    from aotc.runtime import kernels as K

    for sys_name, model in models.items():
        step = step_of(model)
        launches = dict(K.FIRST_LAUNCH)
        try:
            first = first_call_seconds(step, device)
        except Exception as e:
            if sys_name != "aotc":
                raise
            # the default capture failed: measure the kernels through the tracer
            models["aotc"] = _trace_fallback(res, e, make_trace)
            step = step_of(models["aotc"])
            first = first_call_seconds(step, device)
        secs = time_call(step, device, reps)
        res[sys_name] = {
            "step_seconds": secs,
            "first_call_seconds": first,
            "compile_seconds": max(first - secs, 0.0),
        }
        if sys_name == "aotc":  # first kernel launches: in all, and warm-compiled configs
            res[sys_name]["first_launch_total_seconds"] = (
                K.FIRST_LAUNCH["total"] - launches["total"]
            )
            res[sys_name]["first_launch_warm_configs"] = K.FIRST_LAUNCH["warm"] - launches["warm"]
    res["aotc_kernels"] = num_kernels(models["aotc"])
    res["aotc_over_eager_step"] = ratio(res["aotc"]["step_seconds"], res["eager"]["step_seconds"])
    res["aotc_over_inductor_step"] = ratio(
        res["aotc"]["step_seconds"], res["inductor"]["step_seconds"]
    )
    res["aotc_over_inductor_compile"] = ratio(
        res["aotc"]["compile_seconds"], res["inductor"]["compile_seconds"]
    )
    res["meets_goal"] = (
        res["aotc_over_inductor_step"] <= STEP_GOAL
        and res["aotc_over_inductor_compile"] <= COMPILE_GOAL
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU (interpreter)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument(
        "--sections",
        default="memory_bound_fp32,memory_bound_bf16,training_steps_fp32",
        help="comma-separated parts of the suite to run",
    )
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        p.error(
            "no CUDA device: the GPU suite needs one (use --smoke for a CPU check of the script)"
        )
    reps = args.reps or (3 if args.smoke else 50)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        device_name = torch.cuda.get_device_name()
    else:
        device_name = "cpu (Triton interpreter)"
    name = "gpu_smoke" if args.smoke else "gpu"
    results: dict[str, Any] = {}
    goal = (
        f"memory-bound aotc >= {BW_GOAL} of copy bandwidth; training step aotc/inductor "
        f"<= {STEP_GOAL}; compile aotc/inductor <= {COMPILE_GOAL}"
    )

    def save() -> Path:
        return write_results(
            name,
            results,
            device=device_name,
            smoke=args.smoke,
            triton_version=_triton_version(),
            goal=goal,
        )

    global _SAVE
    _SAVE = save  # noqa: F841
    sections = {
        "memory_bound_fp32": lambda: memory_bound(
            device, torch.float32, args.smoke, reps, results.setdefault("memory_bound_fp32", {})
        ),
        "memory_bound_bf16": lambda: memory_bound(
            device, torch.bfloat16, args.smoke, reps, results.setdefault("memory_bound_bf16", {})
        ),
        "training_steps_fp32": lambda: training_steps(
            device, args.smoke, reps, results.setdefault("training_steps_fp32", {})
        ),
    }
    for key in args.sections.split(","):
        sections[key]()
    path = save()
    print(table(results))
    print(f"wrote {path}")
    return results


def _triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return None


def table(results: dict[str, Any]) -> str:
    def get(r: dict[str, Any], *keys: str) -> str:
        for k in keys:
            if not isinstance(r, dict) or k not in r:
                return "error" if "error" in r else "-"
            r = r[k]
        return f"{r:.2f}" if isinstance(r, float) else str(r)

    rows = []
    for dtype_key in ("memory_bound_fp32", "memory_bound_bf16"):
        for case, r in results.get(dtype_key, {}).items():
            if case == "copy":
                rows.append([f"{dtype_key}:copy", f"{r['bw_GBps']:.0f} GB/s", "", "", ""])
                continue
            rows.append(
                [f"{dtype_key}:{case}"]
                + [get(r, s, "fraction_of_copy_bw") for s in ("eager", "inductor", "aotc")]
                + [get(r, "aotc_kernels")]
            )
    out = fmt_table(["workload", "eager bw", "inductor bw", "aotc bw", "aotc kernels"], rows)
    rows = [
        [name]
        + [
            get(r, k)
            for k in (
                "aotc_over_eager_step",
                "aotc_over_inductor_step",
                "aotc_over_inductor_compile",
                "aotc_kernels",
            )
        ]
        for name, r in results.get("training_steps_fp32", {}).items()
    ]
    return (
        out
        + "\n\n"
        + fmt_table(
            ["model", "step aotc/eager", "step aotc/inductor", "compile aotc/inductor", "kernels"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
