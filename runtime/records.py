"""The runtime's records in the plain codec (runtime/cache.py): registered here, by the runtime.

Importing this module registers every record a compiled artifact's runtime part holds (calling
convention, mutation/alias metadata, epilogue, autograd plan, runtime plan, lowered-graph
programs), so the disk cache and an exported artifact (runtime/artifact.py) decode them in a
process that never imports the compiler. aotc/persist.py adds the compiler's own records (stage
graphs, partition reports) for the cache's inspection fields.
"""

from __future__ import annotations

from aotc.runtime import (
    autograd,
    epilogue,
    kernels,
    outspec,  # noqa: F401  registers SizeOutput for output specs (Note [Size outputs])
    schema,
    segments,
    steps,
    symexpr,
    symsizes,
    viewreplay,
    wrappers,
)
from aotc.runtime.codec import register_records

RUNTIME_RECORDS: tuple[type, ...] = (
    schema.MutationKind,
    schema.OutputKind,
    schema.Geometry,
    schema.InputInfo,
    schema.OutputInfo,
    schema.MutationAliasInfo,
    schema.SyntheticBase,
    schema.CallingConvention,
    schema.FwdOutputPlan,
    schema.LeafChange,
    schema.DetachedRoot,
    schema.RootGrad,
    schema.RootSource,
    epilogue.StepKind,
    epilogue.MutationStep,
    epilogue.OutputStep,
    epilogue.EpiloguePlan,
    autograd.AutogradPlan,
    wrappers.RuntimePlan,
    segments.SegmentProgram,
    kernels.KernelSource,
    kernels.KernelFigures,
    kernels.BufferSpec,
    symsizes.SymKind,
    symsizes.SymSource,
    symexpr.SizeExpr,
    steps.StepProgram,
    steps.GraphProgram,
    viewreplay.ViewOp,
)

register_records(*RUNTIME_RECORDS)
