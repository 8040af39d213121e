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
cheap *key trace* (aotc/keytrace.py): the program runs once on key tensors (meta tensors that
report the real device; fake tensors for inputs those do not model, see Note [Meta key trace]),
with no functionalization and no joint backward, with the inputs' real requires_grad and grad
mode, under a dispatch mode that writes every ATen call as one line of canonical text:

    t3:float32[4, 3]/(3, 1)+0@cpu = aten.mul.Tensor((t0 rg, 2.0), {}) grad=1

Every tensor is named by when it first appeared (inputs t0..tn in graph-argument order), so the
text records which op reads and writes which tensor, in order, with every non-tensor argument
(Python floats exactly, via repr), the grad mode and requires_grad of each tensor argument, and
each result's dtype, shape, strides, offset and device. Tensors created from Python data
(`torch.tensor`) appear as real constants and are hashed by value. The text ends with the output leaves (tensor
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from aotc import keytrace
from aotc.functional import FlatProgram
from aotc.options import CompileOptions
from aotc.passes import descriptors
from aotc.passes.ir import StageGraph
from aotc.passes.partition import PartitionResult, Recomputation, RecomputeReason, SavedValue
from aotc.passes.recompute import CostKind, Executor, RecomputeCost
from aotc.passes.select import select_backend
from aotc.runtime import cache as store
from aotc.runtime import records  # noqa: F401  (registers the runtime records)
from aotc.runtime.errors import CacheError
from aotc.runtime.kernels import CompiledGraph
from aotc.symkey import ShapeFacts

log = logging.getLogger("aotc.cache")

store.register_records(  # the runtime registers its own records (runtime/records.py)
    descriptors.PrimalInput,
    descriptors.TangentInput,
    descriptors.SavedInput,
    descriptors.FwdOutput,
    descriptors.GradOutput,
    descriptors.SavedOutput,
    StageGraph,
    SavedValue,
    PartitionResult,
    Executor,
    CostKind,
    RecomputeCost,
    RecomputeReason,
    Recomputation,
)

# Options that change only diagnostics, never the compiled graphs: left out of the key.
_NOT_IN_KEY = frozenset(
    {
        "capture",  # how the program was captured does not change its graphs
        "dump_dir",
        "check_invariants",
        "recompile_warn_limit",
        "max_signatures",
        "cache",
        "cache_dir",
        "cache_max_bytes",
    }
)
_PLAIN = keytrace.PLAIN


@dataclass(frozen=True, slots=True)
class CacheKey:
    key: str | None  # hex digest, or None when the program cannot be keyed safely
    reason: str  # why not, when key is None
    tracer: str = ""  # "meta" or "fake" (see Note [Meta key trace] in aotc/keytrace.py)
    trace: str = ""  # the key trace's text


def is_enabled(options: CompileOptions) -> bool:
    return bool(options.cache and options.cache_dir)


def cache_key(
    program: FlatProgram,
    leaves: list[object],
    names: Sequence[str],
    options: CompileOptions,
    grad_enabled: bool,
    tracers: Sequence[str] | None = None,
    facts: ShapeFacts | None = None,
) -> CacheKey:
    """See Note [Cache key]. `tracers`: which key tracers to try, in order (default: meta, then
    fake, or fake alone for inputs the meta tracer does not model). `facts`: the symbols of a
    symbolic compilation's inputs (Note [Symbolic cache entries] in aotc/symkey.py); the key then
    also covers what the ShapeEnv knows about them, and only the fake tracer runs."""
    try:
        parts = [
            _versions(),
            _options_text(options),
            _signature_text(leaves, names, grad_enabled, facts),
        ]
        if facts is not None:
            parts.append("shape facts\n" + facts.prior_text())
    except _Unkeyable as e:
        return CacheKey(None, str(e))
    if facts is not None:
        tracers = ("fake",)
    elif tracers is None:
        tracers = ("meta", "fake") if keytrace.meta_eligible(leaves) else ("fake",)
    reason = "no key tracer"
    for tracer in tracers:
        try:
            trace = keytrace.trace_text(program, leaves, grad_enabled, tracer, facts)
            break
        except _Unkeyable as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 the key trace failed: the full compile reports it
            reason = f"key trace failed ({type(e).__name__})"
    else:
        return CacheKey(None, reason)
    return _digest(parts, tracer, trace)


def _digest(parts: list[str], tracer: str, trace: str) -> CacheKey:
    text = "\n".join([*parts, f"tracer {tracer}", trace])
    if " at 0x" in text:
        return CacheKey(None, "a value prints with its memory address")
    digest = hashlib.sha256(text.encode()).hexdigest()
    return CacheKey(digest, "", tracer, trace)


def _key_of(
    options: CompileOptions,
    leaves: list[object],
    names: Sequence[str],
    grad_enabled: bool,
    tracer: str,
    trace: str,
) -> CacheKey:
    """The key of an already written key text (see `cache_key`)."""
    try:
        parts = [_versions(), _options_text(options), _signature_text(leaves, names, grad_enabled)]
    except _Unkeyable as e:
        return CacheKey(None, str(e))
    return _digest(parts, tracer, trace)


def lookup(
    program: FlatProgram,
    leaves: list[object],
    names: Sequence[str],
    options: CompileOptions,
    grad_enabled: bool,
    lap: Callable[[str], None],
    facts: ShapeFacts | None = None,
) -> tuple[CacheKey, dict[str, Any] | None]:
    """The key of this signature and its decoded entry, if stored. A meta key whose entry is a
    redirect (its program's meta and fake texts differed, see `store_verified`) is keyed again
    with the fake tracer. `lap(stage)` closes the timing of "cache_key" and, on a hit,
    "cache_load" (a miss's read counts as key time)."""
    key = cache_key(program, leaves, names, options, grad_enabled, facts=facts)
    lap("cache_key")
    cached = load_entry(options, key.key) if key.key is not None else None
    if cached is _REDIRECT:
        lap("cache_key")
        key = cache_key(program, leaves, names, options, grad_enabled, tracers=("fake",))
        cached = load_entry(options, key.key) if key.key is not None else None
    lap("cache_load" if cached is not None and cached is not _REDIRECT else "cache_key")
    return key, cached if cached is not _REDIRECT else None


def store_verified(
    key: CacheKey,
    program: FlatProgram,
    leaves: list[object],
    names: Sequence[str],
    options: CompileOptions,
    grad_enabled: bool,
    record: dict[str, Any],
    plan: object,
    compiled: tuple[CompiledGraph | None, CompiledGraph | None] = (None, None),
    observed: keytrace.FakeRunObserver | None = None,
    shape_guards: dict[str, Any] | None = None,
) -> None:
    """Store a cold compile's entry under `key` once `verify_key` accepts it. A meta key it
    refuses gets a redirect instead, and the entry goes under the program's fake key, so the next
    process pays one extra key trace rather than a cold compile. `observed`: the fake text of the
    compile's own fake run, which spares the verification its trace (Note [Verifying on the
    compile's own run] in aotc/keytrace.py). `shape_guards`: what a symbolic compilation added to
    the ShapeEnv (`ShapeFacts.added_guards`), replayed on a hit."""
    assert key.key is not None
    if shape_guards is not None:  # a fake-traced key: nothing to verify
        store_entry(options, key.key, record, plan, compiled, shape_guards)
        return
    fake_text = observed.text if observed is not None else None
    refused = verify_key(key, program, leaves, grad_enabled, fake_text)
    if refused is None:
        store_entry(options, key.key, record, plan, compiled)
        return
    log.info("%s: not stored under its meta key: %s", record.get("name", "?"), refused)
    if fake_text is not None:
        fake = _key_of(options, leaves, names, grad_enabled, "fake", fake_text)
    else:
        fake = cache_key(program, leaves, names, options, grad_enabled, tracers=("fake",))
    if fake.key is None:
        log.info("not caching: %s", fake.reason)
        return
    if store_entry(options, fake.key, record, plan, compiled):
        _write_redirect(options, key.key)


_REDIRECT: dict[str, Any] = {"redirect": "fake"}


def _write_redirect(options: CompileOptions, key: str) -> None:
    assert options.cache_dir is not None
    try:
        store.write_entry(options.cache_dir, key, dict(_REDIRECT), options.cache_max_bytes)
    except OSError as e:
        log.info("cannot write a redirect entry: %s", e)


def verify_key(
    key: CacheKey,
    program: FlatProgram,
    leaves: list[object],
    grad_enabled: bool,
    fake_text: str | None = None,
) -> str | None:
    """None when `key` may be stored under; else why not. A meta-traced key is trusted only if a
    fake-tensor run of the same program writes the same text (Note [Meta key trace]):
    `fake_text` when the compile recorded one, else a fake trace run here."""
    if key.tracer != "meta":
        return None
    if fake_text is not None:
        fake = fake_text
    else:
        try:
            fake = keytrace.trace_text(program, leaves, grad_enabled, "fake")
        except Exception as e:  # noqa: BLE001 the fake tracer is the reference: any failure refuses
            return f"the fake-tensor key trace failed ({type(e).__name__}: {e})"
    if fake == key.trace:
        return None
    for i, (a, b) in enumerate(zip(key.trace.splitlines(), fake.splitlines())):
        if a != b:
            return f"meta and fake key traces differ at line {i}: {a[:200]!r} vs {b[:200]!r}"
    return "meta and fake key traces differ in length"


_Unkeyable = keytrace.Unkeyable
FakeRunObserver = keytrace.FakeRunObserver


_VERSIONS: list[str] = []


def _versions() -> str:
    """aotc (version and a digest of its sources), torch, triton, Python, entry format."""
    if not _VERSIONS:
        digest = hashlib.sha256()
        for package in ("aotc", "aotc.passes", "aotc.runtime"):
            folder = os.path.dirname(os.path.abspath(sys.modules[package].__file__ or ""))
            for name in sorted(os.listdir(folder)):
                if name.endswith(".py"):
                    digest.update(f"{package}/{name}".encode())
                    with open(os.path.join(folder, name), "rb") as f:
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
        f"{f.name}={getattr(options, f.name)!r}"
        for f in fields(options)
        if f.name not in _NOT_IN_KEY
    )


def _signature_text(
    leaves: Sequence[object],
    names: Sequence[str],
    grad_enabled: bool,
    facts: ShapeFacts | None = None,
) -> str:
    lines = [f"grad={grad_enabled} inference={torch.is_inference_mode_enabled()}"]
    autocast = [
        (d, str(torch.get_autocast_dtype(d)))
        for d in ("cpu", "cuda")
        if torch.is_autocast_enabled(d)
    ]
    lines.append(f"autocast={autocast} default_dtype={torch.get_default_dtype()}")
    ids: dict[int, int] = {}
    storages: dict[int, int] = {}
    roots: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        name = names[i] if i < len(names) else f"arg{i}"
        if isinstance(leaf, torch.Tensor):
            fake = type(leaf) is FakeTensor  # a Dynamo graph's input: stands for a real tensor
            if type(leaf) is not torch.Tensor and not isinstance(leaf, torch.nn.Parameter):
                if not fake:
                    raise _Unkeyable(f"input {name} is a tensor subclass {type(leaf).__name__}")
            root = leaf._base if leaf._base is not None else leaf
            ptr = keytrace.storage_id(leaf) if leaf.layout is torch.strided else 0
            if facts is not None:
                memo = getattr(leaf, "item_memo", None) if fake else None
                geometry = (
                    f"{facts.dims(leaf.shape)} {facts.dims(leaf.stride())} "
                    f"+{facts.text(leaf.storage_offset())}"
                    + (f" item={facts.text(memo)}" if memo is not None else "")
                )
                root_geometry = (
                    f"{facts.dims(root.shape)} {facts.dims(root.stride())} "
                    f"+{facts.text(root.storage_offset())}"
                )
            else:
                geometry = f"{tuple(leaf.shape)} {leaf.stride()} +{leaf.storage_offset()}"
                root_geometry = f"{tuple(root.shape)} {root.stride()} +{root.storage_offset()}"
            lines.append(
                f"{name}: {leaf.dtype} {geometry} "
                f"{leaf.device} {leaf.layout} rg={leaf.requires_grad} leaf={leaf.is_leaf} "
                f"view={leaf._is_view()} conj={leaf.is_conj()} neg={leaf.is_neg()} "
                f"param={isinstance(leaf, torch.nn.Parameter)} inference={leaf.is_inference()} "
                f"same={ids.setdefault(id(leaf), i)} "
                f"storage={storages.setdefault(ptr, i) if ptr else i} "
                f"root={roots.setdefault(id(root), i)} {root_geometry}"
            )
        elif isinstance(leaf, _PLAIN):
            lines.append(f"{name}: {type(leaf).__name__} {leaf!r}")
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)) and facts is not None:
            lines.append(f"{name}: {facts.text(leaf)}")
        else:
            raise _Unkeyable(f"argument {name} has type {type(leaf).__name__}")
    return "\n".join(lines)


def load_entry(options: CompileOptions, key: str) -> dict[str, Any] | None:
    """The decoded body of entry `key`, or None: {"record": fields, "plan": RuntimePlan,
    "kernels": stored [{"name", "source"}], "lowered": (forward, backward) went to Triton}."""
    assert options.cache_dir is not None
    body = store.read_entry(options.cache_dir, key)
    if body is None:
        return None
    if body == _REDIRECT:
        return _REDIRECT
    try:
        lowered = tuple(bool(x) for x in store._list(body.get("lowered", [False, False])))
        # Graphs that the cold compile lowered to Triton are lowered again on this hit, which
        # reads node values on their real devices (storage-less ValueTensors); the others get
        # meta values.
        lowering = _lowered_graph_ids(body, lowered)
        graphs = store.GraphTable(
            store._list(body.get("graphs")),
            lambda i, g: store.decode_graph(g, on_device=i in lowering),
        )
        kernels = [
            {"name": str(k["name"]), "source": str(k["source"])}
            for k in store._list(body.get("kernels", []))
        ]
        if len(lowered) != 2:
            raise CacheError("bad 'lowered' field")
        decomposed = tuple(
            store.decode(g, graphs) for g in store._list(body.get("decomposed", [None, None]))
        )
        if len(decomposed) != 2 or not all(
            g is None or isinstance(g, fx.GraphModule) for g in decomposed
        ):
            raise CacheError("bad 'decomposed' field")
        return {
            "record": _decode_record(body.get("record"), graphs, key),
            "plan": store.decode(body.get("plan"), graphs),
            "kernels": kernels,
            "lowered": lowered,
            "decomposed": decomposed,
            "shape_guards": body.get("shape_guards"),  # checked by ShapeFacts.replay
        }
    except (
        CacheError,
        RecursionError,
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        RuntimeError,
    ) as e:
        import warnings

        warnings.warn(
            f"aotc cache: ignoring entry {store.entry_path(options.cache_dir, key)}: {e}. It "
            "will be rebuilt.",
            stacklevel=3,
        )
        return None


# Record fields only inspection reads (the joint graphs): decoded on first read.
_DEFERRED_FIELDS = ("joint", "joint_graph", "partitioned_joint")


def _decode_record(value: Any, graphs: store.GraphTable, key: str) -> dict[str, Any]:
    fields = value.get("D") if isinstance(value, dict) and len(value) == 1 else None
    if not isinstance(fields, dict):
        raise CacheError("bad record")
    eager = {k: v for k, v in fields.items() if k not in _DEFERRED_FIELDS}
    out = store.decode({"D": eager}, graphs)
    for name in _DEFERRED_FIELDS:
        if name not in fields:
            raise CacheError(f"record has no {name!r}")
        out[name] = store.Deferred(
            lambda v=fields[name]: store.decode(v, graphs), f"the {name} of entry {key[:16]}"
        )
    return out


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
            compiled = select_backend(module, options.backend, options.triton_interpret, decomposed)
        out.append(compiled)
    made = [{"name": k.name, "source": k.source} for c in out if c for k in c.kernels]
    if made != cached["kernels"]:
        log.warning(
            "cache hit for %s: the regenerated Triton kernels differ from the stored "
            "ones (%d vs %d kernels); running the regenerated ones",
            record.get("name", "?"),
            len(made),
            len(cached["kernels"]),
        )
    return out[0], out[1]


def store_entry(
    options: CompileOptions,
    key: str,
    record: dict[str, Any],
    plan: object,
    compiled: tuple[CompiledGraph | None, CompiledGraph | None] = (None, None),
    shape_guards: dict[str, Any] | None = None,
) -> bool:
    """Write the entry; False (logged) when some value has no plain encoding or the directory
    cannot be written. `record` maps CompiledRecord field names to values; `compiled` are the
    forward and backward graphs' Triton lowerings (None: run as ATen calls); `shape_guards`: a
    symbolic compilation's guards (already plain JSON, see aotc/symkey.py)."""
    assert options.cache_dir is not None
    graphs: list[dict[str, Any]] = []
    ids: dict[int, int] = {}
    record = dict(record)
    kernels = record.pop("kernels", ())
    record.pop("fusion_text", None)  # regenerated with the kernels
    try:
        body = {
            "record": store.encode(record, graphs, ids, symbols_as_text=True),
            "plan": store.encode(plan, graphs, ids),
            "graphs": graphs,
            "kernels": [{"name": k.name, "source": k.source} for k in kernels],
            "lowered": [c is not None for c in compiled],
        }
        if shape_guards is not None:
            body["shape_guards"] = shape_guards
    except store.Uncachable as e:
        log.info("not caching: %s", e)
        return False
    # The decomposed graphs spare a hit the decomposition (a retrace, and on first use building
    # torch's decomposition table: most of the kernel stage); optional, as they may hold values
    # without a plain encoding.
    count, known = len(graphs), dict(ids)
    try:
        body["decomposed"] = [
            store.encode(c.decomposed, graphs, ids)
            if c is not None and c.decomposed is not None
            else None
            for c in compiled
        ]
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
    "CacheKey",
    "FakeRunObserver",
    "cache_key",
    "is_enabled",
    "load_entry",
    "lookup",
    "regenerate_kernels",
    "store_entry",
    "store_verified",
]
