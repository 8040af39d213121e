"""Guards: the key under which one compiled signature is cached.

Hot path: `signature_key(leaves)` keys a call; it must change whenever any property the compiled
graphs were specialized on changes (see Note [What a signature covers]). `signature_check(sig)`
generates, for one signature, a check equivalent to `signature_key(leaves) == sig` that builds no
key (see Note [Guard checks]): the dispatcher runs it first, for the entry it ran last.

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

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

# Dynamo's C tensor checks (Note [Tensor checks in C]); typed Any: torch's stub declares the
# per-tensor size lists flat, the class takes one list per tensor.
TensorGuards: Any
try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # a torch without Dynamo's C guards
    TensorGuards = None

Tensor = torch.Tensor


def signature_key(leaves: Sequence[object]) -> tuple[object, ...]:
    parts: list[object] = []
    ptrs: list[int] = []
    for t in leaves:
        if isinstance(t, Tensor):
            part: tuple[object, ...] = (
                t.dtype,
                t.device,
                t.shape,
                t.stride(),
                t.requires_grad,
                t.is_leaf,
            )
            if t.is_conj() or t.is_neg():  # See Note [Conjugate and negative bits]
                part += (t.is_conj(), t.is_neg())
            parts.append(part)
            ptrs.append(t.untyped_storage().data_ptr())
        elif isinstance(t, slice):  # unhashable before Python 3.12
            parts.append((slice, t.start, t.stop, t.step))
        else:
            parts.append((type(t), t))
    pattern = _alias_pattern(leaves, ptrs) if len(set(ptrs)) != len(ptrs) else None
    autocast = _autocast_state() if torch._C._is_any_autocast_enabled() else None
    return (tuple(parts), pattern, torch.is_grad_enabled(), autocast)


# Note [Conjugate and negative bits]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `b.conj()` and `z.conj().imag` are views with a lazy conjugate or negative bit: their values
# read as conjugated (negated), and ops such as `resolve_conj`, `view_as_real` and `.real`
# behave differently on them. A graph traced on a plain tensor folds `resolve_conj()` away, so it
# must not run on a conjugate view, nor one traced on a view on a plain tensor. A tensor with
# either bit keys with two more fields (the bits), so its key differs from a plain tensor's, and
# such signatures get no generated check (the key path handles them, as for shared storage). The
# checks of signatures of plain tensors refuse tensors with a bit: the C tensor check compares
# their dispatch keys (Conjugate, Negative), and the Python conditions read the bits of complex
# leaves (a real tensor gets the negative bit only as `.imag` of a conjugate view).


# Note [Guard checks]
# ~~~~~~~~~~~~~~~~~~~
# Building the key of a call reads every property of every leaf into fresh tuples, hashes them
# and compares them with the stored key: ~40% of the per-call cost of a tiny training step (2
# tensors). A training loop calls one signature over and over, so the dispatcher first asks the
# entry it ran last "is this call yours?", with straight-line code generated from that entry's
# signature, every expected value a constant:
#
#     def check(leaves):
#         if len(leaves) != 2: return False
#         l0, l1 = leaves
#         return (isinstance(l0, Tensor) and l0.dtype is c0_dtype and l0.device == c0_device
#                 and l0.shape == c0_shape and l0.stride() == c0_stride
#                 and l0.requires_grad is True and l0.is_leaf is True
#                 and isinstance(l1, Tensor) and ... and l1.is_leaf is True
#                 and l0.untyped_storage().data_ptr() != l1.untyped_storage().data_ptr()
#                 and grad_enabled() is True and not any_autocast()
#                 and not functorch_active())
#
# The last condition is not in the key: a passing check also tells the dispatcher that the
# entry's generated call may skip its own autocast and functorch checks (Note [Calls after a
# guard hit] in runtime/fastpath.py); under a transform the key path runs the checked call.
# It compares exactly the fields `signature_key` puts in the key, with the same equality (`is`
# for singletons and bools, `==` for the rest; non-tensor leaves as the same `(type, value)`
# tuple), so it is True iff the key would equal the signature: no guard is dropped. Signatures
# with shared storage among the leaves, or autocast on, get no check (the key path handles them).
# tests/runtime/test_guard_matrix.py checks check == (key == signature) over many changes.


def signature_check(signature: tuple[Any, ...]) -> Callable[[Sequence[object]], bool] | None:
    """`leaves -> signature_key(leaves) == signature`, generated (see Note [Guard checks]);
    None when the signature has shared storage or autocast state."""
    found = _signature_conditions(signature, 0)
    if found is None:
        return None
    n, conds, namespace = found
    lines = ["def check(leaves):", f"    if len(leaves) != {n}:", "        return False"]
    if n:
        lines.append(f"    {', '.join(f'l{i}' for i in range(n))}, = leaves")
    lines.append("    return (\n        " + "\n        and ".join(conds) + "\n    )")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<aotc guard check>", "exec"), namespace)  # noqa: S102
    check = namespace["check"]
    check.__aotc_source__ = source  # type: ignore[attr-defined]
    return check  # type: ignore[return-value]


def _signature_conditions(
    signature: tuple[Any, ...],
    exact: int,
    tensor_check: tuple[Callable[..., bool], tuple[int, ...]] | None = None,
) -> tuple[int, list[str], dict[str, object]] | None:
    """(number of leaves, the conditions on l0, l1, ... that hold iff the key of the leaves
    equals `signature`, their names), or None (shared storage, autocast). The first `exact`
    leaves are checked to be exactly `torch.Tensor` rather than an instance of it (callers that
    know the call's key requires so, see Note [Fused guard and call]); `tensor_check`, when
    given, checks those leaves' type, dtype, device, shape, strides and requires_grad in one C
    call (Note [Tensor checks in C]), with the positions of the leaves it takes."""
    parts, pattern, grad_enabled, autocast = signature
    if pattern is not None or autocast is not None:
        return None
    n = len(parts)
    namespace: dict[str, object] = {
        "Tensor": Tensor,
        "grad_enabled": torch.is_grad_enabled,
        "any_autocast": torch._C._is_any_autocast_enabled,
        "functorch_active": torch._C._are_functorch_transforms_active,
    }
    conds: list[str] = []
    tensors: list[str] = []
    checked: tuple[int, ...] = ()
    if tensor_check is not None:
        namespace["tensor_check"], checked = tensor_check
        conds.append(f"tensor_check({''.join(f'l{i}, ' for i in checked)})")
    for i, part in enumerate(parts):
        leaf = f"l{i}"
        if len(part) == 6 and isinstance(part[0], torch.dtype):
            dtype, device, shape, stride, requires_grad, is_leaf = part
            tensors.append(leaf)
            if i in checked:
                # The C check proves requires_grad, and a tensor that does not require grad is
                # always a leaf (it has no grad_fn): only the others' leafness is read.
                if requires_grad or not is_leaf:
                    conds.append(f"{leaf}.is_leaf is {bool(is_leaf)}")
                continue
            namespace[f"c{i}_dtype"], namespace[f"c{i}_device"] = dtype, device
            namespace[f"c{i}_shape"], namespace[f"c{i}_stride"] = shape, stride
            conds += [
                f"type({leaf}) is Tensor" if i < exact else f"isinstance({leaf}, Tensor)",
                f"{leaf}.dtype is c{i}_dtype",
                f"{leaf}.device == c{i}_device",
                f"{leaf}.shape == c{i}_shape",
                f"{leaf}.stride() == c{i}_stride",
                f"{leaf}.requires_grad is {bool(requires_grad)}",
                f"{leaf}.is_leaf is {bool(is_leaf)}",
            ]
            if dtype.is_complex:  # Note [Conjugate and negative bits]
                conds += [f"not {leaf}.is_conj()", f"not {leaf}.is_neg()"]
        elif i < exact:  # a plain-tensor call cannot have this leaf
            conds.append("False")
        elif part[0] is slice:
            namespace[f"c{i}"] = part
            conds.append(
                f"type({leaf}) is slice and (slice, {leaf}.start, {leaf}.stop, {leaf}.step) == c{i}"
            )
        else:
            namespace[f"c{i}"] = part
            conds.append(f"not isinstance({leaf}, Tensor) and (type({leaf}), {leaf}) == c{i}")
    if len(tensors) == 2:  # the two tensor leaves share no storage (an empty one counts as 0)
        a, b = (f"{t}.untyped_storage().data_ptr()" for t in tensors)
        conds.append(f"{a} != {b}")
    elif len(tensors) > 2:  # no two tensor leaves share storage
        ptrs = ", ".join(f"{t}.untyped_storage().data_ptr()" for t in tensors)
        conds.append(f"len({{{ptrs}}}) == {len(tensors)}")
    conds.append(f"grad_enabled() is {bool(grad_enabled)}")
    conds.append("not any_autocast()")
    if not checked:
        # Note [Calls after a guard hit] in fastpath.py. The C check compares each tensor's
        # dispatch keys with the thread's included ones, which a functorch transform extends
        # (its DynamicLayer keys): it fails under a transform, so it stands for this read.
        conds.append("not functorch_active()")
    return n, conds, namespace


# Note [Tensor checks in C]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# In a probe, the five Python conditions per tensor (dtype, device, shape, strides,
# requires_grad) each read a property into a fresh Python object: on the tiny training step of
# bench/overhead.py (two tensors) they were ~3,500 of its ~217,000 instructions (callgrind). Dynamo keeps the same checks
# in C++: `torch._C._dynamo.guards.TensorGuards`, built from example tensors and the expected
# sizes and strides, checks a tuple of tensors' exact Python type, dispatch keys (device type,
# and the conjugate/negative bits and layouts the key does not even hold), dtype, device index,
# requires_grad, sizes and strides in one call. So a probe built from a call whose tensor leaves
# are all plain tensors or Parameters (a module's weights and buffers, lifted) checks them with
# one TensorGuards built from that call, and keeps only `is_leaf` in Python. It checks at least
# what the key covers (it compares exact types where the key asks `isinstance`), so a passing
# check still proves the key; it also fails where the key would not (a conjugate view, a plain
# tensor where the probe saw a Parameter, or a call under a dispatch mode whose keys the thread
# adds, which the check compares): such calls take the key path, as any probe miss does. On the
# conv net of bench/partition.py (12 tensor leaves) the check is 1.2 us against 6.5 us for the
# Python conditions, and more in a training step, where the kernels between two calls leave the
# caches cold. Tensor leaves of other types (subclasses) keep their Python conditions. The
# check is built only in a call with no dispatch mode or functorch transform active (it keeps
# the thread's dispatch keys of the call that built it), and only if it passes on the leaves
# that made the probe and rejects a changed copy of them; otherwise (or if this torch has no
# such class) the Python conditions stay.
# tests/runtime/test_guard_check.py compares the probe with key equality over many changes.


def _tensor_check(
    signature: tuple[Any, ...], leaves: Sequence[object], exact: int
) -> tuple[Callable[..., bool], tuple[int, ...]] | None:
    """A C check of the tensor leaves of `leaves` (a call with key part `signature`), see Note
    [Tensor checks in C]: (the check, the positions of the leaves it takes), or None where it
    cannot be built or does not behave. The first `exact` leaves must be plain tensors; of the
    others, plain tensors and Parameters are checked."""
    if TensorGuards is None or len(leaves) != len(signature[0]):
        return None
    if torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active():
        return None  # the check would keep this call's dispatch keys: build it in a plain call
    parts = signature[0]
    if any(type(leaves[i]) is not Tensor for i in range(exact)):
        return None
    # Tensor leaves of other types (subclasses) keep their Python conditions.
    at = tuple(
        i
        for i, p in enumerate(parts)
        if len(p) == 6 and isinstance(p[0], torch.dtype) and type(leaves[i]) in _C_CHECKED
    )
    if not at:
        return None
    tensors = [cast(Tensor, leaves[i]) for i in at]
    try:
        sizes = [list(parts[i][2]) for i in at]
        strides = [list(parts[i][3]) for i in at]
        guards = TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        check = guards.check
        changed = [*tensors[:-1], tensors[-1].unsqueeze(0)]
        if check(*tensors) is not True or check(*changed) is not False:
            return None
    except Exception:  # an older or changed TensorGuards: keep the Python conditions
        return None
    return check, at


# The leaf types the C check takes: it compares a leaf's exact type with the type the probe was
# built from, so a Parameter leaf checks as a Parameter (a plain tensor there misses the probe).
_C_CHECKED = (Tensor, torch.nn.Parameter)


class _Miss:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISS"


# What a fused probe returns when the call is not its entry's (no call result is this object).
MISS: Any = _Miss()


# Note [Fused guard and call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# After a hit, the dispatchers used to run three generated functions in a row: the signature
# check (Note [Guard checks]), the entry's state guard (Note [Generated guard checks] in
# runtime/stateguard.py) and the entry's call after a hit (Note [Calls after a guard hit] in
# runtime/fastpath.py). Each is a Python frame, and on a tiny training step frames are most of
# what aotc adds to a hand-written autograd.Function. So the record the dispatcher keeps for the
# entry it ran last is one generated *probe*, the three bodies in one function:
#
#     def probe(leaves):
#         if len(leaves) != 2: return MISS
#         l0, l1, = leaves
#         try:
#             if not (<the signature check's conditions>): return MISS
#         except (RuntimeError, TypeError):   # e.g. a sparse leaf: the key path explains it
#             return MISS
#         try:
#             if r0() is not x0: return MISS  # the state guard's items
#             ...
#         except Exception:                   # a location that cannot be read any more
#             return MISS
#         d = apply(None, *leaves)            # the call after a hit
#         return d
#
# It returns MISS exactly when the check or the state guard would have failed (then the key path
# runs, as before) and otherwise what the entry returns; every condition of both guards is still
# evaluated, in the same order. An entry without a generated call (mutations, synthetic bases)
# ends the probe with `return hit(leaves)` instead.
# When the call's key part besides the signature is an int (the arity of a call whose arguments
# are all plain tensors, nothing lifted: aotc/api.py), the probe checks that each of those leaves
# is exactly a `torch.Tensor` (`type(l) is Tensor`, not isinstance): then a passing probe also
# proves the key's extra part, so `CompiledFunction.__call__` runs it on the argument tuple
# itself, before flattening anything (`plain_probe`).


def make_probe(
    signature: tuple[Any, ...],
    entry: Any,
    state: tuple[list[str], dict[str, object]] | None = None,
    exact: int = 0,
    leaves: Sequence[object] | None = None,
) -> Callable[[Sequence[object]], object] | None:
    """The fused guard and call of Note [Fused guard and call] for `entry` (a CompiledEntry)
    under `signature`, with the state guard's inline lines (`StateGuard.inline()`); None when
    the signature has no generated check. `leaves`: a call's leaves that have `signature`, for
    the C check of its tensor leaves (Note [Tensor checks in C])."""
    check = _tensor_check(signature, leaves, exact) if leaves is not None else None
    found = _signature_conditions(signature, exact, check)
    if found is None:
        return None
    n, conds, namespace = found
    namespace["MISS"] = MISS
    lines = ["def probe(leaves):", f"    if len(leaves) != {n}:", "        return MISS"]
    if n:
        lines.append(f"    {', '.join(f'l{i}' for i in range(n))}, = leaves")
    lines += [
        "    try:",
        "        if not (\n            " + "\n            and ".join(conds) + "\n        ):",
        "            return MISS",
        "    except (RuntimeError, TypeError):  # e.g. a sparse leaf: the key path explains it",
        "        return MISS",
    ]
    if state is not None and state[0]:
        state_lines, state_names = state
        clash = set(state_names) & set(namespace)
        assert not clash, f"state guard names clash with the signature check's: {clash}"
        namespace.update(state_names)
        lines += ["    try:", *state_lines, "    except Exception:", "        return MISS"]
    hit_body = getattr(entry.call, "aotc_hit_body", None)
    if hit_body is not None:
        body, names = hit_body
        clash = set(names) & set(namespace) - {"any_autocast", "functorch_active"}
        assert not clash, f"the call's names clash with the guards': {clash}"
        namespace.update(names)
        lines.append(body.rstrip("\n"))
    else:  # the general call takes a list
        namespace["hit"] = entry.hit
        lines.append("    return hit(leaves if type(leaves) is list else [*leaves])")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<aotc guard and call>", "exec"), namespace)  # noqa: S102
    probe = namespace["probe"]
    probe.__aotc_source__ = source  # type: ignore[attr-defined]
    return probe  # type: ignore[return-value]


def explain_bad_leaves(leaves: Sequence[object], names: Sequence[str]) -> str | None:
    """Why `signature_key` cannot key these leaves (off the hot path), or None."""
    for i, t in enumerate(leaves):
        name = names[i] if i < len(names) else f"argument {i}"
        if isinstance(t, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
            return (
                f"{name} is a tensor wrapped by a torch.func transform (grad, vjp, jacrev, vmap) "
                "that is no longer active: it escaped the transform (through a global, a closure "
                "or an attribute), and aotc cannot key it. Return what you need from the "
                "transformed function instead of keeping its inner tensors."
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


def remember_probe(
    probes: dict[tuple[object, ...], Callable[[Sequence[object]], object] | None],
    key: tuple[object, ...],
    entry: Any,
    state: Any = None,
    arity_extra: bool = False,
    leaves: Sequence[object] | None = None,
) -> tuple[object, Callable[[Sequence[object]], object]] | None:
    """The dispatchers' "last entry" record for `key` = (extra, signature): (extra, its fused
    probe), or None when the signature has no check (see Note [Fused guard and call]). `state`:
    the entry's StateGuard or None. `arity_extra`: an int extra is the number of leading leaves
    that are plain tensors (aotc/api.py's calls). Probes are generated once per (key, entry)
    into `probes` (the dispatcher keeps its entries alive, so their ids stay theirs)."""
    pkey = (key, id(entry))
    if pkey not in probes:
        extra = key[0]
        exact = extra if arity_extra and type(extra) is int else 0
        inline = state.inline() if state is not None else None
        probes[pkey] = make_probe(key[1], entry, inline, exact, leaves)  # type: ignore[arg-type]
    probe = probes[pkey]
    return (key[0], probe) if probe is not None else None
