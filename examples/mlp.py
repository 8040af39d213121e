"""Train a small MLP through aotc and check every step against eager PyTorch.

    .venv/bin/python examples/mlp.py                      # from the repo root
    .venv/bin/python examples/mlp.py --dump aotc_dump/mlp # also write every stage to disk

The compiled model shares its parameters with `model`; an independent deep copy runs eagerly.
Both take the same SGD steps on the same random batches; losses and gradients must match.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.common import train_against_eager  # noqa: E402


class MLP(nn.Module):
    def __init__(self, d_in: int = 781, d_hidden: int = 64, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", metavar="DIR", help="write every compiled stage under DIR")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--backend",
        default="aten",
        choices=["aten", "triton", "auto"],
        help="'triton' runs generated kernels (Triton's interpreter on CPU)",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP()
    train_against_eager(
        model,
        lambda: (torch.randn(32, 781), torch.randint(0, 10, (32,))),
        F.cross_entropy,
        steps=args.steps,
        lr=0.1,
        dump=args.dump,
        backend=args.backend,
    )


if __name__ == "__main__":
    main()
