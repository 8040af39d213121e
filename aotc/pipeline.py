"""The compile driver: the one place to read the data flow for one input signature.

`_compile_signature` is a flat list of stages run by `aotc.stages.StageRunner` (timed, linted,
recorded; the names are `aotc.stages.Stage` values, as in `stage_seconds`):

program, leaves, CompileOptions
  │ cache_key   aotc.persist.find              → CacheKey, a verified entry or None
  │ cache_load  aotc.persist.decode_hit        → CacheHit (hit: its lowerings, stored if the
  │                                               entry is trusted, else generated; assemble)
  │ metadata    plan_convention, collect_metadata → CallingConvention, MetadataResult
  │ trace       aotc.tracer.trace_joint        → JointGraph (functional ATen)
  │ cleanup     passes.cleanup.cleanup         → JointGraph (DCE, CSE, no-op views; training)
  │ partition   passes.partition.partition     → PartitionResult (min-cut; training)
  │ epilogue    _runtime_plan                  → RuntimePlan (epilogue, autograd plan)
  │ decompose, lower, fuse, generate           → CompiledGraph | None per graph (Triton)
  │ assemble    runtime.artifact.assemble      → CompiledEntry with its CompiledRecord
  ▼ cache_store aotc.persist.store_verified    → the CacheEntry for the next process

A cold compile and a cache hit produce the same records (`CompiledProgram`, `Inspection`) and
share `_assemble` (Note [One compiled program] in runtime/artifact.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import TreeSpec

from aotc import eagercomposites, persist
from aotc.cachekey import CacheKey
from aotc.disabledhooks import compiling_in_region, seen_by_program
from aotc.eagerautograd import SHAPE_KEY, replays_eagerly
from aotc.functional import FlatProgram, compiling, refused_by_functorch, transform_state
from aotc.higher_order import (
    DifferentiableBackward,
    random_device,
    saved_graph_args,
    watched_args,
)
from aotc.metadata import MetadataResult, collect_metadata
from aotc.options import CompileOptions, full_tracebacks
from aotc.passes.cleanup import cleanup
from aotc.passes.decompose import decompose
from aotc.passes.descriptors import FwdOutput, GradOutput, TangentInput
from aotc.passes.fusion import plan_fusion
from aotc.passes.ir import JointGraph, StageGraph, primal_names
from aotc.passes.kernelize import KERNEL_LISTENERS, generate_graph, graph_device
from aotc.passes.lowering import lower, view_output_positions
from aotc.passes.partition import PartitionResult, partition
from aotc.passes.recompute import Executor, executor_for
from aotc.passes.segments import (
    SEGMENTS_KEY,
    Segmentation,
    padded_backward,
    split_backward,
    strip_markers,
)
from aotc.passes.select import triton_target
from aotc.persist import Inspection
from aotc.runtime import heap, precompile
from aotc.runtime.artifact import KERNEL_DIR, CompiledProgram, assemble
from aotc.runtime.autograd import AutogradPlan
from aotc.runtime.convention import alias_groups, apply_convention, plan_convention
from aotc.runtime.epilogue import EpiloguePlan, StepKind, plan_epilogue
from aotc.runtime.errors import UnsupportedError
from aotc.runtime.fastpath import eager_replayable
from aotc.runtime.kernels import CompiledGraph, KernelSource, KernelStep
from aotc.runtime.launch import make_callable
from aotc.runtime.lazy import Deferred
from aotc.runtime.outspec import keep_sizes
from aotc.runtime.replay import fwd_only, writable_in_place
from aotc.runtime.schema import (
    CallingConvention,
    FwdOut,
    GraphArg,
    MutationAliasInfo,
    OutputKind,
    UserArg,
)
from aotc.runtime.segments import SegmentProgram
from aotc.runtime.steps import GraphProgram, build_compiled_graph, graph_program
from aotc.runtime.wrappers import CompiledEntry, RuntimePlan
from aotc.stages import Stage, StageRunner
from aotc.structured import trace_failure, trace_record
from aotc.symkey import ShapeFacts, is_symbolic
from aotc.tracer import fresh_views, trace_joint


@dataclass(frozen=True)
class CompiledRecord:
    """What `aotc.inspect` shows for one compiled signature: its `CompiledProgram` (what runs),
    the compiler's `Inspection` record (decoded on first read on a cache hit), and how the
    compile went."""

    name: str
    signature: str  # readable input signature (the guard)
    source: str  # where the user function is defined, "file:line"
    guards: str  # what the compiled entry is specialized on, readable
    program: CompiledProgram
    inspection: Deferred[Inspection]
    stage_seconds: dict[str, float] = field(default_factory=dict)
    kernels: tuple[KernelSource, ...] = ()  # generated Triton kernels, forward then backward
    fusion_text: str = ""  # the fusion plans of the forward and backward graphs
    # Readable name of each user leaf (UserArg space): argument paths, lifted parameter paths.
    input_names: tuple[str, ...] = ()
    # A cache hit: the stage times of the compile that stored the entry (stage_seconds then
    # holds the hit's own key and load times). Empty for a cold compile.
    cold_stage_seconds: dict[str, float] = field(default_factory=dict)
    # Whether the forward and backward graphs run as Triton lowerings.
    lowered: tuple[bool, bool] = (False, False)

    @property
    def training(self) -> bool:
        return self.program.backward is not None

    @property
    def convention(self) -> CallingConvention:
        return self.program.plan.convention

    @property
    def epilogue(self) -> EpiloguePlan:
        return self.program.plan.epilogue

    @property
    def forward(self) -> fx.GraphModule:
        return self.program.forward

    @property
    def backward(self) -> fx.GraphModule | None:
        return self.program.backward

    @property
    def meta(self) -> MutationAliasInfo:
        return self.inspection.get().meta

    @property
    def partition(self) -> PartitionResult | None:
        return self.inspection.get().partition

    @property
    def joint_graph(self) -> JointGraph:
        return self.inspection.get().joint_graph

    @property
    def partitioned_joint(self) -> JointGraph:
        """The joint graph after cleanup, as the partition saw it."""
        return self.inspection.get().partitioned_joint

    @property
    def joint(self) -> fx.GraphModule:
        return self.joint_graph.module

    @property
    def compile_seconds(self) -> float:
        return sum(self.stage_seconds.values())

    @property
    def is_cache_hit(self) -> bool:
        return bool(self.cold_stage_seconds)

    @property
    def graph_arg_names(self) -> tuple[str, ...]:
        """Readable name of each graph arg (GraphArg space); see `CallingConvention`."""
        return graph_arg_names(self.convention, self.input_names)

    @property
    def saved_bytes(self) -> int:
        return self.partition.saved_bytes if self.partition else 0

    @property
    def stages(self) -> list[tuple[str, str]]:
        """Every stage's printable record, in pipeline order: (file name, text)."""
        out = [
            (
                "00_signature.txt",
                f"# stage: signature\n{self.name} (defined at {self.source})\n"
                f"{self.signature}\n# guards\n{self.guards}\n",
            ),
            ("01_metadata.txt", self.meta.format() + "\n" + self.convention.format() + "\n"),
            ("02_joint.py", self.joint_graph.format("joint", self.graph_arg_names)),
        ]
        if self.partition is not None:
            names = self.graph_arg_names
            saved = primal_names(self.partition.forward, names)
            out += [
                ("03_partition.txt", self.partition.format(names) + "\n"),
                ("04_forward.py", self.partition.forward.format("forward", names, saved)),
                ("05_backward.py", self.partition.backward.format("backward", names, saved)),
            ]
        for i, seg in enumerate(self.program.segments):  # Note [Segments] in passes/segments.py
            out.append((f"05_backward_segment{i}.py", _segment_text(i, seg)))
        runtime = ""
        if self.program.plan.eager_autograd:  # Note [Eager autograd on the ATen path]
            runtime = (
                "# backward: eager's autograd records one node per ATen call of the forward "
                "(it saves no more than the partition); the compiled backward runs only under "
                "autocast or a functorch transform\n"
            )
        out.append(("06_epilogue.txt", self.epilogue.format() + "\n" + runtime))
        if self.kernels:
            out.append(("09_fusion.txt", self.fusion_text))
            out += [
                (f"09_kernels/{i:02d}_{k.name}.py", k.source) for i, k in enumerate(self.kernels)
            ]
        out.append(("07_compile_time.txt", compile_time_text(self)))
        return out

    def format(self) -> str:
        return "\n".join(text for _, text in self.stages)


def _segment_text(i: int, seg: SegmentProgram) -> str:
    """One segment node's backward, as the dump shows it."""
    owned = ", ".join(f"fwd_out{k}" for k in seg.owned)
    takes = ", ".join(f"fwd_out{k}" for k in seg.consumes) or "nothing"
    saved = ", ".join(str(p) for p in seg.saved) or "none"
    grads = ", ".join(f"node arg {a}" for a in seg.autograd.grad_args)
    return (
        f"# stage: backward segment {i}\n# returns {owned}; takes {takes} after the graph args\n"
        f"# keeps saved values {saved}; gradients of {grads}\n{seg.backward.code.strip()}\n"
    )


def graph_arg_names(convention: CallingConvention, names: Sequence[str]) -> tuple[str, ...]:
    """A readable name per graph arg: its user leaf's name, or the members of a synthetic base."""
    bases = iter(convention.synthetic_bases)
    out = []
    for g, src in enumerate(convention.graph_sources):
        if src is not None:
            out.append(names[src] if src < len(names) else f"graph_arg{g}")
        else:
            members = next(bases).members
            out.append("base of " + ", ".join(names[m] if m < len(names) else "?" for m in members))
    return tuple(out)


def compile_time_text(record: CompiledRecord) -> str:
    """07_compile_time.txt: stage times; for a cache hit, the hit's and the original compile's."""

    def table(times: dict[str, float]) -> str:
        return "\n".join(f"{k}: {v * 1e3:.2f} ms" for k, v in times.items())

    text = "# stage: compile time\n"
    if record.is_cache_hit:
        cold = sum(record.cold_stage_seconds.values())
        return (
            f"{text}# cache hit: loaded in {record.compile_seconds * 1e3:.2f} ms\n"
            f"{table(record.stage_seconds)}\n"
            f"# the compile that stored the entry took {cold * 1e3:.2f} ms\n"
            f"{table(record.cold_stage_seconds)}\n"
        )
    return f"{text}{table(record.stage_seconds)}\n"


def describe_signature(leaves: Sequence[object], names: Sequence[str]) -> str:
    parts = []
    for i, leaf in enumerate(leaves):
        name = names[i] if i < len(names) else f"arg{i}"
        if isinstance(leaf, torch.Tensor):
            dtype = str(leaf.dtype).removeprefix("torch.")
            rg = " requires_grad" if leaf.requires_grad else ""
            parts.append(
                f"{name}: {dtype}{list(leaf.shape)} stride={leaf.stride()} {leaf.device}{rg}"
            )
        else:
            parts.append(f"{name}: {type(leaf).__name__} = {leaf!r}")
    return "\n".join(parts) + f"\ngrad_enabled={torch.is_grad_enabled()}"


def compile_signature(
    program: FlatProgram,
    leaves: list[object],
    names: list[str],
    options: CompileOptions,
    name: str,
    source: str = "<unknown>",
    fake_mode: FakeTensorMode | None = None,
    graph: fx.GraphModule | None = None,
) -> CompiledEntry:
    """`fake_mode`: a compilation on fakes (`leaves`): Dynamo's, or aotc's own with
    `dynamic=True` (see Note [Symbolic compilations] in aotc/symbolic.py). `graph`: the Dynamo
    graph `program` runs, for its cache key (Note [Graph key] in aotc/graphkey.py). A failure is
    reported (see `FailedCompile`) and re-raised; see Note [User-facing tracebacks]."""
    start = time.perf_counter()
    # Note [Eager's interpolation kernels in the trace] in aotc/eagercomposites.py
    device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)
    fused = executor_for(options.backend, options.triton_interpret, device) is Executor.TRITON
    try:
        # See Note [Compiling where saved-tensor hooks are disabled] in aotc/disabledhooks.py
        with compiling_in_region():
            program = seen_by_program(program)
            # Tracing saves fake tensors for autograd; the user's saved-tensor hooks must not
            # see them. See Note [No hooks pushed for torch.func] for the second attempt.
            user_hooks = torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
            try:
                with (
                    transform_state(),
                    torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
                    no_anomaly_checks(),
                    compiling(),
                    eagercomposites.fusing(fused),
                ):
                    return _compile_signature(
                        program, leaves, names, options, name, source, fake_mode, graph
                    )
            except Exception as e:
                if user_hooks or not refused_by_functorch(e):
                    raise
            with (
                transform_state(),
                no_anomaly_checks(),
                compiling(),
                eagercomposites.fusing(fused),
            ):
                return _compile_signature(
                    program, leaves, names, options, name, source, fake_mode, graph
                )
    except Exception as e:
        if type(e).__module__.startswith("torch._dynamo"):
            raise  # Dynamo's own control flow (restart analysis), not a failure
        failure = FailedCompile(
            name=name,
            source=source,
            signature=describe_signature(leaves, names),
            error_type=type(e).__name__,
            error=str(e),
            stage_seconds={"until the failure": time.perf_counter() - start},
        )
        report_failure(failure, options)
        if isinstance(e, UnsupportedError) and not full_tracebacks():
            # See Note [User-facing tracebacks]
            e.add_note(_TRACEBACK_NOTE)
            raise e.with_traceback(None) from None
        raise


def no_anomaly_checks() -> AbstractContextManager[object]:
    """Anomaly mode off while tracing: its NaN check on every backward output reads values
    (`isnan().any()`), which fake tensors do not have. The compiled node's own outputs are
    checked by the engine at run time, as eager's nodes' are."""
    return torch.autograd.set_detect_anomaly(False)


# Note [User-facing tracebacks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An UnsupportedError from tracing is about the user's program: its message names the user's line
# and what to do. Python would print it below the exception it was raised from (a FakeTensor or
# functionalization error, 20+ frames deep in torch) and with every aotc frame between the
# user's call and the trace. So it leaves compile_signature with neither: the traceback starts
# here and the cause is dropped. AOTC_FULL_TRACEBACK=1 keeps both (to debug aotc itself).
_TRACEBACK_NOTE = "(aotc and torch frames hidden; AOTC_FULL_TRACEBACK=1 shows them)"


@dataclass(frozen=True)
class FailedCompile:
    """A compilation that raised: shown by `aotc dump`/`aotc explain` and in the report."""

    name: str
    source: str  # where the user function is defined, "file:line"
    signature: str  # readable input signature
    error_type: str  # the exception's class name
    error: str  # its message
    stage_seconds: dict[str, float]  # time spent before the failure


# Called with every FailedCompile (the `aotc` command's recording), before the error propagates.
COMPILE_FAILURE_LISTENERS: list[Callable[[FailedCompile], None]] = []


def report_failure(failure: FailedCompile, options: CompileOptions) -> None:
    for listener in COMPILE_FAILURE_LISTENERS:
        listener(failure)
    trace_failure(failure)  # TORCH_TRACE: see aotc/structured.py
    if options.dump_dir:
        dump_failure(failure, options.dump_dir)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


# Note [No hooks pushed for torch.func]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.func.grad/vjp/jacrev/hessian refuse to run while any saved-tensor hooks are on the stack
# (eager raises "don't yet support saved tensor hooks"). A compile runs under identity hooks that
# hide its fake tensors from the user's hooks. When a transform refused them and the user has no
# hooks active, the compile runs again without them (with user hooks, eager refuses too, and so
# does the compile); the runs that need hooks of their own retry without them as well (Note
# [Traces under torch.func] in aotc/functional.py). Programs without such transforms compile
# exactly as before, under identity hooks throughout.


def _compile_signature(
    program: FlatProgram,
    leaves: list[object],
    names: list[str],
    options: CompileOptions,
    name: str,
    source: str,
    given_mode: FakeTensorMode | None,
    graph: fx.GraphModule | None = None,
) -> CompiledEntry:
    stages = StageRunner(options.check_invariants)
    grad_enabled = torch.is_grad_enabled()
    key: CacheKey | None = None
    facts, cacheable = _cache_facts(given_mode, leaves, options)
    snapshot = facts.snapshot() if facts is not None else None
    if cacheable:
        persist.load_verdicts(options)  # Note [Binding verdicts across processes]
        # Real leaves: the metadata pass's fake run can settle a deferred key (Note [Keys of
        # programs never stored] in aotc/cachekey.py).
        key, stored = stages.run(
            Stage.CACHE_KEY, persist.find, program, leaves, names, options, grad_enabled, facts,
            graph, given_mode is None,
        )  # fmt: skip
        hit = stages.run(Stage.CACHE_LOAD, persist.decode_hit, stored, options) if stored else None
        if hit is not None and (facts is None or facts.replay(hit.shape_guards)):
            lowerings = _stored_lowerings(hit, options)
            # Segments' backwards are lowered again (their kernels are not stored apart).
            seg_lowerings = _lower_segments(stages, hit.program, options)
            if lowerings is None:
                lowerings = _lower_both(stages, hit.program, options)
                _check_kernels(hit, lowerings, name, seg_lowerings)
            times = stages.seconds
            cold = {k: v for k, v in hit.stage_seconds}
            info = _Described(name, source, leaves, names, options)
            hit_entry = stages.run(
                Stage.ASSEMBLE, _assemble, hit.program, lowerings, hit.inspection, info, times,
                cold, seg_lowerings,
            )  # fmt: skip
            persist.store_verdicts_later(options)
            return hit_entry
        stages.merge(Stage.CACHE_LOAD, into=Stage.CACHE_KEY)  # a miss: reading was keying
    fake_mode = given_mode or FakeTensorMode(allow_non_fake_inputs=False)
    # A meta key is verified on the metadata pass's own fake run (Note [Verifying on the
    # compile's own run] in aotc/keytrace.py). Only for real leaves: fakes (Dynamo's graphs)
    # are verified by their own fake trace.
    verify = key is not None and (key.key is not None or key.deferred) and given_mode is None
    observed = persist.FakeRunObserver(leaves) if verify else None
    convention, metadata, fake_mode = stages.run(
        Stage.METADATA, _metadata, program, observed, leaves, names, fake_mode, given_mode,
        grad_enabled,
    )  # fmt: skip
    # Also under no_grad: outputs computed inside torch.enable_grad() require grad as in eager.
    training = any(metadata.fwd_plan.needs_tangent)
    joint = stages.run(
        Stage.TRACE, trace_joint, program, leaves, convention, metadata, fake_mode, grad_enabled,
        training,
    )  # fmt: skip
    cleaned, part = joint, None
    if training:
        cleaned = stages.run(Stage.CLEANUP, cleanup, joint)
        executor = executor_for(options.backend, options.triton_interpret, _graph_device(joint))
        part = stages.run(
            Stage.PARTITION, partition, cleaned, _changed_args(metadata.meta, convention),
            options.recompute, options.memory_budget, options.partitioner, executor,
        )  # fmt: skip
    plan = stages.run(
        Stage.EPILOGUE, _runtime_plan, name, convention, metadata, joint, part, leaves, grad_enabled
    )
    # See Note [Segments] in passes/segments.py
    segmentation = joint.module.meta.get(SEGMENTS_KEY)
    segments: tuple[SegmentProgram, ...] = ()
    if segmentation is not None:
        if part is not None:
            segments = _segment_programs(segmentation, part, plan)
            part = dataclasses.replace(part, backward=strip_markers(part.backward))
        joint, cleaned = strip_markers(joint), strip_markers(cleaned)
    fwd_module = part.forward.module if part is not None else joint.module
    bwd_module = part.backward.module if part is not None else None
    lowerings = (
        _lower(stages, "forward", fwd_module, options),
        # A segmented entry runs its segments' backwards, not the whole one.
        _lower(stages, "backward", bwd_module, options)
        if bwd_module is not None and not segments
        else None,
    )
    seg_lowerings = tuple(
        _lower(stages, f"backward{s}", seg.backward, options) for s, seg in enumerate(segments)
    )
    if part is not None and not segments and not any(lowerings):
        plan = _eager_autograd(plan, joint, part, leaves)
    compiled, storable = _program(plan, fwd_module, bwd_module, lowerings, segments, seg_lowerings)
    inspection = Inspection(training, metadata.meta, part, joint, cleaned)
    info = _Described(name, source, leaves, names, options)
    entry = stages.run(
        Stage.ASSEMBLE, _assemble, compiled, lowerings, Deferred.of(inspection), info,
        stages.seconds, {}, seg_lowerings,
    )  # fmt: skip
    shape_guards = None
    if key is not None and facts is not None and snapshot is not None:
        # See Note [Symbolic cache entries]: stored only with the guards it added, and only as
        # ATen graphs (a Triton lowering of symbolic graphs would need its node values).
        shape_guards = facts.added_guards(snapshot)
        if shape_guards is None or any(lowerings) or any(seg_lowerings):
            storable = False
    if key is not None and (key.key is not None or key.deferred) and storable:
        stored_entry = persist.CacheEntry(compiled, inspection, tuple(stages.seconds.items()))
        fwd_low, bwd_low = (
            persist.StoredLowering(c.kernels, c.fusion_text, c.figures) if c else None
            for c in lowerings
        )
        stages.run(
            Stage.CACHE_STORE, persist.store_verified, key, program, leaves, names, options,
            grad_enabled, stored_entry, _kernel_texts(lowerings, seg_lowerings), observed,
            shape_guards, (fwd_low, bwd_low),
        )  # fmt: skip
    persist.store_verdicts_later(options)
    return entry


@dataclass(frozen=True, slots=True)
class _Described:
    """Who a compiled signature is: the user function's name and line, its leaves' names."""

    name: str
    source: str
    leaves: list[object]
    names: list[str]
    options: CompileOptions


def _metadata(
    program: FlatProgram,
    observed: persist.FakeRunObserver | None,
    leaves: list[object],
    names: list[str],
    fake_mode: FakeTensorMode,
    given_mode: FakeTensorMode | None,
    grad_enabled: bool,
) -> tuple[CallingConvention, MetadataResult, FakeTensorMode]:
    """The calling convention and mutation/alias metadata; aliased inputs of which one is
    mutated get synthetic bases, and the metadata is collected again for them."""
    convention = plan_convention(leaves, names=names)
    observed_program = observed.observe(program) if observed is not None else program
    metadata = collect_metadata(
        observed_program, leaves, convention, fake_mode, grad_enabled, names
    )
    symbolic = given_mode is not None  # no synthetic bases: see Note [Symbolic compilations]
    groups = [] if symbolic else _mutated_alias_groups(leaves, convention, metadata)
    if groups:
        convention = plan_convention(leaves, groups, names)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        metadata = collect_metadata(program, leaves, convention, fake_mode, grad_enabled, names)
    return convention, metadata, fake_mode


def _watch_dependencies(
    outs: tuple[tuple[FwdOut, ...] | None, ...], diff_outs: tuple[FwdOut, ...]
) -> tuple[tuple[int, ...], ...] | None:
    """Per watched arg, the diff_outs positions whose backward uses its saved values; None
    when each is used by all (Note [Inputs changed after the call])."""
    if all(o is None for o in outs):
        return None
    every = tuple(range(len(diff_outs)))
    return tuple(every if o is None else tuple(diff_outs.index(k) for k in o) for o in outs)


def _saved_aliases(
    forward: fx.GraphModule, num_fwd_outs: int, num_tensors: int, args: set[GraphArg]
) -> tuple[int, ...]:
    """Positions among the saved tensors of those that are one of `args` (graph args) or a view
    of one (AutogradPlan.unversioned_saved)."""
    if not args:
        return ()
    inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
    chosen = {inputs[g] for g in args if g < len(inputs)}
    (output,) = [n for n in forward.graph.nodes if n.op == "output"]
    saved = list(output.args[0])[num_fwd_outs : num_fwd_outs + num_tensors]
    return tuple(i for i, node in enumerate(saved) if _view_root(node) in chosen)


def _runtime_plan(
    name: str,
    convention: CallingConvention,
    metadata: MetadataResult,
    joint: JointGraph,
    part: PartitionResult | None,
    leaves: list[object],
    grad_enabled: bool,
) -> RuntimePlan:
    """The epilogue, and for training the autograd plan: what runs around the graphs."""
    autograd_plan: AutogradPlan | None = None
    detach: tuple[GraphArg, ...] = ()
    epilogue = plan_epilogue(
        metadata.meta, metadata.fwd_plan, convention, fresh_views(joint.module)
    )
    if part is not None:
        n_fwd = _num_fwd_outs(part)
        grad_args = tuple(d.arg for d in part.backward.outputs if isinstance(d, GradOutput))
        diff_outs = tuple(
            FwdOut(k) for k, needs in enumerate(metadata.fwd_plan.needs_tangent) if needs
        )
        watch, watch_outs = _watched_inputs(metadata, part, epilogue)
        user_watch, user_watch_outs, user_unversioned = _watched_outputs(metadata, part, epilogue)
        autograd_plan = AutogradPlan(
            num_graph_args=len(convention.graph_sources),
            num_fwd_outs=n_fwd,
            diff_outs=diff_outs,
            num_saved=len(part.saved),
            grad_args=grad_args,
            num_saved_symints=part.num_saved_symints,
            refused=tuple((diff_outs.index(k), why) for k, why in metadata.refused),
            grad_deps=_grad_dependencies(part.backward, diff_outs),
            anchor=not any(
                isinstance(a, torch.Tensor) and a.requires_grad
                for a in apply_convention(convention, leaves)
            )
            and not any(c.requires_grad for c in metadata.meta.leaf_changes),
            watch_args=watched_args(part.forward.module, n_fwd),
            rng_device=random_device(part.forward.module, n_fwd),
            watch=watch,
            watch_deps=_watch_dependencies(watch_outs, diff_outs),
            watch_outputs=user_watch,
            watch_output_deps=_watch_dependencies(user_watch_outs, diff_outs),
            unversioned_saved=tuple(
                sorted(
                    {
                        *_saved_aliases(
                            part.forward.module,
                            n_fwd,
                            len(part.saved) - part.num_saved_symints,
                            # After an epilogue that moves versions, the refreshed watch
                            # checks every watched arg: a saved alias keeping the input's
                            # counter would fail autograd's own check (fuzz seed 34564).
                            {
                                g
                                for g, o in zip(watch, watch_outs)
                                if o is not None or epilogue.mutations or epilogue.versions
                            },
                        ),
                        *user_unversioned,
                    }
                )
            ),
        )
        detach = _statically_no_grad(joint, leaves, convention)
    return RuntimePlan(
        name=name,
        convention=convention,
        epilogue=epilogue,
        autograd=autograd_plan,
        detach_args=detach,
        # The user program's output structure: a TreeSpec (pytree.tree_flatten's), typed
        # `object` by FlatProgram. See Note [Size outputs] in runtime/outspec.py
        out_spec=keep_sizes(cast(TreeSpec, metadata.out_spec)),
        enable_grad=part is not None and not grad_enabled,
        refuse_saved_hooks=metadata.refuses_saved_hooks,
    )


def _eager_autograd(
    plan: RuntimePlan, joint: JointGraph, part: PartitionResult, leaves: list[object]
) -> RuntimePlan:
    """`plan`, with `eager_autograd` where its calls may let eager's autograd record the
    backward: Note [Eager autograd on the ATen path] in aotc/eagerautograd.py."""
    auto = plan.autograd
    if auto is None or auto.refused:
        return plan
    if not eager_replayable(plan):
        return plan
    args = apply_convention(plan.convention, leaves)
    requires_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
    if any(requires_grad[m.target] for m in plan.epilogue.mutations):
        return plan
    # Note [Buffers written in place] in runtime/replay.py
    targets = collections.Counter(m.target for m in plan.epilogue.mutations)
    fwd, n_fwd = part.forward.module, auto.num_fwd_outs
    candidates = [
        (m.target, m.new_value)
        for m in plan.epilogue.mutations
        if targets[m.target] == 1 and m.new_value is not None
    ]
    in_place, graph = writable_in_place(fwd, n_fwd, candidates)
    shape, diff, nbytes = joint.module.meta.get(SHAPE_KEY), auto.diff_outs, part.saved_bytes
    replays = replays_eagerly(shape, fwd, graph, diff, requires_grad, nbytes)
    if not replays and in_place:
        in_place = ()
        replays = replays_eagerly(shape, fwd, fwd_only(fwd, n_fwd), diff, requires_grad, nbytes)
    if not replays:
        return plan
    return dataclasses.replace(plan, eager_autograd=True, writes_in_place=in_place)


def _segment_programs(
    segmentation: Segmentation, part: PartitionResult, plan: RuntimePlan
) -> tuple[SegmentProgram, ...]:
    """The entry's autograd nodes (Note [Segments] in passes/segments.py), or () when it runs
    as one node: a plan whose node does more than one node's work can be split into (inputs it
    writes with history, leaves it makes, outputs eager refuses a backward for) keeps one.
    Writes replayed under no_grad run in the epilogue after every node is made; saved sizes
    come after saved tensors in each segment as in the entry."""
    ag = plan.autograd
    epilogue = plan.epilogue
    if (
        ag is None
        or ag.refused
        or ag.anchor
        or not all(
            m.kind is StepKind.COPY and m.no_grad and m.new_value not in ag.diff_outs
            for m in epilogue.mutations
        )
        or epilogue.make_require_grad
        or plan.refuse_saved_hooks
        or sorted(k for owned in segmentation.owned for k in owned)
        != sorted((*ag.diff_outs, *segmentation.regenerated, *segmentation.hidden))
        or not all(_regenerable(epilogue, k, ag.num_fwd_outs) for k in segmentation.regenerated)
    ):
        return ()
    split = split_backward(part.backward, segmentation, ag.num_graph_args)
    if split is None:
        return ()
    position = {k: p for p, k in enumerate(ag.diff_outs)}
    owned_at = [frozenset(position[k] for k in sb.owned if k in position) for sb in split]
    # reach[s]: the outputs whose backward runs segment s (its own, and every consumer's)
    reach = list(owned_at)
    for s in reversed(range(len(split))):
        for t in range(s + 1, len(split)):
            if any(k in split[t].consumes for k in split[s].owned):
                reach[s] = reach[s] | reach[t]
    every = frozenset(range(len(ag.diff_outs)))

    def assign(
        items: tuple[int, ...], deps: tuple[tuple[int, ...], ...] | None, s: int
    ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...] | None]:
        """The watched items segment s checks, with their deps among its own outputs: an item
        eager saves in the nodes of segment s (its deps are s's reach) is checked whenever s
        runs; one whose deps match no segment is checked by each segment owning one of them."""
        order = {k: p for p, k in enumerate(split[s].owned)}
        own = tuple(
            order[ag.diff_outs[p]]
            for p in sorted(owned_at[s], key=lambda p: order[ag.diff_outs[p]])
        )
        kept: list[tuple[int, tuple[int, ...]]] = []
        for i, item in enumerate(items):
            d = every if deps is None else frozenset(deps[i])
            if any(r == d for r in reach):
                if reach[s] == d:
                    kept.append((item, own))
            elif d & owned_at[s]:
                kept.append((item, tuple(sorted(order[ag.diff_outs[p]] for p in d & owned_at[s]))))
        full = tuple(range(len(split[s].owned)))
        if all(dep == full for _, dep in kept):
            return tuple(item for item, _ in kept), None
        return tuple(item for item, _ in kept), tuple(dep for _, dep in kept)

    programs = []
    for s, sb in enumerate(split):
        if not owned_at[s]:
            continue  # a regenerated view's: autograd's own view node (Note [Views other ...])
        watch, watch_deps = assign(ag.watch, ag.watch_deps, s)
        outs, out_deps = assign(ag.watch_outputs, ag.watch_output_deps, s)
        plan_s = AutogradPlan(
            num_graph_args=ag.num_graph_args + len(sb.consumes),
            num_fwd_outs=len(sb.owned),
            diff_outs=tuple(FwdOut(i) for i in range(len(sb.owned))),
            num_saved=len(sb.saved),
            # the entry's saved sizes come after its saved tensors, and so do a segment's
            num_saved_symints=sum(p >= ag.num_saved - ag.num_saved_symints for p in sb.saved),
            grad_args=tuple(
                GraphArg(d.arg) for d in sb.backward.outputs if isinstance(d, GradOutput)
            ),
            grad_deps=_grad_dependencies(sb.backward, sb.owned),
            watch_args=ag.watch_args,
            rng_device=ag.rng_device,
            watch=tuple(GraphArg(g) for g in watch),
            watch_deps=watch_deps,
            watch_outputs=outs,
            watch_output_deps=out_deps,
            unversioned_saved=tuple(i for i, p in enumerate(sb.saved) if p in ag.unversioned_saved),
        )
        programs.append(SegmentProgram(sb.owned, sb.consumes, sb.saved, plan_s, sb.backward.module))
    return tuple(programs)


def _num_fwd_outs(part: PartitionResult) -> int:
    """How many forward outputs the forward graph returns before its saved values: the
    metadata's, and any hidden segment boundaries (Note [Hidden segment boundaries])."""
    return sum(isinstance(d, FwdOutput) for d in part.forward.outputs)


def _regenerable(epilogue: EpiloguePlan, k: FwdOut, num_fwd: int) -> bool:
    """Whether forward output `k` is a user output the runtime regenerates as a plain view of
    another forward output: of an intermediate base, or of a fresh output returned as it is;
    from `num_fwd` on, `k - num_fwd` names a user output that is a plain view of an input."""
    if k >= num_fwd:
        j = k - num_fwd
        if j >= len(epilogue.outputs):
            return False
        s = epilogue.outputs[j]
        return (
            s.kind is OutputKind.ALIAS_OF_INPUT
            and s.track_grad
            and s.geometry is not None
            and not s.stale_view
            and not s.taken_before_write
            and s.source not in epilogue.make_require_grad
        )
    for s in epilogue.outputs:
        if s.source != k:
            continue
        if not s.track_grad:
            return False
        if s.kind is OutputKind.ALIAS_OF_INTERMEDIATE:
            return True
        if s.kind is OutputKind.ALIAS_OF_OUTPUT and s.base is not None:
            b = epilogue.outputs[s.base]
            return (
                b.kind is OutputKind.FRESH
                and not b.detach
                and b.custom_arg is None
                and b.custom_out is None
            )
        return False
    return False


def _watched_inputs(
    metadata: MetadataResult, part: PartitionResult, epilogue: EpiloguePlan
) -> tuple[tuple[GraphArg, ...], tuple[tuple[FwdOut, ...] | None, ...]]:
    """The graph args whose versions the backward checks itself (AutogradPlan.watch), with the
    diff outputs whose backward reads each (None: every output's): those a value eager saved
    shares a version counter with, less those the compiled forward saves as they are and every
    output's backward reads, whose versions autograd checks when the backward unpacks them (one
    snapshot per input, not two). Only when the epilogue writes nothing: a write after the save
    would move a saved input's version, which the backward's own check re-reads after the
    epilogue instead. An arg only some outputs' backwards read stays watched: its saved alias
    gets a version counter of its own, and the watch decides per output (Note [Inputs changed
    after the call] in runtime/autograd.py)."""
    pairs = tuple(zip(metadata.saved_args, metadata.saved_arg_outs))
    if pairs and not (epilogue.mutations or epilogue.versions):
        saved = saved_graph_args(part.forward.module, _num_fwd_outs(part))
        pairs = tuple((g, o) for g, o in pairs if not (o is None and g in saved))
    return tuple(g for g, _ in pairs), tuple(o for _, o in pairs)


def _watched_outputs(
    metadata: MetadataResult, part: PartitionResult, epilogue: EpiloguePlan
) -> tuple[tuple[int, ...], tuple[tuple[FwdOut, ...] | None, ...], tuple[int, ...]]:
    """The user outputs whose versions the backward checks (AutogradPlan.watch_outputs), with
    the diff outputs whose backward reads each, and the saved tensors (positions among them)
    to save as aliases with a version counter of their own: those a value eager saved shares a
    version counter with (Note [Outputs changed after the call] in runtime/autograd.py). An
    output the compiled forward saves as it is and every output's backward reads is left to
    autograd, which checks its version on unpack; one only some outputs' backwards read is
    watched, and its saved value gets its own counter, so that a backward from another output
    runs as in eager."""
    if not metadata.saved_outs:
        return (), (), ()
    forward = part.forward.module
    (out,) = [n for n in forward.graph.nodes if n.op == "output"]
    values = list(out.args[0])
    n_out = _num_fwd_outs(part)
    saved = values[n_out : n_out + len(part.saved) - part.num_saved_symints]
    roots = [_view_root(n) for n in saved]
    kept: list[tuple[int, tuple[FwdOut, ...] | None]] = []
    unversioned: set[int] = set()
    for j, outs in zip(metadata.saved_outs, metadata.saved_out_outs):
        step = epilogue.outputs[j]
        sources = {values[k] for k in (step.source, step.base) if k is not None}
        if step.kind not in (OutputKind.FRESH, OutputKind.ALIAS_OF_INTERMEDIATE):
            sources = set()
        at = [i for i, r in enumerate(roots) if r in sources]
        if at and outs is None:
            continue  # saved (or a view of it), shared counter: autograd's check is eager's
        kept.append((j, outs))
        if outs is not None:
            unversioned.update(at)
    return tuple(j for j, _ in kept), tuple(o for _, o in kept), tuple(sorted(unversioned))


def _view_root(node: object) -> object:
    """The node a chain of view ops starts from (through `getitem` of a multi-output view op
    such as `split`, fuzz seed 34564)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            parent = node.args[0]
            if parent.op == "call_function" and getattr(parent.target, "is_view", False):
                node = parent
                continue
            return node
        if not getattr(node.target, "is_view", False):
            return node
        node = node.args[0]
    return node


Lowerings = tuple[CompiledGraph | None, CompiledGraph | None]


def _lower(
    stages: StageRunner,
    label: str,
    module: fx.GraphModule,
    options: CompileOptions,
    decomposed: fx.GraphModule | None = None,
) -> CompiledGraph | None:
    """The Triton lowering of one stage graph, as four stages (decompose, lower, fuse,
    generate); None: the graph runs as ATen calls (backend "aten", "auto" off CUDA, no Triton,
    or any failure of the lowering, logged: the ATen graph is always a correct fallback).
    `decomposed`: the graph's decomposition from a cache entry (skips decompose)."""
    target = triton_target(module, options.backend)
    if target is None:
        return None
    try:
        if (
            not target.interpret
            and (dev := graph_device(module)) is not None
            and dev.type == "cuda"
        ):
            precompile.start()  # Note [Warm compiles] in runtime/precompile.py
        if decomposed is None:
            decomposed = stages.labeled(Stage.DECOMPOSE, label, decompose, module)
        ir = stages.labeled(Stage.LOWER, label, lower, decomposed, view_output_positions(module))
        plan = stages.labeled(Stage.FUSE, label, plan_fusion, ir)
        return stages.labeled(
            Stage.GENERATE, label, generate_graph, plan, decomposed, target.interpret
        )
    except Exception as e:  # noqa: BLE001 - the ATen graph is always a correct fallback
        logging.getLogger("aotc.kernels").warning(
            "Triton lowering failed (%s: %s); running this graph as ATen calls",
            type(e).__name__,
            e,
        )
        return None


def _lower_both(
    stages: StageRunner, program: CompiledProgram, options: CompileOptions
) -> Lowerings:
    """An untrusted cache hit's lowerings, generated again from the stored decomposed graphs (its
    stored kernel sources are never compiled: Note [Trusted entries] in runtime/cache.py)."""
    fwd = program.forward_kernels
    bwd = program.backward_kernels
    return (
        _lower(stages, "forward", program.forward, options, fwd.decomposed) if fwd else None,
        _lower(stages, "backward", program.backward, options, bwd.decomposed)
        if bwd is not None and program.backward is not None
        else None,
    )


def _lower_segments(
    stages: StageRunner, program: CompiledProgram, options: CompileOptions
) -> tuple[CompiledGraph | None, ...]:
    """A hit's segment backwards, lowered again from their stored decomposed graphs."""
    return tuple(
        _lower(stages, f"backward{s}", seg.backward, options, seg.backward_kernels.decomposed)
        if seg.backward_kernels is not None
        else None
        for s, seg in enumerate(program.segments)
    )


def _stored_lowerings(hit: persist.CacheHit, options: CompileOptions) -> Lowerings | None:
    """A trusted hit's lowerings, built from the kernels the cold compile generated (Note
    [Trusted entries] in runtime/cache.py); None: generate them again (an untrusted entry, or
    stored lowerings that do not fit the stored programs)."""
    if hit.lowerings is None:
        return None
    built: list[CompiledGraph | None] = []
    graphs = (hit.program.forward, hit.program.backward)
    programs = (hit.program.forward_kernels, hit.program.backward_kernels)
    for module, program, stored in zip(graphs, programs, hit.lowerings, strict=True):
        if program is None or module is None or triton_target(module, options.backend) is None:
            if stored is not None and module is not None and program is not None:
                return None  # this process would not lower it: generate as a cold compile would
            built.append(None)
            continue
        if stored is None:
            return None
        try:
            built.append(_built_lowering(program, stored))
        except ValueError as e:
            logging.getLogger("aotc.cache").warning(
                "cache hit: the stored lowering does not fit its program (%s); generating the "
                "kernels again",
                e,
            )
            return None
    for compiled in built:
        if compiled is not None:
            for listener in KERNEL_LISTENERS:
                listener(compiled)
    return built[0], built[1]


def _built_lowering(program: GraphProgram, stored: persist.StoredLowering) -> CompiledGraph:
    """`program` made runnable with `stored`'s kernels (one per kernel step, in order)."""
    files = [sp.kernel_file or "" for sp in program.steps if sp.kernel is not None]
    named = [sp.kernel.name for sp in program.steps if sp.kernel is not None]
    if named != [k.name for k in stored.kernels]:
        raise ValueError(f"kernels {named} stored as {[k.name for k in stored.kernels]}")
    graph = build_compiled_graph(
        program, {f: k.source for f, k in zip(files, stored.kernels, strict=True)}
    )
    kernels = iter(stored.kernels)
    steps = tuple(
        dataclasses.replace(s, kernel=next(kernels)) if isinstance(s, KernelStep) else s
        for s in graph.steps
    )
    return dataclasses.replace(
        graph,
        kernels=stored.kernels,
        steps=steps,
        fusion_text=stored.fusion_text,
        figures=stored.figures,
    )


def _check_kernels(
    hit: persist.CacheHit,
    lowerings: Lowerings,
    name: str,
    seg_lowerings: tuple[CompiledGraph | None, ...] = (),
) -> None:
    """Generation is a pure function of the graph: kernels that differ from the stored ones are
    a bug in it (logged; the regenerated kernels run)."""
    made = _kernel_texts(lowerings, seg_lowerings)
    if made != hit.kernels:
        logging.getLogger("aotc.cache").warning(
            "cache hit for %s: the regenerated Triton kernels differ from the stored "
            "ones (%d vs %d kernels); running the regenerated ones",
            name,
            len(made),
            len(hit.kernels),
        )


def _kernel_texts(
    lowerings: Lowerings, seg_lowerings: tuple[CompiledGraph | None, ...] = ()
) -> tuple[persist.KernelText, ...]:
    return tuple(
        persist.KernelText(k.name, k.source)
        for c in (*lowerings, *seg_lowerings)
        if c
        for k in c.kernels
    )


def _program(
    plan: RuntimePlan,
    forward: fx.GraphModule,
    backward: fx.GraphModule | None,
    lowerings: Lowerings,
    segments: tuple[SegmentProgram, ...] = (),
    seg_lowerings: tuple[CompiledGraph | None, ...] = (),
) -> tuple[CompiledProgram, bool]:
    """The compiled program as data, and whether the disk cache may store it: it describes the
    lowerings completely (a size expression outside the plain grammar of runtime/symexpr.py
    leaves that lowering out, and the program is then neither stored nor exported) and has no
    symbolic sizes (Note [Symbolic cache entries]: the cache stores those as ATen graphs only;
    an exported artifact holds them, see Note [One compiled program] in runtime/artifact.py)."""
    programs: list[GraphProgram | None] = []
    complete = True
    files: dict[str, str] = {}
    for compiled in (*lowerings, *seg_lowerings):
        if compiled is None:
            programs.append(None)
            continue
        for k in compiled.kernels:
            files.setdefault(k.key, f"{KERNEL_DIR}/{len(files):02d}_{k.name}_{k.key}.py")
        try:
            programs.append(graph_program(compiled, files))
        except ValueError as e:
            logging.getLogger("aotc.kernels").info(
                "the %s lowering has no plain form: %s",
                ("forward", "backward")[len(programs)] if len(programs) < 2 else "segment",
                e,
            )
            programs.append(None)
            complete = False
        if compiled.symbols:
            complete = False
    segments = tuple(
        dataclasses.replace(seg, backward_kernels=gp) for seg, gp in zip(segments, programs[2:])
    )
    return (
        CompiledProgram(plan, forward, backward, programs[0], programs[1], segments),
        complete,
    )


def _assemble(
    program: CompiledProgram,
    lowerings: Lowerings,
    inspection: Deferred[Inspection],
    info: _Described,
    times: dict[str, float],
    cold_times: dict[str, float],
    seg_lowerings: tuple[CompiledGraph | None, ...] = (),
) -> CompiledEntry:
    """The one assembly of a compiled signature, for a cold compile and a cache hit alike.
    `seg_lowerings`: the Triton lowerings of the segments' backwards (Note [Segments])."""
    fwd, bwd = lowerings
    # A hit's program carries the name of the compile that stored it.
    program = dataclasses.replace(program, plan=dataclasses.replace(program.plan, name=info.name))
    record = CompiledRecord(
        name=info.name,
        signature=describe_signature(info.leaves, info.names),
        source=info.source,
        guards=_SYMBOLIC_GUARDS if is_symbolic(info.leaves) else _GUARDS,
        program=program,
        inspection=inspection,
        stage_seconds=times,
        input_names=tuple(info.names),
        cold_stage_seconds=cold_times,
        lowered=(fwd is not None, bwd is not None or any(seg_lowerings)),
        kernels=tuple(k for c in (*lowerings, *seg_lowerings) if c for k in c.kernels),
        fusion_text="".join(
            f"# {label} graph\n{c.fusion_text}"
            for label, c in (
                ("forward", fwd),
                ("backward", bwd),
                *((f"backward segment {i}", c) for i, c in enumerate(seg_lowerings)),
            )
            if c
        ),
    )
    higher = _differentiable_backward(
        lambda: (program.forward, program.backward),
        program.plan,
        info.names,
        info.options,
        info.name,
    )
    segment_highers = tuple(
        _differentiable_backward(
            _segment_graphs(program, seg),
            dataclasses.replace(program.plan, autograd=_composed_plan(program.plan, seg)),
            info.names,
            info.options,
            f"{info.name}.segment{s}",
        )
        for s, seg in enumerate(program.segments)
    )
    entry = assemble(program, lowerings, record, higher, segment_highers, seg_lowerings)
    if (dev := graph_device(program.forward)) is None or dev.type == "cpu":
        heap.settle()  # Note [Settled heap thresholds] in runtime/heap.py
    _log_record(record, program.forward, program.backward)
    if info.options.dump_dir:
        dump_record(record, info.options.dump_dir)
    return entry


def _graph_device(graph: JointGraph) -> torch.device | None:
    """The device of the first tensor input (what passes.select decides the backend by)."""
    for node in graph.placeholders():
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return None


def _cache_facts(
    given_mode: FakeTensorMode | None, leaves: Sequence[object], options: CompileOptions
) -> tuple[ShapeFacts | None, bool]:
    """Whether this compilation may use the cache, and for symbolic leaves their `ShapeFacts`.
    Real leaves (aotc.compile) and fakes with static geometry (a static Dynamo graph: the compile
    can add no shape assumption) are keyed as they are; symbolic fakes with their ShapeEnv facts
    (Note [Symbolic cache entries] in aotc/symkey.py)."""
    if not persist.is_enabled(options):
        return None, False
    if any(isinstance(getattr(x, "item_memo", None), torch.SymFloat) for x in leaves):
        return None, False  # a dynamic Python float: Note [Dynamic Python floats] in backend.py
    if given_mode is None or not is_symbolic(leaves):
        return None, True
    if given_mode.shape_env is None:
        return None, False
    return ShapeFacts.of(given_mode.shape_env, leaves), True


def _differentiable_backward(
    graphs: Callable[[], tuple[fx.GraphModule, fx.GraphModule | None]],
    plan: RuntimePlan,
    names: Sequence[str],
    options: CompileOptions,
    name: str,
) -> DifferentiableBackward | None:
    """What an entry's backward runs under create_graph=True (aotc/higher_order.py)."""
    if plan.autograd is None:
        return None
    names = graph_arg_names(plan.convention, names)
    return DifferentiableBackward(graphs, plan.autograd, names, options, name)  # type: ignore[arg-type]


def _segment_graphs(
    program: CompiledProgram, seg: SegmentProgram
) -> Callable[[], tuple[fx.GraphModule, fx.GraphModule | None]]:
    """The graphs a segment's differentiable backward composes (built on first use)."""
    assert program.plan.autograd is not None
    num_saved = program.plan.autograd.num_saved
    return lambda: (program.forward, padded_backward(seg.backward, seg.saved, num_saved))


def _composed_plan(plan: RuntimePlan, seg: SegmentProgram) -> AutogradPlan:
    """What a segment's differentiable backward composes: the entry's forward (its graph args,
    outputs and saved values) with the segment's backward, padded to every saved value."""
    assert plan.autograd is not None
    return dataclasses.replace(plan.autograd, diff_outs=seg.owned, grad_args=seg.autograd.grad_args)


def _log_record(record: CompiledRecord, fwd: fx.GraphModule, bwd: fx.GraphModule | None) -> None:
    trace_record(record)  # TORCH_TRACE: see aotc/structured.py
    graphs, partition_log = logging.getLogger("aotc.graphs"), logging.getLogger("aotc.partition")
    kernels = logging.getLogger("aotc.kernels")
    if graphs.isEnabledFor(logging.INFO):
        graphs.info(
            "%s: joint graph\n%s",
            record.name,
            record.joint_graph.format("joint", record.graph_arg_names),
        )
    if partition_log.isEnabledFor(logging.INFO) and record.partition is not None:
        partition_log.info("%s:\n%s", record.name, record.partition.format(record.graph_arg_names))
    if kernels.isEnabledFor(logging.INFO) and record.kernels:
        kernels.info(
            "%s: %d generated kernels\n%s",
            record.name,
            len(record.kernels),
            "\n".join(k.source for k in record.kernels),
        )
        kernels.info("%s: kernel resources\n%s", record.name, kernel_resources_text(record))
    elif kernels.isEnabledFor(logging.INFO):
        for label, module in (("forward", fwd), ("backward", bwd)):
            if module is not None:
                kernels.info(
                    "%s %s: runs as ATen calls\n%s",
                    record.name,
                    label,
                    getattr(make_callable(module), "__aotc_source__", ""),
                )


def _mutated_alias_groups(
    leaves: Sequence[object], convention: CallingConvention, metadata: MetadataResult
) -> list[list[UserArg]]:
    """Alias groups of user leaves in which some member's data is mutated (a metadata mutation
    is per tensor and needs no synthetic base)."""
    graph_of = dict(convention.leaf_to_graph)
    groups = []
    for group in alias_groups(leaves):
        if any(metadata.meta.inputs[graph_of[m]].mutation.has_data for m in group):
            groups.append(group)
    return groups


def _changed_args(meta: MutationAliasInfo, convention: CallingConvention) -> frozenset[GraphArg]:
    """Graph args the epilogue writes, reshapes or re-versions after the forward."""
    graph_of = dict(convention.leaf_to_graph)
    changed = {GraphArg(g) for g, info in enumerate(meta.inputs) if info.mutation.value != "none"}
    changed |= {graph_of[c.leaf] for c in meta.leaf_changes}
    return frozenset(changed)


def _grad_dependencies(
    backward: StageGraph, diff_outs: tuple[FwdOut, ...]
) -> tuple[tuple[int, ...], ...] | None:
    """Per gradient the backward returns: the positions in `diff_outs` whose cotangents it is
    computed from; None when each depends on all (see Note [None gradients] in
    runtime/autograd.py)."""
    position = {k: pos for pos, k in enumerate(diff_outs)}
    deps: dict[fx.Node, frozenset[int]] = {}
    for node, desc in zip(backward.placeholders(), backward.inputs, strict=True):
        deps[node] = (
            frozenset({position[desc.out]}) if isinstance(desc, TangentInput) else frozenset()
        )
    for node in backward.module.graph.nodes:
        if node.op not in ("placeholder", "output"):
            deps[node] = frozenset().union(*(deps[a] for a in node.all_input_nodes))
    every = tuple(range(len(diff_outs)))
    # A gradient computed from no cotangent (a backward formula that returns zeros, such as
    # copysign's for `other`) still exists in eager whenever autograd runs that formula: treat it
    # as depending on every output, so it is materialized (zeros) rather than None.
    result = tuple(
        (tuple(sorted(deps[v])) or every) if isinstance(v, fx.Node) else ()
        for v, desc in zip(backward.output_values(), backward.outputs, strict=True)
        if isinstance(desc, GradOutput)
    )
    return None if all(d == every for d in result) else result


def _statically_no_grad(
    joint: JointGraph, leaves: Sequence[object], convention: CallingConvention
) -> tuple[GraphArg, ...]:
    values = joint.output_values()
    out = []
    for value, desc in zip(values, joint.outputs):
        if isinstance(desc, GradOutput) and value is None:
            src = convention.graph_sources[desc.arg]
            leaf = leaves[src] if src is not None else None
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                out.append(desc.arg)
    # Outputs of the autograd node require grad iff one of its inputs does. When every input
    # that requires grad gets no gradient (linalg_vector_norm(x, 0)), eager's output still
    # requires grad, so keep them attached; the backward returns None for them.
    rg_args = [
        g
        for g, src in enumerate(convention.graph_sources)
        if src is None or _requires_grad(leaves[src])
    ]
    return () if len(out) == len(rg_args) else tuple(out)


def _requires_grad(leaf: object) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.requires_grad


_GUARDS = (
    "each tensor input: dtype, device, shape, strides, requires_grad, is_leaf\n"
    "each non-tensor input: its type and value\n"
    "which inputs are the same tensor or share storage (and then their storage offsets and "
    "bases)\n"
    "grad mode, autocast state, and for modules every submodule's training flag\n"
    "a call that differs in any of these compiles a new entry (see runtime/guards.py)"
)
_SYMBOLIC_GUARDS = (
    "each tensor input: dtype, device, number of dims, requires_grad, is_leaf; its sizes, strides "
    "and storage offset as the entry's symbolic guard admits (runtime/symbolic.py)\n"
    "each non-tensor input: its type and value\n"
    "which inputs are the same tensor, share storage or have one base\n"
    "grad mode, autocast state, and for modules every submodule's training flag\n"
    "a call that differs in any of these compiles a new entry"
)

_dump_counter: dict[str, int] = {}
_dump_lock = threading.Lock()


def _dump_folder(name: str, root: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    with _dump_lock:
        n = _dump_counter.get(safe, 0)
        _dump_counter[safe] = n + 1
    folder = os.path.join(root, f"{safe}_{n}")
    os.makedirs(folder, exist_ok=True)
    return folder


def _write_files(folder: str, files: Sequence[tuple[str, str]], data: dict[str, object]) -> None:
    for file_name, text in files:
        os.makedirs(os.path.dirname(os.path.join(folder, file_name)), exist_ok=True)
        with open(os.path.join(folder, file_name), "w") as f:
            f.write(text)
    with open(os.path.join(folder, "08_graph.json"), "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def dump_record(record: CompiledRecord, root: str) -> str:
    """Write every stage of one compiled signature under `root/<name>_<n>/`."""
    from aotc.debug import current_dynamo_compile_id, graph_json

    folder = _dump_folder(record.name, root)
    _write_files(folder, record.stages, graph_json(record, current_dynamo_compile_id()))
    if record.kernels:
        with open(os.path.join(folder, "09_kernels", "resources.txt"), "w") as f:
            f.write(kernel_resources_text(record))
    return folder


def dump_failure(failure: FailedCompile, root: str) -> str:
    """Write a failed compilation's signature and error under `root/<name>_<n>/`."""
    from aotc.debug import current_dynamo_compile_id, failure_json

    folder = _dump_folder(failure.name, root)
    files = [
        (
            "00_signature.txt",
            f"# stage: signature\n{failure.name} (defined at {failure.source})\n"
            f"{failure.signature}\n",
        ),
        ("error.txt", f"# compile failed\n{failure.error_type}: {failure.error}\n"),
    ]
    _write_files(folder, files, failure_json(failure, current_dynamo_compile_id()))
    return folder


def kernel_resources_text(record: CompiledRecord) -> str:
    """Registers, spills, shared memory, warps, stages and occupancy of each generated kernel
    on sm_90 and sm_80 (compiled by Triton without a GPU; runtime.cuda_check)."""
    from aotc.options import cuda_check_cache_dir
    from aotc.runtime.cuda_check import describe_resources

    kernels = [k.for_cuda for k in record.kernels]
    return describe_resources(kernels, cache_dir=cuda_check_cache_dir())
