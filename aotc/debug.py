"""Inspection data: a compiled signature's graph as plain JSON for the CLI and the HTML report.

`graph_json(record) -> dict`: every node of the partitioned joint graph with its op, shape, dtype,
inputs and side of the cut (`forward`, `backward`, `both` = recomputed, or `tangent`), whether the
forward saves it, its user module path and source line (passes/provenance.py), the readable name
of an input and of the parameter a gradient is for, and one line of code. `failure_json` is the
same file for a compile that failed. Deterministic: nodes in graph order, keys sorted by the
writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from aotc.passes.descriptors import GradOutput, PrimalInput, describe
from aotc.passes.ir import describe_named
from aotc.passes.provenance import describe_source, source_of

if TYPE_CHECKING:
    from aotc.pipeline import CompiledRecord, FailedCompile

_MAX_CODE = 240  # characters of one node's code line in the JSON


def _node_info(node: fx.Node) -> dict[str, Any]:
    val = node.meta.get("val")
    info: dict[str, Any] = {"name": node.name, "op": node.op}
    if node.op == "call_function":
        info["target"] = str(node.target)
    if isinstance(val, torch.Tensor):
        info["shape"] = [str(s) if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
        info["dtype"] = str(val.dtype).removeprefix("torch.")
    info["inputs"] = [i.name for i in node.all_input_nodes]
    source = source_of(node)
    text = describe_source(source)
    if text:
        info["source"] = text
    if source.module:
        info["module"] = source.module
        info["module_type"] = source.module_type
    if source.line:
        info["line"] = source.line
    if node.op == "call_function":
        info["code"] = node_code(node)
    return info


def node_code(node: fx.Node) -> str:
    """`name = target(args)` for one node, with input nodes by name, cut at _MAX_CODE."""

    def arg(a: object) -> str:
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        return repr(a)

    parts = [arg(a) for a in node.args] + [f"{k}={arg(v)}" for k, v in node.kwargs.items()]
    text = f"{node.name} = {node.target}({', '.join(parts)})"
    return text if len(text) <= _MAX_CODE else text[: _MAX_CODE - 3] + "..."


def graph_json(record: CompiledRecord, dynamo_compile_id: str | None = None) -> dict[str, Any]:
    graph = record.partitioned_joint
    fwd_names = {n.name for n in record.forward.graph.nodes if n.op != "output"}
    bwd_names = (
        {n.name for n in record.backward.graph.nodes if n.op not in ("output", "placeholder")}
        if record.backward is not None
        else set()
    )
    part = record.partition
    saved = {s.name for s in part.saved} if part is not None else set()
    arg_names = record.graph_arg_names
    roles = {n.name: d for n, d in zip(graph.placeholders(), graph.inputs)}
    grads = {
        v.name: arg_names[d.arg]
        for v, d in zip(graph.output_values(), graph.outputs)
        if isinstance(v, fx.Node) and isinstance(d, GradOutput) and d.arg < len(arg_names)
    }
    nodes = []
    for node in graph.module.graph.nodes:
        if node.op == "output":
            continue
        info = _node_info(node)
        in_fwd, in_bwd = node.name in fwd_names, node.name in bwd_names
        if node.name in roles:
            desc = roles[node.name]
            info["role"] = describe(desc)
            info["side"] = "tangent" if info["role"].startswith("tangent") else "forward"
            if isinstance(desc, PrimalInput) and desc.arg < len(arg_names):
                info["input_name"] = arg_names[desc.arg]
        else:
            info["side"] = "both" if in_fwd and in_bwd else "backward" if in_bwd else "forward"
        if node.name in grads:
            info["grad_of"] = grads[node.name]
        info["saved"] = node.name in saved
        nodes.append(info)
    outputs = [
        {
            "value": v.name if isinstance(v, fx.Node) else repr(v),
            "role": describe_named(d, arg_names),
        }
        for v, d in zip(graph.output_values(), graph.outputs)
    ]
    return {
        "name": record.name,
        "source": record.source,
        "training": record.training,
        "nodes": nodes,
        "outputs": outputs,
        "input_names": list(arg_names),
        "saved_bytes": record.saved_bytes,
        "save_everything_bytes": part.save_everything_bytes if part is not None else 0,
        "recomputed": list(part.recomputed) if part is not None else [],
        "compile_seconds": record.stage_seconds,
        "cache_hit": record.is_cache_hit,
        "cold_compile_seconds": record.cold_stage_seconds,
        "kernels": [k.name for k in record.kernels],
        "dynamo_compile_id": dynamo_compile_id,
        "failed": False,
    }


def failure_json(failure: FailedCompile, dynamo_compile_id: str | None = None) -> dict[str, Any]:
    return {
        "name": failure.name,
        "source": failure.source,
        "training": False,
        "nodes": [],
        "outputs": [],
        "saved_bytes": 0,
        "save_everything_bytes": 0,
        "recomputed": [],
        "compile_seconds": failure.stage_seconds,
        "dynamo_compile_id": dynamo_compile_id,
        "failed": True,
        "error_type": failure.error_type,
        "error": failure.error,
    }


def current_dynamo_compile_id() -> str | None:
    """The Dynamo compile id ("frame/compile", e.g. "1/0") of the compile running now, or None
    outside Dynamo (what `aotc explain` and the report join Dynamo's records on)."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_id is None:
        return None
    return f"{compile_id.frame_id}/{compile_id.frame_compile_id}"
