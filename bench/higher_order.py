"""A gradient-penalty (WGAN-GP) critic step through aotc against eager, same run.

No other compiler runs this step: AOTAutograd (and so torch.compile's default backends) raises on
double backward. Per system, on the same critic and batches:
- `compile_s`: the first step (compiles the critic for each input signature, then the
  differentiable backward that the gradient penalty's create_graph=True runs); eager: its first
  step;
- `step_ms`: median step time after warm-up (interleaved rounds), and its ratio to eager's;
- `saved_bytes`: bytes autograd holds for the final backward, counted by saved-tensor hooks
  around the whole step (forward passes, the create_graph backward): what the double backward
  costs in memory; `held_input_bytes`: the graph inputs the compiled nodes keep a reference to
  for the double backward (Note [Graph args for double backward]) that no saved value already
  holds (here the interpolated batch and the parameters, alive anyway).

Run from the repo root: .venv/bin/python bench/higher_order.py [--rounds N]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import fmt_table, interleaved_rounds, median, ratio, write_results  # noqa: E402

import aotc  # noqa: E402

GOAL = "double backward runs (no other compiler can); step time and saved bytes vs eager"


class Critic(torch.nn.Module):
    def __init__(self, dim: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(dim, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.l2 = torch.nn.Linear(hidden, hidden)
        self.l3 = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.norm(self.l1(x)), 0.2)
        h = F.leaky_relu(self.l2(h), 0.2)
        return self.l3(h)


def step(critic: torch.nn.Module, run: Any, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    eps = torch.rand(real.shape[0], 1)
    x_hat = (eps * real + (1 - eps) * fake).requires_grad_()
    (grads,) = torch.autograd.grad(run(x_hat).sum(), x_hat, create_graph=True)
    penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
    loss = run(fake).mean() - run(real).mean() + 10 * penalty
    for p in critic.parameters():
        p.grad = None
    loss.backward()
    return loss.detach()


def saved_bytes(critic: torch.nn.Module, run: Any, real: torch.Tensor, fake: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout is torch.strided:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        eps = torch.rand(real.shape[0], 1)
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_()
        (grads,) = torch.autograd.grad(run(x_hat).sum(), x_hat, create_graph=True)
        penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
        loss = run(fake).mean() - run(real).mean() + 10 * penalty
    loss.backward()
    params = {p.untyped_storage().data_ptr() for p in critic.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    real, fake = torch.randn(64, 128), torch.randn(64, 128) + 1
    base = Critic()
    systems: dict[str, tuple[torch.nn.Module, Any]] = {}
    for name in ("eager", "aotc_trace", "aotc_default"):
        critic = copy.deepcopy(base)
        if name == "eager":
            run: Any = critic
        else:
            torch._dynamo.reset()
            capture = "trace" if name == "aotc_trace" else "dynamo"
            run = aotc.compile(critic, capture=capture, cache=False)
        systems[name] = (critic, run)
    results: dict[str, dict[str, Any]] = {}
    first: dict[str, torch.Tensor] = {}
    for name, (critic, run) in systems.items():
        torch.manual_seed(1)
        start = time.perf_counter()
        first[name] = step(critic, run, real, fake)
        results[name] = {"compile_s": time.perf_counter() - start}
    for name in systems:
        torch.testing.assert_close(first[name], first["eager"], rtol=1e-4, atol=1e-4)

    def runner(name: str) -> Any:
        critic, run = systems[name]

        def go(n: int) -> None:
            for _ in range(n):
                step(critic, run, real, fake)

        return go

    rounds = interleaved_rounds(
        {n: runner(n) for n in systems}, args.iters, args.rounds, warmup_iters=5
    )
    eager_ms = median(rounds["eager"]) * 1e3
    for name, (critic, run) in systems.items():
        ms = median(rounds[name]) * 1e3
        results[name].update(
            step_ms=ms,
            step_vs_eager=ratio(ms, eager_ms),
            saved_bytes=saved_bytes(critic, run, real, fake),
        )
    eager_saved = results["eager"]["saved_bytes"]
    for name in systems:
        results[name]["saved_vs_eager"] = ratio(results[name]["saved_bytes"], eager_saved)
    results["eager"]["compile_s_note"] = "eager's first step (no compile)"
    held = real.numel() * real.element_size()  # x_hat: the only non-parameter graph input
    for name in ("aotc_trace", "aotc_default"):
        results[name]["held_input_bytes"] = held
    rows = [
        [
            n,
            r["compile_s"],
            r["step_ms"],
            r["step_vs_eager"],
            r["saved_bytes"],
            r["saved_vs_eager"],
        ]
        for n, r in results.items()
    ]
    print(
        fmt_table(
            ["system", "first step s", "step ms", "vs eager", "saved B", "saved vs eager"], rows
        )
    )
    path = write_results(
        "higher_order",
        results,
        GOAL,
        workload="WGAN-GP critic step: Linear(128,256)-LayerNorm-LeakyReLU-Linear-LeakyReLU-"
        "Linear, batch 64, gradient penalty weight 10; 1 torch thread",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
