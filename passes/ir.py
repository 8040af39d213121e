"""Graph records: a joint graph, or one stage graph (forward or backward), with the role of every
placeholder and output.

Ensures: `len(inputs)` == number of placeholders, `len(outputs)` == number of output values,
both in graph order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from aotc.passes.descriptors import (
    GradOutput,
    InputDesc,
    OutputDesc,
    PrimalInput,
    SavedInput,
    SavedOutput,
    describe,
)
from aotc.passes.provenance import describe_source, source_of
from aotc.runtime import fxnames  # noqa: F401  Note [Op names that are Python keywords]


@dataclass(frozen=True, slots=True)
class StageGraph:
    module: fx.GraphModule
    inputs: tuple[InputDesc, ...]  # len == num placeholders; graph order
    outputs: tuple[OutputDesc, ...]  # len == num outputs; graph order

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.module.graph.nodes if n.op == "placeholder"]

    def output_values(self) -> list[fx.node.Argument]:
        out = next(n for n in reversed(self.module.graph.nodes) if n.op == "output")
        return list(out.args[0])

    def format(
        self, stage: str, arg_names: Sequence[str] = (), saved_names: Mapping[str, str] = {}
    ) -> str:
        """Readable code with each placeholder's and output's role as a comment, and each run of
        nodes from one user line preceded by that module and line (see passes/provenance.py).
        `arg_names`: readable names of the graph args (GraphArg space), e.g. parameter paths;
        `saved_names`: readable names of saved values that are graph args, by value name."""
        lines = [f"# stage: {stage}"]
        in_roles = {}
        for node, desc in zip(self.placeholders(), self.inputs, strict=True):
            in_roles[node.name] = describe_named(desc, arg_names, saved_names)
            lines.append(f"# input  {node.name}: {in_roles[node.name]}{_meta_text(node)}")
        out_roles = []
        for value, out in zip(self.output_values(), self.outputs, strict=True):
            name = value.name if isinstance(value, fx.Node) else repr(value)
            out_roles.append(describe_named(out, arg_names, saved_names))
            lines.append(f"# output {name}: {out_roles[-1]}")
        lines.append(annotated_code(self.module, in_roles, out_roles))
        return "\n".join(lines) + "\n"


JointGraph = StageGraph  # a joint graph has primal and tangent inputs, fwd and grad outputs


def describe_named(
    desc: InputDesc | OutputDesc, arg_names: Sequence[str], saved_names: Mapping[str, str] = {}
) -> str:
    """`describe(desc)` plus the graph arg's readable name for primals, gradients and saved
    inputs: `primal graph_arg3 = h.0.attn.c_attn.weight`, `grad of graph_arg3 = h.0...weight`."""
    text = describe(desc)
    if isinstance(desc, (PrimalInput, GradOutput)) and desc.arg < len(arg_names):
        return f"{text} = {arg_names[desc.arg]}"
    if isinstance(desc, (SavedInput, SavedOutput)) and desc.name in saved_names:
        return f"{text} = {saved_names[desc.name]}"
    return text


def primal_names(graph: StageGraph, arg_names: Sequence[str]) -> dict[str, str]:
    """Placeholder name -> readable name of its graph arg, for the primal inputs of `graph`."""
    return {
        node.name: arg_names[desc.arg]
        for node, desc in zip(graph.placeholders(), graph.inputs)
        if isinstance(desc, PrimalInput) and desc.arg < len(arg_names)
    }


_DEF = re.compile(r"^def forward\(self(?:, )?([^()\"]*)\):$")
_ASSIGN = re.compile(r"^    (\w+) = ")
_RETURN = re.compile(r"^    return [(\[](.*)[)\]]$")


def annotated_code(
    module: fx.GraphModule, in_roles: dict[str, str], out_roles: Sequence[str]
) -> str:
    """fx's code for `module` with comments: one parameter per line with its role, the user
    module and line above each run of nodes that comes from one line, one output per line
    with its role. Lines it does not recognize are kept as they are, so the text stays Python.

        def forward(
            self,
            primals_1,  # primal graph_arg0 = fc.weight
        ):
            # fc (Linear): model.py:12  y = self.fc(x)
            t = torch.ops.aten.t.default(primals_1)
            ...
            return (
                mm,  # fwd_out0
            )
    """
    sources = {n.name: describe_source(source_of(n)) for n in module.graph.nodes}
    out: list[str] = []
    last = ""
    for line in module.code.strip().splitlines():
        define = _DEF.match(line)
        if define is not None:
            params = [p.strip() for p in define.group(1).split(",") if p.strip()]
            out.append("def forward(")
            out.append("    self,")
            out += [f"    {p},  # {in_roles[p]}" if p in in_roles else f"    {p}," for p in params]
            out.append("):")
            continue
        assign = _ASSIGN.match(line)
        if assign is not None:
            where = sources.get(assign.group(1), "")
            if where and where != last:
                out.append(f"    # {where}")
            last = where or last
        returned = _RETURN.match(line)
        if returned is not None:
            items = [v.strip() for v in returned.group(1).split(",") if v.strip()]
            if len(items) == len(out_roles) and all(re.fullmatch(r"\w+", v) for v in items):
                out.append("    return (")
                out += [f"        {v},  # {role}" for v, role in zip(items, out_roles)]
                out.append("    )")
                continue
        out.append(line)
    return "\n".join(out)


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
