"""Cache keys of Dynamo graphs read off the graph (Note [Graph key] in aotc/graphkey.py) and
deferred cache stores (Note [Deferred cache stores] in aotc/persist.py)."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

import aotc
from aotc import graphkey, keytrace, persist
from tests.conftest import assert_matches_eager, assert_module_matches_eager


@pytest.fixture(autouse=True)
def _no_queued_stores():
    aotc.cache_flush()  # stores other tests queued (Note [Deferred cache stores])
    yield
    aotc.cache_flush()


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def text(fn, *args) -> str:
    return graphkey.graph_text(dynamo_graph(fn, *args))


def entries(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith(".tmp"))


def test_text_changes_with_body_closure_constant_and_hyperparameter():
    x = torch.randn(4, 8)

    def make(k: float):
        return lambda t: (t * k).sin().sum()

    def renamed(t):
        scaled_value = t * 2.0
        return scaled_value.sin().sum()

    assert text(make(2.0), x) == text(make(2.0), x)
    assert text(make(2.0), x) != text(make(3.0), x)  # closure constant
    assert text(make(2.0), x) == text(renamed, x)  # a renamed local is the same program
    assert text(make(2.0), x) != text(lambda t: (t * 2.0).cos().sum(), x)  # body
    torch.manual_seed(0)
    a, b = torch.nn.LayerNorm(8, eps=1e-5), torch.nn.LayerNorm(8, eps=1e-3)
    assert text(a, x) != text(b, x)  # module hyperparameter
    da, db = torch.nn.Dropout(0.1), torch.nn.Dropout(0.2)
    assert text(da, x) != text(db, x)
    da.eval()
    assert text(da, x) != text(torch.nn.Dropout(0.1), x)  # training flag


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SquareWrongGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * g


def test_custom_autograd_function_backward_is_in_the_text():
    x = torch.randn(5, requires_grad=True)
    good = text(lambda t: Square.apply(t).sum(), x)
    wrong = text(lambda t: SquareWrongGrad.apply(t).sum(), x)
    assert "autograd_function_apply" in good and good != wrong


@torch._dynamo.allow_in_graph
def user_op(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_non_torch_target_is_unkeyable_and_falls_back_to_the_key_trace(tmp_path):
    x = torch.randn(6)
    with pytest.raises(keytrace.Unkeyable, match="user_op"):
        text(lambda t: user_op(t).sin(), x)
    d = str(tmp_path)
    fn = lambda t: user_op(t).sin()  # noqa: E731
    args = lambda: (torch.randn(6, requires_grad=True),)  # noqa: E731
    cold = assert_matches_eager(fn, args, cache_dir=d)
    warm = assert_matches_eager(fn, args, cache_dir=d)
    # The key trace saw the ATen calls of user_op: stored and hit like any strict program.
    assert "cache_load" not in aotc.inspect(cold)[0].stage_seconds
    assert "cache_load" in aotc.inspect(warm)[0].stage_seconds


def test_default_mode_is_keyed_without_a_key_trace(tmp_path, monkeypatch):
    def no_trace(*args, **kwargs):
        raise AssertionError("the key trace ran")

    monkeypatch.setattr(keytrace, "trace_text", no_trace)
    d = str(tmp_path)
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16)
    )
    inputs = lambda: (torch.randn(3, 8),)  # noqa: E731
    cold = assert_module_matches_eager(make, inputs, steps=2, cache_dir=d)
    warm = assert_module_matches_eager(make, inputs, steps=2, cache_dir=d)
    assert "cache_load" not in aotc.inspect(cold)[0].stage_seconds
    assert "cache_load" in aotc.inspect(warm)[0].stage_seconds
    assert "trace" not in aotc.inspect(warm)[0].stage_seconds
    # Another epsilon is another program: a miss.
    other = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16, eps=1e-3)
    )
    third = assert_module_matches_eager(other, inputs, steps=1, cache_dir=d)
    assert "cache_load" not in aotc.inspect(third)[0].stage_seconds


def test_deferred_store_is_on_disk_after_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(persist, "_STORE_DELAY", 60.0)  # only the flush writes it
    d = str(tmp_path)
    f = aotc.compile(lambda x: (x.exp() * 3).sum(), cache_dir=d, capture="trace")
    f(torch.randn(4, requires_grad=True)).backward()
    assert persist.pending() == 1 and entries(d) == []
    aotc.cache_flush()
    assert len(entries(d)) == 1 and persist.pending() == 0


def test_deferred_store_runs_on_its_own_later(tmp_path, monkeypatch):
    monkeypatch.setattr(persist, "_STORE_DELAY", 0.05)
    d = str(tmp_path)
    aotc.compile(lambda x: x.cos() * 2, cache_dir=d, capture="trace")(torch.randn(3))
    for _ in range(200):
        if entries(d):
            break
        time.sleep(0.05)
    assert len(entries(d)) == 1 and persist.pending() == 0


def test_store_after_a_flush_does_not_wait_for_the_flushed_batch_timer(tmp_path, monkeypatch):
    # A flush empties the queue while the batch's timer is pending; a later store must start its
    # own timer, not join the earlier one (which, at a long delay, would hold it back).
    monkeypatch.setattr(persist, "_STORE_DELAY", 60.0)
    d = str(tmp_path)
    aotc.compile(lambda x: x.sin() + 1, cache_dir=d, capture="trace")(torch.randn(3))
    aotc.cache_flush()
    assert len(entries(d)) == 1 and persist.pending() == 0
    monkeypatch.setattr(persist, "_STORE_DELAY", 0.05)
    aotc.compile(lambda x: x.tan() - 1, cache_dir=d, capture="trace")(torch.randn(3))
    for _ in range(200):
        if len(entries(d)) == 2:
            break
        time.sleep(0.05)
    assert len(entries(d)) == 2 and persist.pending() == 0


def test_second_compile_of_the_same_program_waits_for_its_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(persist, "_STORE_DELAY", 60.0)
    d = str(tmp_path)
    fn = lambda x: (x.sigmoid() * x).sum()  # noqa: E731
    other = aotc.compile(lambda x: x.abs() + 1, cache_dir=d, capture="trace")
    other(torch.randn(3))
    args = lambda: (torch.randn(6, requires_grad=True),)  # noqa: E731
    assert_matches_eager(fn, args, cache_dir=d, capture="trace")
    assert persist.pending() == 2
    warm = assert_matches_eager(fn, args, cache_dir=d, capture="trace")
    assert "cache_load" in aotc.inspect(warm)[0].stage_seconds
    assert persist.pending() == 1  # the other program's store is still queued
    aotc.cache_flush()


def test_sync_env_stores_on_the_compiling_thread(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTC_CACHE_SYNC", "1")
    monkeypatch.setattr(persist, "_STORE_DELAY", 60.0)
    d = str(tmp_path)
    aotc.compile(lambda x: x.tanh() + 1, cache_dir=d, capture="trace")(torch.randn(3))
    assert persist.pending() == 0
    assert len(sorted(n for n in os.listdir(d) if n.endswith(".json"))) == 1


def test_a_failing_store_never_breaks_the_call(tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(persist, "store_entry", broken)
    d = str(tmp_path)
    fn = lambda x: (x * x).sum()  # noqa: E731
    args = lambda: (torch.randn(5, requires_grad=True),)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="aotc.cache"):
        assert_matches_eager(fn, args, cache_dir=d, capture="trace")
        aotc.cache_flush()
    assert "disk on fire" in caplog.text
    assert entries(d) == []
    monkeypatch.undo()
    again = assert_matches_eager(fn, args, cache_dir=d, capture="trace")  # compiled, then stored
    assert "cache_load" not in aotc.inspect(again)[0].stage_seconds
    aotc.cache_flush()
    assert len(entries(d)) == 1


def test_global_switches_below_the_graph_are_in_the_text(monkeypatch):
    x = torch.randn(2, 3, 8, 4)
    fn = lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q).sum()  # noqa: E731
    before = text(fn, x)
    flash = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(not flash)
    try:
        assert text(fn, x) != before
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)
    torch.set_default_device("meta")
    try:
        changed = graphkey._global_state()
    finally:
        torch.set_default_device(None)
    assert changed != graphkey._global_state()
