"""Eager's composites: ops whose Python kernels under the Python dispatcher differ from eager.

`held()` is a context manager: while any thread holds it, `aten.dropout` runs, under the
Python dispatcher, a kernel that does what eager's C++ composite does. aotc's traces
turn the Python dispatcher on (aotc/functional.py: functionalization, symbolic runs).

Note [Eager's own dropout in the trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under the Python dispatcher, `aten.dropout` runs torch's Python kernel (torch/_decomp) instead of
its C++ composite, and the two differ in what a program can observe:
- With `train=False` or `p == 0`, eager returns the input itself. The Python kernel returns a
  clone. `y = F.dropout(x, training=False); y.mul_(2)` writes into `x` in eager. The metadata pass
  runs eager's kernel and saw an output that is the input, while the trace wrote into a clone.
  The call returned `x` unchanged, a silent wrong answer in both capture modes.
- On CPU with `0 < p < 1`, eager multiplies by a noise tensor of the input's dtype: the kept
  elements hold 1/(1-p) rounded to that dtype (1.109375 in bf16 for p = 0.1). Its backward
  multiplies the gradient by that noise. The Python kernel calls `native_dropout`, whose backward
  scales by the unrounded 1/(1-p). Under bf16 autocast, a Linear's bias gradient behind a dropout
  differed from eager's by up to 6e-2.
On CUDA eager calls `native_dropout` itself (its fused path), and so does the kernel here.

Running the C++ composite itself is not enough: its `noise.bernoulli_(1 - p)` is functionalized
into `bernoulli.p(noise)`, whose result is contiguous, so for a transposed input the draws landed
on other elements than eager's (fuzz seed 37). Which elements is the CPU kernel's business: on
AMD CPUs it fills memory in memory order, with MKL on Intel CPUs in logical order. `_dropout`
takes the draws from `native_dropout`'s mask, which that kernel fills the way it fills eager's
noise, and does eager's arithmetic on them. It uses functional ops only: traces under inference
mode are not functionalized, and an in-place op left in the graph broke its invariant (fuzz seed
39024).

The swap changes a dict that the op shares with every thread (`OpOverload.py_kernels`, plus the
dispatch cache built from it), through a `SharedPatch` (aotc/sharedpatch.py): the kernels come
back when the last holder leaves. Another thread's Python-dispatcher run meanwhile also gets eager's kernel.
"""

from __future__ import annotations

import contextlib

import torch
from torch._C import DispatchKey

from aotc.sharedpatch import SharedPatch

aten = torch.ops.aten

# Devices where eager's dropout calls `native_dropout` (ATen's `is_fused_kernel_acceptable`).
_FUSED_DEVICES = frozenset(("cuda", "xpu", "lazy", "privateuseone"))


def _dropout(input: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    """Eager's `dropout` (ATen's `dropout` and `_dropout_impl`), step for step."""
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not train or input.numel() == 0:
        return input
    if input.device.type in _FUSED_DEVICES and p < 1:
        return aten.native_dropout.default(input, p, train)[0]
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    # The draws: `native_dropout` makes its mask as eager makes its noise (an in-place
    # `bernoulli_` on a tensor of the input's layout), so its mask holds eager's draws in every
    # order the CPU kernel may take (memory order; logical order with MKL on Intel CPUs).
    # The arithmetic is eager's: noise of the input's dtype holding 1/(1-p).
    _, mask = aten.native_dropout.default(input, p, train)
    return input * mask.to(input.dtype).div(1 - p)


# See Note [Eager's own dropout in the trace]
_PATCH = SharedPatch(
    aten.dropout.default.py_kernels,
    {DispatchKey.CompositeImplicitAutograd: _dropout, DispatchKey.Autograd: _dropout},
    after=aten.dropout.default._dispatch_cache.clear,
)


def held() -> contextlib.AbstractContextManager[None]:
    """Eager's dropout under the Python dispatcher while held (Note [Eager's own dropout in the
    trace])."""
    return _PATCH.held()
