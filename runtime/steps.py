"""ATen steps of a lowered graph, as data and as the functions that run them.

Records: `StepProgram` (one step of a lowered graph: a kernel launch or ATen calls, naming the
nodes of the decomposed graph it computes), `GraphProgram` (a whole lowered graph as data: the
decomposed graph, the steps, the buffer plan).
Stage: `node_runner(nodes, keep, aliases, ...) -> run(env)` (used by passes.kernelize when it
lowers a graph, and here when a program is rebuilt); `build_compiled_graph(program, sources)
-> CompiledGraph` (an exported artifact's lowered graph, see runtime/artifact.py).
Requires: a functional ATen fx graph (the decomposed graph) with `meta["val"]` on every node
(a stored graph keeps only static values: symbolic sizes live in the program as `SizeExpr`s).
Ensures: a rebuilt graph runs the same steps as the one lowering made: the same kernels, the same
ATen fallbacks (the same nodes), the same buffer slots and frees; with symbolic sizes, the same
size evaluation per call (Note [Size expressions as text] in runtime/symexpr.py). Nothing here imports
`aotc.passes`: the node runner only reads fx nodes, so a loaded artifact runs without the
compiler.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from aotc.runtime.kernels import (
    SYMS,
    AtenStep,
    BufferSpec,
    CompiledGraph,
    KernelSource,
    KernelStep,
    Step,
)
from aotc.runtime.symexpr import SizeExpr, size_expr, symbols_of
from aotc.runtime.symsizes import SymSource, compile_sizes

Env = dict[str, Any]
StrideFix = Callable[[Any, Env], Any]
# (node, the step keeps its value) -> a fix of the result's strides, or None
StrideFixer = Callable[[fx.Node, bool], StrideFix | None]


# --------------------------------------------------------------------------- running nodes


def node_runner(
    nodes: Sequence[fx.Node],
    keep: Sequence[str],
    aliases: dict[str, str],
    stride_fix: StrideFixer | None = None,
) -> Callable[[Env], None]:
    """Run fx nodes as ATen calls, reading and writing buffers by node name. Each node's call is
    prepared once here (its C++ op entry, which arguments are buffers, whether its result's
    strides need fixing), so a run does little more than the ATen calls themselves.
    `stride_fix`: how a kept result is brought to its traced strides (default: static sizes,
    `static_stride_fix`; passes.kernelize passes one that also handles symbolic sizes)."""
    fixer = stride_fix or static_stride_fix
    kept = set(keep)
    calls = [_prepare_call(node, fixer(node, node.name in kept)) for node in nodes]
    produced = {node.name for node in nodes}
    keep = list(keep)

    def run(env: Env) -> None:
        local: dict[str, Any] = {}
        for name, fn, arg_refs, kwargs, fix in calls:
            args = [_resolve(a, local, env, aliases, produced) for a in arg_refs]
            out = fn(*args, **kwargs)
            local[name] = fix(out, env) if fix is not None else out
        for name in keep:
            env[name] = local[name]

    return run


class _Ref:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _to_ref(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return _Ref(a.name)
    if isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
        return [_to_ref(x) for x in a]
    return a


def _resolve(
    a: Any, local: dict[str, Any], env: Env, aliases: dict[str, str], produced: set[str]
) -> Any:
    if isinstance(a, _Ref):
        if a.name in produced:
            return local[a.name]
        return env[a.name] if a.name in env else env[aliases[a.name]]
    if isinstance(a, list):
        return [_resolve(x, local, env, aliases, produced) for x in a]
    return a


def _prepare_call(
    node: fx.Node, fix: StrideFix | None
) -> tuple[str, Callable[..., Any], list[Any], dict[str, Any], StrideFix | None]:
    if node.op == "get_attr":
        value = _fetch_attr(node.graph.owning_module, str(node.target))
        return node.name, lambda: value, [], {}, None
    target = node.target
    fn = target._op if isinstance(target, torch._ops.OpOverload) else target
    assert callable(fn), node.format_node()
    if any(isinstance(v, fx.Node) for v in fx.node.map_arg(node.kwargs, lambda n: n).values()):
        args = [_to_ref(a) for a in node.args]
        kw_refs = {k: _to_ref(v) for k, v in node.kwargs.items()}
        return (
            node.name,
            _with_kwargs(fn, list(kw_refs)),
            [*args, *kw_refs.values()],
            {},
            fix,
        )
    return node.name, fn, [_to_ref(a) for a in node.args], dict(node.kwargs), fix


def _with_kwargs(fn: Callable[..., Any], names: list[str]) -> Callable[..., Any]:
    def call(*values: Any) -> Any:
        n = len(values) - len(names)
        return fn(*values[:n], **dict(zip(names, values[n:], strict=True)))

    return call


def static_stride_fix(node: fx.Node, keep: bool) -> StrideFix | None:
    """ATen results whose strides differ from the traced ones (which kernels index with) are
    copied into the traced layout. Static sizes only: None for a node with symbolic ones."""
    val = node.meta.get("val")
    if not keep or not isinstance(val, torch.Tensor):
        return None
    shape, stride = tuple(val.shape), tuple(val.stride())
    if not all(isinstance(v, int) for v in (*shape, *stride)):
        return None
    if math.prod(shape) <= 1 or not non_overlapping(shape, stride):
        return None

    def fix(out: Any, env: Env) -> Any:
        if not isinstance(out, torch.Tensor) or out.stride() == stride:
            return out
        return torch.empty_strided(shape, stride, dtype=out.dtype, device=out.device).copy_(out)

    return fix


def non_overlapping(size: Sequence[int], stride: Sequence[int]) -> bool:
    """No two indices share an element (gaps allowed): each stride covers the smaller dims."""
    dims = sorted((st, s) for s, st in zip(size, stride) if s > 1)
    extent = 1
    for st, s in dims:
        if st < extent:
            return False
        extent = st * (s - 1) + extent
    return True


def _fetch_attr(module: Any, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


# --------------------------------------------------------------------------- programs as data


@dataclass(frozen=True, slots=True)
class StepProgram:
    """One step of a lowered graph as data. A kernel step launches `kernel` (whose source text
    lives in the artifact's file `kernel_file`) into `outputs` and falls back to its `nodes` as
    ATen calls; an ATen step runs its `nodes`. `keep`: the nodes whose values outlive the step
    (the buffers it writes); `frees`: buffers dead after it."""

    name: str
    nodes: tuple[str, ...]  # nodes of the decomposed graph, in execution order
    keep: tuple[str, ...]
    frees: tuple[str, ...]
    kernel: KernelSource | None  # None: an ATen step. Its `source` is "" (see kernel_file)
    kernel_file: str | None
    outputs: tuple[BufferSpec, ...]
    # Symbolic sizes: the kept nodes whose traced strides are expressions (their node values
    # are not stored), with those strides; their ATen results are brought to them per call
    restrides: tuple[tuple[str, tuple[int | SizeExpr, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class GraphProgram:
    """A lowered graph (`CompiledGraph`) as data: what `build_compiled_graph` runs. With
    symbolic sizes, the sizes in it are `SizeExpr`s over `symbols` (Note [Size expressions as
    text] in runtime/symexpr.py)."""

    decomposed: fx.GraphModule
    steps: tuple[StepProgram, ...]
    placeholders: tuple[str, ...]
    outputs: tuple[object, ...]  # per graph output: a buffer name or a constant
    num_slots: int
    input_strides: tuple[tuple[int | SizeExpr, ...] | None, ...]
    aliases: tuple[tuple[str, str], ...]
    symbols: tuple[SymSource, ...] = ()  # where each size symbol is read (symbolic sizes)


def graph_program(graph: CompiledGraph, kernel_files: dict[str, str]) -> GraphProgram:
    """`graph` as data; `kernel_files`: each kernel's key -> the file its source goes to.
    Symbolic sizes become `SizeExpr`s (runtime/symexpr.py); raises ValueError for a size
    outside their grammar, or one that reads a symbol the graph does not bind."""
    if graph.decomposed is None:
        raise ValueError("the lowered graph keeps no decomposed graph")
    nodes = {n.name: n for n in graph.decomposed.graph.nodes}
    symbolic = bool(graph.symbols)
    steps = []
    for step in graph.steps:
        restrides = _restrides(step.keep, nodes) if symbolic else ()
        if isinstance(step, KernelStep):
            k = step.kernel
            kernel = dataclasses.replace(
                k,
                source="",
                cuda=None,
                xnumel=size_expr(k.xnumel),
                rnumel=size_expr(k.rnumel),
                bytes_read=_optional_size(k.bytes_read),
                bytes_written=_optional_size(k.bytes_written),
            )
            outputs = tuple(
                dataclasses.replace(
                    spec,
                    size=tuple(size_expr(s) for s in spec.size),
                    stride=tuple(size_expr(s) for s in spec.stride),
                )
                for spec in step.outputs
            )
            steps.append(
                StepProgram(
                    k.name,
                    step.nodes,
                    step.keep,
                    step.frees,
                    kernel,
                    kernel_files[k.key],
                    outputs,
                    restrides,
                )
            )
        else:
            steps.append(
                StepProgram(step.name, step.nodes, step.keep, step.frees, None, None, (), restrides)
            )
    strides = graph.input_strides or (None,) * len(graph.placeholders)
    program = GraphProgram(
        decomposed=graph.decomposed,
        steps=tuple(steps),
        placeholders=graph.placeholders,
        outputs=graph.outputs,
        num_slots=graph.num_slots,
        input_strides=tuple(
            tuple(size_expr(s) for s in st) if st is not None else None for st in strides
        ),
        aliases=graph.aliases,
        symbols=graph.symbols,
    )
    _check_symbols(program)
    return program


def _optional_size(value: Any) -> int | SizeExpr | None:
    """Byte counts are only printed: one outside the grammar is dropped."""
    try:
        return None if value is None else size_expr(value)
    except ValueError:
        return None


def _restrides(
    keep: Sequence[str], nodes: dict[str, fx.Node]
) -> tuple[tuple[str, tuple[int | SizeExpr, ...]], ...]:
    out = []
    for name in keep:
        val = nodes[name].meta.get("val") if name in nodes else None
        if not isinstance(val, torch.Tensor):
            continue
        if all(isinstance(s, int) for s in (*val.shape, *val.stride())):
            continue  # a static value: stored with the graph, `static_stride_fix` reads it
        out.append((name, tuple(size_expr(s) for s in val.stride())))
    return tuple(out)


def _check_symbols(program: GraphProgram) -> None:
    """Every size expression reads only symbols the program binds (else ValueError)."""
    used: frozenset[str] = frozenset()
    for sp in program.steps:
        if sp.kernel is not None:
            used |= symbols_of((sp.kernel.xnumel, sp.kernel.rnumel))
            used |= frozenset(sp.kernel.symbols)
        for spec in sp.outputs:
            used |= symbols_of((spec.size, spec.stride))
        used |= symbols_of(tuple(st for _, st in sp.restrides))
    used |= symbols_of(program.input_strides)
    unbound = used - {src.symbol for src in program.symbols}
    if unbound:
        raise ValueError(f"size expressions read symbols {sorted(unbound)} the graph does not bind")


def symbolic_stride_fix(stride: Sequence[int | SizeExpr], symbols: Sequence[str]) -> StrideFix:
    """Bring an ATen result to its traced strides, evaluated per call from the symbols' values
    (`runtime.kernels.SYMS`): a result that already has them, has at most one element, or whose
    traced layout overlaps itself (an expanded value) is kept as it is."""
    strides_of = compile_sizes(list(stride), list(symbols))

    def fix(out: Any, env: Env) -> Any:
        if not isinstance(out, torch.Tensor) or out.numel() <= 1:
            return out
        want = strides_of(env[SYMS])
        if all(st == w for st, w, n in zip(out.stride(), want, out.shape) if n > 1):
            return out
        if not non_overlapping(tuple(out.shape), want):
            return out
        return torch.empty_strided(out.shape, want, dtype=out.dtype, device=out.device).copy_(out)

    return fix


def build_compiled_graph(program: GraphProgram, sources: dict[str, str]) -> CompiledGraph:
    """The runnable graph of `program`; `sources`: kernel file -> kernel source text. Raises
    ValueError when a size expression reads a symbol the program does not bind."""
    _check_symbols(program)
    nodes = {n.name: n for n in program.decomposed.graph.nodes}
    aliases = dict(program.aliases)
    names = [src.symbol for src in program.symbols]
    steps: list[Step] = []
    kernels = []
    for sp in program.steps:
        fixes = {name: symbolic_stride_fix(st, names) for name, st in sp.restrides}

        def fixer(node: fx.Node, keep: bool, fixes: dict[str, StrideFix] = fixes) -> Any:
            fix = fixes.get(node.name) if keep else None
            return fix if fix is not None else static_stride_fix(node, keep)

        fallback = node_runner([nodes[n] for n in sp.nodes], sp.keep, aliases, fixer)
        if sp.kernel is None:
            steps.append(AtenStep(sp.name, fallback, sp.frees, sp.nodes, sp.keep))
            continue
        assert sp.kernel_file is not None
        kernel = dataclasses.replace(sp.kernel, source=sources[sp.kernel_file])
        kernels.append(kernel)
        steps.append(KernelStep(kernel, sp.outputs, fallback, sp.frees, sp.nodes, sp.keep))
    return CompiledGraph(
        kernels=tuple(kernels),
        steps=tuple(steps),
        placeholders=program.placeholders,
        outputs=program.outputs,
        num_slots=program.num_slots,
        input_strides=program.input_strides,
        symbols=program.symbols,
        decomposed=program.decomposed,
        aliases=program.aliases,
    )


__all__ = [
    "GraphProgram",
    "StepProgram",
    "build_compiled_graph",
    "graph_program",
    "node_runner",
    "non_overlapping",
    "static_stride_fix",
    "symbolic_stride_fix",
]
