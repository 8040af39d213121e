"""Train one GPT-style decoder block through aotc and check every step against eager PyTorch.

    .venv/bin/python examples/gpt_block.py                            # from the repo root
    .venv/bin/python examples/gpt_block.py --dump aotc_dump/gpt_block # also write every stage

Pre-LayerNorm block: x + attn(ln1(x)), then + mlp(ln2(x)); causal multi-head self-attention
through F.scaled_dot_product_attention (or plain matmul/softmax with --plain-attention).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.common import train_against_eager  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, use_sdpa: bool) -> None:
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.use_sdpa = use_sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            att = F.dropout(att, p)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return F.dropout(self.proj(y), p, self.training)


class Block(nn.Module):
    def __init__(
        self, d_model: int = 64, n_heads: int = 4, dropout: float = 0.0, use_sdpa: bool = True
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, use_sdpa)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", metavar="DIR", help="write every compiled stage under DIR")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--plain-attention",
        action="store_true",
        help="matmul/softmax attention instead of F.scaled_dot_product_attention",
    )
    parser.add_argument(
        "--backend",
        default="aten",
        choices=["aten", "triton", "auto"],
        help="'triton' runs generated kernels (Triton's interpreter on CPU)",
    )
    args = parser.parse_args()

    batch, seq, d_model, n_heads = 4, 32, 64, 4
    torch.manual_seed(0)
    model = Block(d_model, n_heads, dropout=0.0, use_sdpa=not args.plain_attention)
    train_against_eager(
        model,
        lambda: (torch.randn(batch, seq, d_model), torch.randn(batch, seq, d_model)),
        F.mse_loss,
        steps=args.steps,
        lr=0.05,
        dump=args.dump,
        backend=args.backend,
    )


if __name__ == "__main__":
    main()
