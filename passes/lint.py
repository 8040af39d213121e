"""Graph invariants checked between stages when `check_invariants` is on.

Requires: a StageGraph. Ensures: it returns, or raises GraphInvariantError naming the node with
at most ten nodes of context either side.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from aotc.passes.ir import StageGraph
from aotc.runtime.errors import GraphInvariantError

_CONTEXT = 10

# Ops that mutate an argument without saying so in their schema.
_HIDDEN_MUTATIONS = frozenset(
    {"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"}
)


def lint_graph(graph: StageGraph, stage: str) -> None:
    placeholders = graph.placeholders()
    if len(placeholders) != len(graph.inputs):
        raise GraphInvariantError(
            f"[{stage}] {len(placeholders)} placeholders but {len(graph.inputs)} input descriptors"
        )
    outputs = graph.output_values()
    if len(outputs) != len(graph.outputs):
        raise GraphInvariantError(
            f"[{stage}] {len(outputs)} outputs but {len(graph.outputs)} output descriptors"
        )
    nodes = list(graph.module.graph.nodes)
    for i, node in enumerate(nodes):
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            if target._schema.is_mutable or target._schema.name in _HIDDEN_MUTATIONS:
                raise GraphInvariantError(
                    f"[{stage}] node {node.name} calls mutating op {target}; graphs must be "
                    f"functional.\n{_context(nodes, i)}"
                )
    graph.module.graph.lint()


def _context(nodes: list[fx.Node], i: int) -> str:
    lo, hi = max(0, i - _CONTEXT), min(len(nodes), i + _CONTEXT + 1)
    return "\n".join(
        ("> " if j == i else "  ") + (nodes[j].format_node() or "") for j in range(lo, hi)
    )
