"""The loop IR of one lowered graph: what `passes.lowering.lower` produces and fusion reads.

Records: `Computed` (a value a kernel computes into its own buffer), `Extern` (an fx node that
stays an ATen call), `LoweredGraph` (a graph's items in execution order, its buffers, outputs and
placeholders), `ReductionInfo`, `SymScalar`, `NodeKind`. All frozen: fusion and code generation
read them, nothing changes them after lowering.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import sympy
import torch
from torch import fx

from aotc.passes.loop_ir import IndexFn, Size, size_symbols


class NodeKind(enum.Enum):
    POINTWISE = "pointwise"
    REDUCTION = "reduction"


@dataclass(frozen=True)
class ReductionInfo:
    src_size: tuple[Size, ...]  # the size of the reduced input
    dims: tuple[int, ...]  # reduced dims of src_size, sorted
    # "sum", "max", "min", "prod", "any", "all", "argmax", "argmin"; or a scan, "cumsum" or
    # "cumprod", whose result has every element (size == src_size, see is_scan)
    kind: str

    @property
    def is_scan(self) -> bool:
        return self.kind in ("cumsum", "cumprod")

    @property
    def outer(self) -> tuple[Size, ...]:
        return tuple(s for d, s in enumerate(self.src_size) if d not in self.dims)

    @property
    def reduced(self) -> tuple[Size, ...]:
        return tuple(s for d, s in enumerate(self.src_size) if d in self.dims)


@dataclass(frozen=True)
class Computed:
    """A value computed by a generated kernel and stored to its own buffer."""

    name: str  # buffer name == the fx node's name
    kind: NodeKind
    size: tuple[Size, ...]
    stride: tuple[Size, ...]  # layout of the stored buffer
    dtype: torch.dtype
    fn: IndexFn  # POINTWISE: over `size`; REDUCTION: over `reduction.src_size`
    reduction: ReductionInfo | None
    origin: fx.Node
    reads: tuple[str, ...] = ()  # buffers the fn loads (sorted)
    cone: tuple[fx.Node, ...] = ()  # fx nodes to run as ATen if its kernel fails (graph order)

    @property
    def numel(self) -> Size:
        return _prod(self.size)

    @property
    def nbytes(self) -> Size:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class Extern:
    """An fx node that runs as an ATen call."""

    name: str
    node: fx.Node
    reads: tuple[str, ...]


Item = Computed | Extern


@dataclass(frozen=True)
class LoweredGraph:
    module: fx.GraphModule
    items: tuple[Item, ...]  # execution order
    buffers: dict[str, tuple[tuple[Size, ...], tuple[Size, ...], int, torch.dtype]]
    outputs: tuple[object, ...]  # per graph output: a buffer name (str) or a constant
    placeholders: tuple[str, ...]
    aliases: dict[str, str]  # fx node name -> buffer name, where they differ (ATen args)

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        """The size symbols of the graph's buffers, sorted by name (empty for static sizes)."""
        syms: set[sympy.Symbol] = set()
        for size, stride, _, _ in self.buffers.values():
            syms |= size_symbols((*size, *stride))
        return tuple(sorted(syms, key=str))


class Unsupported(Exception):
    pass


@dataclass(frozen=True)
class SymScalar:
    """A SymInt argument of an op (a size computed in the graph) as a sympy expression."""

    expr: sympy.Expr


def _prod(xs: Sequence[Size]) -> Size:
    out: Size = 1
    for x in xs:
        out = out * (x if isinstance(x, sympy.Basic) and not x.is_Integer else int(x))
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


__all__ = [
    "Computed",
    "Extern",
    "Item",
    "LoweredGraph",
    "NodeKind",
    "ReductionInfo",
    "SymScalar",
    "Unsupported",
]
