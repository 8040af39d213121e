"""Eager's own autograd for a training entry on the ATen path.

Stages: `autograd_shape(roots, leaves)`, during the joint trace, records the autograd graph the
traced program built (aotc/tracer.py keeps it in the joint module's meta under `SHAPE_KEY`);
`replays_eagerly(shape, forward, graph, diff_outs, requires_grad, saved_bytes)`, once per cold
compile of a training entry whose graphs run as ATen calls and whose plan allows it (direct,
Note [Direct plans] in runtime/fastpath.py, or `eager_replayable`), says whether its calls may run
the forward graph with grad on and let eager's autograd record the backward (see the Note).
The runtime's side is `replay_forward` (runtime/replay.py), run by the generated call
(runtime/fastpath.py) or, before the epilogue's writes, by `CompiledEntry._run`.
Requires: `forward` is the partitioned forward graph (fwd outputs, then saved values) with fake
tensors in its placeholders' `meta["val"]`.
Ensures: True only when running `forward`'s first `n_fwd` outputs under autograd, on fake
inputs that require grad where the call's do, builds an autograd graph of the same shape as the
traced program's (same node types, same edges, same leaves, in the same order), makes exactly
the outputs in `diff_outs` require grad, and saves no more bytes than the partition does.

Note [Eager autograd on the ATen path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On the ATen path every op of the compiled backward is one ATen call, as it is in eager's
backward; what the compiled pair adds is the custom autograd node: the engine calls a Python
`backward` (the GIL, a tuple of gradients, the node's checks), ~10 us of a tiny training call,
more than the 1.3x goal leaves (#18). When the partition saves no fewer bytes than eager's own
autograd would, the node buys nothing: the same kernels run, and the same memory is held. Such an
entry's calls then run the forward graph with grad on, and each ATen call records eager's own
C++ node. The backward is eager's, node by node: its gradients, its freeing of saved values,
its version checks, hooks on the outputs' nodes, `retain_graph`, double backward and saved-tensor
hooks all are eager's own.

That is only right when the forward graph's ops, run under autograd, differentiate as the
program did. The joint trace ran the program under autograd and differentiated what autograd
recorded, so the trace's autograd graph is what the compiled backward computes. `autograd_shape`
writes that graph down in a canonical order (breadth first from the differentiated outputs,
each node's type and the positions of its edges, leaves as graph-arg indices), and the compile
runs the forward graph on fake tensors under autograd and writes its graph down the same way.
They differ, and the entry keeps its compiled pair, when the program:
- ran a custom `autograd.Function` (its node is a Python one: a shape is never written then), a
  module's full backward hook (a Function too), `torch.no_grad()` or `detach()` inside (the
  replayed graph has nodes the traced one lacks), or an in-place write into a view (eager's
  `CopySlices` against the graph's scatter ops);
- was changed by the cleanup passes in a way autograd sees (common subexpressions merged).
  A shape looks through views, expands and aliases (`_RESHAPES`: their backward only gives the
  gradient its input's geometry back), so dropping one that changes nothing does not count;
  the forward values are the graph's either way.
The saved bytes are the pack hook's view of the replay (each storage once, the inputs' own
included), against the partition's saved values: an entry whose partition recomputes what eager
saves keeps its compiled pair, so this never costs memory.

The replay needs autograd's nodes and the geometry of what they save, never values: where sizes are
static it runs on meta tensors, and below autograd `_RecordedResults` answers each node's op with
meta tensors of the results the trace recorded for it, so no meta kernel runs (those of decomposed
ops are Python, batch norm's above all: on bench/compile_time.py's conv net the check took 3.5 ms
with them and takes 0.9 ms without). Views and in-place ops that return what they write still
run their (C++) meta kernels, since autograd and the byte count see which storage their results
share; an op that writes arguments it does not return (batch norm run in place on its running
statistics, Note [Buffers written in place] in runtime/replay.py) is answered too. The results are the
trace's own, so the saved bytes are those of the layouts the trace saw (eager's, Note [Eager's
layouts of normalization kernels] in aotc/eagerlayouts.py), where a decomposition's meta kernel
could give another; tests/e2e/test_eager_autograd.py checks that both decide alike.

Writes into inputs that need no grad, made without autograd history (a BatchNorm's running
statistics, a step counter; runtime/fastpath.py `eager_replayable`), are done in place by the
replayed forward where its op has an in-place variant (Note [Buffers written in place] in
runtime/replay.py), else by the epilogue after the forward; either way the epilogue sets the
input's version to eager's (`EpiloguePlan.versions`). The forward graph reads such an input
only for values from before the write, so where eager's autograd saved the input it saved it
before eager's write too. Where eager's write bumped the version (`w.add_(1)` after `x * w`),
the saved input's version check fails in the backward as eager's does; where it did not (the
BatchNorm kernel updates its running statistics without a bump), it passes as eager's does, and
the backward reads the same buffer eager's reads.

Calls under autocast or a functorch transform, and entries whose plans need more than that
(writes with history, aliased outputs, synthetic bases, ...), keep the compiled pair.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from aotc.runtime.replay import symbolic_geometry

SHAPE_KEY = "aotc_autograd_shape"

# Nodes a shape looks through: their backward only gives the gradient its input's geometry back,
# and the cleanup passes drop the views and expands that change nothing (passes/cleanup.py).
_RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "AliasBackward0", "ExpandBackward0"})

Shape = tuple[object, ...]


def autograd_shape(
    roots: Sequence[torch.Tensor], leaves: Sequence[tuple[int, torch.Tensor]]
) -> Shape | None:
    """The autograd graph behind `roots`, written canonically; None when it has a node that is
    not one of torch's own (C++) nodes, or a leaf that is not among `leaves` ((index, tensor))."""
    leaf_of = {id(t): g for g, t in leaves}
    index: dict[int, int] = {}
    keep: list[object] = []  # the nodes seen, alive while their ids are keys
    queue: collections.deque[object] = collections.deque()
    entries: list[object] = []

    def edge(fn: object, nr: int) -> object:
        while type(fn).__name__ in _RESHAPES and len(_edges(fn)) == 1:
            fn, nr = _edges(fn)[0]
        if fn is None:
            return None
        if type(fn).__name__ == "AccumulateGrad":
            g = leaf_of.get(id(fn.variable))  # type: ignore[attr-defined]
            return None if g is None else ("leaf", g)
        k = index.get(id(fn))
        if k is None:
            k = index[id(fn)] = len(keep)
            keep.append(fn)
            queue.append(fn)
        return (k, nr)

    heads: list[object] = []
    for t in roots:
        if t.grad_fn is None:
            g = leaf_of.get(id(t))
            if t.requires_grad and g is None:
                return None
            heads.append(("leaf", g) if t.requires_grad else None)
        else:
            heads.append(edge(t.grad_fn, t.output_nr))
    if any(h is None and r.requires_grad for h, r in zip(heads, roots)):
        return None  # a leaf nobody named
    while queue:
        fn = queue.popleft()
        if type(fn).__module__ != "builtins":
            return None  # a Python node: a custom Function, a backward hook's Function
        children = []
        for nxt, nr in _edges(fn):
            e = edge(nxt, nr)
            if e is None and nxt is not None:
                return None
            children.append(e)
        entries.append((type(fn).__name__, tuple(children)))
    return (tuple(heads), tuple(entries))


def replays_eagerly(
    shape: Shape | None,
    forward: fx.GraphModule,
    graph: fx.Graph,
    diff_outs: Sequence[int],
    requires_grad: Sequence[bool],
    saved_bytes: int,
) -> bool:
    """See the module docstring and Note [Eager autograd on the ATen path]. The replay runs on
    meta tensors where the graph's sizes are static (no fake tensor dispatch: a third of the
    check's time on a GPT block), on fake tensors where they are symbolic or meta fails."""
    if shape is None:
        return False
    vals = [n.meta.get("val") for n in forward.graph.nodes if n.op == "placeholder"]
    if len(vals) != len(requires_grad):
        return False
    static = all(
        isinstance(v, torch.Tensor) and not symbolic_geometry(v)
        for v in vals
        if not isinstance(v, int)
    )
    modes: list[FakeTensorMode | None] = [None] if static else []
    fake_mode = detect_fake_mode(vals)
    if fake_mode is not None:
        modes.append(fake_mode)
    for mode in modes:
        try:
            found = _replay(graph, forward, vals, requires_grad, diff_outs, mode)
        except Exception:  # noqa: BLE001  # a graph this replay cannot run
            continue
        if found is None:
            return False
        replayed, nbytes = found
        return replayed == shape and nbytes <= saved_bytes
    return False


def _replay(
    graph: fx.Graph,
    module: fx.GraphModule,
    vals: Sequence[object],
    requires_grad: Sequence[bool],
    diff_outs: Sequence[int],
    mode: FakeTensorMode | None,
) -> tuple[Shape | None, int] | None:
    """Runs `graph` under autograd on stand-ins of `vals` (meta tensors when `mode` is None):
    the shape of the autograd graph behind `diff_outs` and the bytes it saves; None when an
    output's requires_grad is not eager's, or a saved size is unknown."""
    storages: dict[int, int] = {}
    unknown = [False]
    meta = mode is None

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if isinstance(nbytes, torch.SymInt):
            hint = nbytes.node.hint
            if hint is None:
                unknown[0] = True
                return t
            nbytes = int(hint)
        storages[storage._cdata] = int(nbytes)
        return t

    def stand_in(v: torch.Tensor) -> torch.Tensor:
        device = torch.device("meta") if meta else v.device
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)

    with (
        mode if mode is not None else contextlib.nullcontext(),
        torch.enable_grad(),
        torch._C._DisableAutocast(),
        torch.autograd.graph.saved_tensors_hooks(pack, _same),
    ):
        args: list[object] = []
        leaves: list[tuple[int, torch.Tensor]] = []
        for g, (v, rg) in enumerate(zip(vals, requires_grad)):
            if isinstance(v, torch.Tensor):
                a = stand_in(v)
                if rg:
                    a.requires_grad_()
                    leaves.append((g, a))
                args.append(a)
            else:
                args.append(v)
        env: dict[fx.Node, Any] = {}
        it = iter(args)
        outs: Sequence[object] = ()
        recorded = _RecordedResults() if meta else contextlib.nullcontext()
        with recorded:
            for node in graph.nodes:
                if node.op == "placeholder":
                    env[node] = next(it)
                elif node.op == "get_attr":
                    value = getattr(module, str(node.target))
                    env[node] = stand_in(value) if isinstance(value, torch.Tensor) else value
                elif node.op == "call_function":
                    pos = fx.node.map_arg(node.args, env.__getitem__)
                    kw = fx.node.map_arg(node.kwargs, env.__getitem__)
                    if meta and "device" in kw:
                        kw = {**kw, "device": torch.device("meta")}
                    if isinstance(recorded, _RecordedResults):
                        recorded.expect(node)
                    env[node] = node.target(*pos, **kw)
                elif node.op == "output":
                    outs = fx.node.map_arg(node.args[0], env.__getitem__)
        diff = set(diff_outs)
        for k, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.requires_grad != (k in diff):
                return None
        replayed = autograd_shape([cast(torch.Tensor, outs[k]) for k in diff_outs], leaves)
    if unknown[0]:
        return None
    return replayed, sum(storages.values())


class _RecordedResults(TorchDispatchMode):
    """Below autograd, answers each node's op with meta tensors of the results the trace
    recorded (`node.meta["val"]`) instead of running its meta kernel: autograd records its node
    and saves its values above this mode, so only the results' geometry matters here, and the
    meta kernels of decomposed ops (batch norm's, in Python) were most of the check's time.
    Ops whose results alias or write their arguments (views, in-place), results without a
    recorded value, and any further op a node issues run their meta kernels."""

    def __init__(self) -> None:
        super().__init__()
        self._node: fx.Node | None = None

    def expect(self, node: fx.Node) -> None:
        self._node = node

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        node, self._node = self._node, None
        if node is not None and func is node.target and not _aliases(func):
            out = _empty_like(node.meta.get("val"), func)
            if out is not None:
                return out
        return func(*args, **(kwargs or {}))


def _aliases(func: Any) -> bool:
    """Whether a result of `func` may alias an argument. An op that only writes arguments it
    does not return (`_native_batch_norm_legit` on the running statistics, Note [Buffers
    written in place] in runtime/replay.py) does not: its results are fresh tensors."""
    schema = func._schema
    if any(r.alias_info is not None for r in schema.returns):
        return True
    return any(a.alias_info is not None and not a.alias_info.is_write for a in schema.arguments)


def _empty_like(val: object, func: Any) -> object:
    """Meta tensors of `val`'s geometry, in the structure `func` returns; None when `val`
    does not have that structure (or holds something but tensors)."""
    returns = func._schema.returns
    if len(returns) == 1 and str(returns[0].type) == "Tensor":
        return _meta_of(val)
    if not isinstance(val, (tuple, list)) or len(val) != len(returns):
        return None
    outs = []
    for r, v in zip(returns, val):
        if str(r.type) != "Tensor":
            return None
        t = _meta_of(v)
        if t is None:
            return None
        outs.append(t)
    return tuple(outs)


def _meta_of(val: object) -> torch.Tensor | None:
    if not isinstance(val, torch.Tensor) or symbolic_geometry(val):
        return None
    return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")


def _edges(fn: object) -> tuple[tuple[object, int], ...]:
    return fn.next_functions  # type: ignore[attr-defined]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
