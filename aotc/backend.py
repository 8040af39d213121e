"""`torch.compile(model, backend="aotc")`: Dynamo hands each captured FX graph to aotc.

Stage: `aotc_backend(gm, example_inputs, options=...) -> callable` (Dynamo's backend protocol).
Registered through the `torch_dynamo_backends` entry point in pyproject, so the name resolves
after install with no import. Options pass through `torch.compile(..., options={...})` and are the
fields of `aotc.CompileOptions` (`dump=` is short for `dump_dir=`).

Requires: `gm` is one Dynamo graph (one per graph break; each is compiled on its own), with
Dynamo's fake tensors as its placeholders' `example_value`.
Ensures: the graph is compiled now, at backend time, on Dynamo's fake inputs in Dynamo's fake
mode and ShapeEnv (static, automatic-dynamic and `dynamic=True` sizes alike; see
Note [Symbolic compilations] in aotc/symbolic.py). The returned callable runs the one compiled
entry without aotc guards of its own: Dynamo's guards (sizes, strides, dtypes, requires_grad,
grad mode, autocast state) already decide when it is valid, and shape assumptions aotc makes
while tracing land in Dynamo's ShapeEnv, whose guards Dynamo installs after the backend returns.

Note [Backend fallback]
~~~~~~~~~~~~~~~~~~~~~~~
A few graphs cannot be compiled ahead on Dynamo's fakes: inputs that share storage (a mutation of
one must be seen through the other: aotc's synthetic bases need real tensors), SymInt inputs that
are no tensor's size, SymInt outputs, or views of inputs with symbolic geometry. Those fall back to
`aotc.compile(gm.forward)`, which compiles on the first real call and keys entries with aotc's own
guards (so a size change recompiles there). `aotc.backend.stats` counts both kinds.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from aotc.api import COMPILE_LISTENERS, CompiledFunction, _flatten_output, compile
from aotc.lifting import find_free_tensors, swapped
from aotc.options import CompileOptions
from aotc.pipeline import compile_signature
from aotc.provenance import graph_input_names, run_with_node_meta
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.wrappers import CompiledEntry
from aotc.symbolic import check_static_geometry, symbolic_leaves

log = logging.getLogger("aotc.graphs")

# How many Dynamo graphs were compiled ahead ("ahead") or fell back ("fallback").
stats: Counter[str] = Counter()


def aotc_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any
) -> Callable[..., Any]:
    options = dict(options.pop("options", None) or {}, **options)
    if "dump" in options:
        options["dump_dir"] = options.pop("dump")
    opts = CompileOptions.from_env(**options)
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is not None and fake_mode.shape_env is not None:
        _specialize_float_inputs(fake_mode.shape_env)
    fakes = _fake_inputs(gm, example_inputs, fake_mode)
    problem = _why_not_ahead(fakes, fake_mode)
    if problem is None:
        fakes, problem = _pre_call_fakes(fakes, example_inputs, fake_mode)  # type: ignore[arg-type]
    if problem is None:
        try:
            run = _compile_ahead(gm, fakes, fake_mode, opts)  # type: ignore[arg-type]
            stats["ahead"] += 1
            return run
        except UnsupportedError as e:
            problem = str(e)
    # See Note [Backend fallback]
    stats["fallback"] += 1
    log.info("aotc backend: compiling graph on its first call instead (%s)", problem)
    compiled: CompiledFunction = compile(gm.forward, **options)

    def run_lazily(*args: Any) -> Any:
        return compiled(*args)

    run_lazily.aotc_compiled = compiled  # type: ignore[attr-defined]
    return run_lazily


def _specialize_float_inputs(shape_env: Any) -> None:
    """Dynamo passes Python floats it treats as dynamic (`dynamic=True`) as 0-d tensors read
    with `.item()`, expecting the backend to fold them into tensor ops; aotc does not, so it asks
    Dynamo to restart with those floats as constants (Dynamo's own protocol for this, guarded
    by value)."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    values = (
        shape_env.backed_var_to_val
        if hasattr(shape_env, "backed_var_to_val")
        else shape_env.var_to_val
    )  # torch < 2.13
    floats = [
        str(s)
        for s in values
        if symbol_is_type(s, SymT.FLOAT) and not TensorifyState.should_specialize(str(s))
    ]
    if floats:
        for name in floats:
            TensorifyState.specialize(name)
        raise TensorifyScalarRestartAnalysis


def _fake_inputs(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: FakeTensorMode | None
) -> list[object]:
    """Dynamo's fake value of each placeholder (its real example input where it has none)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: list[object] = []
    for node, example in zip(placeholders, example_inputs):
        fake = node.meta.get("example_value")
        if fake is None and isinstance(example, torch.Tensor) and mode is not None:
            fake = mode.from_tensor(example)
        out.append(fake if fake is not None else example)
    return out


def _pre_call_fakes(
    fakes: list[object], examples: Sequence[Any], mode: FakeTensorMode
) -> tuple[list[object], str | None]:
    """Inputs as they are when the graph is called. Dynamo's example value of an input the graph
    mutates holds its state after Dynamo traced the mutation (`a.mul_(w)` leaves it requiring
    grad, with a stale grad_fn); aotc must see the state before. A mutated input (version > 0)
    gets a fresh fake with its geometry and the real input's requires_grad and leafness; if its
    geometry changed too (`t_()`), the graph falls back (see Note [Backend fallback])."""
    out = list(fakes)
    for i, (fake, example) in enumerate(zip(fakes, examples)):
        if not isinstance(fake, FakeTensor) or fake._version == 0:
            continue
        if not isinstance(example, torch.Tensor) or isinstance(example, FakeTensor):
            return out, f"input {i} is mutated by the graph and its value before is unknown"
        hints = [_hint(v) for v in (*fake.shape, *fake.stride())]
        if hints != [*example.shape, *example.stride()]:
            return out, f"input {i}'s shape or strides are changed in place by the graph"
        with mode:
            fresh = torch.empty_strided(
                fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device
            )
            if example.requires_grad:
                fresh.requires_grad_(True)
                if not example.is_leaf:
                    dest = torch.empty_strided(
                        fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device
                    )
                    with torch.enable_grad():
                        fresh = dest.copy_(fresh)
        out[i] = fresh
    return out, None


def _hint(value: object) -> object:
    if isinstance(value, torch.SymInt):
        return value.node.hint
    return value


def _why_not_ahead(fakes: Sequence[object], mode: FakeTensorMode | None) -> str | None:
    if mode is None:
        return "no fake mode found in Dynamo's example inputs"
    storages: set[StorageWeakRef] = set()
    for i, x in enumerate(fakes):
        if isinstance(x, torch.Tensor):
            if not isinstance(x, FakeTensor) or x.fake_mode.shape_env is not mode.shape_env:
                return f"input {i} is not one of Dynamo's fake tensors"
            ref = StorageWeakRef(x.untyped_storage())
            if ref in storages:
                return f"input {i} shares storage with another input"
            storages.add(ref)
        elif isinstance(x, torch.SymInt):
            if _size_binding(x, fakes) is None:
                return f"input {i} is a symbolic int that is no input tensor's size"
        elif isinstance(x, (torch.SymFloat, torch.SymBool)):
            return f"input {i} is a symbolic {type(x).__name__}"
    return None


def _size_binding(value: torch.SymInt, fakes: Sequence[object]) -> tuple[int, int] | None:
    """(input, dim) whose size is the same symbol as `value`, or None."""
    expr = value.node.expr
    for i, x in enumerate(fakes):
        if isinstance(x, torch.Tensor):
            for d, size in enumerate(x.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == expr:
                    return i, d
    return None


def _compile_ahead(
    gm: torch.fx.GraphModule, fakes: list[object], mode: FakeTensorMode, opts: CompileOptions
) -> Callable[..., Any]:
    lifted = find_free_tensors(gm.forward)
    accesses = lifted.accesses
    num_inputs = len(fakes)
    # SymInt placeholders are re-read from the size they are bound to, so the trace tracks them.
    bindings = {
        k: _size_binding(x, fakes) for k, x in enumerate(fakes) if isinstance(x, torch.SymInt)
    }
    leaves = symbolic_leaves(
        mode, [*fakes, *(a.get() for a in accesses)], [False] * (num_inputs + len(accesses))
    )
    forward = run_with_node_meta(gm)  # See Note [Node provenance] in aotc/provenance.py

    def program(user_leaves: list[object]) -> tuple[list[object], object]:
        args = list(user_leaves[:num_inputs])
        for k, (i, d) in bindings.items():  # type: ignore[misc]
            args[k] = args[i].size(d)  # type: ignore[union-attr]
        with swapped(lifted, user_leaves[num_inputs:]):
            out = forward(*args)
        return _flatten_output(out)

    names = graph_input_names(gm) + [a.name for a in accesses]
    entry: CompiledEntry = compile_signature(
        program, leaves, names, opts, "dynamo_graph", _graph_source(gm), mode
    )
    check_static_geometry(entry.plan.epilogue, "dynamo_graph")
    graph = DynamoGraph(entry)
    for listener in COMPILE_LISTENERS:
        listener(graph, entry.record, None)  # type: ignore[arg-type]
    run_entry = entry.run
    if accesses:

        def run(*args: Any) -> Any:
            return run_entry([*args, *(a.get() for a in accesses)])
    else:

        def run(*args: Any) -> Any:
            return run_entry(list(args))

    run.aotc_graph = graph  # type: ignore[attr-defined]
    return run


class DynamoGraph:
    """One Dynamo graph compiled ahead: its entry and record (what `aotc explain` lists)."""

    def __init__(self, entry: CompiledEntry) -> None:
        self.entry = entry
        self.records = [entry.record]


def _graph_source(gm: torch.fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            lines = [
                ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File")
            ]
            if lines:
                parts = lines[-1].split('"')
                return (
                    f"{parts[1]}:{lines[-1].split('line ')[-1].split(',')[0]}"
                    if len(parts) > 2
                    else lines[-1]
                )
    return "<dynamo graph>"
