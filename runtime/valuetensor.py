"""`ValueTensor`: the value of a stored graph's node, as geometry without storage.

Records: `ValueTensor` (sizes, strides, storage offset, dtype and the real device; no data).
Ensures: running any op on one raises CacheError; the Triton lowering only reads geometry.
"""

from __future__ import annotations

import torch

from aotc.runtime.errors import CacheError


class ValueTensor(torch.Tensor):
    """A node value of a cached graph that the Triton lowering reads: sizes, strides, storage
    offset, dtype and the real device, and no storage. It runs no ops (the lowering only reads
    geometry); building one costs a fraction of a fake tensor, which made up most of a Triton
    hit's load."""

    # torch's stubs type Tensor.__torch_function__ as a 4-argument classmethod; this is the
    # documented way to disable it on a subclass.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(  # noqa: PYI034
        cls,
        size: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> ValueTensor:
        return torch.Tensor._make_wrapper_subclass(
            cls, size, strides, offset, dtype=dtype, device=device, requires_grad=False
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise CacheError(f"{func} ran on the value of a cached graph node (values hold no data)")


__all__ = ["ValueTensor"]
