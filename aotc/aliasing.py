"""Output aliasing: how each output of the user program relates to its inputs, to the other
outputs and to intermediates, exactly as eager sees it.

Stage helper of the metadata pass: `classify_outputs(outs, leaves) -> OutputAnalysis`.
Requires: `outs` and `leaves` are the outputs and the user leaves of the *plain* fake run (fake
tensors with eager's autograd: views know their `._base`, storages are shared as in eager).
Ensures: one `OutputInfo` per output; the intermediate bases and detached roots the runtime
regenerates outputs from, each named by how the joint trace reaches it from an output
(`ValueRef`), so the trace can return its functional value.

Note [Output aliasing]
~~~~~~~~~~~~~~~~~~~~~~
Every tensor output `o` has a *root*: `o._base` if it is a view, else `o` itself. Checked in this
order:
  1. `o` is a user input object                           -> IS_INPUT
  2. `o` is an earlier output object                      -> IS_OUTPUT
  3. `o` shares storage with an input, and its root is that input's root (the input itself or
     the input's own `._base`)                            -> ALIAS_OF_INPUT: regenerated as a view
     of the input it was derived from (found on its autograd graph; gradients then flow through
     that input's own history, as in eager), geometry relative to that input
  4. `o` shares storage with an input, root elsewhere     -> DETACHED (Note [Detached aliases])
  5. `o`'s storage is new: the outputs on that storage form a group with one *primary* root
     (preferring a returned root with history: `y` over `y.detach()`); the primary itself is
     FRESH (or, when it is not returned, an intermediate base); views of it are ALIAS_OF_OUTPUT /
     ALIAS_OF_INTERMEDIATE (regenerated off the base's graph value with their own autograd
     edge); other roots on the storage are DETACHED aliases of it.
Every view output also records whether eager tracked it (`view_without_grad`: made under
no_grad) and whether it came from a multi-output view op (`multi_output_view`: eager refuses
in-place writes to it; the regenerated view carries the same creation meta).

Note [Detached aliases]
~~~~~~~~~~~~~~~~~~~~~~~
`x.detach()` shares x's storage and version counter but is a new tensor: not a view (`_base` is
None), a leaf, no grad. Eager users rely on that: `out = f(w)` returning `w.detach()` may be
written in place even when w is a leaf that requires grad, and `w.detach().requires_grad_()` is a
new leaf whose gradients never reach `w`. A functional graph has no such objects, so the runtime
makes them per call (`DetachedRoot`): `source.detach()`, moved to the root's geometry without a
version bump, then, by `RootGrad`, left alone (NONE), made a new leaf (NEW_LEAF), or given the
history the call gave it (HISTORY: `d = x.detach(); d.mul_(w)`), by copying its graph value into
it with grad on, which writes the same values and links its autograd edge. Outputs that are the
root or views of it are built from that one object, so they share storage, version counter and
`._base` as in eager.

    def f(w):                  # w: leaf, requires grad
        v = w.detach().requires_grad_()
        return v.t()           # eager: w.grad stays None after backward

    root 0: detached alias of input 0 grad=new_leaf
    output 0: detached base=root0     (a view of root 0 with grad: backward stops at the root)

A leaf created inside (`torch.zeros(3, requires_grad=True)`, or a NEW_LEAF root) that other
outputs' gradients would accumulate into cannot be matched (the runtime's copy is a different
leaf from the one the graph used): that raises UnsupportedError.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

import torch
from torch.autograd.graph import get_gradient_edge
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef

from aotc.functional import ViewRecord, elements_within, geometry_of
from aotc.runtime.autograd import autograd_nodes
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.schema import Dim, Geometry, OutputInfo, OutputKind, RootGrad, UserArg, UserOut
from aotc.runtime.viewreplay import ViewOp

_MULTI_OUTPUT = torch._C._autograd.CreationMeta.MULTI_OUTPUT_NODE
_DEFAULT = torch._C._autograd.CreationMeta.DEFAULT
_IN_CUSTOM_FUNCTION = torch._C._autograd.CreationMeta.IN_CUSTOM_FUNCTION
# Heuristic: the autograd walk that finds which aliased input a view output came from stops
# after this many nodes (views of inputs sit a few nodes from the input).
_MAX_WALK = 2000


@dataclass(frozen=True, slots=True)
class ValueRef:
    """A tensor of the program's run reached from an output: `outs[out]`, or its `._base`."""

    out: UserOut
    via_base: bool

    def resolve(self, outs: list[object]) -> torch.Tensor:
        t = outs[self.out]
        assert isinstance(t, torch.Tensor)
        if self.via_base:
            assert t._base is not None
            return t._base
        return t


@dataclass(frozen=True, slots=True)
class RootRef:
    """A detached root before forward-output numbers exist (see `DetachedRoot`)."""

    source_arg: UserArg | None  # the input whose storage it shares, or
    source_out: UserOut | None  # the FRESH output that is its storage's primary, or
    source_base: int | None  # the intermediate base that is its storage's primary
    geometry: Geometry  # relative to the source's storage offset
    grad: RootGrad
    value: ValueRef  # where the root itself is (HISTORY: its value becomes a forward output)
    whole: bool = False  # the root has its source's own geometry (no as_strided_ needed)


@dataclass
class OutputAnalysis:
    infos: list[OutputInfo]  # len == num outputs; UserOut space
    bases: list[ValueRef]  # intermediate bases, by index
    roots: list[RootRef]  # detached roots, by index
    new_leaf_bases: list[int] = field(default_factory=list)  # bases that are new leaves


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _geometry(t: torch.Tensor, relative_to: torch.Tensor) -> Geometry:
    return Geometry(
        tuple(t.shape), tuple(t.stride()), t.storage_offset() - relative_to.storage_offset()
    )


# Note [Regenerated view nodes on fake tensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When a view's base changes in place after the view was taken (`w = v.view(-1)`, then
# `v.transpose_(0, 1)`), autograd regenerates the view's grad_fn the next time it is read. Eager's
# real tensors regenerate it with `as_strided` of the view's own geometry, which always works;
# fake tensors dispatch to Python, for which autograd replays the recorded view function on the
# changed base instead (`view(-1)` of a transposed base), and that can fail. The metadata pass
# reads such a view's node through `_grad_fn`: when the replay fails, eager's node (an
# AsStridedBackward0 whose only edge is the base's) is stood for by the base's node, which is
# what every question asked here (does it have history, what does a gradient from it reach)
# needs. The stale no_grad / multi-output view error is eager's own and is not caught here.


def _grad_fn(t: torch.Tensor) -> Any:
    """`t.grad_fn` as eager has it; see Note [Regenerated view nodes on fake tensors]."""
    try:
        return t.grad_fn
    except Exception:
        if t._base is None or torch._C._autograd._get_creation_meta(t) != _DEFAULT:
            raise
        return t._base.grad_fn


def _has_grad_fn(t: torch.Tensor) -> bool:
    try:
        return t.grad_fn is not None
    except RuntimeError:  # a stale no_grad view (see _view_flags)
        if t._base is not None and torch._C._autograd._get_creation_meta(t) == _DEFAULT:
            return t._base.requires_grad  # a failed replay: eager's node exists
        return False
    except Exception:  # a failed replay (Note [Regenerated view nodes on fake tensors])
        return t._base is not None and t._base.requires_grad


def _root_grad(t: torch.Tensor) -> RootGrad:
    if not t.requires_grad:
        return RootGrad.NONE
    return RootGrad.NEW_LEAF if t.grad_fn is None else RootGrad.HISTORY


class _ViewFlags(TypedDict, total=False):
    view_without_grad: bool
    multi_output_view: bool
    stale_view: bool
    new_leaf: bool


def _view_flags(o: torch.Tensor) -> _ViewFlags:
    if o._base is None:
        return {}
    try:
        grad_fn = _grad_fn(o)
    except RuntimeError as e:  # its base was written after it was made: reading grad_fn raises
        if torch._C._autograd._get_creation_meta(o) == _MULTI_OUTPUT:
            # eager's message tells whether the view had a node when it was made (`unbind` of a
            # tensor that did not require grad yet: "created in no_grad mode"; fuzz seed 24265)
            untracked = "created in no_grad mode" in str(e)
            return {"multi_output_view": True, "stale_view": True, "view_without_grad": untracked}
        return {"view_without_grad": True, "stale_view": True}
    return {
        "view_without_grad": grad_fn is None,
        "multi_output_view": o.requires_grad
        and torch._C._autograd._get_creation_meta(o) == _MULTI_OUTPUT,
        "new_leaf": grad_fn is None and _own_leaf(o),
    }


def _own_leaf(view: torch.Tensor) -> bool:
    """Whether `requires_grad_()` made this view without history a leaf of its own (gradients
    accumulate into it). Its `requires_grad` alone does not tell: a view also reports its base's
    (`v = x.view(-1)`, then `x.requires_grad_()`), and eager's backward then raises at `v`, which
    has no accumulator. A view made under no_grad of a base that requires grad, then
    `requires_grad_()`, is such a leaf (fuzz seed 16082); autograd's gradient edge tells them
    apart. The edge is read with grad mode on and inference mode off: `get_gradient_edge` finds
    the accumulator through a `view_as` node, which a call under `torch.inference_mode()` or
    no_grad does not record (a view of an input that requires grad, returned from such a call,
    raised AttributeError)."""
    base = view._base
    if not view.requires_grad or base is None:
        return False
    if not base.requires_grad:
        return True  # its own flag: nothing to inherit
    try:
        with torch.inference_mode(False), torch.enable_grad():
            return get_gradient_edge(view).node is not None
    except (RuntimeError, AssertionError):  # "Expected gradient function to be set"
        return False


# Note [Views a custom Function returns]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A custom autograd.Function whose forward returns a view of its input (`x.view_as(x)`, a
# gradient reversal layer) or the input itself gives a view of that input whose grad_fn is the
# Function's own node: its gradient goes through the Function's backward (the reversal), not
# through the view's. Regenerated outside the compiled node as a view of its base, like other
# aliased outputs, the output's gradient would skip that backward: the reversal silently lost.
# Such an output is therefore a FRESH graph output (the joint graph gives it its own gradient,
# through the Function's backward), and the epilogue makes it the view eager returned again: a
# small custom Function (`custom_view` in runtime/epilogue.py) takes the base (the input, or an
# earlier output) and the graph's value, returns the base's view at the recorded geometry, and
# sends the view's gradient to the graph's value. Autograd treats that view as it treats the
# custom Function's output in eager: it shares the base's storage and version counter, its
# gradient goes through the compiled backward (which holds the Function's backward), and an
# in-place change of it raises eager's "view created inside a custom Function" error. A view of a
# value the call does not return stays the graph's fresh tensor (its `_base` is not eager's).


def _custom_view(
    o: torch.Tensor,
    j: int,
    root: torch.Tensor,
    storage: StorageWeakRef,
    input_storage: dict[StorageWeakRef, list[UserArg]],
    leaves: list[object],
    primaries: dict[StorageWeakRef, tuple[torch.Tensor, ValueRef]],
) -> OutputInfo:
    """See Note [Views a custom Function returns]: a FRESH output the epilogue makes a view of
    its input or returned base again; a view of a value the call does not return stays a fresh
    tensor (only its `_base` differs from eager's)."""
    rg, dtype = o.requires_grad, o.dtype
    fresh = OutputInfo(OutputKind.FRESH, rg, dtype)
    if any(isinstance(d, torch.SymInt) for d in (*o.shape, *o.stride(), o.storage_offset())):
        return fresh
    if storage in input_storage:
        candidates = [a for a in input_storage[storage] if _root(leaves[a]) is root]  # type: ignore[arg-type]
        if not candidates:
            return fresh
        leaf = _view_source(o, candidates, leaves)
        base = leaves[leaf]
        assert isinstance(base, torch.Tensor)
        if base.dtype != o.dtype or not elements_within(o, base):
            return fresh
        return replace(fresh, base_arg=leaf, geometry=_geometry(o, base), custom_view=True)
    primary, where = primaries[storage]
    if root is not primary or o is primary or where.via_base or where.out >= j:
        return fresh
    if primary.dtype != o.dtype or not elements_within(o, primary):
        return fresh
    return replace(fresh, base_out=where.out, geometry=_geometry(o, primary), custom_view=True)


def _made_by_custom_function(o: torch.Tensor) -> bool:
    """`o`'s autograd node is a custom Function's (Note [Views a custom Function returns])."""
    # the view's creation record, inherited by views of it (`GradReverse.apply(x)[0]`, whose
    # own node is a select's), and read without regenerating a node
    # (an output marked non-differentiable requires grad and has no node: not one of these).
    # A Function returning several views (`return x[0], x[1]`) records them as a multi-output
    # node's, as unbind does: there the node itself tells.
    if not o.requires_grad or o._base is None or not _has_grad_fn(o):
        return False
    meta = torch._C._autograd._get_creation_meta(o)
    if meta == _IN_CUSTOM_FUNCTION:
        return True
    if meta != _MULTI_OUTPUT:
        return False
    try:
        return isinstance(_grad_fn(o), torch.autograd.function.BackwardCFunction)
    except Exception:  # a stale view (its base written since): left to the other kinds
        return False


def classify_outputs(
    outs: list[object],
    leaves: list[object],
    narrowed: Mapping[torch.Tensor, Any] | None = None,
    views: Mapping[int, ViewRecord] | None = None,
    reshaped: Mapping[int, Any] | None = None,
    view_versions: Mapping[int, int] | None = None,
) -> OutputAnalysis:
    """See Note [Output aliasing]. `narrowed`: `EagerChecks.narrowed` of the run that made
    `outs` (Note [as_strided past its input view] in aotc/functional.py); `views`: its
    `EagerChecks.views` (Note [Replayed views] in runtime/viewreplay.py); `view_versions`: its
    `EagerChecks.view_versions`."""
    view_versions = view_versions if view_versions is not None else {}
    narrowed = narrowed if narrowed is not None else {}
    views = views if views is not None else {}
    reshaped = reshaped if reshaped is not None else {}
    leaf_of_id: dict[int, UserArg] = {}
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor):
            leaf_of_id.setdefault(id(t), UserArg(i))
    distinct = [leaf_of_id[k] for k in dict.fromkeys(leaf_of_id)]
    input_storage: dict[StorageWeakRef, list[UserArg]] = {}
    for a in distinct:
        leaf = leaves[a]
        assert isinstance(leaf, torch.Tensor)
        input_storage.setdefault(StorageWeakRef(leaf.untyped_storage()), []).append(a)
    primaries = _internal_primaries(outs, leaf_of_id, input_storage)

    result = OutputAnalysis(infos=[], bases=[], roots=[])
    out_of_id: dict[int, UserOut] = {}
    base_of_id: dict[int, int] = {}
    root_of_id: dict[int, int] = {}
    for j, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            _check_constant(o, j)
            result.infos.append(OutputInfo(OutputKind.NOT_TENSOR, False, None, constant=o))
            continue
        rg, dtype = o.requires_grad, o.dtype
        if id(o) not in leaf_of_id and isinstance(o, torch.nn.Parameter):
            raise UnsupportedError(
                f"output {j} is an nn.Parameter created inside the compiled function "
                f"(requires_grad={rg}); aotc returns plain tensors, not new Parameters. Create it "
                "outside and pass it as an argument."
            )
        if id(o) in leaf_of_id:
            info = OutputInfo(OutputKind.IS_INPUT, rg, dtype, base_arg=leaf_of_id[id(o)])
        elif id(o) in out_of_id:
            info = OutputInfo(OutputKind.IS_OUTPUT, rg, dtype, base_out=out_of_id[id(o)])
        else:
            out_of_id[id(o)] = UserOut(j)
            storage = StorageWeakRef(o.untyped_storage())
            root = _root(o)
            if _made_by_custom_function(o):
                info = _custom_view(o, j, root, storage, input_storage, leaves, primaries)
            elif storage in input_storage:
                candidates = [
                    a
                    for a in input_storage[storage]
                    if _root(leaves[a]) is root  # type: ignore[arg-type]
                ]
                if candidates:
                    info = _alias_of_input(o, j, candidates, leaves, narrowed.get(o, ()))
                    base = leaves[info.base_arg]  # type: ignore[index]
                    info = _with_replay(info, o, base, views, reshaped, j)  # type: ignore[arg-type]
                    if _taken_before_write(info, o, view_versions):
                        info = replace(info, taken_before_write=True)
                else:
                    source = input_storage[storage][0]
                    k = _add_root(result, root_of_id, root, o, j, leaves[source], source_arg=source)  # type: ignore[arg-type]
                    info = _detached(o, root, k, j)
            else:
                primary, where = primaries[storage]
                if root is primary:
                    if o is not primary and narrowed.get(o):
                        raise UnsupportedError(
                            f"output {j} is a view made by as_strided reaching past the elements "
                            "of the view it was applied to, of a tensor made inside the "
                            "compiled function; eager's gradient stops at that inner view's "
                            "elements, which aotc cannot reproduce for such a view. Return a "
                            ".clone() of it, or apply as_strided to the tensor itself."
                        )
                    info = _in_group(o, j, primary, where, result, base_of_id)
                    info = _with_replay(info, o, primary, views, reshaped, j)
                else:
                    src_out, src_base = _primary_source(primary, where, result, base_of_id)
                    k = _add_root(
                        result,
                        root_of_id,
                        root,
                        o,
                        j,
                        primary,
                        source_out=src_out,
                        source_base=src_base,
                    )
                    info = _detached(o, root, k, j)
        result.infos.append(info)
    _check_new_leaves(outs, result)
    return result


def _internal_primaries(
    outs: list[object],
    leaf_of_id: dict[int, UserArg],
    input_storage: dict[StorageWeakRef, list[UserArg]],
) -> dict[StorageWeakRef, tuple[torch.Tensor, ValueRef]]:
    """For each new storage among the outputs: its primary root and where the trace finds it.
    Preference: a returned root with history, a returned root, a base with history, any."""
    candidates: dict[StorageWeakRef, list[tuple[int, torch.Tensor, ValueRef]]] = {}
    seen: set[int] = set()
    for j, o in enumerate(outs):
        if not isinstance(o, torch.Tensor) or id(o) in leaf_of_id:
            continue
        storage = StorageWeakRef(o.untyped_storage())
        if storage in input_storage:
            continue
        root = _root(o)
        if id(root) in seen:
            continue
        seen.add(id(root))
        returned = root is o or any(x is root for x in outs)
        rank = (0 if root.grad_fn is not None else 1) + (0 if returned else 2)
        rank += 0 if _spans_storage(root) else 4  # the others are regenerated from it
        ref = ValueRef(UserOut(j), via_base=root is not o)
        if root is not o and returned:
            jr = next(k for k, x in enumerate(outs) if x is root)
            ref = ValueRef(UserOut(jr), via_base=False)
        candidates.setdefault(storage, []).append((rank, root, ref))
    primaries = {}
    for storage, cands in candidates.items():
        _, root, ref = min(cands, key=lambda c: c[0])  # stable: the first of the best rank
        primaries[storage] = (root, ref)
    return primaries


def _in_group(
    o: torch.Tensor,
    j: int,
    primary: torch.Tensor,
    where: ValueRef,
    result: OutputAnalysis,
    base_of_id: dict[int, int],
) -> OutputInfo:
    """`o` is the primary of its storage or a view of it."""
    rg, dtype = o.requires_grad, o.dtype
    if o is primary:
        return OutputInfo(
            OutputKind.FRESH, rg, dtype, new_leaf=rg and o.grad_fn is None and o.is_leaf
        )
    if _leaf_view_on_path(o, []) is not None:
        raise UnsupportedError(
            f"output {j} is a view, taken with grad on, of a view of an intermediate made under "
            "torch.no_grad(); eager's gradients through it stop at that inner view, which aotc "
            "cannot reproduce. Return a .clone() of the inner view, or take both views in the "
            "same grad mode."
        )
    if not where.via_base:  # the primary is a returned output
        return OutputInfo(
            OutputKind.ALIAS_OF_OUTPUT, rg, dtype, base_out=where.out, **_view_flags(o)
        )
    if primary.requires_grad and primary.grad_fn is None and not elements_within(o, primary):
        raise UnsupportedError(
            f"output {j} is a view reaching past the elements of a leaf made inside the compiled "
            "function (`t.detach().requires_grad_()`): eager reads the memory that leaf shares "
            "with t, aotc makes the leaf a tensor of its own, which holds only its elements "
            "(fuzz seed 21003). Return a .clone() of the view, or take it from t."
        )
    idx = _base_index(primary, where, result, base_of_id)
    return OutputInfo(
        OutputKind.ALIAS_OF_INTERMEDIATE, rg, dtype, base_intermediate=idx, **_view_flags(o)
    )


def _base_index(
    primary: torch.Tensor, where: ValueRef, result: OutputAnalysis, base_of_id: dict[int, int]
) -> int:
    idx = base_of_id.get(id(primary))
    if idx is None:
        idx = base_of_id[id(primary)] = len(result.bases)
        result.bases.append(where)
        if primary.requires_grad and primary.grad_fn is None:
            result.new_leaf_bases.append(idx)
    return idx


def _primary_source(
    primary: torch.Tensor, where: ValueRef, result: OutputAnalysis, base_of_id: dict[int, int]
) -> tuple[UserOut | None, int | None]:
    if not where.via_base:
        return where.out, None
    return None, _base_index(primary, where, result, base_of_id)


def _add_root(
    result: OutputAnalysis,
    root_of_id: dict[int, int],
    root: torch.Tensor,
    o: torch.Tensor,
    j: int,
    source: torch.Tensor,
    source_arg: UserArg | None = None,
    source_out: UserOut | None = None,
    source_base: int | None = None,
) -> int:
    k = root_of_id.get(id(root))
    if k is not None:
        return k
    if root.dtype != source.dtype:
        raise UnsupportedError(
            f"output {j} shares memory with another tensor of dtype {source.dtype} as a detached "
            f"{root.dtype} alias (`.view(dtype).detach()`); aotc cannot regenerate such aliases. "
            "Return a .clone() of it instead."
        )
    geometry = _geometry(root, source)
    whole = _is_whole(root, source)
    if not whole:
        _refuse_symbolic(geometry, j, "a detached alias of part of another tensor")
    k = root_of_id[id(root)] = len(result.roots)
    result.roots.append(
        RootRef(
            source_arg=source_arg,
            source_out=source_out,
            source_base=source_base,
            geometry=geometry,
            grad=_root_grad(root),
            value=ValueRef(UserOut(j), via_base=root is not o),
            whole=whole,
        )
    )
    return k


def _is_whole(root: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether `root` has exactly `source`'s geometry (decided without adding shape guards)."""
    pairs = [
        *zip(root.shape, source.shape),
        *zip(root.stride(), source.stride()),
        (root.storage_offset(), source.storage_offset()),
    ]
    return root.dim() == source.dim() and all(statically_known_true(a == b) for a, b in pairs)


def _refuse_symbolic(geometry: Geometry | None, j: int, what: str) -> None:
    """A geometry the runtime rebuilds with as_strided must be concrete (Note [Replayed views]:
    views with symbolic sizes are replayed where their ops can be)."""
    if geometry is None:
        return
    values = (*geometry.size, *geometry.stride, geometry.offset)
    if any(isinstance(v, torch.SymInt) for v in values):
        raise UnsupportedError(
            f"output {j} is {what} with symbolic sizes, which aotc rebuilds only with concrete "
            "ones. Return a .clone() of it, or compile without dynamic sizes for it."
        )


def _detached(o: torch.Tensor, root: torch.Tensor, k: int, j: int) -> OutputInfo:
    if o.dtype != root.dtype:
        raise UnsupportedError(
            f"an output is a {o.dtype} view of a detached {root.dtype} tensor (`.detach()` then "
            "`.view(dtype)`); aotc cannot regenerate it. Return a .clone() of it instead."
        )
    flags = _view_flags(o) if o is not root else _ViewFlags()
    geometry = _geometry(o, root) if o is not root else None
    _refuse_symbolic(geometry, j, "a view of a detached alias")
    return OutputInfo(
        OutputKind.DETACHED,
        o.requires_grad,
        o.dtype,
        base_root=k,
        geometry=geometry,
        lazy_conj=o.is_conj() and not root.is_conj(),
        lazy_neg=o.is_neg() and not root.is_neg(),
        **flags,
    )


def _alias_of_input(
    o: torch.Tensor,
    j: int,
    candidates: list[UserArg],
    leaves: list[object],
    narrowed: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...] = (),
) -> OutputInfo:
    leaf = _view_source(o, candidates, leaves)
    base = leaves[leaf]
    assert isinstance(base, torch.Tensor)
    if base.dtype != o.dtype:
        raise UnsupportedError(
            f"output {j} is a view of input {leaf} with another dtype ({base.dtype} -> "
            f"{o.dtype}); aotc cannot regenerate dtype-changing views of inputs. Return "
            ".clone() of it instead."
        )
    via = _leaf_view_on_path(o, leaves)
    if via is None and _has_grad_fn(o) and base.requires_grad and not _reaches(o, base):
        via = o  # its gradient is dropped at a no_grad view on the way: any no_grad view will do
    if via is None and _reaches_elements_elsewhere(o, base):
        raise UnsupportedError(
            f"output {j} is a view (through `as_strided` with an absolute storage offset) of "
            f"elements that input {leaf} does not hold, and its autograd node is not input "
            f"{leaf}'s: eager sends its gradient to the tensor those elements belong to, aotc "
            f"would regenerate the view from input {leaf}, whose gradient cannot take them. "
            "Return a .clone() of it, or pass the tensor that holds those elements."
        )
    return OutputInfo(
        OutputKind.ALIAS_OF_INPUT,
        o.requires_grad,
        o.dtype,
        base_arg=leaf,
        geometry=_geometry(o, base),
        lazy_conj=o.is_conj() and not base.is_conj(),
        lazy_neg=o.is_neg() and not base.is_neg(),
        via_geometry=_geometry(via, base) if via is not None else None,
        narrowed_by=_narrowings(narrowed, base),
        **_view_flags(o),
    )


_MAX_CHAIN = 32
_NOT_REPLAYED = ("aten.detach.default",)


def _with_replay(
    info: OutputInfo,
    o: torch.Tensor,
    base: torch.Tensor,
    views: Mapping[int, ViewRecord],
    reshaped: Mapping[int, Any],
    j: int,
) -> OutputInfo:
    """`info` with eager's view chain from `base` to `o`, where one can be replayed (Note
    [Replayed views] in runtime/viewreplay.py)."""
    replayable = (OutputKind.ALIAS_OF_INPUT, OutputKind.ALIAS_OF_INTERMEDIATE)
    if info.kind not in (*replayable, OutputKind.ALIAS_OF_OUTPUT):
        return info
    special = info.stale_view or info.new_leaf or info.via_geometry is not None
    chain = None if special or info.narrowed_by else view_chain(o, base, views, reshaped)
    if chain is None:
        _check_concrete_geometry(info, j)
        return info
    ops, grad = chain
    # Replayed in eager's grad mode, the view has an autograd node iff the base requires grad
    # now. Eager's may have none though the base does: made before `base.requires_grad_()`.
    if info.requires_grad and grad != (not info.view_without_grad):
        return info
    return replace(info, replay=ops, replay_grad=grad)


def _taken_before_write(
    info: OutputInfo, o: torch.Tensor, view_versions: Mapping[int, int]
) -> bool:
    """A view of an input, needing no grad at the end of the call, that the call wrote (through
    it or its base) after taking it (Note [Views taken before a write] in runtime/epilogue.py)."""
    if info.requires_grad or info.stale_view or o.is_inference():
        return False
    made = view_versions.get(id(o))
    return made is not None and o._version != made


def _check_concrete_geometry(info: OutputInfo, j: int) -> None:
    """An output view of an input is rebuilt from its recorded geometry when its view ops
    cannot be replayed (a size argument that is itself symbolic, or a view whose gradient eager
    stops early); views of graph values are rebuilt from the graph's own view, at run time."""
    if info.kind is OutputKind.ALIAS_OF_INPUT:
        what = f"a view of input {info.base_arg} made by view ops aotc cannot replay"
        for geometry in (info.geometry, info.via_geometry, *info.narrowed_by):
            _refuse_symbolic(geometry, j, what)


def view_chain(
    o: torch.Tensor,
    base: torch.Tensor,
    views: Mapping[int, ViewRecord],
    reshaped: Mapping[int, Any] | None = None,
) -> tuple[tuple[ViewOp, ...], bool] | None:
    """The view ops eager ran from `base` to `o` and the grad mode it ran them all in, or None:
    a step that is not a recorded view op with plain arguments, mixed grad modes, or `o` or
    `base` changed in place since (`transpose_`: the chain would not give `o` from `base`)."""
    reshaped = reshaped if reshaped is not None else {}
    ops: list[ViewOp] = []
    modes = set()
    cur = o
    base_then: tuple[object, ...] | None = None
    while cur is not base:
        record = views.get(id(cur))
        if record is None or record[0] is not cur or len(ops) >= _MAX_CHAIN:
            return None
        _, parent, op, grad, parent_then, view_then = record
        if op is None or op.op in _NOT_REPLAYED:
            return None
        if cur is o and not _unchanged(o, view_then, reshaped):
            return None
        # A link in the middle must have kept its geometry from when it was made until the
        # next view was taken of it (`v = a.squeeze(1); v.unsqueeze_(1); w = v.squeeze(0)`:
        # replaying squeeze(1) then squeeze(0) on `a` would lose the unsqueezed dim).
        if cur is not o and not _kept(cur, view_then, base_then, reshaped):
            return None
        ops.append(op)
        modes.add(grad)
        cur, base_then = parent, parent_then
    if len(modes) != 1 or not _unchanged(base, base_then, reshaped):
        return None
    return tuple(reversed(ops)), modes.pop()


def _kept(
    t: torch.Tensor,
    made: tuple[object, ...] | None,
    viewed: tuple[object, ...] | None,
    reshaped: Mapping[int, Any],
) -> bool:
    """Whether view `t` had the geometry it was made with when a view was taken of it: compared
    where both were recorded (concrete sizes), else no in-place op reshaped it at all."""
    if made is not None and viewed is not None:
        return made == viewed
    return reshaped.get(id(t)) is not t


def _unchanged(
    t: torch.Tensor, then: tuple[object, ...] | None, reshaped: Mapping[int, Any]
) -> bool:
    """Whether `t` still has the geometry it had when the view was made: compared where it was
    recorded (concrete sizes), else (symbolic sizes) no in-place op reshaped it."""
    if then is not None:
        return then == geometry_of(t)
    return reshaped.get(id(t)) is not t


def _narrowings(
    chain: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...], base: torch.Tensor
) -> tuple[Geometry, ...]:
    """The chain's inner views relative to `base`, less any that is `base` itself (regenerating
    from it restricts the gradient to its elements already)."""
    own = (tuple(base.shape), tuple(base.stride()), 0)
    out = []
    for size, stride, offset in chain:
        g = Geometry(size, stride, offset - base.storage_offset())
        if (g.size, g.stride, g.offset) != own:
            out.append(g)
    return tuple(out)


# Note [Autograd nodes' Python objects]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Walks of autograd graphs compare nodes by `id()`. torch 2.13's C++ nodes keep their Python
# object alive, so a node has one id for as long as it lives. torch 2.11's do not: the object is
# freed when the last Python reference goes, the next access makes a new one, and a freed
# object's address (its id) is soon reused by another node's object. A walk that remembered only
# ids then skipped nodes it had never visited (an `as_strided` view of a narrowed input lost its
# input's AccumulateGrad, and the epilogue cut the output's gradient). So every node whose id is
# kept is kept alive with it, for as long as the id is compared.


def _graph_nodes(grad_fn: Any) -> Iterator[Any]:
    """The autograd nodes reachable from `grad_fn`, breadth-first, at most _MAX_WALK of them."""
    queue: deque[Any] = deque([grad_fn])
    visited: dict[int, Any] = {}  # each node kept alive: Note [Autograd nodes' Python objects]
    while queue and len(visited) < _MAX_WALK:
        node = queue.popleft()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        yield node
        queue.extend(fn for fn, _ in node.next_functions)


def _reaches_elements_elsewhere(o: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `o`, to be regenerated as a view of the input `base`, has a gradient that eager
    sends past `base`: `o` reads storage elements `base` does not hold, and `base`'s own node is
    not on `o`'s graph (eager regenerated `o`'s node from the root after a write into it: fuzz
    seeds 14115, 18804). A view of `base` would give those elements no gradient. False when it
    cannot tell (symbolic or large geometry)."""
    if not (o.requires_grad and _has_grad_fn(o)):
        return False
    held, wanted = _offsets(base), _offsets(o)
    if held is None or wanted is None or wanted <= held:
        return False
    goal = _grad_fn(base) if _has_grad_fn(base) else None
    walked = 0
    for node in _graph_nodes(_grad_fn(o)):
        walked += 1
        if node is goal or getattr(node, "variable", None) is base:
            return False
    return walked < _MAX_WALK


def _reaches(o: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether a gradient from `o` reaches `target` or its base (their grad_fns, or their
    accumulators)."""
    targets = [target, _root(target)]
    goals = [_grad_fn(t) for t in targets if _has_grad_fn(t)]  # Note [Autograd nodes' ...]
    walked = 0
    for node in _graph_nodes(_grad_fn(o)):
        walked += 1
        variable = getattr(node, "variable", None)
        if any(node is g for g in goals) or any(variable is t for t in targets):
            return True
    return walked >= _MAX_WALK  # undecided: assume it does, as without this check


def _leaf_view_on_path(o: torch.Tensor, leaves: list[object]) -> torch.Tensor | None:
    """A view made under no_grad (a leaf that requires grad) that `o` was derived from with
    grad on: eager's gradients through `o` stop there (`with torch.no_grad(): v = x[0]`, then
    `return v.t()`)."""
    if not _has_grad_fn(o):
        return None
    inputs = {id(t) for t in leaves}
    for node in _graph_nodes(_grad_fn(o)):
        variable = getattr(node, "variable", None)
        if variable is not None and variable._base is not None and id(variable) not in inputs:
            return variable
    return None


def _view_source(o: torch.Tensor, candidates: list[UserArg], leaves: list[object]) -> UserArg:
    """Which of several inputs on one storage `o` was derived from: the first one met on `o`'s
    autograd graph, else the first one whose memory holds `o`'s, else the first."""
    if len(candidates) == 1:
        return candidates[0]
    if _has_grad_fn(o):
        by_node: dict[int, UserArg] = {}
        nodes = []  # keeps by_node's nodes alive: Note [Autograd nodes' Python objects]
        by_leaf: dict[int, UserArg] = {}
        for a in candidates:
            t = leaves[a]
            assert isinstance(t, torch.Tensor)
            if _has_grad_fn(t):
                nodes.append(_grad_fn(t))
                by_node.setdefault(id(nodes[-1]), a)
            elif t.requires_grad:
                by_leaf.setdefault(id(t), a)
        for node in _graph_nodes(_grad_fn(o)):
            if id(node) in by_node:
                return by_node[id(node)]
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) in by_leaf:
                return by_leaf[id(variable)]
    for a in candidates:
        if _holds_elements(leaves[a], o):  # type: ignore[arg-type]
            return a
    for a in candidates:
        if _holds(leaves[a], o):  # type: ignore[arg-type]
            return a
    return candidates[0]


def _span(t: torch.Tensor) -> tuple[Dim, Dim]:
    lo = hi = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return (t.storage_offset(), t.storage_offset() - 1)
        lo += min(0, (size - 1) * stride)
        hi += max(0, (size - 1) * stride)
    return lo, hi


def _spans_storage(t: torch.Tensor) -> bool:
    """Whether `t` reaches every element of its storage (a `detach()`ed slice does not: a primary
    that is one would be compiled as a copy of the slice, too small to regenerate the rest from).
    Symbolic geometry counts as spanning."""
    values = (t.storage_offset(), *t.shape, *t.stride(), t.untyped_storage().nbytes())
    if any(isinstance(v, torch.SymInt) for v in values):
        return True
    lo, hi = _span(t)
    return lo == 0 and (hi + 1) * t.element_size() >= t.untyped_storage().nbytes()


def _holds(t: torch.Tensor, o: torch.Tensor) -> bool:
    (t0, t1), (o0, o1) = _span(t), _span(o)
    return t0 <= o0 and o1 <= t1


_MAX_ELEMENTS = 1 << 16  # above this, `_holds_elements` answers False (the span check follows)


def _holds_elements(t: torch.Tensor, o: torch.Tensor) -> bool:
    """Whether every storage element `o` reads is one `t` reads. A span is not enough: `x[:, 1]`
    spans `x[1]` without holding it, and a view regenerated from it would drop the gradient of
    the elements it misses (fuzz seed 8241). False for symbolic or large geometries. Plain
    Python: the tensors may be fake."""
    held, wanted = _offsets(t), _offsets(o)
    return held is not None and wanted is not None and wanted <= held


def _offsets(t: torch.Tensor) -> set[int] | None:
    try:
        sizes = [int(n) for n in t.shape]
        strides = [int(st) for st in t.stride()]
        start = int(t.storage_offset())
    except (TypeError, RuntimeError):  # symbolic sizes
        return None
    if math.prod(sizes) > _MAX_ELEMENTS:
        return None
    idx = [start]
    for size, stride in zip(sizes, strides, strict=True):
        idx = [i + k * stride for i in idx for k in range(size)]
    return set(idx)


def _check_constant(value: object, j: int) -> None:
    if value is None or isinstance(
        value, (int, float, bool, str, complex, torch.dtype, torch.device)
    ):
        return
    raise UnsupportedError(
        f"output {j} has type {type(value).__name__}, which aotc cannot return from a compiled "
        "function. Return tensors, Python numbers/strings/None, or tuples/lists/dicts of them."
    )


def _check_new_leaves(outs: list[object], result: OutputAnalysis) -> None:
    """A leaf created inside the call and visible to the caller must not be one that other
    outputs' gradients accumulate into (see Note [Detached aliases])."""
    new_leaves: list[tuple[torch.Tensor, int]] = []
    for j, (o, info) in enumerate(zip(outs, result.infos)):
        if info.new_leaf:
            new_leaves.append((o, j))  # type: ignore[arg-type]
    for idx in result.new_leaf_bases:
        new_leaves.append((result.bases[idx].resolve(outs), result.bases[idx].out))
    for root in result.roots:
        if root.grad is RootGrad.NEW_LEAF:
            new_leaves.append((root.value.resolve(outs), root.value.out))
    if not new_leaves:
        return
    for leaf, j in new_leaves:
        others = [
            o
            for o in outs
            if isinstance(o, torch.Tensor)
            and o is not leaf
            and _root(o) is not leaf
            and _has_grad_fn(o)  # other leaves accumulate into themselves
        ]
        for node in autograd_nodes(others):
            if getattr(node, "variable", None) is leaf:
                raise UnsupportedError(
                    f"output {j} is (or is a view of) a tensor created inside the compiled "
                    "function with requires_grad=True, and other outputs are computed from it: "
                    "eager accumulates their gradients into it, which aotc cannot reproduce "
                    "(its graph and the returned tensor are different leaves). Create the tensor "
                    "outside and pass it as an argument."
                )
