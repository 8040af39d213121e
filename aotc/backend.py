"""`torch.compile(model, backend="aotc")`: Dynamo hands each captured FX graph to aotc.

Stage: `aotc_backend(gm, example_inputs, options=...) -> callable` (Dynamo's backend protocol);
`compile_graph(gm, example_inputs, options, ...)`, shared with the default capture mode of
`aotc.compile` (aotc/capture.py), whose backend passes its own options, name and record list.
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
while tracing land in Dynamo's ShapeEnv, whose guards Dynamo installs after the backend returns
(a graph that writes an input also checks that no other input shares its storage: Note [Inputs
that alias at run time]). Entries are stored in the disk cache like `aotc.compile`'s (Note
[Symbolic cache entries] in aotc/symkey.py for graphs with symbolic sizes or floats).

Note [Backend fallback]
~~~~~~~~~~~~~~~~~~~~~~~
A few graphs cannot be compiled ahead on Dynamo's fakes: inputs that share storage (a mutation of
one must be seen through the other: aotc's synthetic bases need real tensors), SymInt inputs that
are no tensor's size, SymInt outputs, or views of inputs with symbolic geometry. Those fall back to
`aotc.compile(gm.forward, capture="trace", dynamic=False)`, which compiles on the first real call
and keys entries with aotc's own guards (so a size change recompiles there).
`aotc.backend.stats` counts both kinds.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from aotc.api import COMPILE_LISTENERS, CompiledFunction, _flatten_output
from aotc.eagergraph import eager_graph
from aotc.lifting import find_free_tensors, swapped
from aotc.options import Capture, CompileOptions
from aotc.pipeline import compile_signature
from aotc.provenance import graph_input_names
from aotc.runtime.epilogue import StepKind
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
    _inductor_mode(options.pop("mode", None))
    if "dump" in options:
        options["dump_dir"] = options.pop("dump")
    opts = CompileOptions.from_env(**options)
    return compile_graph(gm, example_inputs, opts)


_INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_warned_modes: set[str] = set()


def _inductor_mode(mode: object) -> None:
    """`torch.compile(model, backend="aotc", mode=...)`: the modes are Inductor's (CUDA graphs,
    autotuning); aotc has none, so a known mode is ignored (logged once), another one refused."""
    if mode is None or mode == "default":
        return
    if mode not in _INDUCTOR_MODES:
        raise ValueError(
            f"torch.compile(backend='aotc', mode={mode!r}): unknown mode; torch.compile's modes "
            f"are {', '.join(_INDUCTOR_MODES)} (Inductor's; aotc ignores them)"
        )
    if mode not in _warned_modes:
        _warned_modes.add(str(mode))
        log.warning(
            "torch.compile(backend='aotc', mode=%r): aotc has no compile modes (they select "
            "Inductor's CUDA graphs and autotuning); compiling as usual",
            mode,
        )


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    opts: CompileOptions,
    name: str = "dynamo_graph",
    owner: Any = None,
    reason: str | None = None,
    on_graph: Callable[[Any], None] | None = None,
) -> Callable[..., Any]:
    """Compile one Dynamo graph. `owner`: the object listeners are told the record belongs to
    (the `aotc.compile` object of the default capture mode; else a `DynamoGraph`); `reason`: why
    Dynamo recompiled, for listeners; `on_graph(graph)`: gets the `DynamoGraph`, or the lazily
    compiled `CompiledFunction` of a fallback (both have `.records`)."""
    run = _compile_graph(gm, example_inputs, opts, name, owner, reason, on_graph)
    return _leaving_global_state(gm, run)


# Note [Global state a Dynamo graph leaves set]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo records a program's calls that set torch's global state (`torch.set_grad_enabled`,
# `torch.set_default_dtype`, `torch.use_deterministic_algorithms`) as nodes of its graph, and
# relies on the graph running them: what the state is after the graph is what the program left
# (eager's `torch.set_grad_enabled(False)` without a restore keeps grad off after the call; a
# graph that ends inside a `with torch.no_grad():` block before a graph break leaves grad off for
# the code after the break). aotc's compiled graphs hold only tensor ops: the setters ran while
# tracing, and the runtime restores the caller's state around its calls. So the call ends by
# setting each such state the way the graph's last setter of it did. Graphs without setters get
# no wrapper; a graph that sets and restores (a `no_grad` region inside) sets what is already set.
_GLOBAL_SETTERS = tuple(
    fn
    for fn in (
        getattr(torch._C, "_set_grad_enabled", None),
        torch.set_default_dtype,
        getattr(torch._C, "_set_deterministic_algorithms", None),
        getattr(torch, "use_deterministic_algorithms", None),
        getattr(torch, "set_grad_enabled", None),
    )
    if fn is not None
)


def _leaving_global_state(gm: torch.fx.GraphModule, run: Callable[..., Any]) -> Callable[..., Any]:
    """`run`, then the last call of each global-state setter in `gm` (Note [Global state a Dynamo
    graph leaves set]); `run` itself when the graph has none."""
    last: dict[object, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _GLOBAL_SETTERS:
            continue
        if any(isinstance(a, torch.fx.Node) for a in (*node.args, *node.kwargs.values())):
            return run  # a state computed in the graph: Dynamo's graph decides (never seen)
        kind = "grad" if "grad" in getattr(node.target, "__name__", "") else node.target
        kind = "deterministic" if "deterministic" in getattr(node.target, "__name__", "") else kind
        last[kind] = (node.target, tuple(node.args), dict(node.kwargs))
    if not last:
        return run
    setters = tuple(last.values())

    def run_and_set(*args: Any) -> Any:
        out = run(*args)
        for fn, fargs, fkwargs in setters:
            fn(*fargs, **fkwargs)
        return out

    for attr in ("aotc_graph", "aotc_compiled"):
        if hasattr(run, attr):
            setattr(run_and_set, attr, getattr(run, attr))
    return run_and_set


def _compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    opts: CompileOptions,
    name: str,
    owner: Any,
    reason: str | None,
    on_graph: Callable[[Any], None] | None,
) -> Callable[..., Any]:
    _refuse_metadata_changes(gm)
    switch = _inference_mode_switch(gm)
    if switch is not None:  # See Note [Inference mode switches in Dynamo graphs]
        stats["eager"] += 1
        log.info("aotc backend: %s runs as Dynamo's graph (inference mode set at %s)", name, switch)
        return _with_mode_guards_released(eager_graph(gm))
    fake_mode = detect_fake_mode(example_inputs)
    fakes = _fake_inputs(gm, example_inputs, fake_mode)
    floats = _dynamic_floats(fakes)
    problem = _why_not_ahead(fakes, fake_mode)
    if problem is None:
        fakes, problem = _pre_call_fakes(fakes, example_inputs, fake_mode)  # type: ignore[arg-type]
    if problem is None:
        try:
            run = _compile_ahead(gm, fakes, fake_mode, opts, name, owner, reason)  # type: ignore[arg-type]
            if floats:
                _check_floats_stayed_symbolic(floats, fake_mode)  # raises Dynamo's restart
            stats["ahead"] += 1
            if on_graph is not None:
                on_graph(run.aotc_graph)  # type: ignore[attr-defined]
            return run
        except UnsupportedError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 see Note [Dynamic Python floats]
            if not floats or type(e).__module__.startswith("torch._dynamo"):
                raise  # (Dynamo's restart is its control flow)
            problem = f"{type(e).__name__}: {e}"
    if floats and fake_mode is not None and fake_mode.shape_env is not None:
        # See Note [Dynamic Python floats]: the fallback runs on real tensors and cannot read
        # them; Dynamo restarts with these floats as constants.
        log.info("aotc backend: specializing Python floats %s (%s)", floats, problem)
        _specialize_float_inputs(fake_mode.shape_env)
    # See Note [Backend fallback]
    stats["fallback"] += 1
    log.info("aotc backend: compiling graph on its first call instead (%s)", problem)
    compiled = _strict_fallback(gm, opts, name)
    if on_graph is not None:
        on_graph(compiled)
    eager_after_refusal = owner is not None  # aotc.compile's default mode, not torch.compile
    eager: list[Callable[..., Any]] = []  # eager_graph(gm), once the graph was refused

    def run_lazily(*args: Any) -> Any:
        # See Note [Refused graphs run eagerly]
        if eager:
            return eager[0](*args)
        try:
            return compiled(*args)
        except UnsupportedError as e:
            if not eager_after_refusal:
                raise
            stats["eager"] += 1
            log.warning("aotc: %s runs this graph eagerly: %s", name, str(e).splitlines()[0])
            eager.append(eager_graph(gm))
            return eager[0](*args)

    run_lazily.aotc_compiled = compiled  # type: ignore[attr-defined]
    return run_lazily


# Note [Refused graphs run eagerly]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under `aotc.compile`'s default mode, a Dynamo graph that the strict fallback refuses to compile
# (an `UnsupportedError`: e.g. an in-place op reading an overlapping view of its own output,
# whose eager result depends on the order elements are visited) runs as Dynamo's graph module,
# eagerly, from then on: what `torch.compile(backend="eager")` would run, so the result is
# eager's. Every `UnsupportedError` a compiled call raises is raised before the graph runs
# (argument checks, compilation), so nothing has happened twice. `torch.compile(backend="aotc")`
# raises the refusal instead, as it does for the other graphs aotc refuses. The warning names
# the reason once per graph; `aotc.backend.stats["eager"]` counts such graphs. Checkpointed
# regions in it run eager's checkpoint, not Dynamo's operator (Note [Checkpointed regions of a
# graph run eagerly] in aotc/eagergraph.py).


# In-place ops that change a tensor's sizes or strides (not its data).
_METADATA_CHANGES = frozenset(
    ("transpose_", "t_", "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_", "as_strided_")
)


def _refuse_metadata_changes(gm: torch.fx.GraphModule) -> None:
    """See Note [Metadata changes in Dynamo graphs]."""
    for node in gm.graph.nodes:
        target = node.target
        name = target if node.op == "call_method" else getattr(target, "__name__", "")
        if node.op in ("call_method", "call_function") and name in _METADATA_CHANGES:
            raise UnsupportedError(
                f"{name}() at {_node_line(node)}: Dynamo keeps the sizes and strides a tensor had "
                "before an in-place metadata change, so Python code reading them after it "
                "(`x.shape`, `x.stride()`) would get stale values in a compiled frame "
                "(torch.compile with any backend). aotc.compile runs this frame eagerly; with "
                "torch.compile, use the out-of-place op (`x = x.transpose(0, 1)`)."
            )


# Note [Inference mode switches in Dynamo graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `with torch.inference_mode(False):` (or `(True)`) inside a compiled region becomes a pair of
# `_enter_inference_mode`/`_exit_inference_mode` calls in Dynamo's graph. Tracing the graph runs
# them while tracing only, so the compiled graph would run every op in the caller's mode: under
# an outer `inference_mode()` the region's outputs came back as inference tensors, and eager's
# errors (an in-place update of an inference tensor outside inference mode, an inference tensor
# saved for backward) were not raised. Such a graph runs as Dynamo's graph module, which switches
# the mode around its ops as eager does (what `torch.compile(backend="eager")` runs).
_INFERENCE_MODE_SWITCHES = (torch.autograd.grad_mode._enter_inference_mode,)


def _with_mode_guards_released(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward`, except that an error leaves no mode switched: the graph enters and exits the
    mode without try/finally, and its guard object, kept alive by the traceback, would restore
    the mode it saved whenever the traceback dies (long after the caller's own `with` exited)."""

    def run(*args: Any) -> Any:
        try:
            return forward(*args)
        except BaseException as e:
            if e.__traceback__ is not None:
                traceback.clear_frames(e.__traceback__.tb_next)  # the graph's frames
            raise

    return run


def _inference_mode_switch(gm: torch.fx.GraphModule) -> str | None:
    """The line of the first inference-mode switch in the graph, or None."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _INFERENCE_MODE_SWITCHES:
            return _node_line(node)
    return None


def _node_line(node: torch.fx.Node) -> str:
    trace = str(node.meta.get("stack_trace") or "").strip().splitlines()
    where = [ln.strip() for ln in trace if ln.strip().startswith("File ")]
    return where[-1] if where else "an unknown line"


# Note [Metadata changes in Dynamo graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `v = a.unsqueeze(0); v.transpose_(0, 1); return v.shape[0]` returns 1 through Dynamo (eager: 3),
# with every backend: Dynamo answers `v.shape` from the sizes it recorded before the in-place
# change, and bakes the answer into the frame's bytecode, where no backend sees it. A graph
# holding such an op may therefore sit in a frame whose Python already read a stale size, so the
# backend refuses it: under `aotc.compile` the frame runs eagerly (Note [Frames Dynamo cannot
# convert] in aotc/capture.py); `torch.compile(backend="aotc")` raises this error naming the line.


# Note [Dynamic Python floats]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A Python float the program reads (an optimizer's `lr` that a scheduler changes every step, a
# module's float attribute) is first a constant guarded by value; when a call sees another value,
# Dynamo recompiles with the float dynamic: the graph gets a 0-d float64 CPU tensor input and
# reads it with `.item()` (the fake tensor's `item_memo` is the float's symbol). aotc traces that
# as it is: `aten._local_scalar_dense` gives the SymFloat, scalar arithmetic on it becomes
# `operator` nodes, and ops take it as a Scalar argument (the fresh fakes of each run carry the
# memo, see functional.fresh_fake; a SymFloat the backward needs is saved like a SymInt). At run
# time the graph reads the float from the CPU tensor Dynamo passes (no device sync), so one
# compiled graph serves every learning rate, as with Inductor. Where that path fails (a graph that
# falls back, any error while compiling ahead with a dynamic float, or the Triton lowering, which
# then runs the graph as ATen calls), aotc asks Dynamo to restart with the floats as constants
# (`_specialize_float_inputs`): correct, one compilation per value. So it does when the trace
# itself specialized a float: an op whose schema takes a C++ `double` (`triplet_margin_loss`'s
# margin) reads the value, and the ShapeEnv replaces the symbol by it
# (`_check_floats_stayed_symbolic`). Graphs with a dynamic float skip the disk cache
# (`_cache_facts` in aotc/pipeline.py): a hit runs no trace, so neither that specialization nor
# a guard the trace adds on the float would reach Dynamo's guards, and the graph's text, the same
# for every value, would hand one value's graph to all (the margin of the first call compiled,
# for every later margin). Recording float specializations with the entry, as symbolic sizes'
# guards are (Note [Symbolic cache entries]), would let an optimizer's lr graph hit again.


def _dynamic_floats(fakes: Sequence[object]) -> list[str]:
    """The symbols of the Python floats Dynamo passes as 0-d tensors (Note [Dynamic Python
    floats])."""
    out = []
    for x in fakes:
        memo = getattr(x, "item_memo", None) if isinstance(x, FakeTensor) else None
        if isinstance(memo, torch.SymFloat):
            out.append(str(memo.node.expr))
    return out


def _check_floats_stayed_symbolic(floats: list[str], mode: FakeTensorMode | None) -> None:
    """Ask Dynamo to restart with the floats as constants if aotc's trace specialized one (an op
    taking a C++ `double` reads the float's value: `torch.triplet_margin_loss`'s margin). See
    Note [Dynamic Python floats]."""
    shape_env = mode.shape_env if mode is not None else None
    if shape_env is None:
        return
    specialized = {str(k) for k in getattr(shape_env, "replacements", {})}
    if specialized & set(floats):
        log.info("aotc backend: the trace specialized Python floats %s", floats)
        _specialize_float_inputs(shape_env)


def _specialize_float_inputs(shape_env: Any) -> None:
    """Ask Dynamo to restart with the Python floats it made dynamic as constants (Dynamo's own
    protocol for this, guarded by value). See Note [Dynamic Python floats]."""
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
    grad, with a stale grad_fn; `a.requires_grad_()` leaves it requiring grad); aotc must see the
    state before. A mutated input (version > 0, or requires_grad other than the real input's)
    gets a fresh fake with its geometry and the real input's requires_grad and leafness; if its
    geometry changed too (`t_()`), the graph falls back (see Note [Backend fallback])."""
    out = list(fakes)
    for i, (fake, example) in enumerate(zip(fakes, examples)):
        if not isinstance(fake, FakeTensor):
            continue
        if fake._version == 0 and not (
            # `x.float().requires_grad_()` on a float input (fuzz seed 12414): the example value
            # requires grad after Dynamo's trace although the input did not before the call.
            isinstance(example, torch.Tensor)
            and not isinstance(example, FakeTensor)
            and example.requires_grad != fake.requires_grad
        ):
            continue
        if not isinstance(example, torch.Tensor) or isinstance(example, FakeTensor):
            return out, f"input {i} is mutated by the graph and its value before is unknown"
        hints = [_hint(v) for v in (*fake.shape, *fake.stride())]
        if hints != [*example.shape, *example.stride()]:
            return out, f"input {i}'s shape or strides are changed in place by the graph"
        with mode:
            fresh = _like(fake)
            if example.requires_grad:
                fresh.requires_grad_(True)
                if not example.is_leaf:
                    dest = _like(fake)
                    with torch.enable_grad():
                        fresh = dest.copy_(fresh)
        out[i] = fresh
    return out, None


def _like(fake: FakeTensor) -> torch.Tensor:
    """A fresh tensor with `fake`'s geometry, storage offset included: a view the graph takes
    with `as_strided` reads absolute storage offsets (fuzz seed 8252)."""
    offset = fake.storage_offset()
    if isinstance(offset, int) and offset == 0:
        return torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device)
    numel = fake.untyped_storage().nbytes() // fake.element_size()
    storage = torch.empty(numel, dtype=fake.dtype, device=fake.device).untyped_storage()
    return torch.empty(0, dtype=fake.dtype, device=fake.device).set_(
        storage, offset, fake.shape, fake.stride()
    )


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
    gm: torch.fx.GraphModule,
    fakes: list[object],
    mode: FakeTensorMode,
    opts: CompileOptions,
    name: str,
    owner: Any,
    reason: str | None,
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

    def program(user_leaves: list[object]) -> tuple[list[object], object]:
        args = list(user_leaves[:num_inputs])
        for k, (i, d) in bindings.items():  # type: ignore[misc]
            args[k] = cast(torch.Tensor, args[i]).size(d)
        with swapped(lifted, user_leaves[num_inputs:]):
            out = _run_with_user_lines(gm, args)
        return _flatten_output(out)

    names = graph_input_names(gm) + [a.name for a in accesses]
    entry: CompiledEntry = compile_signature(
        program, leaves, names, opts, name, _graph_source(gm), mode, graph=gm
    )
    check_static_geometry(entry.plan.epilogue, name)
    graph = DynamoGraph(entry)
    for listener in COMPILE_LISTENERS:
        listener(owner if owner is not None else graph, entry.record, reason)  # type: ignore[arg-type]
    run_entry = entry.run
    mutated = _mutated_leaves(entry)
    if mutated:
        # See Note [Inputs that alias at run time]
        def run(*args: Any) -> Any:
            leaves = [*args, *(a.get() for a in accesses)]
            if _share_storage(leaves, mutated):
                return graph.aliased(gm, opts, name)(*args)
            return run_entry(leaves)
    elif accesses:

        def run(*args: Any) -> Any:
            return run_entry([*args, *(a.get() for a in accesses)])
    else:
        # The entry's generated call itself, no closure frame around it: it takes the graph's
        # inputs as arguments and checks autocast and functorch as `run_entry` does (a function
        # object per entry, so the attribute below is this graph's).
        run = entry.run_args

    run.aotc_graph = graph  # type: ignore[attr-defined]
    return run


# Note [Inputs that alias at run time]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A graph compiled ahead assumes its inputs share no storage (`_why_not_ahead` sends graphs whose
# fake inputs do to the fallback). Dynamo guards that two inputs are not the same tensor, but not
# that two distinct tensors (`buf[:4]`, `buf[2:6]`) do not overlap: called with such views, the
# graph would write one input and read the other's stale value (torch.compile with aot_eager
# gives a wrong result there). So a graph that writes into an input checks, each call, that no
# other input uses the written input's storage (one storage read per tensor input; graphs without
# input mutations skip it); if one does, the call goes to a strict-mode compilation of the same
# Dynamo graph, which keys entries on the aliasing pattern and replays the mutation through a
# synthetic base (compiled on first use).


def _mutated_leaves(entry: CompiledEntry) -> tuple[int, ...]:
    """User leaves (graph inputs, then lifted tensors) whose data the graph writes."""
    sources = entry.plan.convention.graph_sources
    written = {sources[m.target] for m in entry.plan.epilogue.mutations if m.kind is StepKind.COPY}
    return tuple(sorted(s for s in written if s is not None))


def _share_storage(leaves: list[Any], mutated: tuple[int, ...]) -> bool:
    """Whether some tensor leaf uses the storage of a mutated leaf, besides that leaf itself."""
    written = {leaves[m].untyped_storage().data_ptr() for m in mutated}
    written.discard(0)  # empty storages hold nothing to alias
    if len(written) < len(mutated) - sum(1 for m in mutated if leaves[m].numel() == 0):
        return True  # two written leaves share one storage
    hits = 0
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in written:
            hits += 1
    return hits > len(written)


def _run_with_user_lines(gm: torch.fx.GraphModule, args: list[object]) -> Any:
    """Run the Dynamo graph node by node with each node's metadata current, so the ATen nodes aotc
    traces from it carry the user's source line (Dynamo's `stack_trace`), not the graph's
    generated code: dumps, partition reports and errors then name the user's lines."""
    with fx_traceback.preserve_node_meta():
        return torch.fx.Interpreter(gm).run(*args)


class DynamoGraph:
    """One Dynamo graph compiled ahead: its entry and record (what `aotc explain` lists), and the
    strict-mode compilation that serves calls whose inputs alias (Note [Inputs that alias at run
    time]), made on first use."""

    def __init__(self, entry: CompiledEntry) -> None:
        self.entry = entry
        self._aliased: CompiledFunction | None = None

    @property
    def records(self) -> list[Any]:
        return [self.entry.record, *(self._aliased.records if self._aliased else ())]

    def aliased(self, gm: torch.fx.GraphModule, opts: CompileOptions, name: str) -> Any:
        if self._aliased is None:
            self._aliased = _strict_fallback(gm, opts, name)
        return self._aliased


def _strict_fallback(gm: torch.fx.GraphModule, opts: CompileOptions, name: str) -> Any:
    """`aotc.compile(gm.forward)` in strict mode with static sizes (see Note [Backend
    fallback]): the graph is Dynamo's already (the default capture mode would hand it straight
    back to Dynamo), and aotc's own guards key its entries, aliasing patterns and sizes included
    (symbolic entries have no synthetic bases)."""
    strict = dataclasses.replace(opts, capture=Capture.TRACE, dynamic=False)
    # A lazy graph module (Dynamo's) writes its code on its first call, which a strict trace
    # would see as state the program creates (Note [State created on the first call] in
    # aotc/recording.py): the code is written here, before anything traces the graph.
    realize = getattr(gm, "real_recompile", None)
    if callable(realize):
        realize()
    return CompiledFunction(gm.forward, strict, find_free_tensors(gm.forward), name)


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
