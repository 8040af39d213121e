"""Guards: the key under which one compiled signature is cached.

Hot path: `signature_key(leaves)` runs on every call. It must change whenever any property the
compiled graphs were specialized on changes; see Note [What a signature covers].

Note [What a signature covers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Per tensor leaf: dtype, device, shape, strides, requires_grad, and whether it is a leaf (eager
refuses some in-place ops on leaves). Per non-tensor leaf: its type and value (the graph bakes
constants in). Per call: grad mode, autocast state, and the aliasing pattern: which leaves are the
same object and which share storage. Only when some leaves share storage (rare) does the key also
cover their storage offsets and their common base's geometry, which synthetic bases and
alias regeneration depend on. The tree structure of the arguments is covered by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


def signature_key(leaves: Sequence[object]) -> tuple[object, ...]:
    parts: list[object] = []
    ptrs: list[int] = []
    for t in leaves:
        if isinstance(t, Tensor):
            parts.append((t.dtype, t.device, t.shape, t.stride(), t.requires_grad, t.is_leaf))
            ptrs.append(t.untyped_storage().data_ptr())
        elif isinstance(t, slice):  # unhashable before Python 3.12
            parts.append((slice, t.start, t.stop, t.step))
        else:
            parts.append((type(t), t))
    pattern = _alias_pattern(leaves, ptrs) if len(set(ptrs)) != len(ptrs) else None
    autocast = _autocast_state() if torch._C._is_any_autocast_enabled() else None
    return (tuple(parts), pattern, torch.is_grad_enabled(), autocast)


def explain_bad_leaves(leaves: Sequence[object], names: Sequence[str]) -> str | None:
    """Why `signature_key` cannot key these leaves (off the hot path), or None."""
    for i, t in enumerate(leaves):
        name = names[i] if i < len(names) else f"argument {i}"
        if isinstance(t, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
            return (
                f"{name} is a tensor inside a torch.func transform (grad, vjp, jacrev, vmap); "
                "aotc-compiled functions run under regular autograd only. Call the compiled "
                "function outside the transform and differentiate with .backward() or "
                "torch.autograd.grad."
            )
        if isinstance(t, Tensor) and t.layout is not torch.strided:
            return (
                f"{name} is a {t.layout} tensor; aotc compiles dense (strided) tensors only. "
                "Convert it with .to_dense() before the call, or keep this op outside the "
                "compiled function."
            )
        if not isinstance(t, Tensor):
            try:
                hash(t)
            except TypeError:
                return (
                    f"{name} has unhashable type {type(t).__name__}; aotc specializes on "
                    "non-tensor arguments by value and must hash them. Pass it as a tensor, a "
                    "tuple, or a hashable value."
                )
    return None


def _autocast_state() -> tuple[object, ...]:
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )


def _alias_pattern(leaves: Sequence[object], ptrs: list[int]) -> tuple[object, ...]:
    tensors = [t for t in leaves if isinstance(t, Tensor)]
    first_id: dict[int, int] = {}
    first_ptr: dict[int, int] = {}
    first_root: dict[int, int] = {}
    pattern: list[object] = []
    for i, (t, ptr) in enumerate(zip(tensors, ptrs)):
        root = t._base if t._base is not None else t
        pattern.append(
            (
                first_id.setdefault(id(t), i),
                first_ptr.setdefault(ptr, i) if ptr else i,
                first_root.setdefault(id(root), i),
                t.storage_offset(),
                tuple(root.shape),
                root.stride(),
                root.storage_offset(),
            )
        )
    return tuple(pattern)
