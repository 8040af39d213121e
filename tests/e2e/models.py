"""Small-config models for the end-to-end tests, and a training loop that compares a compiled
copy with eager step by step (losses, every gradient, every parameter and buffer)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, HEADS = 37, 12, 32, 4


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        if mask is None:
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~causal, float("-inf"))
        else:
            att = att.masked_fill(~mask[:, None, None, :], float("-inf"))
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2-like decoder: token + position embeddings, pre-LN blocks, tied LM head, loss."""

    def __init__(self, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(DIM, HEADS, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(DIM)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class BERT(nn.Module):
    """BERT-like encoder: post-LN blocks with a padding mask, pooled classifier loss."""

    def __init__(self, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.attn = nn.ModuleList(CausalSelfAttention(DIM, HEADS, dropout) for _ in range(layers))
        self.ffn = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
            for _ in range(layers)
        )
        self.ln1 = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(layers))
        self.cls = nn.Linear(DIM, 3)

    def forward(self, idx: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for attn, ffn, ln1, ln2 in zip(self.attn, self.ffn, self.ln1, self.ln2):
            x = ln1(x + attn(x, mask))
            x = ln2(x + ffn(x))
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.cross_entropy(self.cls(pooled.tanh()), labels)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class LlamaBlock(nn.Module):
    """Llama-like block: RMSNorm, rotary embeddings (buffers), SDPA, SwiGLU MLP; loss on top."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, hd = HEADS, DIM // HEADS
        self.norm1, self.norm2 = RMSNorm(DIM), RMSNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w3 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(SEQ).float(), inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm1(x)
        q, k, v = (
            w(h).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        cos, sin = self.cos[:t], self.sin[:t]
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        x = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return x.pow(2).mean()


class ConvNet(nn.Module):
    """CNN with BatchNorm (running stats and the batch counter are buffers the call updates)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, stride=2), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return F.cross_entropy(self.fc(x.mean((2, 3))), labels)


class LSTMLoop(nn.Module):
    """A manual LSTM loop over time (LSTMCell), then a regression loss."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(6, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 16)
        c = x.new_zeros(x.shape[0], 16)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return F.mse_loss(self.out(h).squeeze(-1), y)


class DropoutMLP(nn.Module):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 1)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.l1(x)), self.p, self.training)
        return self.l2(h).pow(2).mean()


def gpt_batch(b: int = 3, t: int = SEQ) -> tuple[torch.Tensor, ...]:
    return torch.randint(0, VOCAB, (b, t)), torch.randint(0, VOCAB, (b, t))


def bert_batch(b: int = 3) -> tuple[torch.Tensor, ...]:
    mask = torch.ones(b, SEQ, dtype=torch.bool)
    mask[0, SEQ // 2 :] = False
    return torch.randint(0, VOCAB, (b, SEQ)), mask, torch.randint(0, 3, (b,))


def llama_batch(b: int = 2, t: int = SEQ) -> tuple[torch.Tensor, ...]:
    return (torch.randn(b, t, DIM),)


def conv_batch(b: int = 4) -> tuple[torch.Tensor, ...]:
    return torch.randn(b, 3, 9, 9), torch.randint(0, 5, (b,))


def lstm_batch(b: int = 3) -> tuple[torch.Tensor, ...]:
    return torch.randn(b, 5, 6), torch.randn(b)


def mlp_batch(b: int = 8) -> tuple[torch.Tensor, ...]:
    return (torch.randn(b, 16),)


def train_against_eager(
    make_model: Callable[[], nn.Module],
    make_batch: Callable[..., tuple[torch.Tensor, ...]],
    compile_model: Callable[[nn.Module], Any],
    *,
    steps: int = 3,
    batch_sizes: list[int] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> Any:
    """Train an eager copy and a compiled copy (plain SGD outside the compiled call) with the
    same seeds; after every step compare the loss, every gradient and every parameter/buffer."""
    torch.manual_seed(0)
    eager = make_model()
    twin = copy.deepcopy(eager)
    compiled = compile_model(twin)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    opt_c = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    sizes = batch_sizes or [None] * steps
    for step, size in enumerate(sizes):
        torch.manual_seed(100 + step)
        batch = make_batch() if size is None else make_batch(size)
        torch.manual_seed(200 + step)
        want = eager(*batch)
        torch.manual_seed(200 + step)
        got = compiled(*batch)
        torch.testing.assert_close(
            got, want, rtol=rtol, atol=atol, msg=lambda m, step=step: f"step {step} loss: {m}"
        )
        want.backward()
        got.backward()
        for (name, pe), (_, pc) in zip(eager.named_parameters(), twin.named_parameters()):
            assert (pe.grad is None) == (pc.grad is None), f"step {step} grad {name}"
            if pe.grad is not None:
                torch.testing.assert_close(
                    pc.grad,
                    pe.grad,
                    rtol=rtol,
                    atol=atol,
                    msg=lambda m, step=step, name=name: f"step {step} grad {name}: {m}",
                )
        opt_e.step()
        opt_c.step()
        opt_e.zero_grad()
        opt_c.zero_grad()
        for (name, be), (_, bc) in zip(eager.state_dict().items(), twin.state_dict().items()):
            torch.testing.assert_close(
                bc,
                be,
                rtol=rtol,
                atol=atol,
                msg=lambda m, step=step, name=name: f"step {step} state {name}: {m}",
            )
    return compiled
