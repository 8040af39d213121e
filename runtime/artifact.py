"""Exported artifacts: a compiled signature as a directory of plain data, and `load`.

Records: `CompiledArtifact` (everything a loaded artifact runs: the runtime plan, the forward and
backward graphs as ATen programs, their Triton lowerings as step programs, the call's guard).
Stage: `write_artifact(path, artifact, summary)` (called by `aotc.export`, aotc/exporting.py);
`load(path, module=None) -> LoadedArtifact` (`aotc.load`).
Requires: nothing from the compiler. This module imports only `aotc.runtime` and torch (and
Triton when the artifact has kernels, on the first call), so a process that only runs exported
artifacts never imports `aotc.passes`, the tracer or the compile driver (tested with those
imports made to fail, tests/runtime/test_export.py).
Ensures: `load` refuses, with an `ArtifactError` naming what differs and what to do, an artifact
of another format version, torch version or device kind, and any file whose checksum does not
match the manifest. A loaded artifact runs exactly as the compiled function's entry for that
signature (`runtime.wrappers.CompiledEntry`: one autograd node, input mutations and aliasing as
compiled); a call outside the exported signature raises `GuardError` saying what differs.

Note [Artifact format]
~~~~~~~~~~~~~~~~~~~~~~
A directory:

    manifest.json   {"format": "aotc-artifact", "version": 1, "aotc": ..., "torch": ...,
                     "triton": ... | null, "device": "cpu" | "cuda", "name": ..., "kind": ...,
                     "files": {"program.json": "<sha256>", "kernels/...py": ..., ...}}
    program.json    {"artifact": <CompiledArtifact in the cache codec>, "graphs": [...]}
    kernels/*.py    the generated Triton kernels, one module each (only with backend="triton")
    summary.txt     readable: signature, calling convention, metadata, epilogue, graphs, kernels

program.json uses the disk cache's codec (runtime/cache.py, Note [Cache entry format]): records
by registered name, graphs as node lists whose call targets resolve only against aten/prims, no
pickle. Checksums catch corrupted and edited files, not a malicious author: the kernels are Python
modules that a loaded artifact imports, and an author can rewrite the manifest's checksums. Load
artifacts you trust, as you would a pickle. The shape guard of a dynamic artifact is Python
source too; it is checked against a small grammar (`_check_guard_code`) before it is compiled.

Note [Module artifacts bind at load time]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An exported nn.Module's parameters and buffers are inputs of its graphs (lifted, see
aotc/lifting.py), named by their attribute paths ("self.lin.weight"). The artifact stores the
names, never the values: `aotc.load(path, module=m)` binds the artifact to a module `m` of the
same structure, and each call reads the tensors from `m` (so training updates, `load_state_dict`
and buffer writes by the program all act on `m`, as with `aotc.compile(m)`). Loading a module
artifact without `module=` raises, listing the names it needs. The module's training flags are
part of the guard (each call checks that every submodule's `training` is what it was at export).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import hashlib
import json
import operator
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from aotc.runtime import codec, fxcodec, lazy, records
from aotc.runtime.autograd import HigherOrder
from aotc.runtime.errors import AotcError, GuardError
from aotc.runtime.guards import signature_check, signature_key
from aotc.runtime.kernels import CompiledGraph
from aotc.runtime.launch import LazyCallable, make_callable
from aotc.runtime.replay import replay_forward
from aotc.runtime.segments import SegmentProgram
from aotc.runtime.steps import GraphProgram
from aotc.runtime.symbolic import coarse_key, make_guard
from aotc.runtime.wrappers import CompiledEntry, RuntimePlan, describe_change

FORMAT = "aotc-artifact"
FORMAT_VERSION = 2  # 2: the program is a `CompiledProgram` record (shared with the cache)
MANIFEST = "manifest.json"
PROGRAM = "program.json"
SUMMARY = "summary.txt"
KERNEL_DIR = "kernels"


class ArtifactError(AotcError):
    """An exported artifact cannot be written or loaded here (the message says why and what to
    do)."""


class ArtifactKind(enum.Enum):
    FUNCTION = "function"
    MODULE = "module"


@dataclass(frozen=True, slots=True)
class CompiledProgram:
    """What runs one compiled signature, as data: the record the compile driver produces, the
    disk cache stores and an exported artifact holds (see Note [One compiled program]).
    `assemble` builds the callable from it."""

    plan: RuntimePlan
    forward: fx.GraphModule
    backward: fx.GraphModule | None  # None: an inference program
    # The Triton lowerings of forward and backward (None: the graph runs as ATen calls). Kernel
    # sources are not part of the record: each kernel step names its file (`kernel_file`).
    forward_kernels: GraphProgram | None
    backward_kernels: GraphProgram | None
    # The autograd nodes of a call whose outputs have eager's node boundaries between them
    # (Note [Segments] in passes/segments.py); empty: one node, running `backward`.
    segments: tuple[SegmentProgram, ...] = ()

    @property
    def lowered(self) -> tuple[bool, bool]:
        return self.forward_kernels is not None, self.backward_kernels is not None


# Note [One compiled program]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A compiled signature exists in three places: the entry a cold compile builds, a disk-cache
# entry, and an exported artifact. All three hold the same `CompiledProgram` record, written and
# read with the one codec (runtime/codec.py), and all three become a callable through `assemble`.
# They differ only in where the Triton lowerings (`CompiledGraph`s) come from: a cold compile
# lowers its graphs; a cache hit builds them from the stored kernels when this user's aotc signed
# the entry, else lowers them again from the stored decomposed graphs (a cache directory written
# by someone else never supplies code, see Note [Trusted entries] in runtime/cache.py); `load`
# builds them from the artifact's kernel files (`build_compiled_graph`). An artifact adds to the
# program how a caller binds to it (argument structure, module state, guard).


def assemble(
    program: CompiledProgram,
    lowerings: tuple[CompiledGraph | None, CompiledGraph | None] = (None, None),
    record: object = None,
    higher: HigherOrder | None = None,
    segment_highers: tuple[HigherOrder | None, ...] = (),
    segment_lowerings: tuple[CompiledGraph | None, ...] = (),
) -> CompiledEntry:
    """The callable of `program`. `lowerings`: the forward and backward graphs' Triton lowerings
    (None: that graph runs as ATen calls); `record`: what `aotc.inspect` shows for it;
    `higher`: its differentiable backward, built by the compiler (None: a loaded artifact, whose
    create_graph=True backward raises; see runtime/autograd.py)."""
    fwd, bwd = lowerings
    replay, whole = _replay(program) if fwd is None else (None, False)
    # A replaying entry's compiled pair runs only under autocast or a functorch transform.
    pair = LazyCallable if replay is not None else make_callable
    forward: Callable[..., Any]
    if fwd is not None:
        forward = fwd.callable
    elif replay is not None and whole:
        forward = replay
    else:
        forward = pair(program.forward)
    backward = None
    if program.backward is not None:
        backward = bwd.callable if bwd is not None else pair(program.backward)
    return CompiledEntry(
        program.plan,
        forward,
        backward,
        record,
        higher,
        program.backward,
        program.segments,
        segment_highers,
        tuple(c.callable if c is not None else None for c in segment_lowerings),
        replay,
    )


def _replay(program: CompiledProgram) -> tuple[Callable[..., Any] | None, bool]:
    """The forward eager's autograd records (Note [Eager autograd on the ATen path]), and
    whether it is the forward graph's own function (it runs the whole graph as it is)."""
    plan = program.plan
    if not plan.eager_autograd or plan.autograd is None:
        return None, False
    return replay_forward(program.forward, plan.autograd.num_fwd_outs, plan.writes_in_place)


@dataclass(frozen=True, slots=True)
class CompiledArtifact:
    """One exported signature: its `CompiledProgram` and how a caller binds to it."""

    name: str
    kind: ArtifactKind
    program: CompiledProgram
    in_spec: pytree.TreeSpec  # the structure of (args, kwargs)
    num_user_leaves: int
    state_names: tuple[str, ...]  # lifted tensors, read from the bound module ("self.lin.weight")
    training_flags: tuple[tuple[str, bool], ...]  # (submodule path, training) of a module
    input_names: tuple[str, ...]  # readable name of every leaf (user leaves, then state)
    # The guard: static artifacts, `signature_key` of the example leaves; dynamic ones, their
    # `coarse_key` plus `shape_guard` over the sizes (types of constants as `_TYPES` names).
    dynamic: bool
    key: tuple[object, ...]
    shape_guard: str | None
    device: str  # "cpu" or "cuda": the device type of the tensors the graphs run on
    # Python state the graphs were specialized on, checked per call: the default dtype and
    # device, and plain attributes of the bound module ("self.drop.p" -> 0.1), by type and value
    state_checks: tuple[tuple[str, object], ...] = ()

    @property
    def forward(self) -> fx.GraphModule:
        return self.program.forward

    @property
    def backward(self) -> fx.GraphModule | None:
        return self.program.backward

    @property
    def forward_kernels(self) -> GraphProgram | None:
        return self.program.forward_kernels


records.register_records(ArtifactKind, CompiledProgram, CompiledArtifact)


# --------------------------------------------------------------------------- writing


def write_artifact(path: str, artifact: CompiledArtifact, summary: str, kernels: dict[str, str],
                   versions: dict[str, object]) -> None:  # fmt: skip
    """Write `artifact` to the directory `path` (created; existing artifact files are replaced).
    `kernels`: kernel file (relative, under kernels/) -> source; `versions`: the aotc, torch and
    triton versions the manifest records."""
    graphs: list[dict[str, Any]] = []
    try:
        body = {"artifact": codec.encode(_portable(artifact), graphs, {}), "graphs": graphs}
    except codec.Uncachable as e:
        raise ArtifactError(
            f"cannot export {artifact.name}: {e}. Exported artifacts hold plain data only; "
            "return tensors, tuples, lists and dicts, and pass tensors and plain constants."
        ) from e
    files: dict[str, bytes] = {
        PROGRAM: json.dumps(body, separators=(",", ":"), allow_nan=False).encode(),
        SUMMARY: summary.encode(),
    }
    for name, source in kernels.items():
        files[name] = source.encode()
    os.makedirs(os.path.join(path, KERNEL_DIR) if kernels else path, exist_ok=True)
    old = os.path.join(path, KERNEL_DIR)
    for name in os.listdir(old) if os.path.isdir(old) else ():  # a previous export's kernels
        if f"{KERNEL_DIR}/{name}" not in files and name.endswith(".py"):
            os.unlink(os.path.join(old, name))
    for name, data in files.items():
        _write_file(os.path.join(path, name), data)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        **versions,
        "device": artifact.device,
        "name": artifact.name,
        "kind": artifact.kind.value,
        "dynamic": artifact.dynamic,
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
    }
    _write_file(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode() + b"\n")


def _write_file(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# Types of constant leaves a guard key may name (by name in the artifact).
_TYPES: dict[str, type] = {
    t.__name__: t for t in (int, float, bool, str, complex, type(None), slice, torch.dtype)
}


@dataclass(frozen=True, slots=True)
class _TypeName:
    name: str


records.register_records(_TypeName)


def _portable(artifact: CompiledArtifact) -> CompiledArtifact:
    """The artifact with the Python types in its guard key written as names."""

    def conv(v: object) -> object:
        if isinstance(v, type):
            if _TYPES.get(v.__name__) is not v:
                raise codec.Uncachable(f"an argument of type {v.__name__}")
            return _TypeName(v.__name__)
        if isinstance(v, slice):
            raise codec.Uncachable("a slice argument")
        if isinstance(v, tuple):
            return tuple(conv(x) for x in v)
        return v

    return _replace(artifact, key=conv(artifact.key))


def _native(key: object) -> object:
    if isinstance(key, _TypeName):
        return _TYPES[key.name]
    if isinstance(key, tuple):
        return tuple(_native(x) for x in key)
    return key


def _replace(artifact: CompiledArtifact, **changes: object) -> CompiledArtifact:
    return dataclasses.replace(artifact, **changes)  # type: ignore[arg-type]


def current_versions() -> dict[str, object]:
    aotc = sys.modules["aotc"]  # the package this runtime belongs to (imported before it)
    return {"aotc": aotc.__version__, "torch": torch.__version__, "triton": _triton_version()}


def _triton_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- loading


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the artifact at `path`, checked against this process (format version,
    torch version, device kind) and against every file's checksum."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise ArtifactError(
            f"{path} is not an aotc artifact (no {MANIFEST}); write one with aotc.export()"
        ) from None
    except ValueError as e:
        raise ArtifactError(f"{file} is not JSON ({e}); export the artifact again") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{file} is not an aotc artifact manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has artifact format version {manifest.get('version')!r}; this aotc reads "
            f"version {FORMAT_VERSION}. Export it again with this aotc version "
            f"(or load it with the aotc {manifest.get('aotc')!r} that wrote it)."
        )
    if manifest.get("torch") != torch.__version__:
        raise ArtifactError(
            f"{path} was exported with torch {manifest.get('torch')!r}; this process runs torch "
            f"{torch.__version__}. Graphs of ATen ops are tied to the torch version that traced "
            "them: export it again under this torch (or load it under the torch that wrote it)."
        )
    device = manifest.get("device")
    if device not in ("cpu", "cuda"):
        raise ArtifactError(f"{path} targets device kind {device!r}, which aotc cannot run")
    if device == "cuda" and not torch.cuda.is_available():
        raise ArtifactError(
            f"{path} was exported for cuda and this process has no CUDA device. Export it "
            "again from CPU inputs to run it on the CPU."
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or PROGRAM not in files:
        raise ArtifactError(f"{file} lists no files; export the artifact again")
    for name, digest in files.items():
        full = os.path.join(path, name)
        if os.path.normpath(name).startswith("..") or os.path.isabs(name):
            raise ArtifactError(f"{file} names a file outside the artifact: {name!r}")
        try:
            with open(full, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read {name} ({e}); export it again") from e
        if hashlib.sha256(data).hexdigest() != digest:
            raise ArtifactError(
                f"{path}: checksum mismatch for {name} (the file was modified or truncated "
                "after export). Export the artifact again; do not edit its files."
            )
    return manifest


def read_artifact(path: str) -> tuple[CompiledArtifact, dict[str, str]]:
    """The artifact at `path` and its kernel sources (file -> text), all checks passed."""
    manifest = read_manifest(path)
    with open(os.path.join(path, PROGRAM), "rb") as f:
        body = json.loads(f.read())
    try:
        graphs = lazy.GraphTable(
            codec._list(body.get("graphs")), lambda i, g: fxcodec.decode_graph(g)
        )
        artifact = codec.decode(body.get("artifact"), graphs)
    except (AotcError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise ArtifactError(f"{path}: {PROGRAM} cannot be decoded ({e}); export it again") from e
    if not isinstance(artifact, CompiledArtifact):
        raise ArtifactError(f"{path}: {PROGRAM} holds no compiled artifact; export it again")
    artifact = _replace(artifact, key=_native(artifact.key))
    kernels = {}
    for name in manifest["files"]:
        if name.startswith(KERNEL_DIR + "/"):
            with open(os.path.join(path, name)) as f:
                kernels[name] = f.read()
    return artifact, kernels


def load(path: str | os.PathLike[str], module: torch.nn.Module | None = None) -> LoadedArtifact:
    """Load an artifact written by `aotc.export`: a callable with the compiled forward and
    backward. `module`: for an exported nn.Module, the module whose parameters and buffers the
    artifact reads on each call (see Note [Module artifacts bind at load time])."""
    artifact, kernels = read_artifact(os.fspath(path))
    return LoadedArtifact(artifact, kernels, module, os.fspath(path))


def _lowering(program: GraphProgram | None, kernels: dict[str, str]) -> CompiledGraph | None:
    if program is None:
        return None
    from aotc.runtime.steps import build_compiled_graph

    return build_compiled_graph(program, kernels)


class LoadedArtifact:
    """A loaded artifact: call it like the exported function (or module's forward)."""

    def __init__(
        self,
        artifact: CompiledArtifact,
        kernels: dict[str, str],
        module: torch.nn.Module | None,
        path: str = "<artifact>",
    ) -> None:
        self.artifact = artifact
        self.path = path
        self._readers: tuple[Callable[[object], object], ...] = ()
        self._modules: tuple[torch.nn.Module, ...] = ()
        self._flags = tuple(flag for _, flag in artifact.training_flags)
        if artifact.state_names:
            if module is None:
                raise ArtifactError(
                    f"{path} is an exported {artifact.kind.value} that reads "
                    f"{len(artifact.state_names)} parameters and buffers "
                    f"({', '.join(artifact.state_names[:4])}"
                    f"{', ...' if len(artifact.state_names) > 4 else ''}); pass the module they "
                    "belong to: aotc.load(path, module=m)"
                )
            self._readers = tuple(
                _state_reader(module, name, path) for name in artifact.state_names
            )
        if module is not None:
            named = dict(module.named_modules())
            missing = [name for name, _ in artifact.training_flags if name not in named]
            if missing:
                raise ArtifactError(
                    f"{path}: the module given has no submodules {missing[:4]}; bind the "
                    "artifact to a module of the class it was exported from"
                )
            self._modules = tuple(named[name] for name, _ in artifact.training_flags)
        self._module = module
        self._state = _state_checker(artifact.state_checks, module, path)
        program = artifact.program
        lowerings = (
            _lowering(program.forward_kernels, kernels),
            _lowering(program.backward_kernels, kernels),
        )
        segment_lowerings = tuple(
            _lowering(seg.backward_kernels, kernels) for seg in program.segments
        )
        self.entry = assemble(program, lowerings, segment_lowerings=segment_lowerings)
        self._call = self.entry.call
        n = artifact.num_user_leaves
        plain = pytree.tree_flatten((tuple(range(n)), {}))[1] == artifact.in_spec
        self._plain_args = n if plain else -1
        self._check: Callable[[Sequence[object]], bool] | None = None
        self._shape: Callable[[list[torch.Tensor]], bool] | None = None
        if artifact.dynamic:
            if artifact.shape_guard is not None:
                _check_guard_code(artifact.shape_guard, path)
            self._shape = make_guard(artifact.shape_guard)
        else:
            self._check = signature_check(artifact.key)

    @property
    def name(self) -> str:
        return self.artifact.name

    def __repr__(self) -> str:
        return f"<aotc artifact {self.artifact.name} from {self.path}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == self._plain_args:
            leaves: list[object] = list(args)
        else:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if spec != self.artifact.in_spec:
                raise GuardError(
                    f"{self.name} (loaded from {self.path}) was exported for arguments shaped "
                    f"{self.artifact.in_spec}, got {spec}. Call it with the structure it was "
                    "exported with, or export it again."
                )
        if self._readers:
            module = self._module
            leaves.extend(read(module) for read in self._readers)
        if self._modules and tuple(m.training for m in self._modules) != self._flags:
            raise GuardError(
                f"{self.name} (loaded from {self.path}) was exported with the module in "
                f"{'training' if self._flags[0] else 'eval'} mode (and each submodule's "
                "training flag as it was then); set the same mode (module.train() / .eval()) "
                "or export it in this mode too."
            )
        if not self._admits(leaves):
            raise GuardError(self._explain(leaves))
        if self._state is not None:
            why = self._state()
            if why is not None:
                raise GuardError(
                    f"{self.name} (loaded from {self.path}) was exported with {why}; set it "
                    "back, or export the artifact again in this state."
                )
        return self._call(leaves)

    def _admits(self, leaves: list[object]) -> bool:
        if self._check is not None:
            try:
                if self._check(leaves):
                    return True
            except (RuntimeError, TypeError):
                pass
        if not self.artifact.dynamic:
            return signature_key(leaves) == self.artifact.key
        if coarse_key(leaves) != self.artifact.key:
            return False
        assert self._shape is not None
        return self._shape([t for t in leaves if isinstance(t, torch.Tensor)])

    def _explain(self, leaves: list[object]) -> str:
        head = f"{self.name} (loaded from {self.path}) cannot run this call: "
        tail = (
            ". An artifact runs the one signature it was exported for (dtype, device, shape, "
            "strides, requires_grad, grad mode; dynamic=True admits other sizes); export it "
            "again with inputs like these."
        )
        names = self.artifact.input_names
        if self.artifact.dynamic:
            key = coarse_key(leaves)
            if key == self.artifact.key:
                shapes = [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
                return (
                    f"{head}sizes {shapes} fall outside its guard {self.artifact.shape_guard}{tail}"
                )
            why = _coarse_change(self.artifact.key, key, names)
        else:
            why = describe_change((None, self.artifact.key), (None, signature_key(leaves)))
            for i, name in enumerate(names):
                why = why.replace(f"input {i} ", f"{name} ")
        return head + why + tail


def _coarse_change(old: Any, new: Any, names: Sequence[str]) -> str:
    reasons = []
    if old[2] != new[2]:
        reasons.append(f"grad mode {old[2]} -> {new[2]}")
    fields = ("dtype", "device", "number of dims", "requires_grad", "is_leaf")
    for i, (a, b) in enumerate(zip(old[0], new[0])):
        name = names[i] if i < len(names) else f"input {i}"
        if a != b and len(a) == len(b) == len(fields):
            reasons += [f"{name} {f} {x} -> {y}" for f, x, y in zip(fields, a, b) if x != y]
        elif a != b:
            reasons.append(f"{name} {a[-1]!r} -> {b[-1]!r}")
    if len(old[0]) != len(new[0]):
        reasons.append(f"{len(old[0])} -> {len(new[0])} inputs")
    if old[1] != new[1] or old[3] != new[3]:
        reasons.append("aliasing between inputs or autocast state changed")
    return "; ".join(reasons) or "unknown"


def _state_checker(
    checks: tuple[tuple[str, object], ...], module: torch.nn.Module | None, path: str
) -> Callable[[], str | None] | None:
    """A per-call check of the artifact's Python state: None when it holds, else what differs."""
    if not checks:
        return None
    items: list[tuple[str, Callable[[], object], object]] = []
    for what, expected in checks:
        if what == "torch.get_default_dtype()":
            items.append((what, torch.get_default_dtype, expected))
        elif what == "torch.get_default_device()":
            items.append((what, torch._C._get_default_device, expected))  # as aotc/strict.py
        elif what.startswith("self.") and module is not None:
            read = operator.attrgetter(what[len("self.") :])
            try:
                read(module)
            except AttributeError:
                raise ArtifactError(
                    f"{path}: the module given has no {what[5:]!r}; bind the artifact to a "
                    "module of the class it was exported from"
                ) from None
            items.append((what, functools.partial(read, module), expected))
        else:
            raise ArtifactError(f"{path}: unknown state check {what!r}; export it again")

    def check() -> str | None:
        for what, read, expected in items:
            value = read()
            if type(value) is not type(expected) or value != expected:
                return f"{what} = {expected!r} (now {value!r})"
        return None

    return check


def _state_reader(module: torch.nn.Module, name: str, path: str) -> Callable[[object], object]:
    prefix = "self."
    dotted = name[len(prefix) :] if name.startswith(prefix) else None
    if dotted is None or not all(p.isidentifier() or p.isdigit() for p in dotted.split(".")):
        raise ArtifactError(f"{path}: cannot bind state {name!r} to a module")
    read = operator.attrgetter(dotted)
    try:
        value = read(module)
    except AttributeError:
        raise ArtifactError(
            f"{path}: the module given has no {dotted!r}; bind the artifact to a module of the "
            "class it was exported from"
        ) from None
    if not isinstance(value, torch.Tensor):
        raise ArtifactError(f"{path}: {dotted!r} of the module given is not a tensor")
    return read


# Names and methods a shape guard may use: sizes and strides of the tensor leaves, arithmetic
# and comparisons, and the functions torch's guard printer emits (SYMPY_INTERP).
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
_GUARD_NODES = (
    ast.Expression, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call, ast.Name,
    ast.Load, ast.Constant, ast.Subscript, ast.Attribute, ast.Tuple, ast.List, ast.keyword,
    ast.operator, ast.boolop, ast.cmpop, ast.unaryop, ast.IfExp,
)  # fmt: skip


def _check_guard_code(code: str, path: str) -> None:
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError as e:
        raise ArtifactError(f"{path}: the shape guard is not an expression ({e})") from e
    for node in ast.walk(tree):
        ok = isinstance(node, _GUARD_NODES)
        if isinstance(node, ast.Name):
            ok = node.id == "L" or node.id in SYMPY_INTERP
        elif isinstance(node, ast.Attribute):
            ok = node.attr in _GUARD_METHODS
        if not ok:
            raise ArtifactError(
                f"{path}: the shape guard uses {ast.dump(node)[:60]}, which no guard aotc writes "
                "contains; export the artifact again"
            )


__all__ = [
    "ArtifactError",
    "ArtifactKind",
    "CompiledArtifact",
    "LoadedArtifact",
    "load",
    "read_artifact",
    "read_manifest",
    "write_artifact",
]
