"""Graph records: a joint graph, or one stage graph (forward or backward), with the role of every
placeholder and output.

Ensures: `len(inputs)` == number of placeholders, `len(outputs)` == number of output values,
both in graph order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from aotc.passes.descriptors import InputDesc, OutputDesc, describe


@dataclass(frozen=True, slots=True)
class StageGraph:
    module: fx.GraphModule
    inputs: tuple[InputDesc, ...]  # len == num placeholders; graph order
    outputs: tuple[OutputDesc, ...]  # len == num outputs; graph order

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.module.graph.nodes if n.op == "placeholder"]

    def output_values(self) -> list[object]:
        out = next(n for n in reversed(self.module.graph.nodes) if n.op == "output")
        return list(out.args[0])

    def format(self, stage: str) -> str:
        """Readable code with each placeholder's and output's role as a comment."""
        lines = [f"# stage: {stage}"]
        for node, desc in zip(self.placeholders(), self.inputs, strict=True):
            lines.append(f"# input  {node.name}: {describe(desc)}{_meta_text(node)}")
        for value, desc in zip(self.output_values(), self.outputs, strict=True):
            name = value.name if isinstance(value, fx.Node) else repr(value)
            lines.append(f"# output {name}: {describe(desc)}")
        lines.append(self.module.code.strip())
        return "\n".join(lines) + "\n"


JointGraph = StageGraph  # a joint graph has primal and tangent inputs, fwd and grad outputs


def _meta_text(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f" {dtype}{list(val.shape)}"
    return ""


def make_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule whose Python code is generated on first use (`.code`, a call), not here.

    Heuristic: generating code for a 10,000-node graph takes ~0.5 s, and stage graphs are run
    through runtime.launch's own code, so only inspection needs fx's code. Falls back to an eager
    GraphModule where torch lacks the lazy variant.
    """
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def node_nbytes(node: fx.Node) -> int:
    """Bytes of the tensor a node produces (0 for non-tensors). Symbolic sizes count at the
    size the trace was made with (its hint), without adding a guard."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return size_hint(val.numel()) * val.element_size()
    return 0


def size_hint(value: object) -> int:
    """An int, or a SymInt's example value (never guards)."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else 1
    return int(value)  # type: ignore[call-overload]


def is_sym_node(node: fx.Node) -> bool:
    """A node computing a size (SymInt/SymFloat/SymBool), not a tensor."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))
