"""Persistent compile cache stage: the cache key of one signature, and loading/storing entries.

Stage: `cache_key(program, leaves, names, options, grad_enabled) -> CacheKey`;
`load_entry(options, key) -> dict | None` (decoded record fields + runtime plan);
`regenerate_kernels(entry, options)` (the Triton kernels of a hit, generated again);
`store_entry(options, key, record, plan, lowered)`. Every backend is stored; the key covers
`backend` and `triton_interpret` with the other options, so an entry of one backend never
serves another.
Requires: the same `program` and `leaves` that `aotc.pipeline._compile_signature` compiles.
Ensures: equal keys only for programs that compile to the same graphs (see Note [Cache key]);
`CacheKey.key` is None, with a reason, when the program cannot be keyed safely (it is then
compiled as usual and not stored). The entry format is in runtime/cache.py.

Note [Cache key]
~~~~~~~~~~~~~~~~
A warm start must cost under 10% of a cold compile, and tracing (two metadata runs and the joint
trace) is ~80% of a cold compile, so the key cannot come from the joint graph. It comes from one
cheap *key trace*: the program runs once on plain fake tensors (no functionalization, no joint
backward), with the inputs' real requires_grad and grad mode, under a dispatch mode that writes
every ATen call as one line of canonical text:

    t3 = aten.mul.Tensor(t0 rg, 2.0) grad=1 -> float32[4, 3]/(3, 1)+0

Every tensor is named by when it first appeared (inputs t0..tn in graph-argument order), so the
text records which op reads and writes which tensor, in order, with every non-tensor argument
(Python floats exactly, via repr), the grad mode and requires_grad of each tensor argument, and
each result's dtype, shape, strides and offset. Tensors created from Python data (`torch.tensor`)
appear as real constants and are hashed by value. The text ends with the output leaves (tensor
names or typed constant values) and the output tree structure.

Why the same text means the same compiled graphs: everything the pipeline derives (mutations,
aliasing, the functional joint graph, its backward, the partition, the epilogue) is a function of
(a) the sequence of ATen ops applied to the input tensors, (b) the autograd state they run under
(grad mode per op, requires_grad of the arguments: the backward of each op is the derivative
formula of that op), (c) the input signature (dtype, shape, strides, offsets, devices,
requires_grad, leafness, view-ness, conj/neg bits, aliasing between inputs, non-tensor argument
values), (d) the outputs and their structure, and (e) the code and options of aotc and torch.
The key hashes all of (a)-(e). Python code that changes none of these (a renamed local, a comment)
shares the entry; a changed function body, closure constant or module hyperparameter changes an
op, an argument or a constant and so the key (tests/runtime/test_cache.py checks each).

What the op text cannot see makes a program unkeyable (compiled, not stored): custom
`autograd.Function`s (their backward is Python code; found by walking the autograd graph from the
outputs and inputs), tensor hooks registered inside the function, tensors reached without a
dispatch (`.data` aliases), ops outside aten/prims, non-tensor arguments or constants without a
stable text, and any failure of the key trace (the normal compile then reports the error).
Not covered: hooks registered on autograd nodes (`y.grad_fn.register_hook`) inside the compiled
function and saved-tensor hooks installed inside it; pass `cache=False` for such programs. A
program whose ops depend on Python state that changes between calls (a counter) is already traced
nondeterministically (the pipeline runs it three times); the key reflects its first run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from aotc.functional import FlatProgram, fakeify
from aotc.options import CompileOptions
from passes import descriptors
from passes.ir import StageGraph
from passes.partition import PartitionResult, SavedValue
from passes.select import select_backend
from runtime import autograd, epilogue, schema, wrappers
from runtime import cache as store
from runtime.convention import apply_convention, expand_graph_args, plan_convention
from runtime.errors import CacheError
from runtime.kernels import CompiledGraph

log = logging.getLogger("aotc.cache")

store.register_records(
    schema.MutationKind, schema.OutputKind, schema.Geometry, schema.InputInfo, schema.OutputInfo,
    schema.MutationAliasInfo, schema.SyntheticBase, schema.CallingConvention,
    schema.FwdOutputPlan, epilogue.MutationStep, epilogue.OutputStep, epilogue.EpiloguePlan,
    autograd.AutogradPlan, wrappers.RuntimePlan, descriptors.PrimalInput, descriptors.TangentInput,
    descriptors.SavedInput, descriptors.FwdOutput, descriptors.GradOutput,
    descriptors.SavedOutput, StageGraph, SavedValue, PartitionResult,
)

# Options that change only diagnostics, never the compiled graphs: left out of the key.
_NOT_IN_KEY = frozenset({
    "dump_dir", "check_invariants", "recompile_warn_limit", "max_signatures",
    "cache", "cache_dir", "cache_max_bytes",
})
_PLAIN = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, slice,
          type(Ellipsis), torch.layout, torch.memory_format)


@dataclass(frozen=True, slots=True)
class CacheKey:
    key: str | None  # hex digest, or None when the program cannot be keyed safely
    reason: str  # why not, when key is None
    seconds: float  # time the key trace took


def is_enabled(options: CompileOptions) -> bool:
    return bool(options.cache and options.cache_dir)


def cache_key(
    program: FlatProgram,
    leaves: list[object],
    names: Sequence[str],
    options: CompileOptions,
    grad_enabled: bool,
) -> CacheKey:
    """See Note [Cache key]."""
    start = time.perf_counter()
    try:
        parts = [_versions(), _options_text(options), _signature_text(leaves, names, grad_enabled)]
        parts.append(_trace_text(program, leaves, grad_enabled))
    except _Unkeyable as e:
        return CacheKey(None, str(e), time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 the key trace failed: the full compile reports it
        return CacheKey(None, f"key trace failed ({type(e).__name__})", time.perf_counter() - start)
    text = "\n".join(parts)
    if " at 0x" in text:
        return CacheKey(None, "a value prints with its memory address", time.perf_counter() - start)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return CacheKey(digest, "", time.perf_counter() - start)


class _Unkeyable(Exception):
    pass


_VERSIONS: list[str] = []


def _versions() -> str:
    """aotc (version and a digest of its sources), torch, triton, Python, entry format."""
    if not _VERSIONS:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        digest = hashlib.sha256()
        for package in ("aotc", "passes", "runtime"):
            folder = os.path.join(root, package)
            for dirpath, dirnames, files in os.walk(folder):
                dirnames.sort()
                for name in sorted(files):
                    if name.endswith(".py"):
                        path = os.path.join(dirpath, name)
                        digest.update(os.path.relpath(path, root).encode())
                        with open(path, "rb") as f:
                            digest.update(f.read())
        try:
            triton = importlib.metadata.version("triton")
        except importlib.metadata.PackageNotFoundError:
            triton = "none"
        from aotc import __version__

        _VERSIONS.append(
            f"aotc {__version__} {digest.hexdigest()} torch {torch.__version__} triton {triton} "
            f"python {sys.version_info[:3]} format {store.FORMAT_VERSION}"
        )
    return _VERSIONS[0]


def _options_text(options: CompileOptions) -> str:
    return "options " + " ".join(
        f"{f.name}={getattr(options, f.name)!r}" for f in fields(options)
        if f.name not in _NOT_IN_KEY
    )


def _signature_text(leaves: Sequence[object], names: Sequence[str], grad_enabled: bool) -> str:
    lines = [f"grad={grad_enabled} inference={torch.is_inference_mode_enabled()}"]
    autocast = [
        (d, str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)
    ]
    lines.append(f"autocast={autocast} default_dtype={torch.get_default_dtype()}")
    ids: dict[int, int] = {}
    storages: dict[int, int] = {}
    roots: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        name = names[i] if i < len(names) else f"arg{i}"
        if isinstance(leaf, torch.Tensor):
            if type(leaf) is not torch.Tensor and not isinstance(leaf, torch.nn.Parameter):
                raise _Unkeyable(f"input {name} is a tensor subclass {type(leaf).__name__}")
            root = leaf._base if leaf._base is not None else leaf
            ptr = leaf.untyped_storage().data_ptr() if leaf.layout is torch.strided else 0
            lines.append(
                f"{name}: {leaf.dtype} {tuple(leaf.shape)} {leaf.stride()} +{leaf.storage_offset()} "
                f"{leaf.device} {leaf.layout} rg={leaf.requires_grad} leaf={leaf.is_leaf} "
                f"view={leaf._is_view()} conj={leaf.is_conj()} neg={leaf.is_neg()} "
                f"param={isinstance(leaf, torch.nn.Parameter)} inference={leaf.is_inference()} "
                f"same={ids.setdefault(id(leaf), i)} "
                f"storage={storages.setdefault(ptr, i) if ptr else i} "
                f"root={roots.setdefault(id(root), i)} {tuple(root.shape)} {root.stride()} "
                f"+{root.storage_offset()}"
            )
        elif isinstance(leaf, _PLAIN):
            lines.append(f"{name}: {type(leaf).__name__} {leaf!r}")
        else:
            raise _Unkeyable(f"argument {name} has type {type(leaf).__name__}")
    return "\n".join(lines)


def _trace_text(program: FlatProgram, leaves: list[object], grad_enabled: bool) -> str:
    convention = plan_convention(leaves)
    graph_args = apply_convention(convention, leaves)
    constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    # Heuristic: one run sees most ops once, so fake tensors' dispatch cache mostly costs: in a
    # cProfile of the GPT block's key trace in a fresh process, building its keys and entries
    # took ~75 of 255 ms.
    mode.cache_enabled = False
    with mode:
        fakes = fakeify(mode, graph_args, as_leaves=False)
    recorder = _Recorder(fakes)
    with mode, recorder, torch.set_grad_enabled(grad_enabled):
        user_leaves = expand_graph_args(convention, fakes, constants)
        outs, out_spec = program(user_leaves)
    if recorder.unkeyable is not None:
        raise _Unkeyable(recorder.unkeyable)
    lines = recorder.lines
    out_text = []
    for o in outs:
        if isinstance(o, torch.Tensor):
            out_text.append(f"{recorder.name(o)} rg={o.requires_grad} leaf={o.is_leaf}")
        elif isinstance(o, _PLAIN):
            out_text.append(f"{type(o).__name__} {o!r}")
        else:
            raise _Unkeyable(f"output of type {type(o).__name__}")
    lines.append("outputs " + ", ".join(out_text))
    lines.append(f"out_spec {out_spec}")
    lines.append("inputs after " + ", ".join(
        f"rg={f.requires_grad} leaf={f.is_leaf}" for f in fakes))
    _check_autograd(outs, fakes, recorder.seen)
    return "\n".join(lines)


def _check_autograd(outs: list[object], inputs: list[torch.Tensor], seen: list[torch.Tensor]) -> None:
    """Python code the op text cannot see: custom autograd.Functions and tensor hooks."""
    for t in seen:
        if getattr(t, "_backward_hooks", None):
            raise _Unkeyable("a tensor hook registered inside the function")
    for node in autograd.autograd_nodes([*outs, *inputs]):
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            raise _Unkeyable(f"custom autograd.Function {type(node).__name__}")


class _Recorder(TorchDispatchMode):
    """Writes each ATen call as canonical text (see Note [Cache key])."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []  # keeps every tensor alive, so ids stay unique
        self.names: dict[int, str] = {}
        self.lines: list[str] = []
        # Never raise inside __torch_dispatch__ (some callers are C++ that cannot propagate a
        # Python error); the reason is raised after the program returns.
        self.unkeyable: str | None = None
        for t in inputs:
            self._new(t)
        for t in inputs:  # autograd replays views of inputs on their bases
            if t._base is not None and id(t._base) not in self.names:
                self.lines.append(f"{self._new(t._base)} = base of {self.names[id(t)]}")

    def _new(self, t: torch.Tensor) -> str:
        name = self.names.get(id(t))
        if name is None:
            name = self.names[id(t)] = f"t{len(self.seen)}"
            self.seen.append(t)
        return name

    def name(self, t: torch.Tensor) -> str:
        name = self.names.get(id(t))
        if name is None:
            raise _Unkeyable("a tensor reached without a dispatched op (e.g. `.data`)")
        return name

    def _arg(self, a: Any) -> str:
        if isinstance(a, torch.Tensor):
            if id(a) in self.names:
                return self.names[id(a)] + (" rg" if a.requires_grad else "")
            if isinstance(a, FakeTensor) or type(a) is not torch.Tensor:
                self.unkeyable = "a tensor reached without a dispatched op (e.g. `.data`)"
                return self._new(a)
            return self._constant(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self._arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k}={self._arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, _PLAIN):
            return repr(a)
        self.unkeyable = f"op argument of type {type(a).__name__}"
        return "?"

    def _constant(self, t: torch.Tensor) -> str:
        """A real tensor inside the program (`torch.tensor([...])`): named by its value."""
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        digest = hashlib.sha256(data.numpy().tobytes() if data.numel() else b"").hexdigest()
        name = self._new(t)
        return f"{name}=const({t.dtype} {tuple(t.shape)} {t.stride()} {digest})"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        try:
            text = f"{func}({self._arg(args)}, {self._arg(kwargs)}) grad={int(torch.is_grad_enabled())}"
        except Exception as e:  # noqa: BLE001 see __init__: never raise from here
            self.unkeyable, text = f"cannot print the arguments of {func} ({e})", ""
        out = func(*args, **kwargs)
        try:
            results = []
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    results.append(
                        f"{self._new(o)}:{o.dtype}{list(o.shape)}/{o.stride()}+{o.storage_offset()}"
                    )
                else:
                    results.append(self._arg(o))
            self.lines.append(f"{', '.join(results)} = {text}")
        except Exception as e:  # noqa: BLE001 see __init__
            self.unkeyable = f"cannot print the result of {func} ({e})"
        return out


def load_entry(options: CompileOptions, key: str) -> dict[str, Any] | None:
    """The decoded body of entry `key`, or None: {"record": fields, "plan": RuntimePlan,
    "kernels": stored [{"name", "source"}], "lowered": (forward, backward) went to Triton}."""
    assert options.cache_dir is not None
    body = store.read_entry(options.cache_dir, key)
    if body is None:
        return None
    try:
        lowered = tuple(bool(x) for x in store._list(body.get("lowered", [False, False])))
        # Graphs that the cold compile lowered to Triton are lowered again on this hit, which
        # reads node values on their real devices (fake tensors); the others (the joint graphs)
        # get meta values, which are cheaper to make.
        lowering = _lowered_graph_ids(body, lowered)
        mode = FakeTensorMode(allow_non_fake_inputs=True) if lowering else None
        graphs = [store.decode_graph(g, mode if i in lowering else None)
                  for i, g in enumerate(store._list(body.get("graphs")))]
        kernels = [{"name": str(k["name"]), "source": str(k["source"])}
                   for k in store._list(body.get("kernels", []))]
        if len(lowered) != 2:
            raise CacheError("bad 'lowered' field")
        decomposed = tuple(store.decode(g, graphs) for g in
                           store._list(body.get("decomposed", [None, None])))
        if len(decomposed) != 2 or not all(g is None or isinstance(g, fx.GraphModule)
                                           for g in decomposed):
            raise CacheError("bad 'decomposed' field")
        return {
            "record": store.decode(body.get("record"), graphs),
            "plan": store.decode(body.get("plan"), graphs),
            "kernels": kernels,
            "lowered": lowered,
            "decomposed": decomposed,
        }
    except (CacheError, RecursionError, ValueError, TypeError, KeyError, AttributeError,
            RuntimeError) as e:
        import warnings

        warnings.warn(
            f"aotc cache: ignoring entry {store.entry_path(options.cache_dir, key)}: {e}. It "
            "will be rebuilt.",
            stacklevel=3,
        )
        return None


def _lowered_graph_ids(body: dict[str, Any], lowered: tuple[bool, ...]) -> set[int]:
    """Indices into body["graphs"] of the lowered stage graphs and their decomposed graphs."""
    record = body.get("record")
    fields = record.get("D") if isinstance(record, dict) else None
    if not isinstance(fields, dict):
        raise CacheError("bad record")
    decomposed = store._list(body.get("decomposed", [None, None]))
    out = set()
    for name, low, dec in zip(("forward", "backward"), lowered, decomposed):
        for ref in (fields.get(name), dec) if low else ():
            if isinstance(ref, dict) and isinstance(ref.get("G"), int):
                out.add(ref["G"])
    return out


def regenerate_kernels(
    cached: dict[str, Any], options: CompileOptions
) -> tuple[CompiledGraph | None, CompiledGraph | None]:
    """The Triton kernels of a hit, generated again from its cached graphs (the stored kernel
    sources are never compiled: a cache directory cannot run code). The stored sources serve
    as a check: generation is a pure function of the graph, so a difference is a bug in it
    (logged; the regenerated kernels run)."""
    record = cached["record"]
    out: list[CompiledGraph | None] = []
    graphs = zip((record["forward"], record["backward"]), cached["lowered"], cached["decomposed"])
    for module, lowered, decomposed in graphs:
        compiled = None
        if lowered and module is not None:
            compiled = select_backend(module, options.backend, options.triton_interpret,
                                      decomposed)
        out.append(compiled)
    made = [{"name": k.name, "source": k.source} for c in out if c for k in c.kernels]
    if made != cached["kernels"]:
        log.warning("cache hit for %s: the regenerated Triton kernels differ from the stored "
                    "ones (%d vs %d kernels); running the regenerated ones",
                    record.get("name", "?"), len(made), len(cached["kernels"]))
    return out[0], out[1]


def store_entry(options: CompileOptions, key: str, record: dict[str, Any], plan: object,
                compiled: tuple[CompiledGraph | None, CompiledGraph | None] = (None, None)
                ) -> bool:
    """Write the entry; False (logged) when some value has no plain encoding or the directory
    cannot be written. `record` maps CompiledRecord field names to values; `compiled` are the
    forward and backward graphs' Triton lowerings (None: run as ATen calls)."""
    assert options.cache_dir is not None
    graphs: list[dict[str, Any]] = []
    ids: dict[int, int] = {}
    record = dict(record)
    kernels = record.pop("kernels", ())
    record.pop("fusion_text", None)  # regenerated with the kernels
    try:
        body = {
            "record": store.encode(record, graphs, ids),
            "plan": store.encode(plan, graphs, ids),
            "graphs": graphs,
            "kernels": [{"name": k.name, "source": k.source} for k in kernels],
            "lowered": [c is not None for c in compiled],
        }
    except store.Uncachable as e:
        log.info("not caching: %s", e)
        return False
    # The decomposed graphs spare a hit the decomposition (a retrace, and on first use building
    # torch's decomposition table: most of the kernel stage); optional, as they may hold values
    # without a plain encoding.
    count, known = len(graphs), dict(ids)
    try:
        body["decomposed"] = [store.encode(c.decomposed, graphs, ids)
                              if c is not None and c.decomposed is not None else None
                              for c in compiled]
    except store.Uncachable as e:
        log.info("not caching the decomposed graphs: %s", e)
        del graphs[count:]
        ids.clear()
        ids.update(known)
    try:
        store.write_entry(options.cache_dir, key, body, options.cache_max_bytes)
    except OSError as e:
        import warnings

        warnings.warn(f"aotc cache: cannot write to {options.cache_dir} ({e}).", stacklevel=3)
        return False
    return True


__all__ = [
    "CacheKey", "cache_key", "is_enabled", "load_entry", "regenerate_kernels", "store_entry",
]
