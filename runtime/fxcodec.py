"""fx graphs in the plain codec: node lists whose call targets resolve only against an allowlist.

Stage: `encode_graph(module) -> JSON value`, `decode_graph(value, on_device) -> GraphModule`,
`check_graph(value)` (targets and node kinds, without building).
Requires: functional graphs of aten/prims ops, `operator.getitem`, the scalar functions of
symbolic sizes and the control-flow operators of `_HIGHER_ORDER`, whose subgraphs are stored
with the graph; tensor constants are plain CPU tensors (stored as raw bytes).
Ensures: a call target that is not an aten/prims overload, a listed scalar function or a listed
control-flow operator is rejected (Uncachable when writing, CacheError when reading); node values come back as meta
tensors, or with `on_device` as storage-less `ValueTensor`s on their devices (runtime/valuetensor.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from aotc.runtime import fxnames  # noqa: F401  Note [Op names that are Python keywords]
from aotc.runtime.codec import Uncachable, _list, decode, encode
from aotc.runtime.errors import CacheError
from aotc.runtime.schema import NODE_SOURCE_KEY, ONCE_DIFFERENTIABLE_KEY, NodeSource
from aotc.runtime.valuetensor import ValueTensor

_NAMESPACES = ("aten", "prims")


# Python functions of sizes and scalars that symbolic graphs call (`s0 * 4`, `-lr`): a fixed
# table, resolved by name on load like the ops.
_SCALAR_FUNCTIONS: dict[str, Callable[..., Any]] = {
    f"operator.{name}": getattr(operator, name)
    for name in (
        "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos",
        "abs", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_",
    )
}  # fmt: skip
_SCALAR_FUNCTIONS.update(
    {
        f"torch.{name}": getattr(torch, name)
        for name in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_ite")
        if hasattr(torch, name)
    }
)
_SCALAR_NAMES = {id(fn): name for name, fn in _SCALAR_FUNCTIONS.items()}

# Higher-order operators a stored graph may call: control flow whose callable arguments are
# subgraphs of the graph (get_attr nodes), stored with it under "subgraphs" and checked the same
# way (their targets resolve against this allowlist too).
_HIGHER_ORDER = frozenset(("cond", "while_loop", "map_impl", "scan", "associative_scan"))


def _target_name(target: object) -> str:
    name = _SCALAR_NAMES.get(id(target))
    if name is not None:
        return name
    if isinstance(target, torch._ops.OpOverload) and target.namespace in _NAMESPACES:
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator) and target.name() in _HIGHER_ORDER:
        return f"higher_order::{target.name()}"
    raise Uncachable(f"graph calls {target}, which is not an aten/prims op")


def _resolve_target(name: object) -> object:
    """Allowlist: only aten/prims overloads and the scalar functions of `_SCALAR_FUNCTIONS` can
    come out of a cache."""
    if isinstance(name, str) and name in _SCALAR_FUNCTIONS:
        return _SCALAR_FUNCTIONS[name]
    if isinstance(name, str) and name.startswith("higher_order::"):
        hop = name.partition("::")[2]
        if hop not in _HIGHER_ORDER or not hasattr(torch.ops.higher_order, hop):
            raise CacheError(f"call target {name[:80]!r} is not a known control-flow operator")
        return getattr(torch.ops.higher_order, hop)
    if not isinstance(name, str) or "::" not in name:
        raise CacheError(f"bad call target {str(name)[:80]!r}")
    namespace, _, rest = name.partition("::")
    opname, _, overload = rest.partition(".")
    if namespace not in _NAMESPACES or not opname.isidentifier() or not overload.isidentifier():
        raise CacheError(f"call target {name!r} is not an aten/prims op")
    try:
        target = getattr(getattr(getattr(torch.ops, namespace), opname), overload)
    except (AttributeError, RuntimeError) as e:
        raise CacheError(f"op {name} does not exist in this torch") from e
    if not isinstance(target, torch._ops.OpOverload):
        raise CacheError(f"{name} is not an op overload")
    return target


def _encode_arg(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return {"N": arg.name}
    if isinstance(arg, (list, tuple)) and not hasattr(arg, "_fields"):
        items = [_encode_arg(a) for a in arg]
        return items if isinstance(arg, list) else {"T": items}
    if isinstance(arg, dict):
        return {"D": {str(k): _encode_arg(v) for k, v in arg.items()}}
    if isinstance(arg, torch.Tensor):
        raise Uncachable("tensor inside node arguments")
    return encode(arg)


def _decode_arg(value: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(value, list):
        return [_decode_arg(v, env) for v in value]
    if isinstance(value, dict) and set(value) == {"N"}:
        node = env.get(value["N"])
        if node is None:
            raise CacheError(f"reference to unknown node {str(value['N'])[:40]!r}")
        return node
    if isinstance(value, dict) and set(value) == {"T"}:
        return tuple(_decode_arg(v, env) for v in _list(value["T"]))
    if isinstance(value, dict) and set(value) == {"D"}:
        return {str(k): _decode_arg(v, env) for k, v in dict(value["D"]).items()}
    return decode(value)


def _encode_val(val: Any) -> Any:
    if isinstance(val, torch.Tensor) and any(
        isinstance(v, torch.SymInt) for v in (*val.shape, *val.stride(), val.storage_offset())
    ):
        return None  # symbolic geometry: dropped like other symbolic values
    if isinstance(val, torch.Tensor):
        return {
            "t": [
                list(val.shape),
                list(val.stride()),
                encode(val.dtype),
                val.storage_offset(),
                encode(val.device),
            ]
        }
    if isinstance(val, (list, tuple)):
        return [_encode_val(v) for v in val]
    if val is None or isinstance(val, (bool, int, float)):
        return encode(val)
    return None  # symbolic or opaque values are dropped; only inspection reads them


def _decode_val(value: Any, on_device: bool) -> Any:
    """A node value: a meta tensor, or with `on_device` a ValueTensor on the stored device
    (what the Triton lowering reads, see Note [Cache entry format])."""
    if isinstance(value, dict) and set(value) == {"t"}:
        shape, stride, dtype, offset, device = _list(value["t"])
        size = tuple(int(s) for s in _list(shape))
        strides = tuple(int(s) for s in _list(stride))
        offset = int(offset)
        if len(size) != len(strides) or min((*size, *strides, offset, 0)) < 0:
            raise CacheError("bad tensor value")
        dtype = decode(dtype)
        if not isinstance(dtype, torch.dtype):
            raise CacheError("bad tensor dtype")
        if on_device:
            where = decode(device)
            if not isinstance(where, torch.device):
                raise CacheError("bad tensor device")
            return ValueTensor(size, strides, offset, dtype, where)
        if offset == 0:
            return torch.empty_strided(size, strides, dtype=dtype, device="meta")
        extent = (
            offset + 1 + sum((n - 1) * st for n, st in zip(size, strides)) if all(size) else offset
        )
        storage = torch.empty(extent, dtype=dtype, device="meta")
        return storage.as_strided(size, strides, offset)
    if isinstance(value, list):
        return [_decode_val(v, on_device) for v in value]
    return decode(value)


def _encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    if t.layout is not torch.strided or t.device.type != "cpu" or t.requires_grad:
        raise Uncachable("tensor constant that is not a plain CPU tensor")
    values = t.detach().contiguous().reshape(-1).view(torch.uint8)
    raw = values.numpy().tobytes() if values.numel() else b""
    return {
        "dtype": encode(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "bytes": raw.hex(),
    }


def _decode_tensor(value: dict[str, Any]) -> torch.Tensor:
    try:
        dtype = decode(value["dtype"])
        shape = tuple(int(s) for s in _list(value["shape"]))
        raw = bytearray.fromhex(value["bytes"])
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        values = flat.view(dtype).reshape(shape)
        out = torch.empty_strided(shape, tuple(int(s) for s in _list(value["stride"])), dtype=dtype)
        return out.copy_(values)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CacheError(f"bad tensor constant ({e})") from e


def encode_graph(module: fx.GraphModule) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []
    consts: dict[str, Any] = {}
    subgraphs: dict[str, Any] = {}
    for node in module.graph.nodes:
        item: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            item["target"] = _target_name(node.target)
        elif node.op == "get_attr":
            target = str(node.target)
            value = _fetch_attr(module, target)
            if isinstance(value, fx.GraphModule) and target.isidentifier():
                subgraphs[target] = encode_graph(value)  # a control-flow operator's branch
            elif isinstance(value, torch.Tensor):
                consts[target] = _encode_tensor(value)
            else:
                raise Uncachable(f"graph attribute {target} is not a tensor or a subgraph")
            item["target"] = target
        elif node.op in ("placeholder", "output"):
            item["target"] = str(node.target)
        else:
            raise Uncachable(f"graph node kind {node.op}")
        item["args"] = _encode_arg(node.args)
        item["kwargs"] = _encode_arg(node.kwargs)
        if "val" in node.meta:
            item["val"] = _encode_val(node.meta["val"])
        if node.meta.get("stack_trace"):
            item["stack_trace"] = str(node.meta["stack_trace"])
        source = node.meta.get(NODE_SOURCE_KEY)
        if isinstance(source, NodeSource):  # for inspection of a hit (aotc/provenance.py)
            item["source"] = [source.module, source.module_type, source.line, source.backward]
        if node.meta.get(ONCE_DIFFERENTIABLE_KEY):  # the differentiable backward reads it
            item["once_differentiable"] = True
        nodes.append(item)
    encoded: dict[str, Any] = {"nodes": nodes, "consts": consts}
    if subgraphs:
        encoded["subgraphs"] = subgraphs
    return encoded


def decode_graph(value: Any, on_device: bool = False) -> fx.GraphModule:
    """`on_device`: node values become ValueTensors on their stored devices,
    as after tracing; otherwise meta tensors (enough to run and print the graph)."""
    if not isinstance(value, dict):
        raise CacheError("bad graph")
    root = torch.nn.Module()
    for target, t in dict(value.get("consts", {})).items():
        if not all(part.isidentifier() for part in str(target).split(".")) or "." in target:
            raise CacheError(f"bad constant name {str(target)[:40]!r}")
        root.register_buffer(target, _decode_tensor(t))
    for target, sub in dict(value.get("subgraphs", {})).items():
        if not str(target).isidentifier() or hasattr(root, str(target)):
            raise CacheError(f"bad subgraph name {str(target)[:40]!r}")
        root.add_module(str(target), decode_graph(sub, on_device))
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for item in _list(value.get("nodes")):
        try:
            name, op, target = str(item["name"]), item["op"], item.get("target")
            args, kwargs = _decode_arg(item["args"], env), _decode_arg(item["kwargs"], env)
        except (KeyError, TypeError) as e:
            raise CacheError("bad node") from e
        if op == "call_function":
            target = _resolve_target(target)
        elif op == "get_attr":
            if not hasattr(root, str(target)):
                raise CacheError(f"unknown constant {str(target)[:40]!r}")
        elif op not in ("placeholder", "output"):
            raise CacheError(f"bad node kind {str(op)[:20]!r}")
        elif not isinstance(target, str) or not isinstance(args, (list, tuple)):
            raise CacheError("bad placeholder or output")
        node = graph.create_node(op, target, tuple(args), kwargs, name=name)
        if node.name != name:
            raise CacheError(f"node name {name!r} clashes")
        if "val" in item:
            node.meta["val"] = _decode_val(item["val"], on_device)
        if "stack_trace" in item:
            node.meta["stack_trace"] = str(item["stack_trace"])
        if "source" in item:
            module, kind, line, backward = _list(item["source"])
            node.meta[NODE_SOURCE_KEY] = NodeSource(
                str(module), str(kind), str(line), bool(backward)
            )
        if item.get("once_differentiable") is True:
            node.meta[ONCE_DIFFERENTIABLE_KEY] = True
        env[name] = node
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def check_graph(value: Any) -> None:
    """The node kinds and call targets of an encoded graph, without building it."""
    if not isinstance(value, dict):
        raise CacheError("bad graph")
    for item in _list(value.get("nodes")):
        if not isinstance(item, dict):
            raise CacheError("bad node")
        op = item.get("op")
        if op == "call_function":
            _resolve_target(item.get("target"))
        elif op not in ("placeholder", "output", "get_attr"):
            raise CacheError(f"bad node kind {str(op)[:20]!r}")
    for sub in dict(value.get("subgraphs", {})).values():
        check_graph(sub)


def _fetch_attr(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = ["check_graph", "decode_graph", "encode_graph"]
