"""Hugging Face models built from small configs (nothing downloaded), trained a few AdamW steps
with a learning-rate scheduler through `aotc.compile(model)` and a compiled optimizer step, against
eager: loss, every gradient and every parameter after each step. GPT-2, BERT and T5 tie their
embeddings; Llama returns its default `DynamicCache`; ViT sets `config.problem_type` on its first
call (a side effect Dynamo replays, then guards on); Mixtral routes tokens to experts and adds the
router's auxiliary loss; ResNet's batch norm updates running statistics (buffers, compared too)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import aotc

pytest.importorskip("transformers")

from tests.e2e.hf_models import MODELS, llama  # noqa: E402


def train_hf_against_eager(
    name: str, *, layers: int = 1, steps: int = 3, **options: Any
) -> tuple[Any, Any]:
    """AdamW + a per-step scheduler; model and optimizer step both compiled. Returns the
    compiled model and the compiled step."""
    torch.manual_seed(0)
    eager, make_batch = MODELS[name](layers=layers)
    twin = copy.deepcopy(eager)
    compiled = aotc.compile(twin, **options)
    opts = []
    for model in (eager, twin):
        # eps=1e-3: some gradients are zero up to rounding (an attention key's bias: softmax
        # ignores it), and Adam's m / sqrt(v) turns a rounding difference there into a full
        # learning-rate step with the default eps.
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, eps=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        opts.append((opt, sched))
    (opt_e, sched_e), (opt_c, sched_c) = opts
    step_c = aotc.compile(lambda: opt_c.step(), **options)
    for step in range(steps):
        torch.manual_seed(100 + step)
        batch = make_batch()
        torch.manual_seed(200 + step)
        want = eager(**batch)
        torch.manual_seed(200 + step)
        got = compiled(**batch)
        assert type(got) is type(want) and list(got.keys()) == list(want.keys())
        torch.testing.assert_close(got.loss, want.loss, msg=lambda m, s=step: f"step {s}: {m}")
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
        if "past_key_values" in want:
            assert type(got.past_key_values) is type(want.past_key_values)
        want.loss.backward()
        got.loss.backward()
        for (n, pe), (_, pc) in zip(eager.named_parameters(), twin.named_parameters()):
            assert (pe.grad is None) == (pc.grad is None), f"step {step} grad {n}"
            if pe.grad is not None:
                torch.testing.assert_close(
                    pc.grad, pe.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"grad {n}: {m}"
                )
        opt_e.step()
        step_c()
        sched_e.step()
        sched_c.step()
        opt_e.zero_grad()
        opt_c.zero_grad()
        for (n, pe), (_, pc) in zip(eager.named_parameters(), twin.named_parameters()):
            torch.testing.assert_close(
                pc, pe, rtol=1e-4, atol=1e-5, msg=lambda m, n=n, s=step: f"step {s} {n}: {m}"
            )
        for (n, be), (_, bc) in zip(eager.named_buffers(), twin.named_buffers()):
            # batch norm's running statistics (ResNet), position-id buffers, ...
            torch.testing.assert_close(
                bc, be, rtol=1e-4, atol=1e-5, msg=lambda m, n=n, s=step: f"step {s} {n}: {m}"
            )
    return compiled, step_c


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model_trains_like_eager(name):
    compiled, step = train_hf_against_eager(name)
    assert len(aotc.inspect(compiled)) >= 1
    assert all(r.training for r in aotc.inspect(compiled))
    assert 1 <= len(aotc.inspect(step)) <= 2  # lr changes every step: one dynamic recompile


def test_llama_returns_its_dynamic_cache():
    torch.manual_seed(0)
    model, make_batch = llama()
    compiled = aotc.compile(copy.deepcopy(model))
    batch = make_batch()
    got, want = compiled(**batch), model(**batch)
    cache_type = type(want.past_key_values)
    assert cache_type.__name__ == "DynamicCache" and type(got.past_key_values) is cache_type
    for (gk, gv), (wk, wv) in zip(_layers(got.past_key_values), _layers(want.past_key_values)):
        torch.testing.assert_close(gk, wk)
        torch.testing.assert_close(gv, wv)


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model_two_layers_more_steps(name):
    train_hf_against_eager(name, layers=2, steps=5)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    "name,capture", [(n, "dynamo") for n in sorted(MODELS)] + [("bert", "trace"), ("t5", "trace")]
)
def test_hf_model_under_autocast_gets_eager_gradients_bit_for_bit(name, capture):
    # One training step under CPU bf16 autocast, dropout on: eager's dropout and cached casts,
    # and a backward traced without autocast (Notes in aotc/tracer.py, aotc/eagercomposites.py).
    torch.manual_seed(0)
    eager, make_batch = MODELS[name](layers=1)
    twin = copy.deepcopy(eager)
    compiled = aotc.compile(twin, capture=capture)
    torch.manual_seed(100)
    batch = make_batch()
    for model in (eager, compiled):
        torch.manual_seed(200)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
    for (n, pe), (_, pc) in zip(eager.named_parameters(), twin.named_parameters()):
        assert (pe.grad is None) == (pc.grad is None), n
        if pe.grad is not None:
            assert torch.equal(pe.grad, pc.grad), n
