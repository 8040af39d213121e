"""The graph key: a Dynamo graph's cache-key text, read off the graph instead of a key trace.

Stage: `graph_text(gm) -> str`.
Requires: `gm` is the Dynamo FX graph that `aotc.backend._compile_ahead` compiles, with static
input geometry (a symbolic compilation is keyed by the fake key trace, aotc/symkey.py).
Ensures: equal texts only for graphs that run the same calls on the same arguments (see Note
[Graph key]); raises `keytrace.Unkeyable` for any node the text cannot pin down, and the caller
then keys the program with the key trace as before.

Note [Graph key]
~~~~~~~~~~~~~~~~
In the default capture mode the program aotc compiles is a Dynamo FX graph run node by node
(`aotc.backend._compile_ahead`). The graph already is the canonical program text the key trace
(Note [Cache key] in aotc/cachekey.py) reconstructs by running the program: so it is hashed
directly (~1 ms instead of a key trace of 10-100 ms, and no meta-vs-fake verification, which for
a Dynamo graph was a standalone fake trace of the whole program).

The text lists every node in order: its kind, its name, its target and its arguments. Together
with what `cache_key` adds (input signature, options, versions), the same text means the same
compiled graphs because the compile is a function of (a) the graph's calls and constants, (b) the
inputs' signature, (c) the global state the calls read, and (d) aotc's and torch's code:
- Targets: `torch.ops.aten`/`prims` overloads by name; a short list of higher-order operators
  whose callables are subgraphs of `gm` (get_attr nodes), each written out recursively (a custom
  `autograd.Function` that Dynamo traced is an `autograd_function_apply` with its forward and
  backward as such subgraphs, so its backward is in the text); Python functions and classes whose
  module is `torch`'s (or `operator`, `math`, `builtins`), by qualified name: their behaviour is
  fixed by the torch version in the key; tensor methods (`call_method`) by name. Anything else
  is unkeyable: a user function put in the graph with `allow_in_graph`, an op of another
  namespace (a user's `torch.library` op: its Python implementation can change without its name),
  a higher-order operator that refers to a side table (user Triton kernels), `call_module`.
- Arguments: other nodes by name; Python scalars exactly (`repr` of floats is exact), strings,
  dtypes, devices, layouts, memory formats, slices, Ellipsis, and containers of these. Anything
  else (an object, a function, an enum) is unkeyable. A module hyperparameter (a dropout
  probability, an epsilon, a training flag) and a closure constant are literal arguments in a
  Dynamo graph, so changing one changes the text.
- get_attr: a subgraph (above), or a tensor attribute by its geometry. Every tensor attribute of
  the graph module and its submodules is lifted as an input of the program (`find_free_tensors`
  visits the module, aotc/lifting.py), so the compile never reads its value, exactly as for a
  parameter; its geometry is in the signature text. Any other attribute is unkeyable.
- Global state that an ATen-level trace would have seen but a graph does not show: which
  scaled-dot-product-attention backends are enabled, deterministic algorithms, float32 matmul
  precision, cuDNN/mkldnn switches, the default device (`torch.set_default_device`). These are
  written into the text (`_global_state`); grad mode, autocast and the default dtype are in the
  signature text already.
What the text leaves out is what does not change the compile: source lines and stack traces in
node metadata (errors may then name the line of the program that stored the entry, as with the
key trace), node metadata values (recomputed from the inputs), graph-module names. One fact of a
stack trace does change it: a node of a Function's backward marked `@once_differentiable`, which
Dynamo inlines (Note [Once-differentiable backwards] in aotc/oncediff.py); such a line ends in
`once`.
"""

from __future__ import annotations

import builtins
import math
import operator

import torch
import torch.fx as fx

from aotc.keytrace import Unkeyable
from aotc.oncediff import in_once_differentiable

# Higher-order operators whose every callable argument is a subgraph of the graph module.
_SUBGRAPH_HOPS = frozenset(
    {
        "autograd_function_apply",
        "wrap",
        "tag_activation_checkpoint",
        "invoke_subgraph",
        "cond",
        "while_loop",
        "map_impl",
        "wrap_with_set_grad_enabled",
        "wrap_with_autocast",
        "scan",
        "associative_scan",
        "flex_attention",
        "flex_attention_backward",
    }
)
_OP_NAMESPACES = frozenset({"aten", "prims"})
_PLAIN_MODULES = frozenset({"operator", "_operator", "math", "builtins"})
_TAGGED = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def graph_text(gm: fx.GraphModule) -> str:
    """See Note [Graph key]."""
    lines = [_global_state()]
    _graph_lines(gm, "", lines)
    return "\n".join(lines)


def _graph_lines(gm: fx.GraphModule, prefix: str, lines: list[str]) -> None:
    # Nodes by position, not by name: Dynamo names nodes after the user's locals, and a renamed
    # local is the same program. (Input names are in the signature text.)
    ids: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        ids[node] = f"%{prefix.count(' ') // 2}.{len(ids)}"
        name = ids[node]
        if node.op == "placeholder":
            lines.append(f"{prefix}{name} = input")
        elif node.op == "output":
            lines.append(f"{prefix}return {_arg(node.args[0], ids)}")
        elif node.op == "get_attr":
            # The attribute's name says which lifted input it reads: it stays in the text.
            lines.append(f"{prefix}{name} = attr {node.target!r} {_attr(gm, node, prefix)}")
        elif node.op in ("call_function", "call_method"):
            target = _target(node.target) if node.op == "call_function" else f".{node.target}"
            args = ", ".join(_arg(a, ids) for a in node.args)
            kwargs = ", ".join(f"{k}={_arg(v, ids)}" for k, v in node.kwargs.items())
            once = in_once_differentiable(str(node.meta.get("stack_trace") or ""))
            lines.append(f"{prefix}{name} = {target}({args}; {kwargs}){' once' if once else ''}")
        else:
            raise Unkeyable(f"graph node {node.format_node()} ({node.op})")


def _target(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace not in _OP_NAMESPACES:
            raise Unkeyable(f"op {target} is not an ATen or prims op")
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        if target.name() not in _SUBGRAPH_HOPS:
            raise Unkeyable(f"higher-order operator {target.name()}")
        return f"higher_order.{target.name()}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        raise Unkeyable(f"op packet {target}")  # Dynamo graphs call overloads or torch functions
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None)
    if not isinstance(qualname, str) or "<" in qualname:
        raise Unkeyable(f"call target {target!r}")  # a lambda, a local function
    if module in _PLAIN_MODULES or module == "torch" or module.startswith("torch."):
        owner = _resolve(module, qualname)
        if owner is target:  # the name really reaches this object
            return f"{module}.{qualname}"
        raise Unkeyable(f"call target {module}.{qualname} is not reachable by its name")
    raise Unkeyable(f"call target {module}.{qualname} is not a torch function")


def _resolve(module: str, qualname: str) -> object:
    import sys

    roots = {"builtins": builtins, "math": math, "operator": operator, "_operator": operator}
    obj: object = roots.get(module) or sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _arg(value: object, ids: dict[fx.Node, str]) -> str:
    if isinstance(value, fx.Node):
        return ids[value]
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return f"float({value!r})"
    if isinstance(value, complex):
        return f"complex({value!r})"
    if isinstance(value, _TAGGED):
        return f"{type(value).__name__}({value})"
    if value is Ellipsis:
        return "..."
    if isinstance(value, slice):
        parts = (value.start, value.stop, value.step)
        return f"slice({', '.join(_arg(v, ids) for v in parts)})"
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return f"{kind}[{', '.join(_arg(v, ids) for v in value)}]"
    if isinstance(value, dict):
        items = ", ".join(f"{_arg(k, ids)}: {_arg(v, ids)}" for k, v in value.items())
        return "dict{" + items + "}"
    raise Unkeyable(f"graph argument of type {type(value).__name__}")


def _attr(gm: fx.GraphModule, node: fx.Node, prefix: str) -> str:
    obj: object = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    if isinstance(obj, fx.GraphModule):
        lines = ["subgraph {"]
        _graph_lines(obj, prefix + "  ", lines)
        return "\n".join([*lines, prefix + "}"])
    if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
        # Lifted: an input of the program (its geometry is in the signature text), never read
        # by the compile; written here too so the text alone names what the graph reads.
        return (
            f"tensor {obj.dtype} {tuple(obj.shape)} {obj.stride()} +{obj.storage_offset()} "
            f"{obj.device} {obj.layout} rg={obj.requires_grad}"
        )
    raise Unkeyable(f"graph attribute {node.target} of type {type(obj).__name__}")


def _global_state() -> str:
    """Global switches that choose ATen kernels or decompositions below the graph's calls."""
    cuda = torch.backends.cuda
    return (
        f"globals device={torch.get_default_device()} sdp=flash:{cuda.flash_sdp_enabled()} mem:{cuda.mem_efficient_sdp_enabled()} "
        f"math:{cuda.math_sdp_enabled()} cudnn:{cuda.cudnn_sdp_enabled()} "
        f"deterministic={torch.are_deterministic_algorithms_enabled()}"
        f"/{torch.is_deterministic_algorithms_warn_only_enabled()} "
        f"matmul={torch.get_float32_matmul_precision()} "
        f"cudnn={torch.backends.cudnn.enabled}/{torch.backends.cudnn.deterministic}"
        f"/{torch.backends.cudnn.benchmark}/{torch.backends.cudnn.allow_tf32} "
        f"mkldnn={torch.backends.mkldnn.enabled} tf32={cuda.matmul.allow_tf32} "
        f"reduced={cuda.matmul.allow_fp16_reduced_precision_reduction}"
        f"/{cuda.matmul.allow_bf16_reduced_precision_reduction}"
    )


__all__ = ["graph_text"]
