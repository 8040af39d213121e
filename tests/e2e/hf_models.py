"""Hugging Face models built from small configs (nothing is downloaded), for the tests and
bench/capture.py: `MODELS[name](layers, hidden, batch, seq) -> (model, make_batch)`, where
`make_batch()` returns the keyword arguments of one training call (inputs and labels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers

transformers.logging.set_verbosity_error()

Batch = Callable[[], dict[str, Any]]
VOCAB = 50


def _lm_batch(batch: int, seq: int) -> Batch:
    def make() -> dict[str, Any]:
        return {
            "input_ids": torch.randint(0, VOCAB, (batch, seq)),
            "labels": torch.randint(0, VOCAB, (batch, seq)),
        }

    return make


def gpt2(layers: int = 1, hidden: int = 16, batch: int = 2, seq: int = 6):
    """GPT-2: the LM head is tied to the token embedding."""
    cfg = transformers.GPT2Config(
        n_layer=layers, n_head=2, n_embd=hidden, vocab_size=VOCAB, n_positions=max(16, seq)
    )
    return transformers.GPT2LMHeadModel(cfg), _lm_batch(batch, seq)


def bert(layers: int = 1, hidden: int = 16, batch: int = 2, seq: int = 6):
    """BERT masked LM: the decoder is tied to the word embedding."""
    cfg = transformers.BertConfig(
        num_hidden_layers=layers,
        num_attention_heads=2,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        vocab_size=VOCAB,
        max_position_embeddings=max(16, seq),
    )
    return transformers.BertForMaskedLM(cfg), _lm_batch(batch, seq)


def _decoder_sizes(layers: int, hidden: int, seq: int) -> dict[str, int]:
    """Config sizes of a tiny Llama-style decoder (grouped-query attention: 2 heads, 1 KV head)."""
    return {
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "vocab_size": VOCAB,
        "max_position_embeddings": max(16, seq),
    }


def llama(layers: int = 1, hidden: int = 16, batch: int = 2, seq: int = 6):
    """Llama with its default `use_cache=True`: the output carries a DynamicCache."""
    cfg = transformers.LlamaConfig(**_decoder_sizes(layers, hidden, seq))
    assert cfg.use_cache
    return transformers.LlamaForCausalLM(cfg), _lm_batch(batch, seq)


def t5(layers: int = 1, hidden: int = 16, batch: int = 2, seq: int = 6):
    """T5: one embedding module shared by the encoder, the decoder and the LM head."""
    cfg = transformers.T5Config(
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=2,
        d_model=hidden,
        d_kv=hidden // 2,
        d_ff=2 * hidden,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
    )

    def make() -> dict[str, Any]:
        return {
            "input_ids": torch.randint(1, VOCAB, (batch, seq)),
            "labels": torch.randint(1, VOCAB, (batch, max(2, seq - 2))),
        }

    return transformers.T5ForConditionalGeneration(cfg), make


def _image_batch(batch: int, pixels: int) -> Batch:
    """Random RGB images of `pixels` x `pixels` with labels among 3 classes."""

    def make() -> dict[str, Any]:
        return {
            "pixel_values": torch.randn(batch, 3, pixels, pixels),
            "labels": torch.randint(0, 3, (batch,)),
        }

    return make


def vit(layers: int = 1, hidden: int = 16, batch: int = 2, seq: int = 6):
    """ViT image classifier (`seq` is unused: 4 patches of 4x4 pixels)."""
    cfg = transformers.ViTConfig(
        num_hidden_layers=layers,
        num_attention_heads=2,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        image_size=8,
        patch_size=4,
        num_labels=3,
    )

    return transformers.ViTForImageClassification(cfg), _image_batch(batch, 8)


def mixtral(layers: int = 1, hidden: int = 16, batch: int = 2, seq: int = 6):
    """Mixtral: sparse mixture of experts (top-2 of 4 routed per token, data-dependent expert
    dispatch) plus the router's load-balancing loss."""
    cfg = transformers.MixtralConfig(
        **_decoder_sizes(layers, hidden, seq),
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    )
    return transformers.MixtralForCausalLM(cfg), _lm_batch(batch, seq)


def resnet(layers: int = 1, hidden: int = 16, batch: int = 2, seq: int = 6):
    """ResNet image classifier: convolutions and batch norm, whose running statistics are
    buffers the compiled step updates (`seq` is unused: 16x16 pixels)."""
    cfg = transformers.ResNetConfig(
        embedding_size=hidden // 2,
        hidden_sizes=[hidden // 2, hidden],
        depths=[layers, layers],
        layer_type="basic",
        num_labels=3,
    )

    return transformers.ResNetForImageClassification(cfg), _image_batch(batch, 16)


MODELS: dict[str, Callable[..., tuple[torch.nn.Module, Batch]]] = {
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "t5": t5,
    "vit": vit,
    "mixtral": mixtral,
    "resnet": resnet,
}
