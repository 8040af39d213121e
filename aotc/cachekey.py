"""Persistent compile cache, the key: what one signature's entry is stored under.

Stage: `cache_key(program, leaves, names, options, grad_enabled) -> CacheKey`;
`verify_key(key, program, leaves, grad_enabled) -> str | None` (whether a meta key may be
stored under). The store (reading and writing entries) is aotc/persist.py.
Requires: the same `program` and `leaves` that `aotc.pipeline._compile_signature` compiles.
Ensures: equal keys only for programs that compile to the same graphs (see Note [Cache key]);
`CacheKey.key` is None, with a reason, when the program cannot be keyed safely (it is then
compiled as usual and not stored). The key covers `backend` and `triton_interpret` with the
other options, so an entry of one backend never serves another.

Note [Cache key]);
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

Note [Keys of programs never stored]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The key trace serves lookups, and most cold compiles are of programs nothing was ever stored
for: their key trace (3-19 ms on bench/compile_time.py's workloads, 5-10% of the cold compile)
bought only a miss. So a lookup first asks something cheaper. The key hashes its trace together
with *parts* computed without running the program (aotc's and torch's versions, the options, the
input signature); their digest is the key's *family*, a function of the key's own inputs, so two
programs with equal keys have equal families. Every store of an entry (or a redirect) marks its
family in the cache directory (`<dir>/families/<family>`, an empty file; in this process at once,
before the deferred store writes it). A lookup whose family is unmarked cannot hit: it skips the
key trace and returns a *deferred* meta key. The compile then writes the key from its own
metadata pass's fake run (the FakeRunObserver of Note [Verifying on the compile's own run] in
aotc/keytrace.py), which it makes anyway: `settled` hashes that fake text under the meta tracer's
name, and the entry is stored there.

Why storing under a meta key written from a fake text is sound: Note [Meta key trace]'s induction
uses only that the stored text T is a fake-tensor text of the compiled program P, and that a later
program P' writes T under the meta tracer; it never reads P's own meta text. What the verification
of a traced meta key adds is usefulness, not soundness: a meta key whose program writes another
meta text would never be found by that program. Here that costs one compile more: the next lookup
finds the family marked, traces, misses, compiles, and verification sends it to the fake key with a
redirect, as before (tests/runtime/test_keytrace.py checks this sequence). Only meta keys are
deferred (a fake key needs no verification, but the observer is trusted only where the meta
tracer runs), only for real leaves (a Dynamo graph's fakes are keyed by their graph text or a
fake trace), and never for symbolic compilations. A compile whose fake run could not be written
(the observer saw no plain fake run) runs the skipped key trace after compiling; one whose fake
text the key cannot hold (a custom Function, a hook) is not stored, as a traced key would not
have been. Families are never unmarked: an evicted entry only makes later lookups trace again.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from aotc import graphkey, keytrace
from aotc.functional import FlatProgram
from aotc.options import CompileOptions
from aotc.runtime import cache as store
from aotc.symkey import ShapeFacts

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
log = logging.getLogger("aotc.cache")


@dataclass(frozen=True, slots=True)
class CacheKey:
    key: str | None  # hex digest, or None when the program cannot be keyed safely
    reason: str  # why not, when key is None
    tracer: str = ""  # "meta" or "fake" (see Note [Meta key trace] in aotc/keytrace.py)
    trace: str = ""  # the key trace's text
    # What the key hashes besides the trace (versions, options, the input signature), and
    # their digest, the key's *family* (Note [Keys of programs never stored]).
    parts: tuple[str, ...] = ()
    family: str = ""
    # The key trace was skipped: no entry of this family is stored, so the key is written
    # from the compile's own fake run (`settled`) once the compile has run.
    deferred: bool = False


def cache_key(
    program: FlatProgram,
    leaves: list[object],
    names: Sequence[str],
    options: CompileOptions,
    grad_enabled: bool,
    tracers: Sequence[str] | None = None,
    facts: ShapeFacts | None = None,
    graph: fx.GraphModule | None = None,
    stored: Callable[[str], bool] | None = None,
) -> CacheKey:
    """See Note [Cache key]. `tracers`: which key tracers to try, in order (default: meta, then
    fake, or fake alone for inputs the meta tracer does not model). `facts`: the symbols of a
    symbolic compilation's inputs (Note [Symbolic cache entries] in aotc/symkey.py); the key then
    also covers what the ShapeEnv knows about them, and only the fake tracer runs. `graph`: the
    Dynamo graph `program` runs, keyed by its text when it can be (Note [Graph key] in
    aotc/graphkey.py; tracer "graph", which needs no verification). `stored(family)`: whether
    an entry of that family may be stored; when it says no, a meta key is deferred instead of
    traced (Note [Keys of programs never stored]; only for real leaves, whose compile runs the
    fake run that settles it)."""
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
    if graph is not None and facts is None and tracers is None:
        try:
            return _digest(parts, "graph", graphkey.graph_text(graph))
        except _Unkeyable:
            pass  # a node the graph text cannot pin down: the key trace decides
        except Exception as e:  # noqa: BLE001 a bug in the graph text must not fail the compile
            log.warning("graph key failed (%s: %s); keying by trace", type(e).__name__, e)
    if facts is not None:
        tracers = ("fake",)
    elif tracers is None:
        tracers = ("meta", "fake") if keytrace.meta_eligible(leaves) else ("fake",)
    family = _family(parts)
    if stored is not None and tracers[0] == "meta" and not stored(family):
        return CacheKey(None, "deferred", "meta", "", tuple(parts), family, deferred=True)
    reason = "no key tracer"
    for tracer in tracers:
        try:
            trace = keytrace.trace_text(program, leaves, grad_enabled, tracer, facts)
            break
        except _Unkeyable as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 the key trace failed: the full compile reports it
            from aotc.recording import SideEffectsRefused

            if isinstance(e, SideEffectsRefused):
                raise  # the full compile would only make the changes again, then refuse them
            reason = f"key trace failed ({type(e).__name__})"
    else:
        return CacheKey(None, reason)
    return _digest(parts, tracer, trace)


def _digest(parts: Sequence[str], tracer: str, trace: str) -> CacheKey:
    text = "\n".join([*parts, f"tracer {tracer}", trace])
    if " at 0x" in text:
        return CacheKey(None, "a value prints with its memory address")
    digest = hashlib.sha256(text.encode()).hexdigest()
    return CacheKey(digest, "", tracer, trace, tuple(parts), _family(parts))


def _family(parts: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def settled(key: CacheKey, fake_text: str) -> CacheKey:
    """The meta key of a deferred `key`, written from the compile's own fake run's text (Note
    [Keys of programs never stored])."""
    assert key.deferred
    return _digest(key.parts, "meta", fake_text)


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
    """aotc (version and a digest of its sources), torch, triton, Python, entry format. The
    sources are digested by path, size and modification time (nanoseconds), not content: a
    stat per file instead of reading ~700 kB on every process's first key (an edit or a
    reinstall changes the time; identical sources at another time only cost a miss)."""
    if not _VERSIONS:
        digest = hashlib.sha256()
        for package in ("aotc", "aotc.passes", "aotc.runtime"):
            folder = os.path.dirname(os.path.abspath(sys.modules[package].__file__ or ""))
            with os.scandir(folder) as it:
                files = sorted((e.name, e.stat()) for e in it if e.name.endswith(".py"))
            for name, st in files:
                digest.update(f"{package}/{name} {st.st_size} {st.st_mtime_ns}\n".encode())
        triton = _triton_install()
        from aotc import __version__

        _VERSIONS.append(
            f"aotc {__version__} {digest.hexdigest()} torch {torch.__version__} triton {triton} "
            f"python {sys.version_info[:3]} format {store.FORMAT_VERSION}"
        )
    return _VERSIONS[0]


def _triton_install() -> str:
    """Which Triton is installed, without importing it: its package's path, size and
    modification time (reading the distribution's metadata cost ~4 ms of every process's first
    key, most of a small program's warm start; a reinstall changes the time as an upgrade
    changes the version). The same whether or not the process has imported triton yet."""
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return "none"
    try:
        st = os.stat(spec.origin)
    except OSError:
        return "none"
    return f"{spec.origin} {st.st_size} {st.st_mtime_ns}"


def _options_text(options: CompileOptions) -> str:
    return "options " + " ".join(
        f"{f.name}={_option_text(getattr(options, f.name))}"
        for f in fields(options)
        if f.name not in _NOT_IN_KEY
    )


def _option_text(value: object) -> str:
    """An option's value as key text. Enums by class name and value, never by repr (a changed
    enum repr, e.g. a member renamed with the same value, must not change the key)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}:{value.value!r}"
    return repr(value)


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


__all__ = ["CacheKey", "FakeRunObserver", "cache_key", "settled", "verify_key"]
