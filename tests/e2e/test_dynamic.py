"""Dynamic shapes: one symbolic artifact serves every batch size / sequence length it admits;
without dynamic, each new shape recompiles. Compared with eager on outputs and gradients."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch._dynamo

import aotc
import aotc.backend
from tests.e2e.models import GPT, ConvNet, conv_batch, gpt_batch, train_against_eager

SIZES = [3, 5, 2, 8, 4, 7, 6, 9, 11, 10]


def mlp(x, w1, w2):
    return torch.nn.functional.gelu(x @ w1).softmax(-1) @ w2


def _check_sizes(compiled, sizes):
    w1 = torch.randn(16, 8, requires_grad=True)
    w2 = torch.randn(8, 4, requires_grad=True)
    for b in sizes:
        x = torch.randn(b, 16, requires_grad=True)
        got = compiled(x, w1, w2)
        grads = torch.autograd.grad(got.sum(), (x, w1, w2))
        want = mlp(x, w1, w2)
        torch.testing.assert_close(got, want)
        for g, w in zip(grads, torch.autograd.grad(want.sum(), (x, w1, w2))):
            torch.testing.assert_close(g, w)


def test_dynamic_one_artifact_for_all_batch_sizes():
    compiled = aotc.compile(mlp, dynamic=True, check_invariants=True)
    _check_sizes(compiled, SIZES)
    assert len(compiled.records) == 1
    rec = compiled.records[0]
    assert "s" in rec.signature  # symbolic sizes in the signature


def test_static_recompiles_per_shape():
    torch._dynamo.reset()  # torch 2.11 counts recompiles per code object, across objects
    compiled = aotc.compile(mlp, dynamic=False)
    _check_sizes(compiled, SIZES)
    expected = len(set(SIZES))
    if "isolate_recompiles" not in inspect.signature(torch._dynamo.eval_frame._optimize).parameters:
        # torch 2.11: Dynamo's global recompile limit, not max_signatures, bounds the entries
        expected = min(expected, torch._dynamo.config.recompile_limit)
    assert len(compiled.records) == expected


def test_dynamic_size_one_is_specialized_and_still_correct():
    # Strict mode's own ShapeEnv has no duck sizing; Dynamo's (the default mode) gives w2's last
    # dim, equal to the first batch size, the batch's symbol and recompiles once more.
    compiled = aotc.compile(mlp, dynamic=True, capture="trace")
    _check_sizes(compiled, [4, 1, 6])
    assert len(compiled.records) == 2  # sizes 0/1 are specialized, as in Dynamo


def test_backward_sizes_saved_as_symints():
    def f(x):
        return x.sum() * 2  # the backward expands the tangent to x's (symbolic) shape

    compiled = aotc.compile(f, dynamic=True, check_invariants=True)
    for b in (3, 6):
        x = torch.randn(b, 5, requires_grad=True)
        (g,) = torch.autograd.grad(compiled(x), x)
        torch.testing.assert_close(g, torch.full((b, 5), 2.0))
    part = compiled.records[0].partition
    assert part.num_saved_symints == 2 and len(part.saved) == 2  # sizes only, no tensor
    assert len(compiled.records) == 1


@pytest.mark.slow
def test_dynamic_sequence_length_gpt():
    compiled = train_against_eager(
        lambda: GPT(layers=1, dropout=0.0),
        lambda b: gpt_batch(2, b),
        lambda m: aotc.compile(m, dynamic=True),
        batch_sizes=[5, 9, 12],
    )
    assert len(compiled.records) == 1


def test_dynamic_batchnorm_module():
    compiled = train_against_eager(
        ConvNet, conv_batch, lambda m: aotc.compile(m, dynamic=True), batch_sizes=[4, 6, 3]
    )
    assert len(compiled.records) == 1


def test_torch_compile_dynamic_true_compiles_once():
    torch._dynamo.reset()
    before = aotc.backend.stats["ahead"]
    compiled = torch.compile(mlp, backend="aotc", dynamic=True)
    _check_sizes(compiled, SIZES)
    assert aotc.backend.stats["ahead"] - before == 1


def test_torch_compile_automatic_dynamic_compiles_twice():
    torch._dynamo.reset()
    before = aotc.backend.stats["ahead"]
    compiled = torch.compile(mlp, backend="aotc")
    _check_sizes(compiled, SIZES)
    assert aotc.backend.stats["ahead"] - before == 2  # static first, then symbolic


def test_dynamic_output_view_of_input_gets_static_entries():
    """See Note [Static entries under dynamic=True]: an output that is a view of an input gets an
    entry per size, compiled for the exact sizes, and behaves as eager's view."""

    def f(x):
        return x.view(-1)

    compiled = aotc.compile(f, dynamic=True)
    for rows in (4, 6, 4):
        x = torch.randn(rows, 3)
        out = compiled(x)
        assert out._base is x and out.shape == (rows * 3,)
        torch.testing.assert_close(out, x.view(-1))
        out.mul_(0)  # a real view: the write reaches the input
        assert not x.any()


def test_torch_compile_output_view_of_input_falls_back():
    torch._dynamo.reset()

    def f(x):
        return x.view(-1), x * 2

    before = aotc.backend.stats["fallback"]
    compiled = torch.compile(f, backend="aotc", dynamic=True)
    for b in (3, 5):
        x = torch.randn(b, 4)
        got = compiled(x)
        assert got[0]._base is x
        torch.testing.assert_close(got[1], x * 2)
    assert aotc.backend.stats["fallback"] - before == 1


def test_dynamic_with_triton_backend_runs_kernels():
    """The Triton lowering handles symbolic sizes (more in tests/e2e/test_triton_dynamic.py):
    one compilation serves every batch size, through generated kernels."""
    compiled = aotc.compile(mlp, dynamic=True, backend="triton")
    _check_sizes(compiled, SIZES[:4])
    assert len(compiled.records) == 1
    assert len(aotc.inspect(compiled)[0].kernels) > 0


def alibi_scores(alibi, q, k):
    # BLOOM's ALiBi attention: `self` broadcasts over the batch1 @ batch2 product; the meta of
    # `baddbmm` expands it, which needs the Python dispatcher for symbolic sizes (see Note
    # [Symbolic sizes need the Python dispatcher]).
    return alibi.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=0.5).softmax(-1)


@pytest.mark.parametrize("via", ["torch.compile", "aotc.compile"])
def test_dynamic_broadcast_baddbmm_compiles_ahead(via):
    """dynamic=True under torch.compile; Dynamo's automatic dynamic (the second size recompiles
    with symbolic sizes) under aotc.compile. Both once fell back to eager."""
    torch._dynamo.reset()
    before = aotc.backend.stats.copy()
    if via == "torch.compile":
        compiled = torch.compile(alibi_scores, backend="aotc", dynamic=True)
    else:
        compiled = aotc.compile(alibi_scores)
    # The head size is the first head count: with distinct sizes fake tensors get past `expand`.
    for heads, seq in [(4, 6), (6, 8), (4, 5)]:
        args = [
            torch.randn(heads, 1, seq, requires_grad=True),
            torch.randn(heads, seq, 4, requires_grad=True),
            torch.randn(heads, 4, seq, requires_grad=True),
        ]
        got = compiled(*args)
        weight = torch.randn_like(got)
        got_grads = torch.autograd.grad((got * weight).sum(), args)
        want = alibi_scores(*args)
        torch.testing.assert_close(got, want)
        for g, w in zip(got_grads, torch.autograd.grad((want * weight).sum(), args)):
            torch.testing.assert_close(g, w)
    assert aotc.backend.stats["fallback"] == before["fallback"]
    assert aotc.backend.stats["ahead"] - before["ahead"] >= 2


def positions_of_mask(mask, position_ids, table, x):
    # BERT's embeddings: a slice of the position-id buffer as long as the (dynamic) attention
    # mask. The backward of `embedding` reads the slice: saved as its base (the buffer), it is
    # re-created from the mask's size, which the backward has no other way to.
    ids = position_ids[:, : mask.shape[1]]
    return torch.nn.functional.embedding(ids, table) * x + mask.unsqueeze(-1)


@pytest.mark.parametrize("via", ["torch.compile", "aotc.compile"])
def test_dynamic_view_saved_as_base_keeps_its_sizes(via):
    torch._dynamo.reset()
    before = aotc.backend.stats.copy()
    if via == "torch.compile":
        compiled = torch.compile(positions_of_mask, backend="aotc", dynamic=True)
    else:
        compiled = aotc.compile(positions_of_mask, dynamic=True)
    position_ids = torch.arange(16).unsqueeze(0)
    for batch, seq in [(2, 6), (3, 8), (2, 5)]:
        table = torch.randn(16, 4, requires_grad=True)
        x = torch.randn(batch, seq, 4, requires_grad=True)
        mask = torch.ones(batch, seq)
        got = compiled(mask, position_ids, table, x)
        weight = torch.randn_like(got)
        got_grads = torch.autograd.grad((got * weight).sum(), (table, x))
        want = positions_of_mask(mask, position_ids, table, x)
        torch.testing.assert_close(got, want)
        want_grads = torch.autograd.grad((want * weight).sum(), (table, x))
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w)
    assert aotc.backend.stats["fallback"] == before["fallback"]
    assert aotc.backend.stats["ahead"] - before["ahead"] >= 1


_ALIASING_PROGRAMS = {
    "views_of_the_input": lambda x: (x.view(-1), x[0], x.t(), x[1:], x.unsqueeze(0), x.diagonal()),
    "views_with_symbolic_arguments": lambda x: (
        x.view(x.shape[0], -1),
        x[:, :1].expand(x.shape[0], 3),
    ),
    "multi_output_views": lambda x: (*x.split(1, dim=1), *x.chunk(2, dim=0)),
    "views_of_an_intermediate": lambda x: ((x * 2).t(), (x * 3).view(-1, x.shape[1])),
    "detached_aliases": lambda x: (x.detach(), x.detach()[1:], x + 1),
    "narrow": lambda x: (x.narrow(0, 1, x.shape[0] - 1), x.mean()),
}


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
@pytest.mark.parametrize("name", sorted(_ALIASING_PROGRAMS))
def test_outputs_that_alias_inputs_with_symbolic_sizes_match_eager(name, capture):
    # Before session 13 these crashed ("SymIntArrayRef expected to contain only concrete
    # integers") or returned a detached alias of the first call's size (Note [Replayed views]).
    f = _ALIASING_PROGRAMS[name]
    torch._dynamo.reset()
    options = {"dynamic": True} if capture == "trace" else {}
    compiled = aotc.compile(f, capture=capture, **options)
    for n in (3, 5, 7):  # the default mode recompiles with dynamic sizes on the second
        x = torch.randn(n, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        want, got = f(x), compiled(x2)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w)
            assert g.stride() == w.stride() and (g.grad_fn is None) == (w.grad_fn is None)
        sum((w * 1.5).sum() for w in want if w.requires_grad).backward()
        sum((g * 1.5).sum() for g in got if g.requires_grad).backward()
        torch.testing.assert_close(x2.grad, x.grad)


@pytest.mark.parametrize(
    "index",
    [
        lambda x: x[x.shape[0] // 2],
        lambda x: x[x.shape[0] - 1],
        lambda x: x[:, x.shape[1] - 2],
        lambda x: x[1 - x.shape[0]],
        lambda x: x[1, x.shape[1] - 1],
        lambda x: x[x.shape[0] - 2, 1:].sum(0, keepdim=True),
    ],
    ids=["middle_row", "last_row", "column", "negative", "element", "slice_after"],
)
@pytest.mark.parametrize("cache", [False, True])
def test_dynamic_index_by_a_size_is_one_entry(index, cache, tmp_path, monkeypatch):
    # `t[i]` with a symbolic i: traced as select, not specialized on i's value (each size
    # compiled its own entry, with the disk cache's key run too)
    monkeypatch.setenv("AOTC_CACHE_DIR", str(tmp_path))

    def f(x):
        return index(x).sin() * 2

    compiled = aotc.compile(f, capture="trace", dynamic=True, cache=cache)
    for n, m in [(3, 4), (5, 6), (8, 3)]:
        x = torch.randn(n, m, requires_grad=True)
        ref = x.detach().clone().requires_grad_()
        got, want = compiled(x), f(ref)
        got.sum().backward()
        want.sum().backward()
        assert torch.equal(got, want)
        assert torch.equal(x.grad, ref.grad)
    assert len(aotc.inspect(compiled)) == 1, compiled.recompile_reasons
