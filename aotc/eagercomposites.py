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
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch._decomp.decompositions as decompositions
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._dispatch.python import no_python_dispatcher

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


# Note [Dropout between the layers of an RNN]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under the Python dispatcher, `aten.lstm`, `gru`, `rnn_tanh` and `rnn_relu` run torch's Python
# kernels (torch/_decomp), whose multi-layer loop never applies the dropout between layers: it
# sets the probability to 0 unless `num_layers < i - 1`, which no layer index satisfies (torch
# 2.13). Eager's C++ composite applies `dropout(output, p, train=True)` to every layer's output but
# the last. A strict-mode trace of `nn.LSTM(..., num_layers=2, dropout=0.5)` therefore trained
# without dropout: outputs and gradients far from eager's, silently. (The default mode is not
# affected: Dynamo does not capture RNN modules unless `allow_rnn` is set.) Here a multi-layer
# call with dropout runs torch's kernel one layer at a time, with eager's dropout (the kernel
# above) between layers, drawing in eager's order. The per-layer math is torch's kernel's; the C++
# composite's cannot run on symbolic sizes.


def _layered(kernel: Any, first: int) -> Any:
    """`kernel` (torch's Python kernel of an RNN op) with eager's dropout between layers.
    `first`: the index of `hx` in the op's arguments (0 for `.input`, 1 for `.data`, which
    takes `batch_sizes` after the data)."""

    def run(*args: Any) -> Any:
        hx, params, has_biases, num_layers, p, train, bidirectional = args[first + 1 : first + 8]
        if p == 0 or not train or num_layers == 1:
            return kernel(*args)
        directions = 2 if bidirectional else 1
        per_layer = len(params) // num_layers
        x: Any = args[0]
        finals: list[Any] = []
        for layer in range(num_layers):
            rows = slice(layer * directions, (layer + 1) * directions)
            layer_hx = [h[rows] for h in hx] if isinstance(hx, (list, tuple)) else hx[rows]
            layer_params = params[layer * per_layer : (layer + 1) * per_layer]
            out = kernel(
                x,
                *args[1 : first + 1],  # batch_sizes of `.data`
                layer_hx,
                layer_params,
                has_biases,
                1,
                0.0,
                train,
                *args[first + 7 :],  # bidirectional (and batch_first of `.input`)
            )
            x, finals = out[0], [*finals, out[1:]]
            if layer < num_layers - 1:
                x = aten.dropout.default(x, p, True)
        return (x, *(torch.cat([f[k] for f in finals]) for k in range(len(finals[0]))))

    return run


def _rnn_patches() -> list[SharedPatch]:
    patches = []
    for name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
        packet = getattr(aten, name)
        for overload, first in (("input", 0), ("data", 1)):
            op = getattr(packet, overload)
            kernel = op.py_kernels.get(DispatchKey.CompositeImplicitAutograd)
            if kernel is None:
                continue
            fixed = _layered(kernel, first)
            keys = {DispatchKey.CompositeImplicitAutograd: fixed}
            if DispatchKey.Autograd in op.py_kernels:
                keys[DispatchKey.Autograd] = fixed
            patches.append(SharedPatch(op.py_kernels, keys, after=op._dispatch_cache.clear))
    return patches


_RNN_PATCHES = _rnn_patches()


# Note [Final states of torch 2.11's LSTM layer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch 2.11's Python kernel of one LSTM layer (`one_layer_lstm` in torch/_decomp, the one the
# `aten.lstm` kernel picks without oneDNN, as in every training trace: Note [LSTM layers in a
# training trace] in aotc/tracer.py) returns the final states as `hx.squeeze(1)` of a
# [1, batch, hidden] tensor: for a batch of two or more they keep the leading 1, and `h_n` came
# out [layers, 1, batch, hidden] against eager's [layers, batch, hidden] (the metadata pass
# refused the program, or its backward failed to broadcast). torch 2.13's kernel squeezes dim 0.
# The layer here calls torch's and drops that leading dim where it is left, so it is a no-op on
# torch 2.13.


def _one_layer_lstm(
    inp: Any, hidden: Any, params: Any, has_biases: Any, reverse: Any = False
) -> Any:
    """torch's `one_layer_lstm` with the final states in eager's shape (Note [Final states of
    torch 2.11's LSTM layer])."""
    out, (hx, cx) = _LSTM_LAYER.saved["one_layer_lstm"](inp, hidden, params, has_biases, reverse)
    if hx.dim() > hidden[0].dim():
        hx, cx = hx.squeeze(0), cx.squeeze(0)
    return out, (hx, cx)


_LSTM_LAYER = SharedPatch(decompositions, {"one_layer_lstm": _one_layer_lstm})


# Note [Eager's interpolation kernels in the trace]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under the Python dispatcher, `F.interpolate`'s linear, bilinear, bicubic and trilinear modes
# (the `upsample_*.vec` overloads) run torch's Python kernels, which compute the interpolation in
# pointwise arithmetic and index ops; eager's C++ composite calls the op's own kernel
# (`upsample_bilinear2d.default`) and its backward kernel. The results differ in rounding
# (bilinear with align_corners: gradients 7e-4 apart on a 1x4x8x8 input). The kernels here (for
# `.vec` and for the `.default` overloads, whose Python kernel sits at the Autograd key) call the
# op with the Python dispatcher off, so eager's C++ composite and autograd kernel run and the
# graph holds eager's ops and backward ops. With symbolic sizes torch's Python kernel runs:
# eager's composite computes the output size with concrete ints, which would specialize the
# trace on the input's size (a recompile per size under dynamic=True). So do graphs that go to
# generated kernels (`fusing`): the Python kernels' arithmetic fuses into them, and a fused
# kernel does not round as eager's does anyway.
_INTERPOLATIONS = (
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_bicubic2d",
    "upsample_trilinear3d",
    "_upsample_bilinear2d_aa",
    "_upsample_bicubic2d_aa",
)


_FUSING = threading.local()


@contextlib.contextmanager
def fusing(fused: bool) -> Iterator[None]:
    """Whether the graphs this thread traces go to generated kernels (Triton): interpolation then
    keeps torch's Python kernels, whose arithmetic fuses (fused kernels round as they do anyway)."""
    before = getattr(_FUSING, "on", False)
    _FUSING.on = fused
    try:
        yield
    finally:
        _FUSING.on = before


def _eager_composite(kernel: Any, op: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        from aotc.symkey import is_symbolic  # (aotc.symkey imports aotc.functional)

        if getattr(_FUSING, "on", False) or is_symbolic(pytree.tree_leaves((args, kwargs))):
            return kernel(*args, **kwargs)
        with no_python_dispatcher():  # eager's C++ composite and autograd kernel
            return op(*args, **kwargs)

    return run


def _interpolation_patches() -> list[SharedPatch]:
    patches = []
    for name in _INTERPOLATIONS:
        for overload in ("vec", "default"):
            op = getattr(getattr(aten, name, None), overload, None)
            if op is None:
                continue
            keys = {
                key: _eager_composite(op.py_kernels[key], op)
                for key in (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)
                if key in op.py_kernels
            }
            if keys:
                patches.append(SharedPatch(op.py_kernels, keys, after=op._dispatch_cache.clear))
    return patches


_INTERPOLATION_PATCHES = _interpolation_patches()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Eager's dropout (Note [Eager's own dropout in the trace]), dropout between RNN layers
    (Note [Dropout between the layers of an RNN]), LSTM layers' final states (Note [Final states
    of torch 2.11's LSTM layer]) and interpolation kernels (Note [Eager's interpolation kernels
    in the trace]) under the Python dispatcher while held."""
    with contextlib.ExitStack() as stack:
        for patch in (_PATCH, *_RNN_PATCHES, _LSTM_LAYER, *_INTERPOLATION_PATCHES):
            stack.enter_context(patch.held())
        yield
