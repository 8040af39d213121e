"""Records shared by every stage and by the runtime.

Stage: none (data only). Everything here is a frozen dataclass that a compiled artifact stores,
so `runtime` can run a compiled function without importing `aotc` or `passes`.

Index spaces (see Note [Index spaces]) are `NewType`s over int so that a conversion names the
space it produces.

Note [Index spaces]
~~~~~~~~~~~~~~~~~~~
A call goes through four numbered lists:

    user leaves   UserArg    every leaf of (args, kwargs) after flattening, then lifted tensors
    graph args    GraphArg   tensors the compiled graphs take, after dedupe and synthetic bases
    user outputs  UserOut    every leaf of the user function's flattened return value
    fwd outputs   FwdOut     what the forward graph returns before its saved values:
                             fresh user outputs, then updated mutated inputs, then
                             intermediate bases, then values of detached aliases with
                             history (see `FwdOutputPlan`)

Example: f(x, x, b[0], b[1]) where b[0] is mutated. UserArg 0..3; dedupe maps UserArg 1 to
UserArg 0; a synthetic base `b` replaces UserArgs 2 and 3; so GraphArgs are (x, b).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType, TypeAlias

import torch

from aotc.runtime.viewreplay import ViewOp

UserArg = NewType("UserArg", int)
GraphArg = NewType("GraphArg", int)
UserOut = NewType("UserOut", int)
FwdOut = NewType("FwdOut", int)


class MutationKind(enum.Enum):
    NONE = "none"
    METADATA_ONLY = "metadata_only"
    DATA = "data"
    DATA_AND_METADATA = "data_and_metadata"

    @property
    def has_data(self) -> bool:
        return self in (MutationKind.DATA, MutationKind.DATA_AND_METADATA)

    @property
    def has_metadata(self) -> bool:
        return self in (MutationKind.METADATA_ONLY, MutationKind.DATA_AND_METADATA)


class OutputKind(enum.Enum):
    FRESH = "fresh"  # a new tensor computed by the graph
    IS_INPUT = "is_input"  # the very input object (e.g. `x.add_(1); return x`)
    ALIAS_OF_INPUT = "alias_of_input"  # a view of an input
    ALIAS_OF_INTERMEDIATE = "alias_of_intermediate"  # a view of a graph intermediate
    ALIAS_OF_OUTPUT = "alias_of_output"  # a view of another (fresh) user output
    IS_OUTPUT = "is_output"  # the same object as an earlier user output
    NOT_TENSOR = "not_tensor"  # a Python constant (int, float, bool, None, str)
    # a detached alias (`x.detach()`, `y.detach().requires_grad_()`) or a view of one: shares
    # storage with an input or a graph value but not its autograd history. See Note [Detached
    # aliases] in aotc/aliasing.py.
    DETACHED = "detached"


class RootGrad(enum.Enum):
    """The autograd state of a detached alias at the end of the call."""

    NONE = "none"  # no history, does not require grad (`x.detach()`)
    NEW_LEAF = "new_leaf"  # a new leaf that requires grad (`x.detach().requires_grad_()`)
    HISTORY = "history"  # history the call gave it (`d = x.detach(); d.mul_(w)`)


class RootSource(enum.Enum):
    INPUT = "input"  # a user input (UserArg)
    VALUE = "value"  # a forward output of the graph (FwdOut)


# A size, stride or offset: an int, or a SymInt in a symbolic compilation's records (the cache
# and exported artifacts store only static ones: a SymInt has no plain encoding).
Dim: TypeAlias = int | torch.SymInt


@dataclass(frozen=True, slots=True)
class Geometry:
    """Size, stride and storage offset of a view, relative to its base's storage offset. Under
    dynamic shapes (a symbolic compilation) the values are SymInts: see `Dim`."""

    size: tuple[Dim, ...]
    stride: tuple[Dim, ...]
    offset: Dim  # element offset from the base tensor's own storage offset


@dataclass(frozen=True, slots=True)
class InputInfo:
    """Facts about one graph argument (a tensor the graphs take)."""

    mutation: MutationKind
    # The data mutations left the input's autograd history as it was (eager: every write under
    # no_grad, through a detach()ed alias, or of values without grad): replayed under no_grad.
    hidden_from_autograd: bool
    requires_grad: bool
    is_leaf: bool


@dataclass(frozen=True, slots=True)
class LeafChange:
    """What a call does to one user input tensor besides writing its data (one per distinct
    tensor object, first occurrence): new geometry, and eager's version counter bumps."""

    leaf: UserArg
    geometry: Geometry | None  # new geometry (t_, squeeze_, as_strided_ ...), else None
    version_bumps: int  # how much eager's `_version` of this tensor grows during the call
    with_grad: bool = False  # eager recorded autograd history for it (replay with grad on)
    requires_grad: bool = False  # `requires_grad_()` made it a leaf that requires grad


@dataclass(frozen=True, slots=True)
class DetachedRoot:
    """A tensor the call makes that shares storage (and version counter) with an input or with a
    graph value, without sharing its autograd history. See Note [Detached aliases] in
    aotc/aliasing.py."""

    source: RootSource
    index: int  # UserArg (INPUT) or FwdOut (VALUE) whose storage it shares
    geometry: Geometry  # relative to the source's storage offset
    grad: RootGrad
    history: int | None = None  # HISTORY: the FwdOut holding its value and history
    whole: bool = False  # it has the source's own geometry: no as_strided_ (sizes may be symbolic)


@dataclass(frozen=True, slots=True)
class OutputInfo:
    """Facts about one user output leaf."""

    kind: OutputKind
    requires_grad: bool
    dtype: torch.dtype | None
    base_arg: UserArg | None = None  # IS_INPUT / ALIAS_OF_INPUT: the user leaf it aliases
    base_out: UserOut | None = None  # ALIAS_OF_OUTPUT / IS_OUTPUT: the earlier output
    base_intermediate: int | None = None  # ALIAS_OF_INTERMEDIATE: index into intermediate bases
    geometry: Geometry | None = None  # ALIAS_OF_INPUT: the view relative to base_arg
    constant: object = None  # NOT_TENSOR: the value
    view_without_grad: bool = False  # a view eager made without autograd tracking (no_grad)
    lazy_conj: bool = False  # the output carries the lazy conjugate bit (z.conj())
    lazy_neg: bool = False  # the output carries the lazy negative bit
    multi_output_view: bool = False  # a view from unbind/split/chunk: eager forbids writing it
    new_leaf: bool = False  # a leaf created inside that requires grad (FRESH, or a view)
    # a view of an input, needing no grad, that the call wrote after taking it (Note [Views
    # taken before a write] in runtime/epilogue.py)
    taken_before_write: bool = False
    stale_view: bool = False  # a no_grad or multi-output view whose base was written after
    base_root: int | None = None  # DETACHED: index into MutationAliasInfo.roots
    # ALIAS_OF_INPUT: eager derived the output, with grad, from a view of the input made under
    # no_grad (a leaf): its geometry relative to base_arg, so gradients stop there as in eager
    via_geometry: Geometry | None = None
    # ALIAS_OF_INPUT: the views (relative to base_arg) that an `as_strided` on the way reached
    # past, innermost last: eager's gradient stops at their elements (Note [as_strided past its
    # input view] in aotc/functional.py)
    narrowed_by: tuple[Geometry, ...] = ()
    # ALIAS_OF_*: eager's view ops from the base to the output, and the grad mode it ran them
    # in; None: rebuilt with as_strided (Note [Replayed views] in runtime/viewreplay.py)
    replay: tuple[ViewOp, ...] | None = None
    replay_grad: bool = True
    # FRESH: eager's output is a view a custom autograd.Function returned (Note [Views a custom
    # Function returns] in aotc/aliasing.py) of `base_arg` (an input) or `base_out` (an earlier
    # output), at `geometry`: the epilogue makes it that view again, its gradient going to the
    # graph's value
    custom_view: bool = False


@dataclass(frozen=True, slots=True)
class MutationAliasInfo:
    """What the metadata pass learned about one compiled signature."""

    inputs: tuple[InputInfo, ...]  # len == num graph args; GraphArg space
    outputs: tuple[OutputInfo, ...]  # len == num user outputs; UserOut space
    num_intermediate_bases: int  # extra forward outputs: bases of ALIAS_OF_INTERMEDIATE outputs
    leaf_changes: tuple[LeafChange, ...] = ()  # user tensors whose geometry or version changes
    roots: tuple[DetachedRoot, ...] = ()  # detached aliases the DETACHED outputs regenerate
    new_leaf_bases: tuple[int, ...] = ()  # intermediate bases that are leaves made inside

    def format(self) -> str:
        lines = ["# stage: metadata"]
        for i, inp in enumerate(self.inputs):
            hidden = inp.hidden_from_autograd and inp.mutation.has_data and inp.requires_grad
            extra = " (hidden from autograd)" if hidden else ""
            lines.append(
                f"input  {i}: mutation={inp.mutation.value}{extra} requires_grad={inp.requires_grad}"
                f" leaf={inp.is_leaf}"
            )
        for j, out in enumerate(self.outputs):
            base = ""
            if out.base_arg is not None:
                base = f" base=user_arg{out.base_arg}"
            elif out.base_out is not None:
                base = f" base=user_out{out.base_out}"
            elif out.base_intermediate is not None:
                base = f" base=intermediate{out.base_intermediate}"
            elif out.base_root is not None:
                base = f" base=root{out.base_root}"
            lines.append(
                f"output {j}: {out.kind.value}{base} requires_grad={out.requires_grad}"
                f" dtype={out.dtype}"
            )
        lines.append(f"intermediate bases: {self.num_intermediate_bases}")
        for change in self.leaf_changes:
            geometry = f" geometry={change.geometry}" if change.geometry is not None else ""
            lines.append(f"user_arg{change.leaf}: version +{change.version_bumps}{geometry}")
        for k, root in enumerate(self.roots):
            lines.append(
                f"root {k}: detached alias of {root.source.value} {root.index} "
                f"grad={root.grad.value}"
            )
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class SyntheticBase:
    """One synthetic base: several aliased user tensors merged into one graph argument.

    See Note [Synthetic bases] in runtime/convention.py.
    """

    members: tuple[UserArg, ...]  # user leaves regenerated from this base
    geometries: tuple[Geometry, ...]  # len == len(members); each member as a view of the base
    base_is_common: bool  # True: the members' shared `._base` is the base; False: the storage


@dataclass(frozen=True, slots=True)
class CallingConvention:
    """How user leaves map to graph args. Planned at compile time, applied every call."""

    num_user_leaves: int
    tensor_leaves: tuple[UserArg, ...]  # user leaves that are tensors
    # For each graph arg, the user leaf passed as-is, or None for a synthetic base.
    graph_sources: tuple[UserArg | None, ...]  # len == num graph args; GraphArg space
    synthetic_bases: tuple[SyntheticBase, ...]  # one per graph arg whose source is None, in order
    # For each user leaf that is a tensor: the graph arg it is read from (a duplicate points
    # at the graph arg of the first occurrence; a synthetic-base member at its base).
    leaf_to_graph: tuple[tuple[UserArg, GraphArg], ...]

    @property
    def is_trivial(self) -> bool:
        return not self.synthetic_bases and len(self.graph_sources) == len(self.tensor_leaves)

    def format(self) -> str:
        """Which user input each graph arg is; duplicates and synthetic bases spelled out."""
        lines = ["# calling convention"]
        bases = iter(self.synthetic_bases)
        for g, src in enumerate(self.graph_sources):
            if src is not None:
                lines.append(f"graph_arg{g} = user_arg{src}")
            else:
                base = next(bases)
                kind = "their common ._base" if base.base_is_common else "their storage"
                members = ", ".join(f"user_arg{m}" for m in base.members)
                lines.append(f"graph_arg{g} = synthetic base of {members} ({kind})")
        first = {g: leaf for leaf, g in reversed(self.leaf_to_graph)}
        for leaf, g in self.leaf_to_graph:
            src = self.graph_sources[g]
            if src is not None and src != leaf:
                lines.append(f"user_arg{leaf} is a duplicate of user_arg{first[g]} (deduped)")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class FwdOutputPlan:
    """What the forward graph returns, in FwdOut order, and which outputs get tangents."""

    user_outs: tuple[UserOut, ...]  # FRESH, ALIAS_OF_INTERMEDIATE, ALIAS_OF_OUTPUT user outputs
    mutated_args: tuple[GraphArg, ...]  # graph args with data mutations: their new values
    num_intermediate_bases: int
    needs_tangent: tuple[bool, ...]  # len == num fwd outputs; True: differentiable output
    num_root_values: int = 0  # last: values of detached aliases with history (RootGrad.HISTORY)

    @property
    def num_outputs(self) -> int:
        return (
            len(self.user_outs)
            + len(self.mutated_args)
            + self.num_intermediate_bases
            + self.num_root_values
        )


NODE_SOURCE_KEY = "aotc_source"  # node.meta[NODE_SOURCE_KEY]: NodeSource
# node.meta[ONCE_DIFFERENTIABLE_KEY] = True: computed by a `@once_differentiable` backward (Note
# [Once-differentiable backwards] in aotc/oncediff.py); kept by the cache's graph codec.
ONCE_DIFFERENTIABLE_KEY = "aotc_once_differentiable"


@dataclass(frozen=True, slots=True)
class NodeSource:
    """Where one graph node comes from in the user's program: `node.meta["aotc_source"]`.

    Set by aotc/provenance.py after tracing, read by passes/provenance.py; kept through the
    partition (nodes are copied with their meta) and the compile cache.
    """

    module: str  # nn.Module path ("transformer.h.0.attn"); "" at the top level or unknown
    module_type: str  # its class name ("GPT2Attention"); "" when unknown
    line: str  # "file:line  code" of the innermost user frame; "" when unknown
    backward: bool  # computed by the backward of the forward op at `module` / `line`
