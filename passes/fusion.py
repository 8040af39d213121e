"""The kernel scheduler: group loop-IR nodes into fused kernels and decide what is stored.

Stage: `plan_fusion(lowered: LoweredGraph) -> FusionPlan`.
Requires: `passes.lowering.lower` output (items in a valid execution order).
Ensures: every `Computed` item is in exactly one `FusionGroup`, every `Extern` in its own group;
`FusionPlan.groups` is in a valid execution order (contracting a group creates no cycle). A
member is stored only when something outside its group reads it or it is a graph output; inside
a group, pointwise values are recomputed by their consumers (the emitted code shares common
subexpressions, so the same element is computed once) and reduction results stay in registers.

A group iterates over rows `x < xnumel` and, for reductions, `r < rnumel` within a row:

- vertical fusion: a pointwise consumer inlines its producers (see passes.lowering);
- horizontal fusion: independent nodes with the same iteration space share one kernel;
- reduction fusion: pointwise nodes of size `xnumel * rnumel` (prologue and epilogue: softmax's
  `exp(x - max) / sum`) and of size `xnumel` (LayerNorm's `rsqrt(var + eps)`) join a reduction
  when every reduction result they read is read at their own row `x` (see Note [Index
  simplification] in passes.loop_ir).

Note [Epilogues join their reduction]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pointwise node of size `x * r` fits any reduction group whose `xnumel * rnumel` equals its
size, including one that reduces over the other dim (LayerNorm's backward: the weight and bias
gradients sum over rows, the input gradient is a row epilogue of the per-row sums). Joined to the
column reduction it is evaluated in that group's transposed iteration order, so it re-reads the
inputs the row reduction already loaded and its stores are no better than strided; joined to the
row reduction it reuses those loads. So a pointwise node tries the groups of the reductions it
reads first (newest first), then every other group in the window, newest first.

Note [Random ops keep their order]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Random ops (ATen calls tagged `nondeterministic_seeded`: dropout, randn, bernoulli) draw from
the generator in the order they run, so they must run in graph order: grouping only orders
groups by data dependencies, and a random op no value depends on (dropout whose output is
unused, or that only later groups read) could otherwise move past the next one and swap their
draws. Each random op's group depends on the previous random op's group, in joining (cycle
checks) as in ordering.

Note [Full-size members of row reductions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pointwise member of size `x * r` is evaluated at the flat index `x * rnumel + r`: in memory
order when the group reduces the innermost dims (softmax), but not when it reduces over rows (a
bias gradient `g.sum(0)`: x walks the columns, r the rows). Such a group would read its inputs in
two orders, once for the member, once inlined into the sum, and its wide column blocks (see
`KernelSource.outer`) would not suit the member's row-order loads and stores. A member that is
fused (inlined) into the sum alone never appears as a group member: lowering inlines a pointwise
producer with one consumer, so the members in question are values something else reads too
(ReLU's gradient feeds the weight gradient's matmul as well). So a reduction over rows never
shares a group with full-size pointwise members: those run in their own kernel, which stores the
value once, and the sum reads it back in column blocks.

Worked example, softmax over the last dim of a float[4, 5] `x`:

    group 0 REDUCTION x=4 r=5: amax, sum_1 (registers), div (stored)
        bytes_read=80 bytes_written=80
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import sympy
import torch

from aotc.passes.loop_ir import (
    Expr,
    IndexValue,
    Indirect,
    Load,
    Op,
    Ranges,
    Size,
    at_least_one,
    at_most_one,
    dense_order,
    flat_index,
    floordiv,
    index_symbol,
    is_static,
    loads_of,
    mod,
    simplify,
    unflatten,
    with_mask,
)
from aotc.passes.lowering_ir import Computed, Extern, Item, LoweredGraph, _itemsize, _prod

XINDEX = index_symbol("xindex")
RINDEX = index_symbol("rindex")
YINDEX = index_symbol("yindex")  # rows of a 2-D tiled pointwise kernel (x is then the column)

# Heuristic: how many recent groups a node may join; bounds scheduling time on large graphs.
FUSION_WINDOW = 16
# Heuristic: members per kernel, so generated source stays readable and compiles quickly.
MAX_GROUP_MEMBERS = 48


class GroupKind(enum.Enum):
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    EXTERN = "extern"


@dataclass(frozen=True)
class FusionGroup:
    name: str  # readable kernel name, e.g. "reduction_amax_sub_exp_sum_div"
    kind: GroupKind
    members: tuple[Item, ...]  # execution order
    xnumel: Size  # a sympy expression when sizes are symbolic
    rnumel: Size  # 1 for pointwise groups
    stores: tuple[str, ...]  # member buffers written to memory
    reads: tuple[str, ...]  # buffers read from outside the group (sorted)
    bytes_read: Size
    bytes_written: Size
    source_ops: tuple[str, ...]  # the fx nodes fused, "name = target" in graph order

    def format(self) -> str:
        names = ", ".join(m.name for m in self.members)
        if self.kind is GroupKind.EXTERN:
            return f"{self.name} EXTERN: {names}"
        return (
            f"{self.name} {self.kind.name} x={self.xnumel} r={self.rnumel}: {names}; "
            f"stores {', '.join(self.stores) or '-'}; bytes_read={self.bytes_read} "
            f"bytes_written={self.bytes_written}"
        )


@dataclass(frozen=True)
class FusionPlan:
    lowered: LoweredGraph
    groups: tuple[FusionGroup, ...]  # execution order

    @property
    def kernel_groups(self) -> tuple[FusionGroup, ...]:
        return tuple(g for g in self.groups if g.kind is not GroupKind.EXTERN)

    def format(self) -> str:
        return "# stage: fusion\n" + "\n".join(g.format() for g in self.groups) + "\n"


# ---- iteration spaces ----------------------------------------------------------------------


def group_ranges(xnumel: Size, rnumel: Size, cols: int = 0) -> Ranges:
    if cols:
        return {XINDEX: cols, YINDEX: max(xnumel // cols, 1), RINDEX: 1}
    return {XINDEX: at_least_one(xnumel), RINDEX: at_least_one(rnumel)}


def member_index(comp: Computed, xnumel: int, rnumel: int, cols: int = 0) -> list[sympy.Expr]:
    """The index at which a member is evaluated (its src index for a reduction). With `cols`,
    a pointwise group is tiled 2-D: the flat index is `yindex * cols + xindex`."""
    ranges = group_ranges(xnumel, rnumel, cols)
    if cols:
        return unflatten(YINDEX * cols + XINDEX, comp.size, ranges)
    if comp.reduction is not None:
        red = comp.reduction
        outer = iter(unflatten(XINDEX, red.outer, ranges))
        inner = iter(unflatten(RINDEX, red.reduced, ranges))
        return [next(inner) if d in red.dims else next(outer) for d in range(len(red.src_size))]
    flat = XINDEX if _same(comp.numel, xnumel) or _same(rnumel, 1) else XINDEX * rnumel + RINDEX
    return unflatten(flat, comp.size, ranges)


def is_row_level(comp: Computed, xnumel: int, rnumel: int) -> bool:
    """A pointwise member with one element per row (computed outside the r loop)."""
    return comp.reduction is None and (_same(comp.numel, xnumel) or _same(rnumel, 1))


def _same(a: Size, b: Size) -> bool:
    """Equal sizes; symbolic ones by structure (sympy's canonical form), never by a guard."""
    return a == b


def store_index(comp: Computed, xnumel: int, rnumel: int, cols: int = 0) -> sympy.Expr:
    ranges = group_ranges(xnumel, rnumel, cols)
    if comp.reduction is not None and not comp.reduction.is_scan:  # a scan stores every element
        red = comp.reduction
        outer = iter(unflatten(XINDEX, red.outer, ranges))
        keep = len(comp.size) == len(red.src_size)
        idx = [sympy.Integer(0) if d in red.dims else next(outer) for d in range(len(red.src_size))]
        if not keep:
            idx = [i for d, i in enumerate(idx) if d not in red.dims]
        return simplify(flat_index(idx, comp.stride), ranges)
    return simplify(flat_index(member_index(comp, xnumel, rnumel, cols), comp.stride), ranges)


def _storage_to_index(comp: Computed, offset: sympy.Expr) -> list[sympy.Expr]:
    if all(is_static(v) for v in (*comp.size, *comp.stride)):
        order = sorted(range(len(comp.size)), key=lambda d: -comp.stride[d])
    else:
        inner_first = dense_order(comp.size, comp.stride)
        if inner_first is None:
            raise FusionMismatch(f"{comp.name}: layout with symbolic strides not provably dense")
        order = inner_first[::-1]
    idx: list[sympy.Expr] = [sympy.Integer(0)] * len(comp.size)
    for d in order:
        if not at_most_one(comp.size[d]):
            idx[d] = mod(floordiv(offset, comp.stride[d], {}), comp.size[d], {})
    return idx


class FusionMismatch(Exception):
    pass


def expand(
    e: Expr, inline: dict[str, Computed], rows: dict[str, sympy.Expr], ranges: Ranges
) -> Expr:
    """`e` with loads of in-group pointwise members replaced by their computation and every
    index simplified. Loads of in-group reductions must be at the row (`rows[buf]`), else
    FusionMismatch. A masked load of a member masks every load of its computation."""
    if isinstance(e, Load):
        mask = None if e.mask is None else simplify(e.mask, ranges)
        mask = None if mask is sympy.true else mask
        if e.buf in inline:
            producer = inline[e.buf]
            value = producer.fn(_storage_to_index(producer, e.index))
            return expand(value if mask is None else with_mask(value, mask), inline, rows, ranges)
        index = simplify(e.index, ranges)
        if e.buf in rows and index != rows[e.buf]:
            raise FusionMismatch(f"{e.buf} read at {index}, computed at {rows[e.buf]}")
        return Load(e.buf, index, mask)
    if isinstance(e, IndexValue):
        return IndexValue(simplify(e.index, ranges), e.dtype)
    if isinstance(e, Op):
        return Op(e.name, tuple(expand(a, inline, rows, ranges) for a in e.args), e.dtype)
    if isinstance(e, Indirect):  # see Note [Data-dependent indices] in passes.loop_ir
        inner = {**ranges, e.symbol: e.size}
        return Indirect(
            e.symbol,
            expand(e.index, inline, rows, ranges),
            e.size,
            expand(e.body, inline, rows, inner),
        )
    return e


def member_expr(
    comp: Computed, members: Sequence[Computed], xnumel: int, rnumel: int, cols: int = 0
) -> Expr:
    ranges = group_ranges(xnumel, rnumel, cols)
    inline = {m.name: m for m in members if m.reduction is None and m is not comp}
    rows = {m.name: store_index(m, xnumel, rnumel) for m in members if m.reduction is not None}
    return expand(comp.fn(member_index(comp, xnumel, rnumel, cols)), inline, rows, ranges)


def tile_columns(group: FusionGroup) -> int:
    """Columns of a 2-D tiling for a pointwise group that reads some input transposed (unit
    stride along rows, not along columns), so both the reads and the writes can be coalesced;
    0 for a 1-D kernel.

    Heuristic: tile when the last dim of the first member is > 1 and some load has unit stride
    along the rows; otherwise the 1-D flat index is already contiguous."""
    members = [m for m in group.members if isinstance(m, Computed)]
    if group.kind is not GroupKind.POINTWISE or not members or len(members[0].size) < 2:
        return 0
    if not is_static(group.xnumel) or not all(is_static(s) for s in members[0].size):
        return 0  # Heuristic: symbolic sizes get 1-D kernels (the tile shape is fixed at codegen)
    cols = members[0].size[-1]
    if cols <= 1 or group.xnumel // cols <= 1 or any(m.numel != group.xnumel for m in members):
        return 0
    for m in members:
        for load in loads_of(member_expr(m, members, group.xnumel, 1, cols)):
            e = sympy.expand(load.index)
            if e.coeff(YINDEX) == 1 and e.coeff(XINDEX) != 1:
                return cols
    return 0


# ---- scheduling ----------------------------------------------------------------------------


@dataclass
class _Group:
    members: list[Computed]
    externs: list[Extern]
    xnumel: Size
    rnumel: Size
    first: int  # item position of the first member

    def items(self) -> list[Computed | Extern]:
        return [*self.members, *self.externs]

    def is_reduction(self) -> bool:
        return any(m.reduction is not None for m in self.members)


def _space(comp: Computed) -> tuple[Size, Size]:
    if comp.reduction is not None:
        return _prod(comp.reduction.outer), _prod(comp.reduction.reduced)
    return comp.numel, 1


def reduces_rows(comp: Computed) -> bool:
    """A reduction over dims that are not the innermost of its input (ignoring size-1 dims):
    a sum over rows, like a bias gradient. See Note [Full-size members of row reductions]."""
    red = comp.reduction
    if red is None or red.is_scan:
        return False
    kept = [d for d, s in enumerate(red.src_size) if s != 1]
    dims = [d for d in red.dims if red.src_size[d] != 1]
    return dims != kept[len(kept) - len(dims) :]


def _fits(group: _Group, comp: Computed) -> tuple[Size, Size] | None:
    """The group's iteration space with `comp` added, or None."""
    if group.externs or len(group.members) >= MAX_GROUP_MEMBERS:
        return None
    x, r = _space(comp)
    if reduces_rows(comp) and any(
        m.reduction is None and not _same(m.numel, x) for m in group.members
    ):
        return None  # Note [Full-size members of row reductions]
    if (
        comp.reduction is None
        and any(reduces_rows(m) for m in group.members)
        and not _same(x, group.xnumel)
    ):
        return None
    if comp.reduction is None:
        if group.rnumel == 1 and not group.is_reduction():
            return (group.xnumel, 1) if x == group.xnumel else None
        return (
            (group.xnumel, group.rnumel)
            if x in (group.xnumel, group.xnumel * group.rnumel)
            else None
        )
    if group.is_reduction():
        return (x, r) if (x, r) == (group.xnumel, group.rnumel) else None
    if all(m.numel in (x, x * r) for m in group.members):
        return x, r
    return None


def _valid(members: Sequence[Computed], xnumel: Size, rnumel: Size) -> bool:
    try:
        for m in members:
            member_expr(m, members, xnumel, rnumel)
    except FusionMismatch:
        return False
    return True


def _draws_random(item: Item) -> bool:
    target = getattr(item.node, "target", None) if isinstance(item, Extern) else None
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def plan_fusion(lowered: LoweredGraph) -> FusionPlan:
    groups: list[_Group] = []
    group_of: dict[str, int] = {}  # buffer name -> group position
    # Note [Random ops keep their order]: each random op's group runs after the previous one's
    after: dict[int, set[int]] = {}
    last_random: int | None = None
    for pos, item in enumerate(lowered.items):
        deps = {group_of[b] for b in item.reads if b in group_of}
        if _draws_random(item) and last_random is not None:
            deps.add(last_random)
        target = None
        if isinstance(item, Computed):
            window = range(len(groups) - 1, max(len(groups) - FUSION_WINDOW, 0) - 1, -1)
            # Note [Epilogues join their reduction]: a pointwise node that reads a reduction's
            # result tries that reduction's group first, then the most recent group that fits.
            producers = (
                [g for g in window if g in deps and groups[g].is_reduction()]
                if item.reduction is None
                else []
            )
            for g in [*producers, *(g for g in window if g not in producers)]:
                space = _fits(groups[g], item)
                if space is None or _creates_cycle(groups, group_of, g, deps, after):
                    continue
                if _valid([*groups[g].members, item], *space):
                    target = g
                    groups[g].xnumel, groups[g].rnumel = space
                    break
        if target is None:
            x, r = _space(item) if isinstance(item, Computed) else (0, 0)
            groups.append(_Group([], [], x, r, pos))
            target = len(groups) - 1
        if isinstance(item, Computed):
            groups[target].members.append(item)
        else:
            groups[target].externs.append(item)
        group_of[item.name] = target
        if _draws_random(item):
            if last_random is not None and last_random != target:
                after.setdefault(target, set()).add(last_random)
            last_random = target
    order = _toposort(groups, group_of, after)
    outputs = {o for o in lowered.outputs if isinstance(o, str)}
    readers: dict[str, set[int]] = {}
    for gi, grp in enumerate(groups):
        for item in grp.items():
            for b in item.reads:
                readers.setdefault(b, set()).add(gi)
    records = []
    for k, gi in enumerate(order):
        records.append(_record(groups[gi], gi, k, lowered, outputs, readers))
    return FusionPlan(lowered, tuple(records))


def _deps_of(
    group: _Group, group_of: dict[str, int], self_pos: int, after: dict[int, set[int]]
) -> set[int]:
    out = set(after.get(self_pos, ())) - {self_pos}
    for item in group.items():
        for b in item.reads:
            if b in group_of and group_of[b] != self_pos:
                out.add(group_of[b])
    return out


def _creates_cycle(
    groups: list[_Group],
    group_of: dict[str, int],
    target: int,
    deps: set[int],
    after: dict[int, set[int]],
) -> bool:
    """Would a node depending on `deps` joining `target` make `target` depend on itself?"""
    stack = [d for d in deps if d != target]
    seen: set[int] = set()
    while stack:
        g = stack.pop()
        if g == target:
            return True
        if g in seen:
            continue
        seen.add(g)
        stack.extend(_deps_of(groups[g], group_of, g, after))
    return False


def _toposort(
    groups: list[_Group], group_of: dict[str, int], after: dict[int, set[int]]
) -> list[int]:
    deps = [_deps_of(g, group_of, i, after) for i, g in enumerate(groups)]
    done: set[int] = set()
    order: list[int] = []
    remaining = sorted(range(len(groups)), key=lambda i: groups[i].first)
    while remaining:
        for i in remaining:
            if deps[i] <= done:
                order.append(i)
                done.add(i)
                remaining.remove(i)
                break
        else:
            raise AssertionError("fusion produced a cycle; this is a bug in aotc")
    return order


def _record(
    group: _Group,
    gi: int,
    k: int,
    lowered: LoweredGraph,
    outputs: set[str],
    readers: dict[str, set[int]],
) -> FusionGroup:
    if group.externs:
        ext = group.externs[0]
        return FusionGroup(
            f"extern_{ext.name}",
            GroupKind.EXTERN,
            tuple(group.externs),
            0,
            0,
            (ext.name,),
            ext.reads,
            0,
            0,
            (_op_text(ext.node),),
        )
    names = {m.name for m in group.members}
    stores = tuple(
        m.name for m in group.members if m.name in outputs or readers.get(m.name, set()) - {gi}
    )
    reads = sorted({b for m in group.members for b in m.reads} - names)
    bytes_read = sum(_nbytes(lowered, b) for b in reads)
    bytes_written = sum(_nbytes(lowered, b) for b in stores)
    cone = sorted(
        {n for m in group.members for n in m.cone},
        key=lambda n: list(lowered.module.graph.nodes).index(n),
    )
    ops = []
    for n in cone:
        op = _short(n)
        if op not in ops and op not in ("view", "permute", "expand", "getitem", "unsqueeze"):
            ops.append(op)
    kind = GroupKind.REDUCTION if group.is_reduction() else GroupKind.POINTWISE
    name = "_".join(
        [kind.value[:3] if kind is GroupKind.REDUCTION else "pw", *(ops[:5] or ["copy"])]
    )
    return FusionGroup(
        f"{name}_{k}",
        kind,
        tuple(group.members),
        group.xnumel,
        group.rnumel,
        stores,
        tuple(reads),
        bytes_read,
        bytes_written,
        tuple(_op_text(n) for n in cone),
    )


def _short(node: object) -> str:
    target = getattr(node, "target", None)
    name = getattr(target, "__name__", str(target)).split(".")[0]
    return "".join(c for c in name if c.isalnum() or c == "_").strip("_") or "op"


def _op_text(node: object) -> str:
    return f"{node.name} = {node.target}"  # type: ignore[attr-defined]


def _nbytes(lowered: LoweredGraph, buf: str) -> Size:
    if buf not in lowered.buffers:
        return 0
    size, _, _, dtype = lowered.buffers[buf]
    return _prod(size) * _itemsize(dtype)
