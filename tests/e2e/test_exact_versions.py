"""Versions and saved values, differential against eager on fresh random inputs: a value eager's
autograd saved that the caller changes in place after the call (eager's backward refuses), inputs
eager's kernels write without a version bump (batch norm's running statistics), and a program
that changes a saved value's geometry in place (Note [Inputs changed after the call] in
runtime/autograd.py, Note [Writes eager does not count] in runtime/epilogue.py, Note [Saved
values changed in place] in aotc/tracer.py)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import aotc

CAPTURES = ["trace", "dynamo"]


def _compile(fn: Callable, capture: str) -> Callable:
    torch._dynamo.reset()
    return aotc.compile(fn, capture=capture, check_invariants=True)


def _outcome(fn, make, between, seed):
    """Call, run `between(args)` (the caller's in-place change), backward; whether the backward
    raised eager's stale-value error, or the gradients; and every input's version."""
    torch.manual_seed(seed)
    args = make()
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    between(args)
    loss = sum(o.float().sum() for o in outs if o.requires_grad)
    try:
        loss.backward()
    except RuntimeError as e:
        return ("raised", "modified by an inplace operation" in str(e), [a._version for a in args])
    grads = [None if a.grad is None else a.grad.clone() for a in args]
    return ("ran", grads, [a._version for a in args])


def _assert_same(fn, make, between, capture):
    compiled = _compile(fn, capture)
    for seed in (0, 1):
        want = _outcome(fn, make, between, seed)
        got = _outcome(compiled, make, between, seed)
        assert got[0] == want[0], f"eager {want[0]}, aotc {got[0]}: {got[1]}"
        assert got[2] == want[2], f"versions {got[2]} != eager's {want[2]}"
        if want[0] == "raised":
            assert got[1] == want[1]
        else:
            for g, w in zip(got[1], want[1]):
                assert (g is None) == (w is None)
                if w is not None:
                    torch.testing.assert_close(g, w)


def _add_under_no_grad(k):
    def between(args):
        with torch.no_grad():
            args[k].add_(1.0)

    return between


def _detached_write(k):
    def between(args):
        args[k].detach().mul_(2.0)

    return between


def _nothing(args):
    return None


def _maximum(x, y):
    return torch.maximum(x, y)


def _mul_then_view(x, w):
    return (x * w).view(-1)


def _sum_only(x, y):
    return x + y  # saves nothing


def _saved_view_of_input(x, w):
    return x[1:] * w


def _saved_by_a_dead_value(x, w):
    torch.maximum(x, w)  # saves x and w in a node no output reaches
    return x * 2


CHANGED_AFTER = {
    "maximum_other_changed": (
        _maximum,
        lambda: [torch.randn(3, requires_grad=True), torch.randn(3)],
        _add_under_no_grad(1),
    ),
    "mul_saved_input_changed": (
        _mul_then_view,
        lambda: [torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)],
        _detached_write(0),
    ),
    "view_of_input_saved": (
        _saved_view_of_input,
        lambda: [torch.randn(4, 3), torch.randn(3, 3, requires_grad=True)],
        _add_under_no_grad(0),
    ),
    "activation_input_changed": (
        _maximum,
        lambda: [torch.randn(3, requires_grad=True) * 1.5, torch.randn(3, requires_grad=True)],
        _detached_write(0),
    ),
    "not_saved_input_changed": (
        _sum_only,
        lambda: [torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)],
        _add_under_no_grad(1),
    ),
    "saved_by_a_dead_value": (
        _saved_by_a_dead_value,
        lambda: [torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)],
        _add_under_no_grad(1),
    ),
    "saved_but_unchanged": (
        _maximum,
        lambda: [torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)],
        _nothing,
    ),
}


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("name", sorted(CHANGED_AFTER))
def test_input_changed_after_the_call(name, capture):
    fn, make, between = CHANGED_AFTER[name]
    _assert_same(fn, make, between, capture)


def _outcome_from(fn, make, between, seed, chosen):
    """As `_outcome`, with the backward through the outputs at positions `chosen` only."""
    torch.manual_seed(seed)
    args = make()
    outs = fn(*args)
    between(args)
    loss = sum(outs[j].sum() for j in chosen)
    try:
        loss.backward()
    except RuntimeError as e:
        return ("raised", "modified by an inplace operation" in str(e), [a._version for a in args])
    return ("ran", [None if a.grad is None else a.grad.clone() for a in args], None)


def _mul_and_add(x, w):
    return x * w, x + 1  # mul saves x and w; add saves nothing


def _sin_and_exp(x, w):
    return x.sin(), w.exp()  # sin saves x; exp saves its result


def _shared_then_split(x, w):
    h = x * w  # saves x and w, used by both outputs' backward
    return h.sin(), h.cos(), w + 1


WHICH_OUTPUT = {
    "mul_and_add": (
        _mul_and_add,
        lambda: [torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)],
        _add_under_no_grad(1),
    ),
    "sin_and_exp_first_changed": (
        _sin_and_exp,
        lambda: [torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)],
        _detached_write(0),
    ),
    "shared_then_split": (
        _shared_then_split,
        lambda: [torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)],
        _add_under_no_grad(1),
    ),
}


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("name", sorted(WHICH_OUTPUT))
def test_input_changed_after_the_call_refuses_only_the_backward_that_uses_it(name, capture):
    """Eager refuses only a backward that unpacks the changed saved value: a backward from an
    output whose path does not reach it runs, with eager's gradients (Note [Inputs changed
    after the call])."""
    fn, make, between = WHICH_OUTPUT[name]
    compiled = _compile(fn, capture)
    n_outs = len(fn(*make()))
    choices = [[j] for j in range(n_outs)] + [list(range(n_outs))]
    kinds = set()
    for chosen in choices:
        want = _outcome_from(fn, make, between, 0, chosen)
        got = _outcome_from(compiled, make, between, 0, chosen)
        kinds.add(want[0])
        assert got[0] == want[0], f"outputs {chosen}: eager {want[0]}, aotc {got[0]}: {got[1]}"
        if want[0] == "ran":
            for g, w in zip(got[1], want[1]):
                assert (g is None) == (w is None)
                if w is not None:
                    torch.testing.assert_close(g, w)
    assert kinds == {"ran", "raised"}  # each case has both kinds of backward


def _amax_of_sin(x, w):
    return x.sin().amax(0), x * w  # amax saves its result; the compiled backward saves a mask


def _softmax_viewed(x, w):
    return (x * w).softmax(-1).view(-1), w + 1  # softmax saves its result; the output views it


def _exp_detached(x, w):
    y = x.exp()  # saves its result
    return y.detach(), y.sum() * w  # the detached alias shares y's version counter


def _product(x, w):
    return x * w, w * 2  # mul saves its inputs, not its output


def _scale_output(j):
    def between(outs):
        with torch.no_grad():
            outs[j].mul_(2.0)

    return between


def _unsqueeze_output(j):
    def between(outs):
        outs[j].unsqueeze_(0)

    return between


def _detached_add_to_output(j):
    def between(outs):
        outs[j].detach().add_(1.0)

    return between


OUTPUT_CHANGED_AFTER = {
    "amax_result_scaled": (_amax_of_sin, _scale_output(0)),
    "amax_result_unsqueezed": (_amax_of_sin, _unsqueeze_output(0)),
    "softmax_view_written": (_softmax_viewed, _detached_add_to_output(0)),
    "exp_result_through_its_detached_alias": (_exp_detached, _scale_output(0)),
    "output_not_saved_written": (_product, _scale_output(0)),
    "saved_output_unchanged": (_amax_of_sin, _nothing),
}


def _output_outcome(fn, between, chosen):
    torch.manual_seed(0)
    args = [torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)]
    outs = fn(*args)
    between(outs)
    try:
        sum(outs[j].sum() for j in chosen).backward()
    except RuntimeError as e:
        return ("raised", "modified by an inplace operation" in str(e))
    return ("ran", [None if a.grad is None else a.grad.clone() for a in args])


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("name", sorted(OUTPUT_CHANGED_AFTER))
def test_output_changed_after_the_call(name, capture):
    """An output whose value eager's autograd saved (amax's or softmax's result) and that the
    caller changes in place: eager's backward through it raises, a backward through another
    output runs (Note [Outputs changed after the call] in runtime/autograd.py)."""
    fn, between = OUTPUT_CHANGED_AFTER[name]
    compiled = _compile(fn, capture)
    for chosen in ([0], [1], [0, 1]):
        want = _output_outcome(fn, between, chosen)
        got = _output_outcome(compiled, between, chosen)
        assert got[0] == want[0], f"outputs {chosen}: eager {want[0]}, aotc {got[0]}: {got[1]}"
        if want[0] == "raised":
            assert got[1] == want[1]
        else:
            for g, w in zip(got[1], want[1], strict=True):
                assert (g is None) == (w is None)
                if w is not None:
                    torch.testing.assert_close(g, w)


def _written_then_saved(x, w):
    x.mul_(2.0)  # eager saves x after this write: its version at the end of the call
    return x.sin() * w


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("between", [_nothing, _add_under_no_grad(0)], ids=["kept", "changed"])
def test_input_written_inside_then_saved(capture, between):
    _assert_same(
        _written_then_saved,
        lambda: [torch.randn(3), torch.randn(3, requires_grad=True)],
        between,
        capture,
    )


def _batch_norm_twice(x, rm, rv, w, b):
    first = torch.nn.functional.batch_norm(x, rm, rv, w, b, training=True)
    return first


def _bn_inputs():
    return [
        torch.randn(5, 3, requires_grad=True),
        torch.randn(3),
        torch.rand(3) + 0.5,
        torch.randn(3, requires_grad=True),
        torch.randn(3, requires_grad=True),
    ]


@pytest.mark.parametrize("capture", CAPTURES)
def test_batch_norm_running_stats_keep_eager_versions(capture):
    """Eager's batch norm writes its running statistics without a version bump and saves them for
    the backward: two calls before one backward must run, with eager's versions and values."""
    compiled = _compile(_batch_norm_twice, capture)
    for seed in (0, 1):
        results = []
        for fn in (_batch_norm_twice, compiled):
            torch.manual_seed(seed)
            args = _bn_inputs()
            a = fn(*args)
            b = fn(*args)
            (a * b).sum().backward()
            results.append((args, [t._version for t in args]))
        (want, want_v), (got, got_v) = results
        assert got_v == want_v
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
            assert (g.grad is None) == (w.grad is None)
            if w.grad is not None:
                torch.testing.assert_close(g.grad, w.grad)


def _regenerated_view_of_a_changed_saved_output(a):
    v = a.tanh()
    w = v.view(-1)
    v.transpose_(0, 1)  # eager's backward through w refuses: tanh saved v
    return w, v.sum()


@pytest.mark.parametrize("capture", CAPTURES)
def test_metadata_change_of_a_saved_output(capture):
    _assert_same(
        _regenerated_view_of_a_changed_saved_output,
        lambda: [torch.randn(2, 3, dtype=torch.float64, requires_grad=True)],
        _nothing,
        capture,
    )


# ------------------------------------------- programs compared with eager by the fuzzer's check


def _detached_views_of_an_intermediate(a):
    v = a.neg()
    return v.diagonal().detach(), v[1:, ::2].detach(), v.sum(), v.t().detach()


def _views_under_no_grad(a):
    with torch.no_grad():
        v = a * 2
        return v.diagonal(), v[1]


def _zero_expanded_intermediate_under_no_grad(a):
    v = a * 2
    with torch.no_grad():
        v.unsqueeze(1).expand(-1, 3, -1).zero_()
    return v * 3, v


def _masked_fill_expanded_under_no_grad(a, b):
    v = a.sin()
    with torch.no_grad():
        v.expand(3, *v.shape).masked_fill_(b, 0.5)
    return (v,)


def _fill_expanded_with_grad(a):
    v = a * 2
    v.expand(2, *v.shape).fill_(1.0)  # eager's backward through v refuses
    return (v,)


def _view_of_input_made_a_leaf(a0):  # fuzz campaign 2026-11-23, seed 31093
    v0 = a0.view(-1)
    v0.requires_grad_()
    return (v0,)


def _detached_slice_and_view_of_an_intermediate(a0):  # fuzz campaign, seed 31295
    v1 = a0.neg()
    v2 = v1[0]
    v3 = v2.detach().requires_grad_()
    return (v3, v2)


def _dead_maximum_then_squeeze_of_an_alias(a0, a1, a2, a3):  # fuzz campaign 2026-11-23, 1176
    torch.maximum(a2, a2)  # saves a2 in a node no output reaches
    v1 = a2 * torch.randn((2, 4))
    a3.squeeze_(0)  # bumps the version counter a2 shares (one base)
    return (v1,)


def _squeeze_of_a_view_unsqueezed_in_place(a0):  # fuzz seed 32885
    v0 = a0.squeeze(1)
    v0.unsqueeze_(1)  # the view changed after it was made: its chain from a0 no longer holds
    return v0.squeeze(0)  # a no-op squeeze: eager's output keeps the unsqueezed dim


def _select_then_squeeze_in_place_of_the_base(a0):  # fuzz seed 32479
    v1 = a0[0]
    a0.squeeze_()  # v1's node is rebuilt on its next use; eager's routes by storage
    return (v1.double(), a0)


def _transpose_then_t_in_place_of_the_base(a0):
    v1 = a0.t()
    a0.t_()
    return (v1 * 3, a0)


def _slice_of_a_flattened_strided_input(a0):  # fuzz seed 33425
    return a0.flatten()[1:]  # a view of the reshape's copy: eager lets the caller write into it


def _chunk_saved_after_a_version_bump(a0, a1):  # fuzz seed 34564
    v0 = a1.movedim(0, -1)
    v0.squeeze_(1)  # a no-op squeeze: bumps a1's version, eager saves the chunk after it
    v1 = a1.chunk(2, 0)[0]
    return (v1 * (a0 * 2.0),)


def _inputs_dead_maximum():
    x1 = torch.randn((3, 2, 4), requires_grad=True) * 1.0
    return [torch.randn((4,), requires_grad=True), x1[:, 1], x1[0], x1[1]]


def _rand_like_of_a_transposed_intermediate(a0, a1, a2):  # fuzz campaign 2026-11-23, 5067
    v0 = a2 + a2  # eager lays v0 out as a2: transposed
    v3 = torch.rand_like(v0)  # filled in v0's memory order
    return (a2.squeeze() * v3,)


def _inputs_rand_like():
    return [
        torch.randn((4, 1), requires_grad=True),
        torch.randn((3, 4), requires_grad=True) * 1.0,
        torch.randn((4, 3)).t(),
    ]


def _as_strided_of_a_transposed_intermediate(a0):  # fuzz campaign 2026-11-23, 5251
    a0.transpose_(0, 1)
    v1 = a0.detach().clone() + 1.0  # eager lays v1 out as a0: transposed
    v1.as_strided_(v1.shape, v1.stride())  # reads v1's memory through eager's strides
    return (v1,)


def _detached_clone_of_an_input(a0, a1):  # fuzz campaign 2026-11-23, 5269
    v1 = a1.detach().clone().detach()  # its own memory, not a1's
    a0.expand(2, *a0.shape).zero_()
    return (v1,)


def _view_of_one_of_overlapping_inputs(a0, a1, a2):  # fuzz campaign 2026-11-23, 8241
    v0 = a1.movedim(0, -1)  # a1's memory, which a0 spans without holding
    with torch.no_grad():
        v0.narrow(0, 1, 1).zero_()
    return (v0,)


def _overlapping_views_of_x():
    x = torch.randn((3, 2, 4), requires_grad=True)
    return [x[:, 1], x[1], x[2]]


def _as_strided_of_a_written_input(a0, a1, a2):  # fuzz campaign 2026-11-23, 8252
    v0 = a2.detach()
    v0.masked_fill_(v0 > 0, 1.0)
    return (a2.as_strided((2,), (1,), 1),)  # an absolute storage offset, below a2's own


def _requires_grad_of_an_input_through_float(a0, a1, a2):  # fuzz campaign 2026-11-27, 12414
    v0 = a2.detach().requires_grad_()  # a graph break in default mode
    v1 = a2.unsqueeze(0)
    v2 = a1.float()  # a1 is float32: v2 is a1 itself
    v2.requires_grad_()
    v3 = (v2 > 0).float()
    v3.zero_()
    return (a0, v0, v1)


def _dead_as_strided_past_its_storage(a0):  # fuzz campaign 2026-11-27, 12499
    a0.add_(a0)
    v0 = a0.chunk(2, 0)[1]
    v1 = v0.to(torch.float16).float()  # one element of storage
    v1.as_strided((2,), (1,), 1)  # eager raises; nothing reads the view
    return (a0, a0)


def _as_strided_past_a_view_within_its_storage(a0):
    v0 = a0[1:3]
    return (v0.as_strided((4,), (1,), 0) * 2,)  # beyond v0, within a0's storage: eager runs


def _reshapes_of_a_noncontiguous_value(a0, a1):  # fuzz campaign 2026-11-27, 14974
    v0 = a1 * 2.5  # a1 is transposed: v0 too, so each reshape copies
    return (v0.reshape(-1), v0.reshape(-1))


def _split_view_and_an_equal_value(a0, a1):  # fuzz campaign 2026-11-27, 18388
    v0 = a1 + 1.0
    v4 = v0.split(1, 0)[0].detach()  # a view of v0 (through split's getitem) is returned
    v5 = a1 + 1.0  # equal to v0, but eager returns its own memory
    return (v5, v4)


def _as_strided_past_a_narrowed_input(a0):  # fuzz campaign 2026-11-27, 19188
    v1 = a0.squeeze().narrow(0, 1, 1)
    return (v1.as_strided((2,), (1,), 1),)  # reads a0[2], which v1 does not hold: no grad there


def _as_strided_past_a_narrowed_input_then_viewed(a0, a1):
    v1 = a0[1:3].t()
    return (v1.as_strided((2, 2), (1, 3), 3).view(4), a1 * 2)


def _masked_fill_of_an_expanded_large_value(a0):  # fuzz campaign 2026-11-27, 19294
    v5 = (a0 * 3.0).pow(2).exp()  # up to ~1e35: a write replayed as base + (new - base) is 0
    v5.expand(2, *v5.shape).masked_fill_(v5.expand(2, *v5.shape) > 0, 2.0)
    return (v5,)


def _fill_of_an_expanded_flat_view(a0, a1, a2):  # fuzz campaign 2026-11-27, 23122
    a2.expand(2, *a2.shape).fill_(1.0)  # a2 = x.view(-1): one element off by a rounding
    a1.expand(2, *a1.shape).masked_fill_(a1.expand(2, *a1.shape) > 0, 2.0)
    return (a2.double(),)


def _unbind_view_of_a_tensor_given_grad_later(a0, a1, a2):  # fuzz 2026-11-27, 24265
    v0 = torch.rand_like(a2)
    v1 = v0.unbind(0)[0]  # made without a node: v0 did not require grad yet
    v0.copy_(a2)  # now it does; reading v1.grad_fn raises eager's "created in no_grad mode"
    return (v1,)


def _no_grad_view_of_a_detached_leaf_then_written(a0):  # fuzz 2026-11-27, 24612
    v0 = a0.unsqueeze(0)
    v1 = v0.detach().requires_grad_()  # shares a0's version counter
    with torch.set_grad_enabled(False):
        v3 = v1.diagonal()
        v0.sigmoid_()  # one write: a0's version moves by 1, v3 goes stale
    return (v3,)


def _strided_view_made_a_new_leaf(a0):  # fuzz campaign 2026-11-27, 23840
    v1 = (a0 + 1.0)[0]  # a0 transposed: the row has stride 3, and so has eager's leaf
    return (v1.detach().requires_grad_(),)


def _expanded_value_made_a_new_leaf(a0):  # fuzz campaign 2026-11-27, 30738
    v1 = a0.exp().expand(2, 3)  # stride 0: eager's leaf keeps it (no copy can: it overlaps)
    return (v1.detach().requires_grad_(), a0 * 2)


def _view_taken_before_a_view_input_requires_grad(a0):  # fuzz 2026-11-28, 31973
    v0 = a0.narrow(0, 1, 1)  # a0 is x.t(): v0's root needs no grad, so v0 never will
    a0.requires_grad_()
    return (v0, a0 * 2)


def _view_written_then_its_input_requires_grad(a0):  # fuzz 2026-11-28, 32051
    v0 = a0.squeeze()
    v0.mul_(2.0)  # written after it was made: once a0 requires grad, v0 gets a node
    a0.requires_grad_()  # the default mode runs this in Python between two graphs
    return (v0,)


def _view_after_a_metadata_write_of_its_input(a0, a1):  # fuzz 2026-11-28, 32432
    a1.unsqueeze_(1)  # a1's geometry changes before the view is taken: made after the epilogue
    v0 = a1[1:]
    return (v0.transpose(0, 2), a0 * 2)


def _view_of_a_transposed_input_written(a0, a1):  # fuzz 2026-11-28, 32837
    a1.t_()  # a metadata write of an input sharing storage with a0: no early views
    v0 = a1.squeeze()
    v0.clamp_(min=-0.5)
    return (v0,)


def _no_grad_view_of_a_leaf_made_a_leaf(a0):  # fuzz campaign 2026-11-27, 16082
    with torch.set_grad_enabled(False):
        v1 = a0.narrow(0, 1, 2)  # a0 requires grad; the view does not
    v1.requires_grad_()  # a leaf of its own: backward accumulates into v1, not a0
    return (v1, v1.detach() * 2, a0 * 3)


def _view_taken_before_its_base_requires_grad(a0, a1):  # its regression: 16930
    v2 = a1 * 2.5
    v4 = v2.reshape(-1)  # requires_grad through its base from here on, but no leaf
    v2.requires_grad_()
    with torch.no_grad():
        v5 = v2[1:]  # the same, under no_grad
    return (v4, v5, v2)  # eager's backward through v4 or v5 raises


def _write_outside_one_of_overlapping_inputs(a0, a1, a2):  # fuzz campaign 2026-11-27, 16893
    v0 = a0.as_strided((2,), (1,), 1)  # absolute offset 1: outside a0, inside a2
    v0.index_put_((torch.tensor([0]),), torch.tensor(3.0, dtype=v0.dtype))
    return (a1.shape[0],)  # Dynamo's graph gets a0 alone


def _clone_made_to_require_grad_then_transposed(a0):  # fuzz campaign 2026-11-27, 17730
    v1 = a0.clone()  # no leaf: a0 requires grad
    v1.requires_grad_()
    v1.t_()  # in place on a leaf that requires grad would raise
    v1.zero_()
    return (v1.to(torch.float16).float().detach(),)  # nothing needs a gradient


def _branch_on_requires_grad_with_detached_outputs(a0, a1):
    y = a0 * 2 if a0.requires_grad else a0 * 3
    a1.mul_(2)  # an input that is no leaf, written in place
    return (y.detach(), a1.detach())


def _mul_into_a_transposed_view(a0, a1):  # found with fuzz campaign 2026-11-27, 18188
    v0 = a0 * 1.0
    v0.t().mul_(a1)  # a1's gradient is the values v0 had before the write
    return (v0 * 2,)


def _div_into_a_transposed_input(a0, a1):
    v1 = a0.t()
    v1.div_(a1)
    return (v1.sum(0),)


def _index_put_into_a_zero_dim_value(a0, a1):  # fuzz session 13, 27125
    v0 = a0.sum()
    v0.index_put_((torch.tensor([0]),), torch.tensor(3.0))  # eager: IndexError, fakes: none
    return (a1,)


def _dead_saved_input_then_written(a0, a1, a2):  # fuzz session 13, 29318
    v0 = a1.amax(0)  # noqa: F841  (a live local at the graph break in the default mode)
    v1 = a2 - a2
    a2.as_strided_(a2.shape, a2.stride())
    a1.masked_fill_(a1 > 0, 1.0)
    return (v1,)


def _overlapping_a1_views():
    x0 = torch.randn((3, 2, 4), requires_grad=True) * 1.0
    x1 = torch.randn((1, 3), requires_grad=True) * 1.0
    return [x0[2], x0.view(-1), x1]


def _views_at_offsets():
    x = torch.randn((3, 2, 4), requires_grad=True)
    return [x[1], x.view(-1), x[:, 1]]


def _view_reshaped_in_place_then_its_storage_written(a0, a1, a2):  # fuzz 2026-11-28, 37925
    a2.squeeze_()  # no-op in place: the trace keeps the version counter where it was
    a1.sigmoid_()  # writes a row a2 shares: a2's gradient must go through the sigmoid
    return (torch.maximum(a2, a2),)


def _leaf_made_inside_beside_an_overlapping_write(a0, a1):  # fuzz 2026-11-28, 36810
    a1.expand(2, *a1.shape).masked_fill_(a1.expand(2, *a1.shape) > 0, 2.0)
    v0 = a1[0]
    v2 = v0.detach().clone().requires_grad_()  # Dynamo breaks the graph here
    v0.detach().mul_(3.0)
    with torch.no_grad():
        v3 = v2.squeeze(0)
    # the backward reaches the first graph's node with no gradient: eager never runs it, and
    # the inputs' leaf keeps a None gradient (the node made it zeros)
    return (v3.double(),)


PROGRAMS = {
    "view_of_one_of_overlapping_inputs": (
        _view_of_one_of_overlapping_inputs,
        _overlapping_views_of_x,
        [0],
    ),
    "as_strided_of_a_written_input": (_as_strided_of_a_written_input, _views_at_offsets, []),
    "as_strided_of_a_transposed_intermediate": (
        _as_strided_of_a_transposed_intermediate,
        lambda: [torch.randn((2, 3), requires_grad=True) * 1.0],
        [],
    ),
    "detached_clone_of_an_input": (
        _detached_clone_of_an_input,
        lambda: [torch.randn((3, 4), requires_grad=True) * 1.0, torch.randn((3, 4))],
        [],
    ),
    "rand_like_of_a_transposed_intermediate": (
        _rand_like_of_a_transposed_intermediate,
        _inputs_rand_like,
        [],
    ),
    "dead_maximum_then_squeeze_of_an_alias": (
        _dead_maximum_then_squeeze_of_an_alias,
        _inputs_dead_maximum,
        [0],
    ),
    "detached_slice_and_view_of_an_intermediate": (
        _detached_slice_and_view_of_an_intermediate,
        lambda: [torch.randn(4, 1, requires_grad=True)],
        [0, 1],
    ),
    "view_of_input_made_a_leaf": (_view_of_input_made_a_leaf, lambda: [torch.randn(4, 1)], [0]),
    "detached_views_of_an_intermediate": (
        _detached_views_of_an_intermediate,
        lambda: [torch.randn(4, 5, requires_grad=True)],
        [2],
    ),
    "views_under_no_grad": (
        _views_under_no_grad,
        lambda: [torch.randn(4, 4, requires_grad=True)],
        [],
    ),
    "zero_expanded_intermediate_under_no_grad": (
        _zero_expanded_intermediate_under_no_grad,
        lambda: [torch.randn(4, 5, requires_grad=True)],
        [0],
    ),
    "masked_fill_expanded_under_no_grad": (
        _masked_fill_expanded_under_no_grad,
        lambda: [torch.randn(4, requires_grad=True), torch.rand(3, 4) > 0.5],
        [0],
    ),
    "requires_grad_of_an_input_through_float": (
        _requires_grad_of_an_input_through_float,
        lambda: [torch.randn((4, 1), requires_grad=True), torch.randn((2, 3)), torch.randn((3,))],
        [0, 1],
    ),
    "dead_as_strided_past_its_storage": (
        _dead_as_strided_past_its_storage,
        lambda: [torch.randn((3,))],
        [],
    ),
    "as_strided_past_a_view_within_its_storage": (
        _as_strided_past_a_view_within_its_storage,
        lambda: [torch.randn((4,), requires_grad=True) * 1.0],
        [0],
    ),
    "reshapes_of_a_noncontiguous_value": (
        _reshapes_of_a_noncontiguous_value,
        lambda: [torch.randn((4,)), torch.randn((4, 3), requires_grad=True).t()],
        [0, 1],
    ),
    "as_strided_past_a_narrowed_input": (
        _as_strided_past_a_narrowed_input,
        lambda: [torch.randn((3,), requires_grad=True)],
        [0],
    ),
    "as_strided_past_a_narrowed_input_then_viewed": (
        _as_strided_past_a_narrowed_input_then_viewed,
        lambda: [torch.randn((4, 3), requires_grad=True), torch.randn(2, requires_grad=True)],
        [0, 1],
    ),
    "masked_fill_of_an_expanded_large_value": (
        _masked_fill_of_an_expanded_large_value,
        lambda: [torch.randn((4, 3), dtype=torch.float64, requires_grad=True).t()],
        [],
    ),
    "unbind_view_of_a_tensor_given_grad_later": (
        _unbind_view_of_a_tensor_given_grad_later,
        lambda: [
            torch.randn((4, 3)).t(),
            torch.randn((2, 3, 4), requires_grad=True) * 1.0,
            torch.randn((3, 1, 2), dtype=torch.float64, requires_grad=True),
        ],
        [],
    ),
    "no_grad_view_of_a_detached_leaf_then_written": (
        _no_grad_view_of_a_detached_leaf_then_written,
        lambda: [torch.randn((4, 1), requires_grad=True) * 1.0],
        [],
    ),
    "strided_view_made_a_new_leaf": (
        _strided_view_made_a_new_leaf,
        lambda: [torch.randn((4, 3)).t()],
        [],
    ),
    "expanded_value_made_a_new_leaf": (
        _expanded_value_made_a_new_leaf,
        lambda: [torch.randn((1, 3), requires_grad=True)],
        [],
    ),
    "view_taken_before_a_view_input_requires_grad": (
        _view_taken_before_a_view_input_requires_grad,
        lambda: [torch.randn((4, 3)).t()],
        [1],
    ),
    "view_written_then_its_input_requires_grad": (
        _view_written_then_its_input_requires_grad,
        lambda: [torch.randn((3, 1, 2))],
        [0],
    ),
    "view_after_a_metadata_write_of_its_input": (
        _view_after_a_metadata_write_of_its_input,
        lambda: [torch.randn((3,), requires_grad=True), torch.randn((4, 3)).t()],
        [1],
    ),
    "view_of_a_transposed_input_written": (
        _view_of_a_transposed_input_written,
        lambda: (lambda x: [x[2], x[1]])(torch.randn((3, 2, 4))),
        [],
    ),
    "fill_of_an_expanded_flat_view": (
        _fill_of_an_expanded_flat_view,
        lambda: (lambda x: [torch.randn((2, 3), requires_grad=True), x[2], x.view(-1)])(
            torch.randn((3, 2, 4)) * 1e8  # large: base + (1 - base) rounds to 0
        ),
        [],
    ),
    "split_view_and_an_equal_value": (
        _split_view_and_an_equal_value,
        lambda: [torch.randn((3,)), torch.randn((3, 2, 4), requires_grad=True)[1]],
        [],
    ),
    "view_taken_before_its_base_requires_grad": (
        _view_taken_before_its_base_requires_grad,
        lambda: [torch.randn((2, 3)), torch.randn((3,))],
        [0],
    ),
    "view_taken_before_its_base_requires_grad_no_grad": (
        _view_taken_before_its_base_requires_grad,
        lambda: [torch.randn((2, 3)), torch.randn((3,))],
        [1, 2],
    ),
    "write_outside_one_of_overlapping_inputs": (
        _write_outside_one_of_overlapping_inputs,
        _views_at_offsets,
        [],
    ),
    "clone_made_to_require_grad_then_transposed": (
        _clone_made_to_require_grad_then_transposed,
        lambda: [torch.randn((2, 3), requires_grad=True) * 1.0],
        [],
    ),
    "branch_on_requires_grad_with_detached_outputs": (
        _branch_on_requires_grad_with_detached_outputs,
        lambda: [torch.randn((2, 3), requires_grad=True), torch.randn(3, requires_grad=True) * 1.0],
        [],
    ),
    "mul_into_a_transposed_view": (
        _mul_into_a_transposed_view,
        lambda: [torch.randn(3, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)],
        [0],
    ),
    "div_into_a_transposed_input": (
        _div_into_a_transposed_input,
        lambda: [
            torch.randn(3, 4, requires_grad=True) * 1.0,
            torch.rand(4, 3, requires_grad=True) + 0.5,
        ],
        [0],
    ),
    "fill_expanded_with_grad": (
        _fill_expanded_with_grad,
        lambda: [torch.randn(4, requires_grad=True)],
        [0],
    ),
    "dead_saved_input_then_written": (
        _dead_saved_input_then_written,
        _overlapping_a1_views,
        [0],
    ),
    "view_reshaped_in_place_then_its_storage_written": (
        _view_reshaped_in_place_then_its_storage_written,
        lambda: (lambda x: [x[1], x[:, 1], x[2]])(torch.randn((3, 2, 4), requires_grad=True) * 1.0),
        [0],
    ),
    "leaf_made_inside_beside_an_overlapping_write": (
        _leaf_made_inside_beside_an_overlapping_write,
        lambda: (lambda x: [x.view(-1), x[2]])(torch.randn((3, 2, 4), requires_grad=True) * 1.0),
        [0],
    ),
    "squeeze_of_a_view_unsqueezed_in_place": (
        _squeeze_of_a_view_unsqueezed_in_place,
        lambda: [(torch.randn((3, 2, 4), requires_grad=True) * 1.0)[:, 1]],
        [0],
    ),
    "select_then_squeeze_in_place_of_the_base": (
        _select_then_squeeze_in_place_of_the_base,
        lambda: [torch.randn((1, 3), requires_grad=True) * 1.0],
        [0],
    ),
    "transpose_then_t_in_place_of_the_base": (
        _transpose_then_t_in_place_of_the_base,
        lambda: [torch.randn((2, 3), requires_grad=True) * 1.0],
        [0],
    ),
    "slice_of_a_flattened_strided_input": (
        _slice_of_a_flattened_strided_input,
        lambda: [(torch.randn((3, 2, 4), requires_grad=True) * 1.0)[:, 1]],
        [0],
    ),
    "chunk_saved_after_a_version_bump": (
        _chunk_saved_after_a_version_bump,
        lambda: [torch.randn((2, 3, 4), requires_grad=True), torch.randn((2, 3, 4))],
        [0],
    ),
    "index_put_into_a_zero_dim_value": (
        _index_put_into_a_zero_dim_value,
        lambda: [torch.randn(4, requires_grad=True) * 1.0, torch.randn(2, 3)],
        [],
    ),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["trace", "default", "triton"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_matches_eager(name, mode):
    from tests.fuzz.compare import Verdict, check

    f, make, backward = PROGRAMS[name]
    outcome = check(f, make, backward=backward, write_outputs=True, mode=mode)
    assert outcome.verdict is Verdict.MATCH, outcome.detail


def test_view_replayed_from_a_base_of_another_rank_is_refused_with_the_line():
    # fuzz campaign 2026-11-23, 8119: eager runs it; fake tensors replay `v` from `a`'s new rank
    def f(a):
        v = a.transpose(0, 1)
        a.squeeze_(0)
        v.unsqueeze_(0)
        return v * 2

    x = torch.randn((1, 3), requires_grad=True) * 1.0
    assert f(x.clone()).shape == (1, 3, 1)
    with pytest.raises(aotc.UnsupportedError, match=r"v\.unsqueeze_\(0\).*IndexError"):
        aotc.compile(f, capture="trace")(x.clone())


def test_write_after_reshaping_a_base_under_a_view_is_refused_with_the_line():
    # Note [Views of a tensor reshaped in place]: after the write autograd would rebuild v's node
    # by replaying `select` on the squeezed tensor (a wrong gradient, silently, before).
    def f(a):
        v = a[0]
        a.squeeze_()
        a.mul_(2)
        return v.double()

    x = torch.randn((1, 3), requires_grad=True) * 1.0
    f(x.clone()).sum().backward()  # eager runs it
    with pytest.raises(aotc.UnsupportedError, match=r"a\.mul_\(2\).*squeeze_") as info:
        aotc.compile(f, capture="trace")(x.clone())
    assert "default capture mode" in str(info.value)
    got = aotc.compile(f)(x.clone())  # the default mode runs that frame as eager does
    torch.testing.assert_close(got, f(x.clone()))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["trace", "default"])
def test_reshape_in_place_under_inference_mode(mode):
    # fuzz seed 33460: the strict trace's version bookkeeping for in-place reshapes (Note [Views
    # of a tensor reshaped in place]) must leave inference tensors alone (they have no counter)
    from tests.fuzz.compare import Verdict, check

    def f(a0, a1, a2):
        a2.mul_(2.0)
        v0 = a1[1:]
        a2.t_()
        return (a0, a2, v0)

    def make():
        return [torch.randn(3), torch.randn(4, 2), torch.randn(2, 3)]

    outcome = check(f, make, backward=[], write_outputs=True, mode=f"{mode}_inference")
    assert outcome.verdict is Verdict.MATCH, outcome.detail


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["trace", "default"])
def test_write_through_an_expand_of_a_transposed_input_under_inference_mode(mode):
    # fuzz seed 35956: views made in inference mode record no `_base`, so the write through the
    # expand went back as base + sum(new - old) and came out one rounding off; the expand's
    # source is now remembered (`OverlappingWrites.expanded`)
    from tests.fuzz.compare import Verdict, check

    def f(a0, a1, a2):
        a2.expand(2, *a2.shape).fill_(1.0)
        return ((a2**2).double(),)

    def make():
        x1 = torch.randn((3, 4), dtype=torch.float64, requires_grad=True) * 1.0
        return [torch.randn((3, 4)), x1, torch.randn((4, 3), requires_grad=True).t()]

    outcome = check(f, make, backward=[], write_outputs=False, mode=f"{mode}_inference")
    assert outcome.verdict is Verdict.MATCH, outcome.detail


def test_requires_grad_of_an_input_merged_into_a_base_is_refused():
    # fuzz campaign 2026-11-23, 9181: the output came back without history in strict mode
    def f(a0, a1):
        a1.mul_(2.0)
        a0.requires_grad_()
        return a0 * 2

    x = torch.randn(3, 2, 4)
    assert f(x[0], x[2]).requires_grad
    with pytest.raises(aotc.UnsupportedError, match=r"input 0 .*requires_grad_\(\)"):
        aotc.compile(f, capture="trace")(x[0], x[2])
    x = torch.randn(3, 2, 4)  # the default mode runs it like eager
    out = aotc.compile(f)(x[0], x[2])
    assert out.requires_grad and out.grad_fn is not None


def _leaf_view_beside_a_written_view():
    x = torch.randn(3, 2, 4)
    a = x[2]
    a.requires_grad_()  # a leaf of its own: x does not require grad
    return a, x.view(-1)


def _loss_then_write(a, v):
    loss = a.neg().sum()
    v.relu_()  # writes a's storage through another input
    return loss


def test_leaf_view_merged_into_a_base_without_grad_is_refused_in_strict_mode():
    # fuzz campaign 2026-11-28, 37840: the output came back not requiring grad in both modes
    a, v = _leaf_view_beside_a_written_view()
    with pytest.raises(aotc.UnsupportedError, match=r"input a requires grad as a leaf of its own"):
        aotc.compile(_loss_then_write, capture="trace")(a, v)


@pytest.mark.filterwarnings("ignore")
def test_leaf_view_merged_into_a_base_without_grad_runs_eagerly_in_the_default_mode():
    torch.manual_seed(0)
    a, v = _leaf_view_beside_a_written_view()
    expected = _loss_then_write(a, v)
    expected.backward()
    torch.manual_seed(0)
    b, w = _leaf_view_beside_a_written_view()
    got = aotc.compile(_loss_then_write)(b, w)
    assert got.requires_grad and got.grad_fn is not None
    got.backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(b.grad, a.grad)
    torch.testing.assert_close(w, v)


def _requires_grad_beside_a_write(a0, a1, a2):  # fuzz 2026-11-28, 37840 (as the campaign ran it)
    v0 = a2.contiguous()  # a2 itself: contiguous already
    a1.requires_grad_()  # Dynamo breaks the graph here; a1 is a view of a tensor without grad
    v5 = a1.neg().sum()
    v0.relu_()
    return (v5,)


@pytest.mark.filterwarnings("ignore")
def test_requires_grad_of_a_view_beside_a_write_in_the_default_mode():
    from tests.fuzz.compare import Verdict, check

    def make():
        x0 = torch.randn((3, 2, 4))
        return [x0[1], x0[2], x0.view(-1)]

    outcome = check(_requires_grad_beside_a_write, make, [], write_outputs=False, mode="default")
    assert outcome.verdict is Verdict.MATCH, outcome.detail


def _write_into_an_unused_expanded_intermediate(a0, a1, a2):  # fuzz 2026-11-28, 39899
    v0 = a2.to(torch.float16).float()
    v1 = a2.unsqueeze(0)
    v3 = v1 * v0
    v4 = v1.double() * v1.double()
    v4.expand(2, *v4.shape).zero_()  # its backward eager refuses; no output reaches it
    return (v3,)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["default", "trace"])
def test_backward_of_an_output_that_does_not_reach_a_refused_write(mode):
    # the write's autograd node died with v4; its id was reused by a node of v3's graph, so v3's
    # backward was refused although eager runs it
    from tests.fuzz.compare import Verdict, check

    def make():
        x0 = torch.randn((3, 2, 4), requires_grad=True)
        return [x0[2], x0[:, 1], x0.view(-1)]

    for _ in range(3):
        outcome = check(
            _write_into_an_unused_expanded_intermediate, make, [0], write_outputs=False, mode=mode
        )
        assert outcome.verdict is Verdict.MATCH, outcome.detail


@pytest.mark.parametrize("capture,dynamic", [("trace", False), ("dynamo", False), ("dynamo", True)])
def test_as_strided_past_an_input_view_within_its_storage_runs(capture, dynamic):
    # The bounds check of `as_strided` (fuzz 12499) must not refuse a view that reaches past the
    # input's own extent but stays inside its storage: eager runs it.
    def f(x):
        return x.as_strided((5,), (1,), 0) * 2 + x.sum()

    compiled = aotc.compile(f, capture=capture, dynamic=dynamic)
    for n in (6, 7):
        base = torch.randn(n)
        torch.testing.assert_close(compiled(base[1:3]), f(base[1:3]))


def _add_of_a_broadcast_column_of_itself(a0):  # fuzz campaign 2026-11-27, 14905
    a0.add_(a0.split(1, 1)[1])  # eager's later columns add the column it already doubled
    return (a0,)


def _add_of_another_row_of_itself(a0):
    a0[0].add_(a0[1])  # one storage, no common element: compiles
    return (a0 * 2,)


def _squeeze_of_a_leaf_under_no_grad(a0, a1):  # fuzz campaign 2026-11-27, 14258
    with torch.set_grad_enabled(False):
        v0 = a1.unsqueeze(1)
        a0.squeeze_()
    return (v0.exp().expand(2, 3, 1, 4), a0)


def _squeeze_then_requires_grad(a0):  # fuzz campaign 2026-11-27, 14403
    a0.squeeze_(0)
    a0.requires_grad_()
    return (a0.abs(),)


def _view_outside_its_input_after_a_write(a0, a1, a2, a3):  # fuzz 2026-11-27, 18804
    v6 = a3.as_strided((2,), (1,), 1)  # storage elements 1 and 2: no input holds them
    a1.sigmoid_()  # eager regenerates v6's node from the inputs' base: its gradient goes there
    return (v6,)


def _inputs_view_outside():
    x1 = torch.randn((3, 2, 4), requires_grad=True) * 1.0
    return [torch.randn((3, 1, 2), requires_grad=True), x1[1], x1[:, 1], x1[2]]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    "f,make,backward,refusal",
    [
        (
            _view_outside_its_input_after_a_write,
            _inputs_view_outside,
            [0],
            "that no input holds",  # the metadata pass sees it first (EagerChecks)
        ),
        (
            _squeeze_of_a_leaf_under_no_grad,
            lambda: [
                torch.randn((1, 3), requires_grad=True),
                torch.randn((3, 4), requires_grad=True),
            ],
            [1],
            "sizes or strides in place",
        ),
        (_squeeze_then_requires_grad, lambda: [torch.randn(1, 3)], [0], "sizes or strides"),
    ],
)
def test_what_strict_mode_cannot_replay_is_refused_and_the_default_mode_runs(
    f, make, backward, refusal
):
    from tests.fuzz.compare import Verdict, check

    strict = check(f, make, backward=backward, write_outputs=True, mode="trace")
    assert strict.verdict is Verdict.REFUSED and refusal in strict.detail, strict.detail
    default = check(f, make, backward=backward, write_outputs=True, mode="default")
    assert default.verdict is Verdict.MATCH, default.detail


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["trace", "default", "triton", "dynamo"])
def test_in_place_op_reading_an_overlapping_view_of_its_output_is_refused(mode):
    # eager's result depends on the order it visits elements; aotc reads before it writes. The
    # default mode runs the refused graph eagerly (Note [Refused graphs run eagerly]).
    from tests.fuzz.compare import Verdict, check

    outcome = check(
        _add_of_a_broadcast_column_of_itself, lambda: [torch.randn(2, 4)], [], mode=mode
    )
    if mode == "default":
        assert outcome.verdict is Verdict.MATCH, outcome.detail
    else:
        assert outcome.verdict is Verdict.REFUSED and "overlaps" in outcome.detail, outcome.detail


@pytest.mark.parametrize("mode", ["trace", "default"])
def test_in_place_add_between_distinct_rows_of_one_storage_compiles(mode):
    from tests.fuzz.compare import Verdict, check

    outcome = check(
        _add_of_another_row_of_itself,
        lambda: [torch.randn(3, 4)],
        [],
        write_outputs=True,
        mode=mode,
    )
    assert outcome.verdict is Verdict.MATCH, outcome.detail


def test_as_strided_past_a_view_of_an_intermediate_is_refused(caplog):
    # Note [as_strided past its input view]: eager's gradient stops at the inner view's elements;
    # a returned view of an intermediate is regenerated without that chain, so it is refused.
    def f(a0):
        v1 = (a0 * 1).narrow(0, 1, 1)
        return v1.as_strided((2,), (1,), 1)

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(aotc.UnsupportedError, match=r"output 0 .*as_strided reaching past"):
        aotc.compile(f, capture="trace")(x)
    f(x).sum().backward()  # eager: x.grad[2] is 0; the default mode runs this graph eagerly
    want, x.grad = x.grad, None
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="aotc.graphs"):
        aotc.compile(f)(x).sum().backward()
    assert any("runs this graph eagerly" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(x.grad, want)


def test_view_past_a_leaf_made_inside_is_refused():
    # fuzz campaign 2026-11-27, 21003: `v4 = v3.detach().requires_grad_()` shares v3's base's
    # memory in eager; aotc's leaf is a tensor of its own, so a view reaching past its elements
    # would read garbage. A view within them still compiles.
    def f(a0):
        v3 = (a0.double() ** 2).unbind(1)[0]
        v4 = v3.detach().requires_grad_()
        return v4.as_strided((2,), (1,), 1)

    def g(a0):
        v3 = (a0.double() ** 2).unbind(1)[0]
        return v3.detach().requires_grad_()[1:]

    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(aotc.UnsupportedError, match=r"output 0 is a view reaching past"):
        aotc.compile(f, capture="trace")(x)
    torch.testing.assert_close(aotc.compile(g, capture="trace")(x), g(x))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["trace", "triton"])
def test_no_grad_view_of_a_leaf_made_a_leaf_matches_eager(mode):
    """Fuzz seed 16082: the view is a leaf of its own although its base requires grad. (The
    default mode differs: Dynamo drops `requires_grad_()` on a tensor that already reports
    requires_grad, see tests/fuzz/test_known_differences.py.)"""
    from tests.fuzz.compare import Verdict, check

    outcome = check(
        _no_grad_view_of_a_leaf_made_a_leaf,
        lambda: [torch.randn((4,), requires_grad=True)],
        backward=[0, 2],
        write_outputs=True,
        mode=mode,
    )
    assert outcome.verdict is Verdict.MATCH, outcome.detail


def _write_outside_an_input_view(a0):
    a0.as_strided((2,), (1,), 1).mul_(2)  # elements 1 and 2 of the storage: not a0's
    return a0 * 1


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["trace", "default", "dynamo"])
def test_write_outside_an_input_view_is_refused_or_runs_eagerly(mode):
    """Fuzz seed 16893: eager writes storage elements the input view does not hold; aotc's
    graph writes back only its inputs. Strict mode and torch.compile refuse naming the op and
    the line; the default mode runs the graph eagerly and matches."""
    if mode == "dynamo":
        torch._dynamo.reset()
        compiled = torch.compile(_write_outside_an_input_view, backend="aotc")
    else:
        compiled = _compile(_write_outside_an_input_view, "dynamo" if mode == "default" else mode)
    for seed in (0, 1):
        torch.manual_seed(seed)
        base = torch.randn(3, 2, 4)
        want = base.clone()
        expected = _write_outside_an_input_view(want[:, 1])
        if mode == "default":
            torch.testing.assert_close(compiled(base[:, 1]), expected)
            torch.testing.assert_close(base, want)
            continue
        with pytest.raises(Exception, match="mul_.*writes elements of an input's storage") as e:
            compiled(base[:, 1])
        assert mode == "dynamo" or "a0.as_strided((2,), (1,), 1).mul_(2)" in str(e.value)


def _write_through_a_view_of_an_input_transposed_in_place(a0, a1):  # fuzz 2026-11-27, 18188
    v1 = a1.movedim(0, -1)
    a1.t_()  # Dynamo breaks the graph here: the next graph gets a1 (transposed) and v1
    v2 = torch.where(a1 > 0, a1, v1)
    v1.mul_(v2)  # written back into a1 with as_strided_scatter
    return (v2, a1 * 2)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", ["default", "dynamo"])
def test_write_through_a_view_of_an_input_transposed_in_place(mode):
    """The compiled forward crashed in `as_strided_scatter` (ATen's assert on a non-contiguous
    tensor that requires grad, Note [as_strided_scatter of a tensor with grad]); with that fixed,
    the gradient of the multiplier was the written values (Note in `_keep_strides`). Strict mode
    refuses the program (a view replayed on the transposed input: a joint-trace failure)."""
    from tests.fuzz.compare import Verdict, check

    outcome = check(
        _write_through_a_view_of_an_input_transposed_in_place,
        lambda: [
            torch.randn((3, 1, 2), requires_grad=True) * 1.0,
            torch.randn((3, 4), requires_grad=True) * 1.0,
        ],
        backward=[0, 1],
        write_outputs=True,
        mode=mode,
    )
    assert outcome.verdict is Verdict.MATCH, outcome.detail


@pytest.mark.parametrize("offset", [1])
def test_as_strided_of_a_written_input_view_is_refused(offset):
    # fuzz campaign 2026-11-27, 21673: after `a1.add_(a1)` on a view at storage offset 16, the
    # functional graph replays `a1.as_strided(..., 1)` on the written value (the view's own
    # elements): it read the wrong elements. Refused in strict mode; the default mode runs the
    # graph eagerly. An input at offset 0 compiles. (Offset 17, inside the view, still fails at
    # the call with setStorage's error: docs/status.md.)
    def f(a1):
        a1.add_(a1)
        return a1.as_strided((2,), (1,), offset).sum()

    def make(row: int) -> torch.Tensor:
        return (torch.randn(3, 2, 4, requires_grad=True) * 1.0)[row]

    with pytest.raises(aotc.UnsupportedError, match=r"as_strided.*no input holds"):
        aotc.compile(f, capture="trace")(make(2))
    torch.manual_seed(0)
    want = f(make(2))
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch.testing.assert_close(aotc.compile(f)(make(2)), want)
    if offset == 1:
        torch.manual_seed(1)
        want = f(make(0))
        torch.manual_seed(1)
        torch.testing.assert_close(aotc.compile(f, capture="trace")(make(0)), want)


def _masked_fill_through_expands(a0, a1, a2, a3):
    v2 = a3.expand(2, *a3.shape)
    v3 = a3.detach().requires_grad_()  # a graph break in the default mode: v2 is a graph input
    v2.expand(2, *v2.shape).masked_fill_(v2.expand(2, *v2.shape) > 0, 2.0)
    return (v3,)


@pytest.mark.parametrize("mode", ["trace", "default", "default_inference", "trace_inference"])
def test_write_into_an_expanded_graph_input(mode):
    # fuzz campaign 2026-11-27, 25586: the default mode's second graph takes the expand `v2` as
    # an input and writes it; the copy-back into a destination whose elements share memory
    # failed (copy_ refuses it), and through the wrong alias it wrote stale values.
    from tests.fuzz.compare import Verdict, check

    def make():
        x1 = torch.randn((3, 2, 4), requires_grad=True) * 1.0
        return [torch.randn((1, 3)), x1[:, 1], x1.view(-1), x1[2]]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # masked_fill_ on an expanded tensor is deprecated
        outcome = check(_masked_fill_through_expands, make, backward=[0], mode=mode)
    assert outcome.verdict is Verdict.MATCH, outcome.detail


def _enable_grad_inside(a0, a1, a2):
    with torch.enable_grad():
        v1 = a2 * a2
    return (v1,)


@pytest.mark.parametrize("mode", ["default_inference", "trace_inference", "default", "trace"])
def test_enable_grad_inside_a_call_under_inference_mode(mode):
    # fuzz campaign 2026-11-27, 25705: Dynamo compiles with inference mode off, so the graph's
    # entry records autograd inside `enable_grad`; under inference mode eager records nothing,
    # and aotc's autograd node failed to save the inference tensors.
    from tests.fuzz.compare import Verdict, check

    def make():
        return [
            torch.randn((3, 4), requires_grad=True),
            torch.randn((1, 3), requires_grad=True),
            torch.randn((2, 3, 4), dtype=torch.float64, requires_grad=True),
        ]

    outcome = check(_enable_grad_inside, make, backward=[0], mode=mode)
    assert outcome.verdict is Verdict.MATCH, outcome.detail


def _new_leaf_beside_a_written_output(a0, a1, a2):
    v0 = a2.exp()
    v1 = a2**2
    v4 = v1.detach().requires_grad_()
    v0.relu_()
    return (v4**2,)


@pytest.mark.parametrize("mode", ["default", "trace"])
def test_backward_that_reaches_a_node_without_gradient_reads_nothing_it_saved(mode):
    # fuzz campaign 2026-11-27, 26283: the default mode's second graph (after the graph break at
    # `requires_grad_()`) takes v0, the first graph's output, and writes it; the loss uses only
    # v4 ** 2. The engine reaches the first graph's node through the second's edge with no
    # gradient; it materialized zeros and unpacked the written saved value (eager's node is never
    # run). A node whose one output got no gradient now returns at once.
    from tests.fuzz.compare import Verdict, check

    def make():
        x0 = torch.randn((3, 2, 4), requires_grad=True)
        return [x0[2], x0[0], torch.randn((1, 3), requires_grad=True)]

    outcome = check(_new_leaf_beside_a_written_output, make, backward=[0], mode=mode)
    assert outcome.verdict is Verdict.MATCH, outcome.detail


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_input_written_after_the_call_when_only_a_dead_value_saved_it(capture):
    # Session 13: `a.amax(0)` saves `a` and its own output; the metadata pass held that node
    # alive (its saved-value hooks kept the output, whose node holds them), so the compiled
    # backward refused a write to `a` after the call that eager's backward never meets.
    def f(a, b):
        a.amax(0)
        return b * 2

    compiled = aotc.compile(f, capture=capture)
    for fn in (f, compiled):
        a = torch.randn(3, 4, requires_grad=True) * 1.0
        b = torch.randn(3, requires_grad=True)
        out = fn(a, b)
        with torch.no_grad():
            a.add_(1)
        out.sum().backward()
        torch.testing.assert_close(b.grad, torch.full((3,), 2.0))
