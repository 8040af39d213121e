"""Launch: turn a graph into the plain Python function the runtime calls.

Stage: `make_callable(module) -> Callable[..., tuple]`.
Requires: an fx GraphModule of ATen op calls (plus `operator.getitem` and tensor constants).
Ensures: a function of the placeholders that returns the graph's output tuple, with each op bound
as a global to a C++ entry point: torch's generated Python binding of that op where it provably
dispatches to the same overload with the same arguments (see Note [Fast op bindings]), else
`OpOverload._op`; either way skipping the Python `OpOverload.__call__` frame and the
`torch.ops.aten.x.y` attribute chain on every call, and dropping every intermediate right after
its last use so peak memory matches the graph's.

Worked example: the forward of `(x * y).sin().sum()` becomes

    def forward(arg0_1, arg1_1):
        mul = op_mul_Tensor(arg0_1, arg1_1); arg0_1 = None
        sin = op_sin_default(mul)
        sum_1 = op_sum_default(sin); sin = None
        return (sum_1, arg1_1, mul)

`forward.boxed(args)` is the same function taking its arguments as a list that it empties, so a
placeholder is freed at its last use too (the compiled backward's saved values; Note [Boxed
backward] in runtime/autograd.py).

Heuristic: measured on a 3-op tiny graph on CPU, this is ~5 us faster per call than calling the
GraphModule (15.6 -> 10.3 us).

Note [Fast op bindings]
~~~~~~~~~~~~~~~~~~~~~~~
`OpOverload._op` is the generic boxed entry: it matches the Python arguments against the schema
at run time and calls the kernel through a stack of IValues. torch's generated bindings
(`torch._C._VariableFunctions.mul`, `Tensor.expand`, ...) parse arguments with a precompiled
signature table and call the kernel unboxed: measured with callgrind on CPU, ~3,600 fewer
instructions per op (a tiny training step's forward and backward graphs: 4 ops, ~7% of the step).
The catch is overload resolution: `torch.mul(x, 2.0)` picks an overload by the Python types of its
arguments, and it must pick the graph's. So a binding is used only after a dry run proves it:
for each (overload, argument kinds) seen, both the binding and `_op` run once on meta tensors of
the node's geometry under a dispatch mode that records what reaches the dispatcher; the binding
is kept only if it dispatched exactly one call, the same overload with equal arguments (tensors
by identity, everything else by type and value). The dry run only asks what reaches the
dispatcher, so the recording mode answers the first call with meta stand-ins of the node's value
instead of running its meta kernel (most are Python reference implementations: ~1 ms each,
most of a cache hit's assembly); later calls (a composite binding, refused anyway) run. Bindings of ops with no tensor argument
(factories, which `torch.set_default_device`'s mode rewrites) and of mutating ops are not tried.
The verdict is cached per process; a failed or impossible dry run (no meta kernel, symbolic
sizes) keeps `_op`.

Note [Binding verdicts across processes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A verdict depends only on the op overload, the Python kinds of its arguments (what overload
resolution sees: `_kind`) and the torch build, never on sizes or values; so the dry runs of one
process hold for the next. They were ~9 ms of a GPT block's cache hit (a third of its assembly)
and as much of its cold compile. Each verdict gets a text key (`aten.mul.Tensor|<kinds>`) and a
candidate index (-1: no binding matched). aotc/persist.py keeps them in the cache directory, one
file per torch build, signed like a trusted entry (Note [Trusted entries] in runtime/cache.py):
`known_verdicts` loads that file's verdicts, `known` hands over all this process has (merged
into the file). Only decided verdicts are kept: a dry run that cannot run (symbolic sizes, no meta
kernel) decides nothing and is tried again next time.
"""

from __future__ import annotations

import keyword
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_SIMPLE = (bool, int, str, type(None))


def make_callable(module: fx.GraphModule, graph: fx.Graph | None = None) -> Callable[..., Any]:
    """`graph`: run this graph of `module`'s nodes instead of `module.graph` (its constants are
    `module`'s attributes)."""
    graph = module.graph if graph is None else graph
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
    parts, made_by_op = _part_calls(nodes)  # See Note [Bindings of one result]
    for node in nodes:
        if node in made_by_op:
            continue  # its op's line makes its value
        name = f"v_{node.name}"
        names[node] = name
        if node in parts:
            item, binding = parts[node]
            names[node] = names[item] = name = f"v_{item.name}"
            fn = const(binding, getattr(binding, "__name__", "part"))
            args = [fmt(a) for a in node.args]
            args += [_keyword_arg(k, fmt(v)) for k, v in node.kwargs.items()]
            body.append(f"    {name} = {fn}({', '.join(args)})")
        elif node.op == "placeholder":
            params.append(name)
            continue
        elif node.op == "get_attr":
            body.append(f"    {name} = {const(_fetch_attr(module, str(node.target)), 'const')}")
        elif node.op == "call_function":
            target = node.target
            if target is _AS_STRIDED_SCATTER:  # Note [as_strided_scatter of a tensor with grad]
                fn = const(_as_strided_scatter, "as_strided_scatter")
            elif isinstance(target, torch._ops.OpOverload):
                fn = const(fast_binding(node) or target._op, target.__name__.replace(".", "_"))
            elif target is operator.getitem:
                fn = const(operator.getitem, "getitem")
            else:
                fn = const(target, getattr(target, "__name__", "fn"))
            args = [fmt(a) for a in node.args]
            args += [_keyword_arg(k, fmt(v)) for k, v in node.kwargs.items()]
            body.append(f"    {name} = {fn}({', '.join(args)})")
        elif node.op == "output":
            body.append(f"    return {fmt(tuple(node.args[0]))}")
            continue
        else:
            raise NotImplementedError(
                f"launch: unsupported node kind {node.op} ({node.format_node()})"
            )
        for inp in node.all_input_nodes:
            if last_use.get(inp) is node and node is not None:
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
    # The boxed twin (Note [Boxed backward]): the same body, its arguments taken from a list it
    # empties, so each is dropped at its last use; placeholders nothing reads at once.
    unpack = f"    {''.join(p + ', ' for p in params)}= args; args.clear()" if params else ""
    unused = [names[n] for n in nodes if n.op == "placeholder" and not n.users]
    boxed_body = [unpack] if unpack else []
    boxed_body += [f"    {v} = None" for v in unused if v not in returned]
    source += "\n\ndef forward_boxed(args):\n" + "\n".join(boxed_body + body) + "\n"
    namespace = dict(globs)
    exec(compile(source, f"<aotc graph {id(module):x}>", "exec"), namespace)  # noqa: S102
    fn = namespace["forward"]
    fn.__aotc_source__ = source
    fn.boxed = namespace["forward_boxed"]
    return fn  # type: ignore[no-any-return]


class LazyCallable:
    """`make_callable(module)`, generated at its first call: the compiled pair of an entry whose
    calls let eager's autograd record the backward runs only under autocast or a functorch
    transform (Note [Eager autograd on the ATen path] in aotc/eagerautograd.py), so its graphs
    are not generated at assembly (~1-2 ms each on a conv net). Two threads calling first may
    both generate it; either function is the graph's."""

    __slots__ = ("_module", "_fn")

    def __init__(self, module: fx.GraphModule) -> None:
        self._module = module
        self._fn: Callable[..., Any] | None = None

    def _get(self) -> Callable[..., Any]:
        fn = self._fn
        if fn is None:
            fn = self._fn = make_callable(self._module)
        return fn

    def __call__(self, *args: Any) -> Any:
        return self._get()(*args)

    def boxed(self, args: list[Any]) -> Any:
        return self._get().boxed(args)  # type: ignore[attr-defined]


_AS_STRIDED_SCATTER = torch.ops.aten.as_strided_scatter.default


def _as_strided_scatter(
    base: torch.Tensor, src: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """See Note [as_strided_scatter of a tensor with grad]."""
    if base.requires_grad and not torch.is_grad_enabled() and not base.is_contiguous():
        base = base.detach()
    return _AS_STRIDED_SCATTER._op(base, src, *args, **kwargs)  # type: ignore[no-any-return]


# Note [as_strided_scatter of a tensor with grad]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Functionalization writes a mutation through a view of a graph input back with
# `as_strided_scatter(input, updated_view, ...)`. ATen refuses that op on a non-contiguous tensor
# that requires grad ("as_strided_scatter is currently only supported for contiguous inputs", an
# internal assert) even with grad mode off, where no autograd node is made: a synthetic base that
# a call transposed in place (`a.t_()` before a graph break, then a write through a view of `a`;
# fuzz seed 18188) crashed the compiled forward. With grad off, the op runs on a `detach()`ed
# alias of the input: the same memory and values, and the result needs no grad either way. The
# forward and inference graphs always run with grad off; a backward with `create_graph=True`
# keeps torch's check.


# Note [Bindings of one result]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Decomposition leaves some losses as a multi-result op of which the program reads one result:
# `F.cross_entropy` traces to `_log_softmax` and `nll_loss_forward`, whose second result
# (`total_weight`) nothing reads. The boxed `_op` builds both results as a Python tuple and the
# graph indexes it; torch's own binding of the op eager calls, `torch._C._nn.nll_loss`, is a C++
# composite that calls the very same overload with the very same arguments and returns its first
# result, with no tuple and no boxing (~1.5 us of a 64x1000 cross-entropy forward of ~42 us,
# measured on CPU). `_PART_CANDIDATES` names such composites: (overload, result index) -> the
# binding. Where a node of one of those overloads is read only through one `getitem` of that
# index, the line of the op runs the binding and names its result as the getitem's value. As for
# any binding (Note [Fast op bindings]), a dry run on meta stand-ins proves it first: with grad off
# the binding must send the dispatcher exactly the call `_op` sends and return the dispatcher's
# result at that index itself (the very tensor object); with grad on, over arguments that require
# grad, the result it returns must carry the same autograd node type as `_op`'s (a composite runs
# above autograd, so eager's autograd records the op's own node, as the replayed forward of Note
# [Eager autograd on the ATen path] in aotc/eagerautograd.py needs). The table holds only
# composites whose C++ body is that one call, with no branch on device or layout, so the meta
# dry run's path is the real one. Verdicts are kept like the others (`|part k` keys).
_PART_CANDIDATES: dict[tuple[str, str, int], tuple[str, str]] = {
    ("aten::nll_loss_forward", "default", 0): ("_nn", "nll_loss"),
    ("aten::nll_loss2d_forward", "default", 0): ("_nn", "nll_loss2d"),
}
_PARTS: dict[tuple[object, ...], Callable[..., Any] | None] = {}


def _part_calls(
    nodes: list[fx.Node],
) -> tuple[dict[fx.Node, tuple[fx.Node, Callable[..., Any]]], set[fx.Node]]:
    """Each op node run through a binding of one result: node -> (its getitem, the binding);
    and the getitems those lines stand for (the read one and any nothing reads)."""
    found: dict[fx.Node, tuple[fx.Node, Callable[..., Any]]] = {}
    covered: set[fx.Node] = set()
    for node in nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        users = list(node.users)
        if not users or any(u.target is not operator.getitem for u in users):
            continue
        read = [u for u in users if u.users]
        if len(read) != 1 or type(read[0].args[1]) is not int:
            continue
        binding = part_binding(node, read[0].args[1])
        if binding is not None:
            found[node] = (read[0], binding)
            covered.update(users)
    return found, covered


def _remembered(key: str, verdict: Callable[[], int | None]) -> int | None:
    """The verdict stored under `key` in `_PROVEN`, or `verdict()`, stored unless it is None
    (not decided: asked again for the next node of these kinds)."""
    index = _PROVEN.get(key)
    if index is None:
        index = verdict()
        if index is not None:
            _PROVEN[key] = index
    return index


def part_binding(node: fx.Node, k: int) -> Callable[..., Any] | None:
    """The binding of Note [Bindings of one result] that runs `node`'s op for its result `k`,
    or None."""
    target = node.target
    assert isinstance(target, torch._ops.OpOverload)
    where = _PART_CANDIDATES.get((target._schema.name, target._overloadname, k))
    if where is None:
        return None
    candidate = getattr(getattr(torch._C, where[0], None), where[1], None)
    if candidate is None:
        return None
    try:
        kinds = (target, k, _kind(node.args), _kind(node.kwargs))
    except _NoExample:
        return None
    if kinds not in _PARTS:

        def verdict() -> int | None:  # None: not decided from this node's examples
            if _verified_part(target, node, k, candidate):
                return 0
            return -1 if _decidable(node) else None

        index = _remembered(f"{target}|{kinds[2]!r}|{kinds[3]!r}|part {k}", verdict)
        _PARTS[kinds] = candidate if index == 0 else None
    return _PARTS[kinds]


def _decidable(node: fx.Node) -> bool:
    """Whether a dry run could stand in for `node`'s arguments and value at all."""
    try:
        _example(node.args), _example(node.kwargs), _example_value(node.meta.get("val"))
    except _NoExample:
        return False
    return True


def _verified_part(
    target: torch._ops.OpOverload, node: fx.Node, k: int, candidate: Callable[..., Any]
) -> bool:
    try:
        args, kwargs = _example(node.args), _example(node.kwargs)
    except _NoExample:
        return False
    result = _result(node.meta.get("val"))
    if result is None:
        return False
    want = _dispatched(target._op, args, kwargs, result)
    answered: list[Any] = []
    got = _dispatched(candidate, args, kwargs, result, answered)
    if want is None or got is None or got != want or len(answered) != 2:
        return False
    made, returned = answered
    if not isinstance(made, (tuple, list)) or len(made) <= k or returned is not made[k]:
        return False

    def needs_grad(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.detach().requires_grad_()
        return a

    gargs, gkwargs = pytree.tree_map(needs_grad, (args, kwargs))
    try:
        with torch.enable_grad():
            ours = type(target._op(*gargs, **gkwargs)[k].grad_fn)
            theirs = type(candidate(*gargs, **gkwargs).grad_fn)
    except Exception:  # noqa: BLE001 no meta kernel for autograd: keep _op
        return False
    return ours is theirs and ours is not type(None)


_BINDINGS: dict[tuple[object, ...], Callable[..., Any] | None] = {}
# See Note [Binding verdicts across processes]
_CANDIDATE_MODULES = ("_VariableFunctions", "_nn", "_special", "TensorBase")  # of torch._C
_PROVEN: dict[str, int] = {}  # verdict key -> candidate index (-1: none), from any process


def fast_binding(node: fx.Node) -> Callable[..., Any] | None:
    """torch's generated binding that runs `node`'s op exactly as `_op` would, or None (see Note
    [Fast op bindings])."""
    target = node.target
    assert isinstance(target, torch._ops.OpOverload)
    schema = target._schema
    if schema.is_mutable or not any(
        isinstance(a.type, torch.TensorType)
        or (
            isinstance(a.type, torch.OptionalType)
            and isinstance(a.type.getElementType(), torch.TensorType)
        )
        for a in schema.arguments
    ):
        return None
    try:
        kinds = (target, _kind(node.args), _kind(node.kwargs))
    except _NoExample:
        return None
    if kinds not in _BINDINGS:
        index = _remembered(
            f"{target}|{kinds[1]!r}|{kinds[2]!r}", lambda: _verified_binding(target, node)
        )
        candidates = _candidates(target)
        _BINDINGS[kinds] = candidates[index] if index is not None and index >= 0 else None
    return _BINDINGS[kinds]


def _candidates(target: torch._ops.OpOverload) -> list[Callable[..., Any] | None]:
    name = target._schema.name.split("::", 1)[-1]
    return [getattr(getattr(torch._C, m, None), name, None) for m in _CANDIDATE_MODULES]


def known_verdicts(verdicts: dict[str, int]) -> None:
    """Verdicts of earlier processes (Note [Binding verdicts across processes])."""
    for key, index in verdicts.items():
        if isinstance(key, str) and type(index) is int and -1 <= index < len(_CANDIDATE_MODULES):
            _PROVEN.setdefault(key, index)


def known() -> dict[str, int]:
    """Every verdict this process knows: found by its dry runs or loaded."""
    return dict(_PROVEN)


def known_count() -> int:
    return len(_PROVEN)


class _NoExample(Exception):
    """An argument the dry run cannot stand in for (symbolic sizes, unknown values)."""


def _kind(arg: Any) -> object:
    """What overload resolution can see of an argument: Python types, tensor-ness, structure."""
    if isinstance(arg, fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return "Tensor"
        if isinstance(val, (int, float, bool)):
            return type(val).__name__
        raise _NoExample
    if isinstance(arg, (list, tuple)):
        return (type(arg).__name__, tuple(_kind(a) for a in arg))
    if isinstance(arg, dict):
        return tuple(sorted((k, _kind(v)) for k, v in arg.items()))
    return type(arg).__name__


def _example(arg: Any) -> Any:
    """A stand-in for an argument in the dry run: meta tensors of the node's geometry."""
    if isinstance(arg, fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            if any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())):
                raise _NoExample
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        if isinstance(val, (int, float, bool)):
            return val
        raise _NoExample
    if isinstance(arg, list):
        return [_example(a) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_example(a) for a in arg)
    return arg


def _verified_binding(target: torch._ops.OpOverload, node: fx.Node) -> int | None:
    """The index in `_candidates(target)` of the first binding the dry run proves (-1: none
    is), or None when the dry run cannot decide for these argument kinds alone (no example of
    the node's geometry, no meta kernel)."""
    try:
        args, kwargs = _example(node.args), _example(node.kwargs)
    except _NoExample:
        return None
    result = _result(node.meta.get("val"))
    want = _dispatched(target._op, args, kwargs, result)
    if want is None:
        return None
    for index, candidate in enumerate(_candidates(target)):
        if candidate is not None and _dispatched(candidate, args, kwargs, result) == want:
            return index
    return -1


class _Dispatched(list[tuple[object, object, object]]):
    """(op, args, kwargs) of each call that reached the dispatcher; compares tensors by id."""

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, list)
            and len(self) == len(other)
            and all(
                a[0] is b[0] and _same(a[1], b[1]) and _same(a[2], b[2])
                for a, b in zip(self, other)
            )
        )

    __hash__ = None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _result(val: Any) -> Callable[[], Any] | None:
    """Meta stand-ins of a node's value, the result the dry run's dispatcher returns without
    running the op (see Note [Fast op bindings]); None when they cannot be made."""
    try:
        example = _example_value(val)
    except _NoExample:
        return None
    return lambda: pytree.tree_map(
        lambda v: (
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
            if isinstance(v, torch.Tensor)
            else v
        ),
        example,
    )


def _example_value(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        if any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())):
            raise _NoExample
        return val
    if isinstance(val, (list, tuple)):
        return type(val)(_example_value(v) for v in val)
    if isinstance(val, (int, float, bool)) or val is None:
        return val
    raise _NoExample


def _dispatched(
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
    result: Callable[[], Any] | None = None,
    answered: list[Any] | None = None,
) -> _Dispatched | None:
    """What calling `fn(*args, **kwargs)` sends to the dispatcher (None if it fails).
    `result`: what the dispatcher returns for the first call instead of running the op;
    `answered` gets that value and what `fn` returned."""
    seen = _Dispatched()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append((func, args, dict(kwargs or {})))
            if result is not None and len(seen) == 1:
                made = result()
                if answered is not None:
                    answered.append(made)
                return made
            return func(*args, **(kwargs or {}))

    try:
        with torch.no_grad(), Record():
            returned = fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 no meta kernel, bad arguments: keep _op
        return None
    if answered is not None:
        answered.append(returned)
    return seen if len(seen) == 1 else None


def _keyword_arg(name: str, value: str) -> str:
    """`name=value` in a call, or `**{'name': value}` for a name Python reserves (Note [Op names
    that are Python keywords] in runtime/fxnames.py)."""
    return f"{name}={value}" if not keyword.iskeyword(name) else f"**{{{name!r}: {value}}}"


def _keep(line: str, returned: set[str]) -> str:
    head, *frees = line.split("; ")
    kept = [f for f in frees if f.split(" = ")[0] not in returned]
    return "; ".join([head, *kept])


def _fetch_attr(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
