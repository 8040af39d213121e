"""Symbolic compilations: fake inputs with SymInt sizes from one ShapeEnv, and their guards.

Stage: `symbolic_leaves(mode, leaves, dynamic) -> fake leaves` before a symbolic compilation;
`guard_expression(mode, fake_leaves) -> GuardCode` after it.
Requires: `mode` has a ShapeEnv (`symbolic_mode()`, or Dynamo's own mode under torch.compile).
Ensures: every tensor leaf becomes a fake tensor of `mode` whose dims are fresh symbols where
`dynamic` says so (static ints elsewhere); the guard expression is what the ShapeEnv learned while
tracing (e.g. `s0 >= 2`, `s1 == s0`), as Python over the runtime tensor leaves.

Note [Symbolic compilations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two callers compile with symbolic sizes: `aotc.compile(dynamic=True)`, which makes its own
ShapeEnv and turns every dim of the user's tensor arguments into a symbol (lifted parameters and
buffers stay static), and the torch.compile backend, which receives Dynamo's fake tensors (and
Dynamo's ShapeEnv, whether the sizes are static, automatic-dynamic or `dynamic=True`). Both hand
the pipeline fake leaves; the pipeline then makes fresh fakes of the same symbolic geometry for
each run (`functional.fresh_fake`), so the metadata runs and the joint trace share symbols and
every guard lands in that one ShapeEnv. make_fx records the size computations as `sym_size` /
`operator` nodes; the partitioner saves the SymInts the backward needs (see
Note [Saved SymInts] in passes/partition.py) and the runtime passes them as plain ints.

What stays unsupported here (raises): synthetic bases (aliased inputs with a mutation: the
dispatch key keeps aliasing patterns apart), and outputs that are views of inputs or inputs whose
metadata changes when their geometry is symbolic (the epilogue replays geometry as ints).
Dynamo's guards cover the backend; for `aotc.compile` the ShapeEnv's guards are evaluated on each
call (`runtime/symbolic.py`).

Example: `f(x) = x * 2` with x: float[s0, 4] (x = torch.randn(8, 4)) gives the guard
`L['t0'].size()[0] >= 2` (0/1 sizes are specialized) plus its dtype/device key: one artifact for
every batch size >= 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from aotc.functional import fresh_fake
from aotc.runtime.epilogue import EpiloguePlan
from aotc.runtime.errors import UnsupportedError


def symbolic_mode() -> FakeTensorMode:
    # No duck sizing: two dims that happen to be equal in the first call (batch 8, hidden 8)
    # get separate symbols, so a later call where they differ needs no recompile.
    return FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv(duck_shape=False))


def symbolic_leaves(
    mode: FakeTensorMode, leaves: Sequence[object], dynamic: Sequence[bool]
) -> list[object]:
    """Fake leaves for a symbolic compilation. `dynamic[i]`: leaf i's dims become symbols."""
    from torch._dynamo.source import LocalSource

    shape_env = mode.shape_env
    out: list[object] = []
    memo: dict[int, object] = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or (
            isinstance(leaf, FakeTensor) and leaf.fake_mode is mode
        ):
            out.append(leaf)
            continue
        if id(leaf) in memo:  # the same tensor twice stays one object (dedupe)
            out.append(memo[id(leaf)])
            continue
        if isinstance(leaf, FakeTensor):
            # Dynamo's graph fakes live in its tracing mode; the backend compiles in a second
            # mode over the same ShapeEnv: copy them over, symbols and all.
            with mode:
                memo[id(leaf)] = fresh_fake(leaf, as_leaves=False)
            out.append(memo[id(leaf)])
            continue
        if dynamic[i] and leaf.dim() > 0:
            assert shape_env is not None, "symbolic_leaves: dynamic dims need a ShapeEnv"
            context: StatelessSymbolicContext[..., Any] = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC] * leaf.dim(),
                constraint_sizes=[None] * leaf.dim(),
            )
            sizes, strides, _ = shape_env.create_symbolic_sizes_strides_storage_offset(
                leaf, LocalSource(f"arg{i}"), symbolic_context=context
            )
        else:
            sizes, strides = tuple(leaf.shape), tuple(leaf.stride())
        with mode:
            template = torch.empty_strided(sizes, strides, dtype=leaf.dtype, device=leaf.device)
            template.requires_grad_(leaf.requires_grad)
            fake = fresh_fake(template, as_leaves=False) if leaf.is_leaf else _non_leaf(template)
        memo[id(leaf)] = fake
        out.append(fake)
    return out


def _non_leaf(template: torch.Tensor) -> torch.Tensor:
    """A non-leaf with the template's exact strides (a clone would make them contiguous)."""
    out = torch.empty_strided(
        template.shape, template.stride(), dtype=template.dtype, device=template.device
    )
    with torch.enable_grad():
        return out.copy_(template)


def guard_expression(mode: FakeTensorMode, fake_leaves: Sequence[object]) -> str | None:
    """Python source over `L['t<k>']` (the k-th tensor leaf) that holds iff a call's sizes are
    admitted by what the trace assumed; None when nothing is assumed."""
    shape_env = mode.shape_env
    assert shape_env is not None
    tensors = [t for t in fake_leaves if isinstance(t, torch.Tensor)]  # fakes of `mode`
    return shape_env.produce_guards_expression(cast(list[FakeTensor], tensors), ignore_static=False)


def static_guard_expression(leaves: Sequence[object]) -> str:
    """A guard over `L['t<k>']` that admits exactly these sizes and strides: the guard of a
    static entry among symbolic ones (Note [Static entries under dynamic=True])."""
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    parts = [
        f"L['t{k}'].size() == {tuple(t.shape)!r} and L['t{k}'].stride() == {tuple(t.stride())!r}"
        for k, t in enumerate(tensors)
    ]
    # Tensors sharing a storage: the entry may hold a synthetic base of their exact layout, and
    # the coarse key keeps only which ones alias (runtime/symbolic.py, `_alias_classes`).
    storages = [t.untyped_storage().data_ptr() if t.layout is torch.strided else 0 for t in tensors]
    for k, (t, ptr) in enumerate(zip(tensors, storages)):
        if not ptr or storages.count(ptr) < 2:
            continue
        root = t._base if t._base is not None else t
        r = f"(L['t{k}'] if L['t{k}']._base is None else L['t{k}']._base)"
        parts.append(
            f"L['t{k}'].storage_offset() == {t.storage_offset()} and {r}.size() == "
            f"{tuple(root.shape)!r} and {r}.stride() == {tuple(root.stride())!r} and "
            f"{r}.storage_offset() == {root.storage_offset()}"
        )
    return " and ".join(parts) or "True"


# Note [Static entries under dynamic=True]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some programs cannot be compiled with symbolic sizes although eager runs them: outputs that
# are views of inputs or inputs reshaped in place (`a.squeeze_(0)`) with symbolic geometry,
# mutations through storage-sharing inputs, a size returned as an output (`x.shape[0]`). For
# those, `aotc.compile(dynamic=True)` compiles a static entry for the call's exact sizes and
# strides (guarded by `static_guard_expression`) instead of raising: the program works as in
# eager, and only such programs pay a compile per size. A program that a static compile refuses
# too raises that error. The coarse key records only which inputs alias (runtime/symbolic.py), so
# a static entry's guard also checks the storage offsets and bases' layouts of the inputs that
# share storage: its synthetic base fits only those.


def check_static_geometry(plan: EpiloguePlan, name: str) -> None:
    """The epilogue replays geometries as ints: refuse symbolic ones (see Note [Symbolic
    compilations])."""
    geometries = [s.geometry for s in plan.outputs] + [m.geometry for m in plan.mutations]
    for g in geometries:
        if g is None:
            continue
        values = (*g.size, *g.stride, g.offset)
        if any(isinstance(v, torch.SymInt) and v.node.maybe_as_int() is None for v in values):
            raise UnsupportedError(
                f"{name}: with dynamic shapes, an output that is a view of an input (or an input "
                f"whose shape/strides the function changes in place) has symbolic geometry "
                f"{tuple(g.size)}; aotc replays such views with fixed sizes only. Return a "
                ".clone() of the view, or compile without dynamic shapes."
            )
