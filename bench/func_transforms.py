"""torch.func and aotc (issue #17): what composing costs and what compiling a transform gains.

Workloads:
  per_sample_step  a per-sample-gradient step compiled as a whole: vmap(grad(functional_call))
                   of a 3-layer MLP (64-128-128-10, batch 64) inside the compiled function,
                   parameters as inputs, forward only (the per-sample gradients' norms).
                   Systems: eager, aotc strict (`capture="trace"`), aotc default (Dynamo),
                   torch.compile(backend="aotc"), torch.compile (Inductor), AOTAutograd
                   (aot_function with nop compilers).
  over_compiled    vmap(grad(functional_call(compiled MLP))) with the transform outside: aotc
                   runs the module's Python code under the transform, so this is eager's cost
                   plus one check per call. Systems: eager module, strict-compiled module,
                   default-mode (Dynamo) compiled module.
  check            the per-call check strict mode added (torch._C._are_functorch_transforms_active)
                   alone, and a tiny strict-mode fwd+bwd call for scale.
Systems are interleaved inside every round (order rotated); reported: medians over rounds of
per-call means, and ratios against eager measured in the same run.

Run from the repo root: .venv/bin/python bench/func_transforms.py [--iters N] [--rounds R]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import (  # noqa: E402
    fmt_table,
    interleaved_rounds,
    median,
    noop_compiler,
    ratio,
    write_results,
)
from torch import func, nn  # noqa: E402

import aotc  # noqa: E402


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _loop(fn: Callable[..., Any], *args: Any) -> Callable[[int], object]:
    def run(n: int) -> object:
        out = None
        for _ in range(n):
            out = fn(*args)
        return out

    return run


def _summarize(times: dict[str, list[float]]) -> dict[str, Any]:
    us = {k: median(v) * 1e6 for k, v in times.items()}
    return {
        "median_us_per_call": us,
        "ratio_vs_eager": {
            f"{k}/eager": ratio(v, us["eager"]) for k, v in us.items() if k != "eager"
        },
    }


def per_sample_step(iters: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLP()
    names = [k for k, _ in model.named_parameters()]

    def step(x: torch.Tensor, y: torch.Tensor, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = dict(zip(names, flat))

        def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            out = func.functional_call(model, p, (xi.unsqueeze(0),))
            return F.cross_entropy(out, yi.unsqueeze(0))

        grads = func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
        return tuple(grads[k].flatten(1).norm(dim=1) for k in names)

    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    flat = [p.detach() for p in model.parameters()]
    want = step(x, y, *flat)
    systems: dict[str, Callable[..., Any]] = {"eager": step}
    errors: dict[str, str] = {}
    candidates: dict[str, Callable[[], Callable[..., Any]]] = {
        "aotc_trace": lambda: aotc.compile(step, capture="trace", cache=False),
        "aotc_default": lambda: aotc.compile(step, cache=False),
        "torch_compile_aotc": lambda: torch.compile(step, backend="aotc"),
        "inductor": lambda: torch.compile(step),
        "aot_autograd": lambda: _aot(step),
    }
    for name, make in candidates.items():
        try:
            compiled = make()
            got = compiled(x, y, *flat)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
            systems[name] = compiled
        except Exception as e:  # noqa: BLE001 a system that cannot run it is reported
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    times = interleaved_rounds(
        {k: _loop(fn, x, y, *flat) for k, fn in systems.items()}, iters, rounds, warmup_iters=3
    )
    return {**_summarize(times), "errors": errors}


def _aot(step: Callable[..., Any]) -> Callable[..., Any]:
    from functorch.compile import aot_function

    return aot_function(step, noop_compiler, noop_compiler)


def over_compiled(iters: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLP()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def per_sample(module: nn.Module) -> Callable[[], object]:
        def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            out = func.functional_call(module, p, (xi.unsqueeze(0),))
            return F.cross_entropy(out, yi.unsqueeze(0))

        g = func.vmap(func.grad(loss), in_dims=(None, 0, 0))
        return lambda: g(params, x, y)

    systems = {
        "eager": per_sample(model),
        "aotc_trace": per_sample(aotc.compile(model, capture="trace", cache=False)),
        "aotc_default": per_sample(aotc.compile(model, cache=False)),
    }
    for name, run in systems.items():
        got, want = run(), systems["eager"]()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=name)
    times = interleaved_rounds(
        {k: _loop(run) for k, run in systems.items()}, iters, rounds, warmup_iters=3
    )
    return _summarize(times)


def check_cost(iters: int, rounds: int) -> dict[str, Any]:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * y).sum()

    compiled = aotc.compile(f, capture="trace", cache=False)
    x, y = torch.randn(4, requires_grad=True), torch.randn(4)
    active = torch._C._are_functorch_transforms_active

    def fwd_bwd(fn: Callable[..., Any]) -> Callable[[int], object]:
        def run(n: int) -> object:
            for _ in range(n):
                fn(x, y).backward()
            return None

        return run

    def check(n: int) -> object:
        for _ in range(n):
            active()
        return None

    def empty(n: int) -> object:
        for _ in range(n):
            pass
        return None

    times = interleaved_rounds(
        {"eager": fwd_bwd(f), "aotc_trace": fwd_bwd(compiled), "check": check, "loop": empty},
        iters * 20,
        rounds,
    )
    us = {k: median(v) * 1e6 for k, v in times.items()}
    check_us = max(us["check"] - us["loop"], 0.0)
    return {
        "median_us_per_call": us,
        "check_us": check_us,
        "check_share_of_aotc_trace_fwd_bwd": ratio(check_us, us["aotc_trace"]),
        "ratio_vs_eager": {"aotc_trace/eager": ratio(us["aotc_trace"], us["eager"])},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {
        "per_sample_step": per_sample_step(args.iters, args.rounds),
        "over_compiled": over_compiled(args.iters, args.rounds),
        "check": check_cost(args.iters, args.rounds),
    }
    for name in ("per_sample_step", "over_compiled"):
        r = results[name]
        rows = [
            [k, v, r["ratio_vs_eager"].get(f"{k}/eager", 1.0)]
            for k, v in r["median_us_per_call"].items()
        ]
        print(f"{name}\n{fmt_table(['system', 'us/call', 'x eager'], rows)}\n")
        for k, e in r.get("errors", {}).items():
            print(f"  {k}: not measured ({e})")
    c = results["check"]
    print(
        f"check: {c['check_us'] * 1000:.0f} ns per call, "
        f"{c['check_share_of_aotc_trace_fwd_bwd'] * 100:.2f}% of a tiny strict fwd+bwd call "
        f"({c['median_us_per_call']['aotc_trace']:.1f} us)"
    )
    path = write_results(
        "func_transforms",
        results,
        goal="transforms over compiled functions cost eager's time (+1 check per strict call); "
        "a compiled per-sample-gradient step is no slower than eager",
        workload="3-layer MLP 64-128-128-10, batch 64, 1 torch thread, CPU (ATen graphs)",
        method=f"{args.rounds} rounds x {args.iters} calls, systems interleaved (order rotated); "
        "median of per-round means",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
