"""Launch: turn a graph into the plain Python function the runtime calls.

Stage: `make_callable(module) -> Callable[..., tuple]`.
Requires: an fx GraphModule of ATen op calls (plus `operator.getitem` and tensor constants).
Ensures: a function of the placeholders that returns the graph's output tuple, with each op bound
as a global to its C++ entry point (`OpOverload._op`), skipping the Python `OpOverload.__call__`
frame and the `torch.ops.aten.x.y` attribute chain on every call, and dropping every intermediate
right after its last use so peak memory matches the graph's.

Worked example: the forward of `(x * y).sin().sum()` becomes

    def forward(arg0_1, arg1_1):
        mul = op_mul_Tensor(arg0_1, arg1_1); arg0_1 = None
        sin = op_sin_default(mul)
        sum_1 = op_sum_default(sin); sin = None
        return (sum_1, arg1_1, mul)

Heuristic: measured on a 3-op tiny graph on CPU, this is ~5 us faster per call than calling the
GraphModule (15.6 -> 10.3 us).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

_SIMPLE = (bool, int, str, type(None))


def make_callable(module: fx.GraphModule) -> Callable[..., Any]:
    graph = module.graph
    nodes = list(graph.nodes)
    names: dict[fx.Node, str] = {}
    globs: dict[str, Any] = {}
    last_use: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            last_use[inp] = node
    frees: dict[fx.Node, list[str]] = {}

    def const(value: Any, hint: str) -> str:
        name = f"c{len(globs)}_{hint}"
        globs[name] = value
        return name

    def fmt(arg: Any) -> str:
        if isinstance(arg, fx.Node):
            return names[arg]
        if isinstance(arg, (list, tuple)):
            inner = ", ".join(fmt(a) for a in arg)
            return (
                f"[{inner}]"
                if isinstance(arg, list)
                else f"({inner}{',' if len(arg) == 1 else ''})"
            )
        if isinstance(arg, _SIMPLE):
            return repr(arg)
        if isinstance(arg, float) and arg == arg and arg not in (float("inf"), float("-inf")):
            return repr(arg)
        return const(arg, type(arg).__name__)

    params: list[str] = []
    body: list[str] = []
    for node in nodes:
        name = f"v_{node.name}"
        names[node] = name
        if node.op == "placeholder":
            params.append(name)
            continue
        if node.op == "get_attr":
            body.append(f"    {name} = {const(_fetch_attr(module, str(node.target)), 'const')}")
        elif node.op == "call_function":
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                fn = const(target._op, target.__name__.replace(".", "_"))
            elif target is operator.getitem:
                fn = const(operator.getitem, "getitem")
            else:
                fn = const(target, getattr(target, "__name__", "fn"))
            args = [fmt(a) for a in node.args]
            args += [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
            body.append(f"    {name} = {fn}({', '.join(args)})")
        elif node.op == "output":
            body.append(f"    return {fmt(tuple(node.args[0]))}")
            continue
        else:
            raise NotImplementedError(
                f"launch: unsupported node kind {node.op} ({node.format_node()})"
            )
        for inp in node.all_input_nodes:
            if last_use.get(inp) is node:
                frees.setdefault(node, []).append(names[inp])
        if node.users == {} or not node.users:
            frees.setdefault(node, []).append(name)
        if node in frees:
            body[-1] += "; " + "; ".join(f"{v} = None" for v in frees[node])
    # Values the output returns must survive: drop frees that name them.
    out_node = nodes[-1]
    returned = {names[n] for n in out_node.all_input_nodes}
    body = [_keep(line, returned) for line in body]
    source = f"def forward({', '.join(params)}):\n" + "\n".join(body) + "\n"
    namespace = dict(globs)
    exec(compile(source, f"<aotc graph {id(module):x}>", "exec"), namespace)  # noqa: S102
    fn = namespace["forward"]
    fn.__aotc_source__ = source
    return fn  # type: ignore[no-any-return]


def _keep(line: str, returned: set[str]) -> str:
    head, *frees = line.split("; ")
    kept = [f for f in frees if f.split(" = ")[0] not in returned]
    return "; ".join([head, *kept])


def _fetch_attr(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
