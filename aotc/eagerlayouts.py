"""Eager's output layouts for CPU kernels whose fake-tensor strides differ from eager's.

Stage: `held()`, around each compilation (aotc/pipeline.py `compile_signature`): while held,
fake tensors give these kernels' results the strides eager's CPU kernels give them.
Requires: torch's fake tensors take these ops' strides from `torch._decomp.decomposition_table`
(checked by tests/e2e/test_eager_kernels.py for each rule and layout).
Ensures: an aotc trace sees, for each op of `_RULES` on CPU, the layout eager's kernel produces.

Note [Eager's layouts of normalization kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Fake tensors compute the results of batch norm (forward and backward), the backward of layer
norm and group norm, and `_log_softmax_backward_data` with torch's Python decompositions, whose
elementwise arithmetic keeps the input's layout. Eager's CPU kernels allocate those results
contiguous, or in the input's suggested memory format (channels-last when the input is): for a
batch norm over `x.transpose(1, 2)` (a BatchNorm1d on (batch, length, channels) data) eager's
output has strides (C*L, L, 1) where the trace saw (C*L, 1, C). The trace decides views by the
strides it sees, so the compiled backward held a `view` of the real result that the real strides
do not allow ("view size is not compatible with input tensor's size and stride", where eager
runs; AOTAutograd's graphs fail the same way), and outputs came back with other strides than
eager's.

So while aotc compiles, the decomposition table's entries for these ops return their result in
eager's layout: the decomposition's values, `contiguous(memory_format=...)` when its strides
differ (fake tensors only: no op is added to any graph, since fake tensors run the table below
the tracer). Only CPU results are changed: the rules were read off the CPU kernels and checked
against them; CUDA kernels keep the fake strides they had. The replacements carry the
originals' module and name, which fake tensors check before they use a table entry, and the
fake-tensor dispatch cache forgets these ops' results (only theirs: clearing it all made cold
compiles 1.5-2x slower) when they are installed and removed, so no result cached with the
other strides is reused. Caches a ShapeEnv keeps for symbolic sizes are not reached.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._prims_common import (
    compute_elementwise_output_strides,
    is_non_overlapping_and_dense_or_false,
    suggest_memory_format,
)

from aotc.sharedpatch import SharedPatch

aten = torch.ops.aten

_SUGGESTED = "suggested"  # contiguous in the format input.suggest_memory_format() names
_CONTIGUOUS = "contiguous"
_ITERATOR = "iterator"  # TensorIterator's layout over the arguments, in the kernel's order
_LIKE = "like"  # empty_like(argument): its layout when dense

# op -> (the arguments whose layouts eager's kernel follows, the rule for result 0)
_RULES: dict[Any, tuple[tuple[int, ...], str]] = {
    aten.native_batch_norm.default: ((0,), _SUGGESTED),
    aten._native_batch_norm_legit.default: ((0,), _SUGGESTED),
    aten._native_batch_norm_legit.no_stats: ((0,), _SUGGESTED),
    aten._native_batch_norm_legit_functional.default: ((0,), _SUGGESTED),
    aten._native_batch_norm_legit_no_training.default: ((0,), _SUGGESTED),
    aten.native_batch_norm_backward.default: ((1,), _SUGGESTED),
    aten.native_layer_norm_backward.default: ((1,), _CONTIGUOUS),
    aten.native_group_norm_backward.default: ((1,), _SUGGESTED),
    aten._log_softmax_backward_data.default: ((0,), _CONTIGUOUS),
    # activations' backward: (grad_output, self or result)
    aten.elu_backward.default: ((0, 5), _ITERATOR),
    aten.hardswish_backward.default: ((0, 1), _ITERATOR),
    aten.hardsigmoid_backward.default: ((0, 1), _ITERATOR),
    aten.hardtanh_backward.default: ((0, 1), _ITERATOR),
    aten.softplus_backward.default: ((0, 1), _ITERATOR),
    aten.logit_backward.default: ((0, 1), _ITERATOR),
    # losses' backward: a gradient of self's shape
    aten.mse_loss_backward.default: ((1,), _CONTIGUOUS),
    aten.smooth_l1_loss_backward.default: ((1,), _CONTIGUOUS),
    aten.huber_loss_backward.default: ((1,), _CONTIGUOUS),
    aten.binary_cross_entropy_backward.default: ((1,), _LIKE),
}


def _strides(rule: str, args: list[torch.Tensor]) -> tuple[int, ...] | None:
    """The strides eager's CPU kernel gives its result under an `_ITERATOR` or `_LIKE` rule
    (None: not known, the decomposition's are kept)."""
    first = args[0]
    if rule == _ITERATOR:
        if any(a.shape != first.shape for a in args):
            return None  # broadcasting: left to the decomposition
        return tuple(compute_elementwise_output_strides(*args))
    if not is_non_overlapping_and_dense_or_false(first):
        return None
    return tuple(first.stride())


def _in_eager_layout(out: torch.Tensor, like: list[torch.Tensor], rule: str) -> torch.Tensor:
    if out.device.type != "cpu" or out.layout is not torch.strided or out.shape != like[0].shape:
        return out
    if rule in (_SUGGESTED, _CONTIGUOUS):
        fmt = suggest_memory_format(like[0]) if rule == _SUGGESTED else torch.contiguous_format
        return out if out.is_contiguous(memory_format=fmt) else out.contiguous(memory_format=fmt)
    strides = _strides(rule, like)
    if strides is None or tuple(out.stride()) == strides:
        return out
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device).copy_(out)


def _replacement(
    original: Callable[..., Any], positions: tuple[int, ...], rule: str
) -> Callable[..., Any]:
    @functools.wraps(original)  # fake tensors use an entry whose module and name are torch's
    def kernel(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        like = [args[i] for i in positions if i < len(args)]
        if len(like) != len(positions) or not all(isinstance(t, torch.Tensor) for t in like):
            return result
        if isinstance(result, torch.Tensor):
            return _in_eager_layout(result, like, rule)
        if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
            first = _in_eager_layout(result[0], like, rule)
            if first is result[0]:
                return result
            items = (first, *result[1:])
            return type(result)(*items) if hasattr(result, "_fields") else type(result)(items)
        return result

    kernel.__module__ = original.__module__
    return kernel


def _patch() -> SharedPatch | None:
    from torch._decomp import decomposition_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    replacements = {
        op: _replacement(decomposition_table[op], positions, rule)
        for op, (positions, rule) in _RULES.items()
        if op in decomposition_table
    }
    if not replacements:
        return None
    ops = frozenset(replacements)

    def forget_results() -> None:
        # only these ops' entries: clearing the whole cache made every compile's fake runs, and
        # the user's other compiles, start cold (cold compiles 1.5-2x slower)
        cache = FakeTensorMode.cache
        for key in [k for k in cache if k.key and k.key[0] in ops]:
            cache.pop(key, None)

    return SharedPatch(decomposition_table, replacements, after=forget_results)


_PATCH = _patch()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """See Note [Eager's layouts of normalization kernels]."""
    with _PATCH.held() if _PATCH is not None else contextlib.nullcontext():
        yield


__all__ = ["held"]
