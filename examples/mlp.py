"""Train a small MLP through aotc and check every step against eager PyTorch.

    .venv/bin/python examples/mlp.py                      # from the repo root
    .venv/bin/python examples/mlp.py --dump aotc_dump/mlp # also write every stage to disk

The compiled model shares its parameters with `model`; an independent deep copy runs eagerly.
Both take the same SGD steps on the same random batches; losses and gradients must match.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import aotc  # noqa: E402


class MLP(nn.Module):
    def __init__(self, d_in: int = 781, d_hidden: int = 64, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


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
            print(f"--- saved for backward: {len(rec.partition.saved)} values, "
                  f"{rec.saved_bytes} bytes")
        times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rec.stage_seconds.items())
        print(f"--- compile time: {rec.compile_seconds * 1e3:.1f} ms ({times})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", metavar="DIR", help="write every compiled stage under DIR")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP()
    eager = copy.deepcopy(model)
    compiled = aotc.compile(model, dump_dir=args.dump)

    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)

    for step in range(args.steps):
        x = torch.randn(32, 781)
        target = torch.randint(0, 10, (32,))

        loss_c = F.cross_entropy(compiled(x), target)
        loss_e = F.cross_entropy(eager(x), target)
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
    if args.dump:
        folders = sorted(os.listdir(args.dump))
        print(f"graphs written under {args.dump}/: {', '.join(folders)}")


if __name__ == "__main__":
    main()
