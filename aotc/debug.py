"""Inspection data: a compiled signature's graph as plain JSON for the CLI and the HTML report.

`graph_json(record) -> dict`: every node of the partitioned joint graph with its op, shape, dtype,
inputs and side of the cut (`forward`, `backward`, `both` = recomputed, or `tangent`), and
whether the forward saves it. Deterministic: nodes in graph order, keys sorted by the writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from aotc.passes.descriptors import describe
from aotc.passes.partition import source_line

if TYPE_CHECKING:
    from aotc.pipeline import CompiledRecord


def _node_info(node: fx.Node) -> dict[str, Any]:
    val = node.meta.get("val")
    info: dict[str, Any] = {"name": node.name, "op": node.op}
    if node.op == "call_function":
        info["target"] = str(node.target)
    if isinstance(val, torch.Tensor):
        info["shape"] = list(val.shape)
        info["dtype"] = str(val.dtype).removeprefix("torch.")
    info["inputs"] = [i.name for i in node.all_input_nodes]
    source = source_line(node)
    if source:
        info["source"] = source
    return info


def graph_json(record: CompiledRecord) -> dict[str, Any]:
    graph = record.partitioned_joint
    fwd_names = {n.name for n in record.forward.graph.nodes if n.op != "output"}
    bwd_names = (
        {n.name for n in record.backward.graph.nodes if n.op not in ("output", "placeholder")}
        if record.backward is not None
        else set()
    )
    part = record.partition
    saved = {s.name for s in part.saved} if part is not None else set()
    roles = {n.name: describe(d) for n, d in zip(graph.placeholders(), graph.inputs)}
    nodes = []
    for node in graph.module.graph.nodes:
        if node.op == "output":
            continue
        info = _node_info(node)
        in_fwd, in_bwd = node.name in fwd_names, node.name in bwd_names
        if node.name in roles:
            info["role"] = roles[node.name]
            info["side"] = "tangent" if roles[node.name].startswith("tangent") else "forward"
        else:
            info["side"] = "both" if in_fwd and in_bwd else "backward" if in_bwd else "forward"
        info["saved"] = node.name in saved
        nodes.append(info)
    outputs = [
        {"value": v.name if isinstance(v, fx.Node) else repr(v), "role": describe(d)}
        for v, d in zip(graph.output_values(), graph.outputs)
    ]
    return {
        "name": record.name,
        "source": record.source,
        "training": record.training,
        "nodes": nodes,
        "outputs": outputs,
        "saved_bytes": record.saved_bytes,
        "save_everything_bytes": part.save_everything_bytes if part is not None else 0,
        "recomputed": list(part.recomputed) if part is not None else [],
        "compile_seconds": record.stage_seconds,
    }
