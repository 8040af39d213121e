"""Shared by the examples: train a compiled model and an eager copy side by side, and print
what aotc compiled."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import torch

import aotc


def summarize(compiled: object) -> None:
    for rec in aotc.inspect(compiled):
        print(f"=== compiled signature: {rec.name} (training={rec.training})")
        print(rec.signature)
        print("--- forward graph")
        print(rec.forward.code.strip())
        if rec.backward is not None:
            print("--- backward graph")
            print(rec.backward.code.strip())
        if rec.partition is not None:
            print(
                f"--- saved for backward: {len(rec.partition.saved)} values, "
                f"{rec.saved_bytes} bytes"
            )
        if rec.kernels:
            print(
                f"--- {len(rec.kernels)} generated Triton kernels: "
                f"{', '.join(k.name for k in rec.kernels)}"
            )
        times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rec.stage_seconds.items())
        print(f"--- compile time: {rec.compile_seconds * 1e3:.1f} ms ({times})")


def train_against_eager(
    model: torch.nn.Module,
    make_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    steps: int,
    lr: float,
    dump: str | None,
    backend: str = "aten",
) -> None:
    """SGD steps on `model` through aotc and on an eager deep copy; losses and every gradient
    must match at each step. Then print the compiled graphs and where the dump went."""
    eager = copy.deepcopy(model)
    compiled = aotc.compile(model, dump_dir=dump, backend=backend)
    opt_c = torch.optim.SGD(model.parameters(), lr=lr)
    opt_e = torch.optim.SGD(eager.parameters(), lr=lr)
    for step in range(steps):
        x, target = make_batch()
        loss_c = loss_fn(compiled(x), target)
        loss_e = loss_fn(eager(x), target)
        opt_c.zero_grad()
        opt_e.zero_grad()
        loss_c.backward()
        loss_e.backward()
        torch.testing.assert_close(loss_c, loss_e)
        for (name, p_c), p_e in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p_c.grad, p_e.grad, msg=lambda m, n=name: f"{n}.grad: {m}")
        opt_c.step()
        opt_e.step()
        print(f"step {step}: loss compiled {loss_c.item():.6f}  eager {loss_e.item():.6f}")
    print("losses and gradients match eager")
    summarize(compiled)
    if dump:
        print(f"graphs written under {dump}/: {', '.join(sorted(os.listdir(dump)))}")
