"""Split a large sum with few results into two sums, so its first kernel has enough programs.

Stage: `split_reductions(module) -> fx.GraphModule` (a new module, or the input itself when no
sum qualifies; the input is never changed).
Requires: a decomposed functional ATen fx graph with `meta["val"]` on every node.
Ensures: every qualifying `aten.sum` (see Note [Split reductions]) becomes a view that splits one
reduced dim in two, a first sum that keeps the outer half of that dim (the partial sums), a second
sum over the partials, and a view back to the original result's shape; the result's size, dtype
and strides are unchanged. Every new node carries `meta["val"]`.

Worked example, the bias gradient of a linear layer on float[16384, 4096]:

    before: sum_1 = aten.sum.dim_IntList(g, [0])                       # 4096 results
    after:  view = aten.view(g, [16, 1024, 4096])
            partial = aten.sum.dim_IntList(view, [1], dtype=float32)   # float[16, 4096]
            total = aten.sum.dim_IntList(partial, [0])                 # float[4096]

Note [Split reductions]
~~~~~~~~~~~~~~~~~~~~~~~
A generated reduction kernel gives each program whole rows of the result (XBLOCK results,
each reduced over all of `rnumel`). A sum with few results over many elements (a bias or
LayerNorm weight gradient: 4096 results of 16384 rows each; a loss summed to one number) then
runs on a handful of programs, each streaming megabytes alone, while most of the GPU's
multiprocessors sit idle. Splitting one reduced dim `n` into `(s, n // s)` and keeping `s`
turns it into `s` times as many results of `1/s` the work, then a small second sum over `s`.
The partial sums are float32 for half types (eager accumulates half sums in float32 and rounds
once), so the split only changes the order of additions, as eager's own reduction trees do.

Heuristic: ~1024 programs (8 per multiprocessor of an H100/H200) in the first kernel. A sum
over the innermost dims gives each program about one result (a whole row: softmax's, a
LayerNorm's statistics), so it splits with fewer than `TARGET_ROWS` results; a sum over rows
(the reduced dims are not the innermost, `reduces_rows` in passes.fusion) gives each program a
block of ~64 contiguous results (runtime.kernels.candidate_configs), so it splits with fewer
than `TARGET_RESULTS`. A split needs at least `MIN_REDUCED` elements reduced; `s` is the
smallest power of two reaching the target, capped so that each partial still sums at least
`MIN_PER_PARTIAL` elements, and must divide the size of the reduced dim split (the one with
the largest stride among those it divides). No split when that leaves `s < 4`, for symbolic
sizes, or for integer and complex sums (exact or rare). Measured on an H200: splitting softmax's
row sums too (16384 rows of 4096, when every sum with fewer than 65536 results split) took its
forward+backward from 0.59 to 0.36 of the copy bandwidth (bench/results/gpu.json history in
docs/figures.md); the target for sums over rows is not yet measured against alternatives.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import fx

aten = torch.ops.aten

MIN_REDUCED = 4096
TARGET_RESULTS = 65536  # a sum over rows (the reduced dims are not the innermost)
TARGET_ROWS = 1024  # a sum over the innermost dims (a row per result)
MIN_PER_PARTIAL = 256
MIN_SPLIT = 4

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def split_reductions(module: fx.GraphModule) -> fx.GraphModule:
    plans = [(n, p) for n in module.graph.nodes if (p := _plan(n)) is not None]
    if not plans:
        return module
    out = fx.GraphModule(module, copy.deepcopy(module.graph))
    by_name = {n.name: n for n in out.graph.nodes}
    for node, plan in plans:
        _rewrite(out.graph, by_name[node.name], *plan)
    out.graph.lint()
    out.recompile()
    return out


def _plan(node: fx.Node) -> tuple[list[int], list[int], int] | None:
    """(view shape, dims the first sum reduces, position of the kept split dim) or None."""
    if node.op != "call_function" or node.target not in (aten.sum.dim_IntList, aten.sum.default):
        return None
    src, out = node.args[0], node.meta.get("val")
    val = src.meta.get("val") if isinstance(src, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if val.dtype not in _FLOATS or val.dim() == 0:
        return None
    if out.dtype != val.dtype and out.dtype not in (torch.float32, torch.float64):
        return None  # a sum that rounds its input to a narrower type first (rare): kept whole
    if not all(isinstance(s, int) for s in (*val.shape, *val.stride())):
        return None  # symbolic sizes: one kernel serves every size, no split is fixed
    dims_arg = node.args[1] if node.target is aten.sum.dim_IntList and len(node.args) > 1 else None
    if dims_arg is not None and not (
        isinstance(dims_arg, (list, tuple)) and all(isinstance(d, int) for d in dims_arg)
    ):
        return None
    dims: list[int] = (
        sorted({int(d) % val.dim() for d in dims_arg}) if dims_arg else list(range(val.dim()))
    )
    reduced = math.prod(val.shape[d] for d in dims)
    results = val.numel() // max(reduced, 1)
    kept = [d for d in range(val.dim()) if val.shape[d] != 1]
    rows = [d for d in dims if val.shape[d] != 1]
    target = TARGET_RESULTS if rows != kept[len(kept) - len(rows) :] else TARGET_ROWS
    if reduced < MIN_REDUCED or results >= target or results == 0:
        return None
    want = 1 << max(0, math.ceil(math.log2(target / results)))
    cap = reduced // MIN_PER_PARTIAL
    s = min(want, 1 << max(0, cap.bit_length() - 1))
    candidates = sorted(dims, key=lambda d: -val.stride()[d])
    while s >= MIN_SPLIT:
        for d in candidates:
            if val.shape[d] % s == 0 and val.shape[d] > s:
                shape = [*val.shape[:d], s, val.shape[d] // s, *val.shape[d + 1 :]]
                first = [e + (1 if e > d else 0) for e in dims if e != d] + [d + 1]
                return shape, sorted(first), d
        s //= 2
    return None


def _rewrite(graph: fx.Graph, node: fx.Node, shape: list[int], first: list[int], d: int) -> None:
    src = node.args[0]
    assert isinstance(src, fx.Node)
    val, out = src.meta["val"], node.meta["val"]
    acc = torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype
    with graph.inserting_before(node):
        view = graph.call_function(aten.view.default, (src, shape))
        view.meta["val"] = aten.view.default(val, shape)
        partial = graph.call_function(aten.sum.dim_IntList, (view, first), {"dtype": acc})
        partial.meta["val"] = aten.sum.dim_IntList(view.meta["val"], first, dtype=acc)
        total = graph.call_function(aten.sum.dim_IntList, (partial, [_kept(d, first)]))
        total.meta["val"] = aten.sum.dim_IntList(partial.meta["val"], total.args[1])
        result = total
        if total.meta["val"].dtype != out.dtype:
            result = graph.call_function(
                torch.ops.prims.convert_element_type.default, (total, out.dtype)
            )
            result.meta["val"] = torch.ops.prims.convert_element_type.default(
                total.meta["val"], out.dtype
            )
        if tuple(result.meta["val"].shape) != tuple(out.shape):
            shaped = graph.call_function(aten.view.default, (result, list(out.shape)))
            shaped.meta["val"] = aten.view.default(result.meta["val"], list(out.shape))
            result = shaped
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def _kept(d: int, first: list[int]) -> int:
    """Where the split's outer dim `d` sits among the dims the first sum keeps."""
    return d - sum(1 for e in first if e < d)
