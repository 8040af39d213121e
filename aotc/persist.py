"""Persistent compile cache, the store: one signature's `CacheEntry` written and read.

Records: `Inspection` (the compiler's records only `aotc.inspect` reads), `CacheEntry` (what an
entry holds: the `CompiledProgram` that runs, the same record an exported artifact holds, and
its inspection record), `CacheHit` (a decoded entry: the program, its inspection decoded on
first read, the stored kernel texts, a symbolic entry's shape guards).
Stage: `find(program, leaves, names, options, grad_enabled) -> (CacheKey, StoredEntry | None)`;
`decode_hit(stored, options) -> CacheHit | None`; `store_verified(key, ..., entry, kernels)`.
Requires: keys from aotc/cachekey.py (Note [Cache key] there); `CacheEntry` records whose
values the plain codec encodes (runtime/codec.py).
Ensures: a hit decodes to the typed records a cold compile builds, and the driver assembles
both the same way (`runtime.artifact.assemble`, Note [One compiled program]); an entry that does
not decode is ignored with a warning and rebuilt. The file format is in runtime/cache.py.

Note [Cache entries and artifacts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Issue #15 asks for one compiled record that the driver produces, the cache stores and export
writes, with one codec. That record is `runtime.artifact.CompiledProgram`: the runtime plan
(calling convention, epilogue plan, autograd plan, output structure), the forward and backward
ATen graphs and their Triton lowerings as step programs (kernel launches by file and launch
spec). The two containers add only what their own lookup needs, each a frozen record in the same
codec:
- an exported `CompiledArtifact` adds how a *caller* binds to the program (argument tree spec,
  lifted module state by name, training flags, the signature guard, device), because `aotc.load`
  has no compiler to derive them;
- a `CacheEntry` adds the compiler's `Inspection` record (so a hit shows the same
  `aotc.inspect` records) and the cold stage times. Its binding is the cache key itself (Note
  [Cache key] in aotc/cachekey.py, Note [Graph key] in aotc/graphkey.py): the key covers the
  input signature, and the driver that looked it up already holds the caller's leaves, guard and
  names, exactly as for a cold compile. Storing an artifact's binding fields in the cache would
  duplicate the key (and has no meaning for a Dynamo graph, whose binding is Dynamo's guards).
Both are written by `codec.encode` and read by `codec.decode` against the same registered
records, graphs by runtime/fxcodec.py with the same op allowlist, and both become a callable
through `runtime.artifact.assemble`. The one deliberate difference is where Triton kernels come
from: an artifact ships kernel modules that `load` imports (trust it as a pickle); a cache hit
runs the stored kernels only if this user's aotc signed the entry, and otherwise regenerates them
from the stored decomposed graphs (Note [Trusted entries] in runtime/cache.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from aotc import keytrace
from aotc.cachekey import CacheKey, _key_of, cache_key, settled, verify_key
from aotc.functional import FlatProgram
from aotc.options import CompileOptions
from aotc.passes import descriptors
from aotc.passes.ir import JointGraph, StageGraph
from aotc.passes.partition import PartitionResult, Recomputation, RecomputeReason, SavedValue
from aotc.passes.recompute import CostKind, Executor, RecomputeCost
from aotc.runtime import cache as store
from aotc.runtime import codec, fxcodec, launch, records
from aotc.runtime.artifact import CompiledProgram
from aotc.runtime.errors import CacheError
from aotc.runtime.kernels import KernelFigures, KernelSource
from aotc.runtime.lazy import Deferred, GraphTable
from aotc.runtime.schema import MutationAliasInfo
from aotc.symkey import ShapeFacts

log = logging.getLogger("aotc.cache")
FakeRunObserver = keytrace.FakeRunObserver


@dataclass(frozen=True, slots=True)
class Inspection:
    """What a compile derived that only inspection reads (the joint graphs, the partition
    report): stored with the program, decoded on first read on a hit."""

    training: bool
    meta: MutationAliasInfo
    partition: PartitionResult | None
    joint_graph: JointGraph  # as traced
    partitioned_joint: JointGraph  # after cleanup, as the partition saw it


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One stored signature."""

    program: CompiledProgram
    inspection: Inspection
    stage_seconds: tuple[tuple[str, float], ...]  # the cold compile's stage times


@dataclass(frozen=True, slots=True)
class StoredLowering:
    """One graph's Triton lowering as the cold compile generated it: its kernels (with their
    GPU twins), the fusion plan's text and the kernel figures. A trusted hit runs these instead
    of generating them again (Note [Trusted entries] in runtime/cache.py)."""

    kernels: tuple[KernelSource, ...]
    fusion_text: str
    figures: KernelFigures | None


codec.register_records(  # the runtime registers its own records (runtime/records.py)
    StoredLowering,
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
    Inspection,
    CacheEntry,
)
assert records.RUNTIME_RECORDS  # imported for its registrations


@dataclass(frozen=True, slots=True)
class KernelText:
    """A stored kernel's name and source: compared with the kernels a hit generates, never
    run (see Note [Cache entry format] in runtime/cache.py)."""

    name: str
    source: str


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """A verified entry body, not yet decoded; `trusted`: this user's aotc wrote it (Note
    [Trusted entries] in runtime/cache.py)."""

    key: str
    body: dict[str, Any]
    trusted: bool = False


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A decoded entry."""

    program: CompiledProgram
    inspection: Deferred[Inspection]
    kernels: tuple[KernelText, ...]
    shape_guards: dict[str, Any] | None  # checked by ShapeFacts.replay
    stage_seconds: tuple[tuple[str, float], ...]  # the cold compile's stage times
    # forward, backward: the stored lowerings of a trusted entry; None: generate them again
    lowerings: tuple[StoredLowering | None, StoredLowering | None] | None = None


def is_enabled(options: CompileOptions) -> bool:
    return bool(options.cache and options.cache_dir)


def find(
    program: FlatProgram,
    leaves: list[object],
    names: Sequence[str],
    options: CompileOptions,
    grad_enabled: bool,
    facts: ShapeFacts | None = None,
    graph: fx.GraphModule | None = None,
    defer: bool = False,
) -> tuple[CacheKey, StoredEntry | None]:
    """The key of this signature and its verified entry, if stored. A meta key whose entry is a
    redirect (its program's meta and fake texts differed, see `store_verified`) is keyed again
    with the fake tracer. `defer`: the compile observes its own fake run, so a key of a family
    never stored here is deferred, not traced (Note [Keys of programs never stored])."""
    was_stored = (lambda family: _family_stored(options, family)) if defer else None
    key = cache_key(
        program, leaves, names, options, grad_enabled, facts=facts, graph=graph, stored=was_stored
    )
    stored = _read(options, key.key) if key.key is not None else None
    if stored is not None and stored.body == _REDIRECT:
        key = cache_key(program, leaves, names, options, grad_enabled, tracers=("fake",))
        stored = _read(options, key.key) if key.key is not None else None
        if stored is not None and stored.body == _REDIRECT:
            stored = None
    return key, stored


# (cache directory, key family) pairs this process stored or found marked: see Note [Keys of
# programs never stored] in aotc/cachekey.py. A queued store's family counts at once.
_FAMILIES: set[tuple[str, str]] = set()


def _family_stored(options: CompileOptions, family: str) -> bool:
    assert options.cache_dir is not None
    if (options.cache_dir, family) in _FAMILIES:
        return True
    if store.has_family(options.cache_dir, family):
        _FAMILIES.add((options.cache_dir, family))
        return True
    return False


def _mark_family(options: CompileOptions, family: str) -> Callable[[], None]:
    """Count `family` as stored in this process now; the returned job marks it on disk (run by
    the deferred store, before the entry is written)."""
    assert options.cache_dir is not None
    directory = options.cache_dir
    _FAMILIES.add((directory, family))
    return lambda: store.mark_family(directory, family)


def _settle(
    key: CacheKey,
    observed: keytrace.FakeRunObserver | None,
    program: FlatProgram,
    leaves: list[object],
    names: Sequence[str],
    options: CompileOptions,
    grad_enabled: bool,
) -> CacheKey:
    """The key a deferred `key` stands for (Note [Keys of programs never stored])."""
    if observed is not None and observed.text is not None:
        return settled(key, observed.text)
    if observed is not None and observed.ran and observed.unkeyable:
        return CacheKey(None, observed.reason)
    return cache_key(program, leaves, names, options, grad_enabled)  # the skipped key trace


def _read(options: CompileOptions, key: str) -> StoredEntry | None:
    assert options.cache_dir is not None
    flush(key)  # Note [Deferred cache stores]
    read = store.read_trusted(options.cache_dir, key)
    return StoredEntry(key, read[0], read[1]) if read is not None else None


def decode_hit(stored: StoredEntry, options: CompileOptions) -> CacheHit | None:
    """The records of a verified entry, or None (warned: the entry is rebuilt)."""
    assert options.cache_dir is not None
    body = stored.body
    try:
        encoded = body.get("entry")
        if not isinstance(encoded, dict) or encoded.get("R") != _ENTRY_NAME:
            raise CacheError("bad entry record")
        fields = encoded.get("f")
        if not isinstance(fields, dict):
            raise CacheError("bad entry record")
        # Graphs that the cold compile lowered to Triton are lowered again on this hit, which
        # reads node values on their real devices (storage-less ValueTensors); the others get
        # meta values.
        lowering = _lowered_graph_ids(fields.get("program"))
        graphs = GraphTable(
            codec._list(body.get("graphs")),
            lambda i, g: fxcodec.decode_graph(g, on_device=i in lowering),
        )
        program = codec.decode(fields.get("program"), graphs)
        if not isinstance(program, CompiledProgram):
            raise CacheError("bad program record")
        kernels = tuple(
            KernelText(str(k["name"]), str(k["source"])) for k in codec._list(body["kernels"])
        )
        guards = body.get("shape_guards")
        inspection_value = fields.get("inspection")
        inspection = Deferred(
            lambda: _inspection(codec.decode(inspection_value, graphs)),
            f"the inspection record of entry {stored.key[:16]}",
        )
        seconds = tuple((str(k), float(v)) for k, v in codec.decode(fields["stage_seconds"]))
        lowerings = _stored_lowerings(body.get("lowerings")) if stored.trusted else None
        return CacheHit(
            program,
            inspection,
            kernels,
            guards if isinstance(guards, dict) else None,
            seconds,
            lowerings,
        )
    except (CacheError, RecursionError, ValueError, TypeError, KeyError, AttributeError) as e:
        warnings.warn(
            f"aotc cache: ignoring entry {store.entry_path(options.cache_dir, stored.key)}: {e}. "
            "It will be rebuilt.",
            stacklevel=3,
        )
        return None


_ENTRY_NAME = f"{CacheEntry.__module__}.{CacheEntry.__qualname__}"


def _stored_lowerings(
    value: object,
) -> tuple[StoredLowering | None, StoredLowering | None] | None:
    """A trusted entry's stored lowerings, or None (none stored, or not as written)."""
    if value is None:
        return None
    decoded = codec.decode(value)
    if (
        not isinstance(decoded, tuple)
        or len(decoded) != 2
        or not all(x is None or isinstance(x, StoredLowering) for x in decoded)
    ):
        raise CacheError("bad lowerings record")
    return decoded[0], decoded[1]


def _inspection(value: object) -> Inspection:
    if not isinstance(value, Inspection):
        raise CacheError("bad inspection record")
    return value


def _lowered_graph_ids(program: object) -> set[int]:
    """Indices into body["graphs"] of the lowered stage graphs and their decomposed graphs."""
    fields = program.get("f") if isinstance(program, dict) else None
    if not isinstance(fields, dict):
        raise CacheError("bad program record")
    # A segment's backward is lowered like the whole backward (Note [Segments]).
    segments = fields.get("segments")
    records = [fields]
    if isinstance(segments, dict) and isinstance(segments.get("T"), list):
        records += [
            seg["f"]
            for seg in segments["T"]
            if isinstance(seg, dict) and isinstance(seg.get("f"), dict)
        ]
    out = set()
    pairs = (("forward", "forward_kernels"), ("backward", "backward_kernels"))
    for record in records:
        for graph, lowering in pairs:
            lowered = record.get(lowering)
            if not isinstance(lowered, dict):
                continue
            decomposed = lowered.get("f", {}).get("decomposed")
            for ref in (record.get(graph), decomposed):
                if isinstance(ref, dict) and isinstance(ref.get("G"), int):
                    out.add(ref["G"])
    return out


def store_verified(
    key: CacheKey,
    program: FlatProgram,
    leaves: list[object],
    names: Sequence[str],
    options: CompileOptions,
    grad_enabled: bool,
    entry: CacheEntry,
    kernels: Sequence[KernelText],
    observed: keytrace.FakeRunObserver | None = None,
    shape_guards: dict[str, Any] | None = None,
    lowered: tuple[StoredLowering | None, StoredLowering | None] | None = None,
) -> None:
    """Store a cold compile's entry under `key` once `verify_key` accepts it. A meta key it
    refuses gets a redirect instead, and the entry goes under the program's fake key, so the next
    process pays one extra key trace rather than a cold compile. `observed`: the fake text of the
    compile's own fake run, which spares the verification its trace (Note [Verifying on the
    compile's own run] in aotc/keytrace.py). `shape_guards`: what a symbolic compilation added to
    the ShapeEnv (`ShapeFacts.added_guards`), replayed on a hit."""
    if key.deferred:
        key = _settle(key, observed, program, leaves, names, options, grad_enabled)
        if key.key is None:
            log.info("not caching: %s", key.reason)
            return
    assert key.key is not None
    stored_key: str = key.key
    mark = _mark_family(options, key.family)
    if shape_guards is not None:  # a fake-traced key: nothing to verify

        def store_symbolic() -> None:
            mark()
            store_entry(options, stored_key, entry, kernels, shape_guards, lowered)

        _store_later(stored_key, store_symbolic)
        return
    # Deciding where the entry goes may run the user's program (a fake key trace): that stays
    # on this thread. Only encoding and writing are deferred (Note [Deferred cache stores]).
    fake_text = observed.text if observed is not None else None
    refused = verify_key(key, program, leaves, grad_enabled, fake_text)
    if refused is None:

        def store_it() -> None:
            mark()
            store_entry(options, stored_key, entry, kernels, lowered=lowered)

        _store_later(stored_key, store_it)
        return
    log.info("%s: not stored under its meta key: %s", entry.program.plan.name, refused)
    if fake_text is not None:
        fake = _key_of(options, leaves, names, grad_enabled, "fake", fake_text)
    else:
        fake = cache_key(program, leaves, names, options, grad_enabled, tracers=("fake",))
    if fake.key is None:
        log.info("not caching: %s", fake.reason)
        return
    fake_key, meta_key = fake.key, key.key

    def store_and_redirect() -> None:
        mark()
        if store_entry(options, fake_key, entry, kernels, lowered=lowered):
            _write_redirect(options, meta_key)

    _store_later(meta_key, store_and_redirect, also=fake_key)


# Note [Deferred cache stores]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Encoding a cold compile's entry (its graphs, the inspection record) and writing it costs
# ~5-10% of a cold compile and serves only the next process, so it is queued once the compile
# has decided what to store, and the compiled function returns without it. Everything a queued
# store reads is immutable once the compile has assembled it (frozen records, fx graphs nothing
# edits afterwards). When a queued store runs:
# - `_STORE_DELAY` seconds later, on a timer thread (one per batch of stores; a flush that empties
#   the queue cancels the batch's timer, so the next store starts a fresh one). Not at once: a
#   thread that starts encoding right away holds the GIL in 5 ms slices against the first call
#   and backward, and on a loaded machine each hand-over of the GIL waits for the OS scheduler
#   (measured: 20 ms of encoding cost the first call 170-380 ms at load average 6).
# - at a lookup of the same key (`_read`): a second compile of the same program in the same
#   process hits exactly as with a synchronous store; other keys' stores stay queued.
# - at `aotc.cache_flush()` (every queued store, on the caller's thread) and at interpreter exit
#   (an atexit flush), so an entry is on disk when the process ends normally; a process killed
#   before then loses its queued entries (it compiles again next time, nothing is wrong).
# - at once, on the compiling thread, with AOTC_CACHE_SYNC=1.
# One store runs at a time (`_STORE_LOCK`). A failure of a store (a bug, a full disk) is logged
# as a warning and never reaches the user's call. Deciding *where* the entry goes stays on the
# compiling thread: it can run the user's program (the fake key trace of Note [Meta key trace]),
# which must not happen behind the user's back.
_STORE_DELAY = 1.0
_STORE_LOCK = threading.Lock()  # held while a store runs
_QUEUE_LOCK = threading.Lock()  # guards _QUEUED and _TIMER
_QUEUED: dict[str, Callable[[], object]] = {}  # key -> its store, in queueing order
_TIMER: list[threading.Timer] = []
# Stores taken off the queue and not finished yet, on any thread (guarded by _QUEUE_LOCK): a
# flush waits for them, also for one a timer thread took but has not started.
_IN_FLIGHT = [0]
_FINISHED = threading.Condition(_QUEUE_LOCK)


def _store_later(key: str, job: Callable[[], object], also: str | None = None) -> None:
    if os.environ.get("AOTC_CACHE_SYNC", "") == "1":
        _run_store(job)
        return
    with _QUEUE_LOCK:
        _QUEUED[key] = job
        if also is not None:
            _QUEUED[also] = job  # the same job under both keys: run once, see _take
        if not _TIMER:
            timer = threading.Timer(_STORE_DELAY, _on_timer)
            timer.daemon = True  # the atexit flush writes what is queued
            timer.name = "aotc-cache-store"
            _TIMER.append(timer)
            timer.start()


def _on_timer() -> None:
    with _QUEUE_LOCK:
        _TIMER.clear()
    flush()


def _take(key: str | None) -> list[Callable[[], object]]:
    """Remove and return the queued jobs (of `key` only, if given), each once."""
    with _QUEUE_LOCK:
        keys = list(_QUEUED) if key is None else [key] if key in _QUEUED else []
        jobs = {id(_QUEUED[k]): _QUEUED[k] for k in keys}
        for k in [k for k, j in _QUEUED.items() if id(j) in jobs]:
            del _QUEUED[k]
        _IN_FLIGHT[0] += len(jobs)
        if not _QUEUED and _TIMER:
            # Nothing left for the pending timer: cancel it, so the next store starts its own
            # (a store queued later must not wait on an earlier batch's timer).
            _TIMER.pop().cancel()
    return list(jobs.values())


def _run_store(job: Callable[[], object]) -> None:
    try:
        with _STORE_LOCK:
            job()
    except Exception as e:  # noqa: BLE001 see Note [Deferred cache stores]
        log.warning("aotc cache: storing an entry failed (%s: %s); not cached", type(e).__name__, e)


def flush(key: str | None = None) -> None:
    """Run the queued cache stores (of `key` only, if given) on this thread, after any store
    already running; see Note [Deferred cache stores]."""
    jobs = _take(key)
    try:
        for job in jobs:
            _run_store(job)
    finally:
        with _FINISHED:
            _IN_FLIGHT[0] -= len(jobs)
            _FINISHED.notify_all()
            # a store another thread (the timer's) took before us: wait until it has finished
            _FINISHED.wait_for(lambda: _IN_FLIGHT[0] == 0)


def pending() -> int:
    """How many entry stores are queued (for tests; the binding verdicts' store is not one)."""
    with _QUEUE_LOCK:
        return len({id(j) for j in _QUEUED.values() if not getattr(j, "verdicts", False)})


atexit.register(flush)


_REDIRECT: dict[str, Any] = {"redirect": "fake"}


# See Note [Binding verdicts across processes] in runtime/launch.py
_VERDICTS = "aotc-binding-verdicts"
_VERDICTS_READ: set[str] = set()  # cache directories whose verdicts this process loaded
_VERDICTS_STORED: dict[str, int] = {}  # cache directory -> how many verdicts it was given


def _verdicts_path(cache_dir: str) -> str:
    git = (getattr(torch.version, "git_version", None) or "")[:12]
    build = f"{torch.__version__}-{git}-py{sys.version_info[0]}{sys.version_info[1]}"
    return os.path.join(cache_dir, f"binding-verdicts-{build}.signed")


def load_verdicts(options: CompileOptions) -> None:
    """Give the launcher the op-binding verdicts earlier processes stored (once per process)."""
    if not is_enabled(options) or options.cache_dir in _VERDICTS_READ:
        return
    assert options.cache_dir is not None
    _VERDICTS_READ.add(options.cache_dir)
    body = store.read_signed(_verdicts_path(options.cache_dir), _VERDICTS)
    if body is not None:
        launch.known_verdicts(body)
        if len(body) >= launch.known_count():  # the file holds all this process knows
            _VERDICTS_STORED[options.cache_dir] = launch.known_count()


def store_verdicts_later(options: CompileOptions) -> None:
    """Queue the verdicts this process found for the cache directory (merged with what is
    there), like an entry (Note [Deferred cache stores])."""
    if not is_enabled(options):
        return
    assert options.cache_dir is not None
    directory, count = options.cache_dir, launch.known_count()
    if _VERDICTS_STORED.get(directory, 0) >= count:
        return
    _VERDICTS_STORED[directory] = count
    path = _verdicts_path(directory)

    def job() -> None:
        old = store.read_signed(path, _VERDICTS) or {}
        store.write_signed(path, _VERDICTS, {**old, **launch.known()})

    job.verdicts = True  # type: ignore[attr-defined]  # not an entry: see `pending`
    _store_later(path, job)


def _write_redirect(options: CompileOptions, key: str) -> None:
    assert options.cache_dir is not None
    try:
        store.write_entry(options.cache_dir, key, dict(_REDIRECT), options.cache_max_bytes)
    except OSError as e:
        log.info("cannot write a redirect entry: %s", e)


def store_entry(
    options: CompileOptions,
    key: str,
    entry: CacheEntry,
    kernels: Sequence[KernelText] = (),
    shape_guards: dict[str, Any] | None = None,
    lowered: tuple[StoredLowering | None, StoredLowering | None] | None = None,
) -> bool:
    """Write the entry; False (logged) when some value has no plain encoding or the directory
    cannot be written. `kernels`: the generated kernels' texts (checked on a hit); `lowered`:
    the lowerings a trusted hit runs (Note [Trusted entries] in runtime/cache.py);
    `shape_guards`: a symbolic compilation's guards (already plain JSON, see aotc/symkey.py)."""
    assert options.cache_dir is not None
    graphs: list[dict[str, Any]] = []
    ids: dict[int, int] = {}
    try:
        body: dict[str, Any] = {
            # The program runs: a symbolic size in it has no encoding. The inspection record
            # keeps symbolic sizes as text (only printed).
            "entry": {
                "R": _ENTRY_NAME,
                "f": {
                    "program": codec.encode(entry.program, graphs, ids),
                    "inspection": codec.encode(entry.inspection, graphs, ids, True),
                    "stage_seconds": codec.encode(entry.stage_seconds),
                },
            },
            "graphs": graphs,
            "kernels": [{"name": k.name, "source": k.source} for k in kernels],
        }
    except codec.Uncachable as e:
        log.info("not caching: %s", e)
        return False
    if shape_guards is not None:
        body["shape_guards"] = shape_guards
    if lowered is not None and any(lowered):
        try:
            body["lowerings"] = codec.encode(lowered)
        except codec.Uncachable as e:  # a hit then generates the kernels again
            log.info("not storing the lowerings: %s", e)
    try:
        store.write_entry(options.cache_dir, key, body, options.cache_max_bytes)
    except OSError as e:
        warnings.warn(f"aotc cache: cannot write to {options.cache_dir} ({e}).", stacklevel=3)
        return False
    return True


__all__ = [
    "CacheEntry",
    "CacheHit",
    "StoredLowering",
    "Inspection",
    "KernelText",
    "StoredEntry",
    "decode_hit",
    "find",
    "flush",
    "pending",
    "is_enabled",
    "store_entry",
    "store_verified",
]
