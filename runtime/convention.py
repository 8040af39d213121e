"""Calling convention: dedupe of duplicate inputs and synthetic bases for aliased inputs.

Stage: `plan_convention(leaves, mutated) -> CallingConvention` at compile time;
`apply_convention(plan, leaves) -> graph args` on every call; `expand_graph_args` inside the
traced function rebuilds the user's tensors from the graph args.

Requires: `leaves` are the flattened user leaves (tensors and constants) of one call.
Ensures: every graph arg is a distinct tensor; graph args alias each other only when no
mutation can be observed through the alias (see Note [Synthetic bases]).

Note [Synthetic bases]
~~~~~~~~~~~~~~~~~~~~~~
Functionalization sees each graph input as its own tensor. If two user inputs share storage and
one is mutated, the other must see the mutation, which a functional graph cannot express across
inputs. So such a group of aliased inputs becomes one graph input, the *base*, and each member is
regenerated inside the graph as `base.as_strided(size, stride, offset)`. Functionalization then
tracks the members as views of one tensor and replays mutations onto the others.

    def f(a, b):            # called as f(buf[0], buf[1]) with a mutated
        a.mul_(2)
        return a + b

    graph args: (buf,)      # buf = a._base, shared by both members
    inside the graph: a = buf.as_strided((n,), (1,), 0); b = buf.as_strided((n,), (1,), n)
    epilogue: buf.copy_(updated_buf)

The base is the members' common `._base` when they have one (so gradients flow into the user's
autograd graph through it). Without a common base, a base is made over the raw storage, which is
only allowed when no member requires grad. Groups with no mutation keep their members as separate
graph args. Duplicates (the same tensor object twice) are folded first: `f(x, x)` has one graph arg.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from aotc.runtime.errors import UnsupportedError
from aotc.runtime.schema import CallingConvention, Geometry, GraphArg, SyntheticBase, UserArg


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def alias_groups(leaves: Sequence[object]) -> list[list[UserArg]]:
    """Groups of distinct tensor leaves that share storage (groups of two or more only)."""
    by_storage: dict[int, list[UserArg]] = {}
    seen_ids: set[int] = set()
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or id(leaf) in seen_ids:
            continue
        seen_ids.add(id(leaf))
        ptr = _storage_key(leaf)
        if ptr == 0:  # empty storage: nothing to alias
            continue
        by_storage.setdefault(ptr, []).append(UserArg(i))
    return [g for _, g in sorted(by_storage.items(), key=lambda kv: kv[1][0]) if len(g) > 1]


def plan_convention(
    leaves: Sequence[object],
    mutated_groups: Sequence[Sequence[UserArg]] = (),
    names: Sequence[str] = (),
) -> CallingConvention:
    """Plan dedupe, and synthetic bases for `mutated_groups` (aliased groups with a mutation).

    >>> import torch
    >>> x = torch.randn(3)
    >>> plan = plan_convention([x, x, 2])
    >>> plan.graph_sources, plan.leaf_to_graph
    ((0,), ((0, 0), (1, 0)))
    """
    first_of: dict[int, UserArg] = {}
    tensor_leaves: list[UserArg] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensor_leaves.append(UserArg(i))
            first_of.setdefault(id(leaf), UserArg(i))
    # Duplicates of a group member are members too (same object, same geometry).
    groups = [
        [i for i in tensor_leaves if first_of[id(leaves[i])] in set(group)]
        for group in mutated_groups
    ]
    in_group = {m: gi for gi, group in enumerate(groups) for m in group}

    graph_sources: list[UserArg | None] = []
    bases: list[SyntheticBase] = []
    graph_of_leaf: dict[UserArg, GraphArg] = {}
    graph_of_group: dict[int, GraphArg] = {}
    for i in tensor_leaves:
        first = first_of[id(leaves[i])]
        if first != i:
            continue
        if i in in_group:
            gi = in_group[i]
            if gi not in graph_of_group:
                graph_of_group[gi] = GraphArg(len(graph_sources))
                graph_sources.append(None)
                bases.append(_plan_base(leaves, groups[gi], names))
            graph_of_leaf[i] = graph_of_group[gi]
        else:
            graph_of_leaf[i] = GraphArg(len(graph_sources))
            graph_sources.append(i)
    leaf_to_graph = tuple((i, graph_of_leaf[first_of[id(leaves[i])]]) for i in tensor_leaves)
    return CallingConvention(
        num_user_leaves=len(leaves),
        tensor_leaves=tuple(tensor_leaves),
        graph_sources=tuple(graph_sources),
        synthetic_bases=tuple(bases),
        leaf_to_graph=leaf_to_graph,
    )


def _plan_base(
    leaves: Sequence[object], members: Sequence[UserArg], names: Sequence[str]
) -> SyntheticBase:
    tensors: list[torch.Tensor] = []
    for m in members:
        t = leaves[m]
        assert isinstance(t, torch.Tensor), (m, type(t))
        tensors.append(t)
    label = [names[m] if m < len(names) else f"argument {m}" for m in members]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise UnsupportedError(
            f"inputs {label} share storage with different dtypes ({sorted(map(str, dtypes))}) "
            "and one of them is mutated. Pass a .clone() of one of them, or avoid the in-place op."
        )
    roots = {id(_root(t)) for t in tensors}
    common = len(roots) == 1
    if not common and any(t.requires_grad for t in tensors):
        raise UnsupportedError(
            f"inputs {label} share storage without a common base tensor, one of them is mutated "
            "and one requires grad, so gradients could not flow to the right tensor. Pass views "
            "of one common tensor, or a .clone() of one of them."
        )
    if common:
        root = _root(tensors[0])
        for who, t in zip(label, tensors, strict=True):
            if t.requires_grad and not root.requires_grad:
                raise UnsupportedError(
                    f"input {who} requires grad as a leaf of its own (`requires_grad_()` on a view "
                    "of a tensor that does not require grad) and shares storage with inputs "
                    f"{label}, one of which is mutated; they are merged into their common base, "
                    f"which does not require grad, so {who} would get no gradient. Pass a .clone() "
                    f"of {who}, or make the base tensor require grad instead."
                )
    base = _runtime_base(tensors, common)
    geometries = tuple(
        # Real tensors, so int offsets (torch's stubs say int | SymInt).
        Geometry(
            tuple(t.shape),
            tuple(t.stride()),
            cast(int, t.storage_offset() - base.storage_offset()),
        )
        for t in tensors
    )
    return SyntheticBase(members=tuple(members), geometries=geometries, base_is_common=common)


def _runtime_base(members: Sequence[torch.Tensor], common: bool) -> torch.Tensor:
    first = members[0]
    if common:
        return _root(first)
    storage = first.untyped_storage()
    numel = storage.nbytes() // first.element_size()
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, 0, (numel,), (1,))


def apply_convention(plan: CallingConvention, leaves: Sequence[object]) -> list[torch.Tensor]:
    """Graph args for one call. Hot path: a list comprehension when nothing is merged."""
    if not plan.synthetic_bases:
        return [leaves[i] for i in plan.graph_sources]  # type: ignore[index,misc]
    out: list[torch.Tensor] = []
    bases = iter(plan.synthetic_bases)
    for src in plan.graph_sources:
        if src is not None:
            out.append(leaves[src])  # type: ignore[arg-type]
        else:
            base = next(bases)
            members = [leaves[m] for m in base.members]
            out.append(_runtime_base(members, base.base_is_common))  # type: ignore[arg-type]
    return out


def synthetic_base_users(plan: CallingConvention) -> dict[GraphArg, SyntheticBase]:
    """Graph args that are synthetic bases, with their plans."""
    result: dict[GraphArg, SyntheticBase] = {}
    bases = iter(plan.synthetic_bases)
    for g, src in enumerate(plan.graph_sources):
        if src is None:
            result[GraphArg(g)] = next(bases)
    return result


def expand_graph_args(
    plan: CallingConvention, graph_args: Sequence[torch.Tensor], constants: Sequence[object]
) -> list[object]:
    """User leaves from graph args (runs inside the trace). `constants` gives non-tensor leaves."""
    leaves: list[object] = list(constants)
    member_geometry: dict[UserArg, Geometry] = {}
    for base in plan.synthetic_bases:
        member_geometry.update(zip(base.members, base.geometries, strict=True))
    for leaf, g in plan.leaf_to_graph:
        arg = graph_args[g]
        geometry = member_geometry.get(leaf)
        if geometry is not None:
            arg = arg.as_strided(
                geometry.size, geometry.stride, arg.storage_offset() + geometry.offset
            )
        leaves[leaf] = arg
    return leaves
