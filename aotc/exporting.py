"""`aotc.export`: compile one signature with the strict tracer and write it as an artifact.

Stage: `export(fn_or_module, *example_args, path=..., dynamic=False, **options) -> str`.
Requires: a function or nn.Module that strict capture (`capture="trace"`, aotc/api.py) compiles;
example arguments of the signature to export. The example arguments are only traced (on fake
tensors): they are not run and not modified.
Ensures: `path` holds a `runtime.artifact.CompiledArtifact` (Note [Artifact format] in
runtime/artifact.py) that `aotc.load` runs without the compiler, exactly as the compiled
function runs this signature; a readable summary.txt next to it. Refuses (ArtifactError, naming
what and what to do) programs whose artifact could not run alone: tensors read from closures or
globals (pass them as arguments, or export an nn.Module), Python state the strict tracer would
outputs or arguments without a plain encoding, and Triton lowerings with a size outside the
plain size grammar (runtime/symexpr.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from aotc.api import CompiledFunction, CompiledModule, _qualname
from aotc.api import compile as aotc_compile
from aotc.dataclasstree import flatten_tree
from aotc.lifting import StateCreated
from aotc.options import Capture
from aotc.pipeline import CompiledRecord
from aotc.runtime.artifact import (
    ArtifactError,
    ArtifactKind,
    CompiledArtifact,
    current_versions,
    write_artifact,
)
from aotc.runtime.guards import signature_key
from aotc.runtime.stateguard import Compare, Retry, StateGuard
from aotc.runtime.symbolic import coarse_key


def _original(obj: Any) -> Any:
    """What an object `aotc.compile` returned was made from (export compiles it again, strict)."""
    from aotc.capture import DynamoFunction, DynamoModule

    if isinstance(obj, (CompiledModule, DynamoModule)):
        return obj._modules["_orig_mod"]
    if isinstance(obj, (CompiledFunction, DynamoFunction)):
        return obj._fn
    return obj


def export(
    fn_or_module: Any,
    *example_args: Any,
    path: str | os.PathLike[str],
    dynamic: bool = False,
    example_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> str:
    """Compile `fn_or_module` for `example_args` (and `example_kwargs`) and write the artifact
    to the directory `path`; returns the path. `dynamic=True` traces with symbolic sizes, so the
    artifact admits other sizes (within the trace's guards). Other keyword arguments are
    `aotc.compile` options (`backend="triton"`, `partitioner=...`); `capture` is always strict.
    Export under `torch.no_grad()` for an inference artifact (no backward)."""
    if options.get("capture", Capture.TRACE) not in (Capture.TRACE, "trace"):
        raise ValueError("aotc.export() always uses strict capture (capture='trace')")
    options.update(capture="trace", dynamic=dynamic)
    options.setdefault("cache", False)
    kwargs = dict(example_kwargs or {})
    fn_or_module = _original(fn_or_module)
    compiled = aotc_compile(fn_or_module, **options)
    is_module = isinstance(compiled, CompiledModule)
    cf: CompiledFunction = compiled._compiled if is_module else compiled
    name = _qualname(fn_or_module)
    leaves, in_spec = flatten_tree((example_args, kwargs))
    num_user = len(leaves)
    gen = cf._gen
    foreign = [n for n in gen.names if not (is_module and n.startswith("self."))]
    if foreign:
        raise ArtifactError(
            f"cannot export {name}: it reads tensors it does not take as arguments "
            f"({', '.join(foreign[:4])}). An artifact stores no tensor values: pass them as "
            "arguments, or make them parameters or buffers of an exported nn.Module."
        )
    if gen.read is not None:
        leaves.extend(gen.read())
    extra_key = cf._extra_key
    extra = (in_spec, extra_key()) if extra_key is not None else in_spec
    key = (extra, signature_key(leaves))
    compile_entry = cf._compile_symbolic if dynamic else cf._compile_static
    try:
        entry, shape_guard, state = compile_entry(gen, leaves, key)
    except (Retry, StateCreated) as e:
        raise ArtifactError(
            f"cannot export {name}: it creates state or moves the tensors it reads on this call "
            f"({type(e).__name__}: {e}). Call it once eagerly (so optimizer state and lazily "
            "created attributes exist), then export."
        ) from e
    checks, baked = _state_checks(state, is_module)
    record: CompiledRecord = entry.record  # type: ignore[assignment]
    symbolic_entry = dynamic and shape_guard is not None and "size() ==" not in shape_guard
    artifact_dynamic = dynamic
    kernels = _kernel_files(record, name, cf._options.backend.value)
    device = _device_kind(leaves)
    state_names = tuple(gen.names)
    flags: tuple[tuple[str, bool], ...] = ()
    if is_module:
        module = fn_or_module
        flags = tuple((path_, m.training) for path_, m in module.named_modules())
    artifact = CompiledArtifact(
        name=name,
        kind=ArtifactKind.MODULE if is_module else ArtifactKind.FUNCTION,
        program=record.program,
        in_spec=in_spec,
        num_user_leaves=num_user,
        state_names=state_names,
        training_flags=flags,
        input_names=tuple(record.input_names),
        dynamic=artifact_dynamic,
        key=coarse_key(leaves) if artifact_dynamic else signature_key(leaves),
        shape_guard=shape_guard if artifact_dynamic else None,
        device=device,
        state_checks=checks,
    )
    folder = os.fspath(path)
    summary = _summary(artifact, record, symbolic_entry, kernels, baked)
    write_artifact(folder, artifact, summary, kernels, current_versions())
    return folder


_AMBIENT = ("torch.get_default_dtype()", "torch.get_default_device()")
_PLAIN = (int, float, bool, str, type(None))


def _state_checks(
    state: StateGuard | None, is_module: bool
) -> tuple[tuple[tuple[str, object], ...], list[str]]:
    """The Python state the strict tracer guards on, split into checks a loaded artifact makes
    per call (the default dtype and device; plain attributes of the bound module, "self.drop.p")
    and the rest, which the graphs bake in (see Note [What an artifact bakes in]): returned as
    readable lines for summary.txt."""
    checks: list[tuple[str, object]] = []
    baked: list[str] = []
    for item in state.items if state is not None else ():
        what = item.what
        if what in _AMBIENT:
            checks.append((what, item.expected))
            continue
        if is_module and what.startswith("self."):
            path = what[len("self.") :]
            plain = item.compare is Compare.VALUE and isinstance(item.expected, _PLAIN)
            if plain and all(part.isidentifier() or part.isdigit() for part in path.split(".")):
                checks.append((what, item.expected))
                continue
        value = item.expected
        shown = repr(value) if isinstance(value, (*_PLAIN, tuple, list)) else type(value).__name__
        baked.append(f"{what} = {shown[:80]}  {item.where}".rstrip())
    return tuple(checks), baked


# Note [What an artifact bakes in]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Strict capture guards on the Python state a program reads (aotc/strict.py): a compiled function
# recompiles when a global constant or a called function changes. An artifact has no program
# left to re-read: like `jax.export`, it is the program as it was at export, with every Python
# value it read baked into the graphs. What a loaded artifact still checks per call: the default
# dtype and device, the bound module's plain attributes (`self.drop.p`) and training flags, and
# the call's signature. summary.txt lists everything else that was baked in.


def _kernel_files(record: CompiledRecord, name: str, backend: str) -> dict[str, str]:
    """The kernel files of the entry's `CompiledProgram` (the same record the disk cache
    stores, Note [One compiled program] in runtime/artifact.py): file -> source. Symbolic sizes
    of a dynamic=True lowering are in the program as size expressions (runtime/symexpr.py)."""
    program = record.program
    lowered = record.lowered
    incomplete = [
        kind
        for kind, low, gp in zip(
            ("forward", "backward"),
            lowered,
            (program.forward_kernels, program.backward_kernels),
        )
        if low and gp is None and not (kind == "backward" and program.segments)
    ]
    # A segmented entry's backward lowerings are its segments': one without a plain form runs
    # as ATen calls in the artifact (Note [Segments] in passes/segments.py).
    if incomplete:
        raise ArtifactError(
            f"cannot export {name} with backend='{backend}': the Triton lowering of its "
            f"{' and '.join(incomplete)} graph has a size that is not a plain integer expression "
            "of the input sizes (the aotc.kernels log at INFO level names it). Export with "
            "backend='aten', or with dynamic=False."
        )
    sources = {k.key: k.source for k in record.kernels}  # a file is named by its kernel's key
    files: dict[str, str] = {}
    graphs = (program.forward_kernels, program.backward_kernels)
    for gp in (*graphs, *(seg.backward_kernels for seg in program.segments)):
        for step in gp.steps if gp is not None else ():
            if step.kernel is not None and step.kernel_file is not None:
                key = step.kernel_file.removesuffix(".py").rsplit("_", 1)[-1]
                files[step.kernel_file] = sources[key]
    return files


def _device_kind(leaves: list[object]) -> str:
    kinds = {t.device.type for t in leaves if isinstance(t, torch.Tensor)}
    if kinds - {"cpu", "cuda"}:
        raise ArtifactError(f"aotc.export: tensors on {sorted(kinds)}; aotc runs cpu and cuda")
    return "cuda" if "cuda" in kinds else "cpu"


def _summary(
    artifact: CompiledArtifact,
    record: CompiledRecord,
    symbolic: bool,
    kernels: dict[str, str],
    baked: list[str],
) -> str:
    versions = current_versions()
    mode = "training (forward and backward)" if artifact.backward is not None else "inference"
    lines = [
        f"# aotc artifact: {artifact.name} ({artifact.kind.value}, {mode})",
        f"# exported with aotc {versions['aotc']}, torch {versions['torch']}, "
        f"triton {versions['triton']}; device {artifact.device}",
        "",
        "# signature",
        record.signature,
    ]
    if artifact.dynamic:
        lines += [
            "# dynamic: admits other sizes where this guard holds"
            + ("" if symbolic else " (a static entry: the program needs these exact sizes)"),
            str(artifact.shape_guard),
        ]
    if artifact.state_names:
        lines += [
            "# state read from the module given to aotc.load(path, module=m), per call",
            *artifact.state_names,
        ]
    if baked:
        lines += ["# Python state baked into the graphs (not checked when loaded)", *baked]
    lines += [
        "",
        record.meta.format(),
        record.convention.format(),
        "",
        record.epilogue.format(),
        "",
        "# forward graph",
        artifact.forward.code.strip(),
    ]
    if artifact.backward is not None:
        lines += ["", "# backward graph", artifact.backward.code.strip()]
    if kernels:
        lines += ["", f"# {len(kernels)} Triton kernels", *sorted(kernels)]
    return "\n".join(lines) + "\n"


__all__ = ["export"]
