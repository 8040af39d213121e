"""Whole models trained a few steps through torch.compile(backend="aotc") and aotc.compile,
against eager: losses, every gradient, every parameter and buffer after each step."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import aotc
import aotc.backend
from tests.e2e.models import (
    BERT,
    GPT,
    ConvNet,
    DropoutMLP,
    LlamaBlock,
    LSTMLoop,
    bert_batch,
    conv_batch,
    gpt_batch,
    llama_batch,
    lstm_batch,
    mlp_batch,
    train_against_eager,
)


def _dynamo(model):
    torch._dynamo.reset()
    return torch.compile(model, backend="aotc")


def _aotc(model):
    return aotc.compile(model, check_invariants=True)


def test_gpt_torch_compile():
    before = aotc.backend.stats["ahead"]
    train_against_eager(GPT, gpt_batch, _dynamo)
    assert aotc.backend.stats["ahead"] > before  # compiled ahead, on Dynamo's fakes


def test_conv_batchnorm_aotc_compile():
    compiled = train_against_eager(ConvNet, conv_batch, _aotc)
    assert len(compiled.records) == 1


def test_llama_block_aotc_compile():
    train_against_eager(LlamaBlock, llama_batch, _aotc)


def test_lstm_loop_torch_compile():
    train_against_eager(LSTMLoop, lstm_batch, _dynamo)


@pytest.mark.slow
@pytest.mark.parametrize("compile_model", [_dynamo, _aotc], ids=["dynamo", "aotc"])
@pytest.mark.parametrize(
    "make_model,make_batch",
    [
        (GPT, gpt_batch),
        (BERT, bert_batch),
        (LlamaBlock, llama_batch),
        (ConvNet, conv_batch),
        (LSTMLoop, lstm_batch),
        (DropoutMLP, mlp_batch),
    ],
    ids=["gpt", "bert", "llama", "conv", "lstm", "dropout"],
)
def test_model_matches_eager(make_model, make_batch, compile_model):
    train_against_eager(make_model, make_batch, compile_model)


def test_bert_aotc_compile_eval_mode_is_guarded():
    torch.manual_seed(0)
    model = BERT()
    compiled = aotc.compile(model)
    batch = bert_batch()
    train = compiled(*batch)
    model.eval()
    with torch.no_grad():
        evaluated = compiled(*batch)
        torch.testing.assert_close(evaluated, model(*batch))
    assert len(compiled.records) == 2  # train/eval flags are part of the key
    assert not torch.equal(train.detach(), evaluated)  # dropout was on in training


def test_compiled_module_state_dict_and_parameters():
    torch.manual_seed(0)
    model = ConvNet()
    compiled = aotc.compile(model)
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in model.named_parameters()]
    compiled(*conv_batch())
    assert int(compiled.b1.num_batches_tracked) == 1  # buffer mutation copied back
    with torch.no_grad():
        model.fc.weight.zero_()  # an update made outside is seen on the next call
        model.fc.bias.zero_()
    loss = compiled(*conv_batch())
    torch.testing.assert_close(loss, torch.tensor(5.0).log())
