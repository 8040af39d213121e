"""Compile generated kernels for CUDA targets on any machine, and read their resource usage.

`launch_signatures(kernel)` lists the launches a CUDA device may make of a kernel (each pointer's
element type, the size arguments as passed, every block configuration the autotuner may pick);
`compile_kernels(kernels, targets)` compiles each one for sm_90 (H100/H200) and sm_80 (A100)
through Triton's whole pipeline, down to a cubin, without a GPU, and returns a `CompileResult`
per (kernel, target, launch): the error, or the registers per thread, spills, shared memory,
warps, stages and the occupancy they allow, with flags for spills and low occupancy.

Requires: triton (its compiler and the `ptxas` its wheel ships). Compiles run in worker
processes (`runtime/cuda_worker.py`, see its docstring): they see real compiler functions even
when this process runs Triton's interpreter, and they compile in parallel. Results are kept per
process and, given a directory, on disk, keyed by (source, launch, target, triton version).

# Note [Launch signatures]
Triton compiles one binary per *specialization* of the arguments a launch passes: a tensor
becomes a pointer to its element type, with a divisibility-by-16 attribute when its address is
16-byte aligned; an int becomes i32 if it fits, else i64, with a divisibility attribute when a
multiple of 16, and the constant 1 when it is 1 (unless the parameter is `do_not_specialize`);
constexprs are baked in. `runtime.kernels.launch` passes the kernel's buffers, then `xnumel`,
`rnumel` (`ynumel` when tiled) and the size symbols, then the block sizes of the chosen
configuration as constexprs, with `num_warps`. So a static kernel is compiled with its own
sizes, once per configuration `cuda_configs` lists, with aligned pointers (what fresh buffers
and contiguous inputs have), plus once with unaligned pointers (an input that is a view at an
odd offset). A kernel with symbolic sizes does not specialize its sizes: it is compiled with
sizes below 2**31 (i32) and above (i64). The worker lets Triton's own binder turn these
arguments into the signature, so the check follows Triton's rules, not a copy of them.
Heuristic (compile time of the test suite's check, ~0.25 s per compile): the unaligned and the
i64 variants are compiled with the default configuration, for sm_90 only; they change the
signature's attributes and integer widths, not the block shapes the configurations vary.
"""

from __future__ import annotations

import atexit
import enum
import hashlib
import itertools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from aotc.runtime.kernels import KernelSource, cuda_configs

log = logging.getLogger("aotc.kernels")


class Target(enum.Enum):
    """A CUDA architecture kernels are checked for."""

    SM90 = "sm_90"  # Hopper: H100, H200
    SM80 = "sm_80"  # Ampere: A100

    @property
    def capability(self) -> int:
        return int(self.value.removeprefix("sm_"))

    @property
    def limits(self) -> SmLimits:
        return _LIMITS[self]


DEFAULT_TARGETS = (Target.SM90, Target.SM80)


@dataclass(frozen=True)
class SmLimits:
    """Per-SM resources of a target (CUDA C Programming Guide, "Compute capabilities")."""

    registers: int  # 32-bit registers per SM
    register_unit: int  # registers are allocated per warp in units of this many
    max_warps: int  # resident warps per SM
    max_blocks: int  # resident blocks per SM
    shared: int  # shared memory per SM, bytes
    shared_per_block: int  # the most one block may use (opt-in), bytes
    shared_reserved: int  # bytes the system reserves per block


_LIMITS = {
    Target.SM90: SmLimits(65536, 256, 64, 32, 228 * 1024, 227 * 1024, 1024),
    Target.SM80: SmLimits(65536, 256, 64, 32, 164 * 1024, 163 * 1024, 1024),
}

# Heuristic: memory-bound kernels (all of ours) hide DRAM latency with warps in flight; below
# half the SM's warps, a kernel whose grid fills the GPU leaves bandwidth unused. A threshold
# from the usual occupancy guidance, not yet measured on a GPU (see docs/status.md).
LOW_OCCUPANCY = 0.5

# torch dtype -> Triton's name of the pointer element type (what its binder derives from a
# tensor; tests/runtime/test_cuda_check.py checks this against the binder).
_POINTER_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "u1",
}

_I32_SIZE, _I64_SIZE = 4099, 2**31 + 3  # representatives of symbolic sizes (Note above)


@dataclass(frozen=True)
class LaunchSignature:
    """One launch of a kernel on CUDA, as Triton's binder will see it (Note [Launch
    signatures])."""

    pointers: tuple[str, ...]  # len == len(kernel.inputs) + len(kernel.outputs)
    aligned: bool  # pointers 16-byte aligned
    sizes: tuple[int, ...]  # xnumel, rnumel (or ynumel), then the kernel's size symbols
    config: tuple[int, int, int]  # XBLOCK, RBLOCK or YBLOCK, num_warps

    def describe(self) -> str:
        xb, second, warps = self.config
        width = "i64" if any(s >= 2**31 for s in self.sizes) else "i32"
        return f"block {xb}x{second}, {warps} warps, sizes {width}" + (
            "" if self.aligned else ", unaligned pointers"
        )


@dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel uses per thread and per block, and what that allows per SM."""

    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # stack frame bytes per thread
    shared: int  # bytes per block
    num_warps: int
    num_stages: int
    occupancy: float  # resident warps / the SM's maximum, in [0, 1]
    limiter: str  # what bounds the resident blocks: "registers", "shared memory", "warps", ...

    @property
    def flags(self) -> tuple[str, ...]:
        out = []
        if self.spill_stores or self.spill_loads:
            out.append(f"SPILLS {self.spill_stores} B stored, {self.spill_loads} B loaded")
        if self.occupancy < LOW_OCCUPANCY:
            out.append(f"LOW OCCUPANCY {self.occupancy:.0%} (limited by {self.limiter})")
        return tuple(out)

    def format(self) -> str:
        text = (
            f"{self.registers} regs, {self.spill_stores + self.spill_loads} B spilled, "
            f"{self.shared} B shared, {self.num_warps} warps, {self.num_stages} stages, "
            f"occupancy {self.occupancy:.0%} ({self.limiter})"
        )
        return text + "".join(f"  [{f}]" for f in self.flags)


@dataclass(frozen=True)
class CompileResult:
    kernel: str  # the kernel's name
    key: str  # KernelSource.key
    target: Target
    launch: LaunchSignature
    signature: str  # the signature Triton compiled (names, types, constexprs, attributes)
    resources: KernelResources | None  # None when it failed
    error: str | None  # None when it compiled
    cpu_seconds: float = 0.0  # what the compile cost (0: from the cache)

    @property
    def ok(self) -> bool:
        return self.error is None

    def format(self) -> str:
        what = self.resources.format() if self.resources else f"FAILED: {self.error}"
        return f"{self.kernel} {self.target.value} [{self.launch.describe()}]: {what}"


def occupancy(target: Target, registers: int, shared: int, num_warps: int) -> tuple[float, str]:
    """Resident warps per SM over the maximum, and the resource that bounds them."""
    lim = target.limits
    unit = lim.register_unit
    regs_per_warp = -(-registers * 32 // unit) * unit
    bounds = {
        "warps": lim.max_warps // num_warps,
        "blocks": lim.max_blocks,
        "registers": lim.registers // max(regs_per_warp * num_warps, 1),
    }
    if shared:
        bounds["shared memory"] = lim.shared // (shared + lim.shared_reserved)
    limiter = min(bounds, key=lambda k: (bounds[k], k != "warps"))
    blocks = bounds[limiter]
    return min(blocks * num_warps / lim.max_warps, 1.0), limiter


# ---- launches ------------------------------------------------------------------------------


def launch_signatures(
    kernel: KernelSource, target: Target = Target.SM90, every_config: bool = True
) -> tuple[LaunchSignature, ...]:
    """The launches to compile for `kernel` (a CUDA kernel: `CompiledGraph.gpu_kernels`) on
    `target`; see Note [Launch signatures]. Every configuration with aligned pointers and i32
    sizes (for symbolic sizes), on every target; the variants that differ only in pointer
    alignment or size width once per kernel, with the default configuration, on sm_90.
    `every_config=False`: the default launch only (what `aotc explain` and the dump report)."""
    missing = [d for d in kernel.arg_dtypes if d not in _POINTER_TYPES]
    if missing or len(kernel.arg_dtypes) != len(kernel.inputs) + len(kernel.outputs):
        raise ValueError(f"kernel {kernel.name}: no pointer types for its buffers ({missing})")
    pointers = tuple(_POINTER_TYPES[d] for d in kernel.arg_dtypes)
    symbolic = bool(kernel.symbols) or not (
        isinstance(kernel.xnumel, int) and isinstance(kernel.rnumel, int)
    )
    if symbolic:
        sizes = (_I32_SIZE,) * (2 + len(kernel.symbols))
    elif kernel.xnumel == 0 or (kernel.tiled and kernel.rnumel == 0):
        return ()  # never launched (runtime.kernels.launch returns first)
    else:
        sizes = (kernel.xnumel, kernel.rnumel)
    configs = cuda_configs(kernel)
    out = [
        LaunchSignature(pointers, True, sizes, cfg)
        for cfg in configs[: None if every_config else 1]
    ]
    if every_config and target is Target.SM90:
        out.append(LaunchSignature(pointers, False, sizes, configs[0]))
        if symbolic:
            out.append(LaunchSignature(pointers, True, (_I64_SIZE,) * len(sizes), configs[0]))
    return tuple(out)


# ---- compiling -----------------------------------------------------------------------------


def compile_kernels(
    kernels: Iterable[KernelSource],
    targets: Sequence[Target] = DEFAULT_TARGETS,
    *,
    every_config: bool = True,
    cache_dir: str | None = None,
    jobs: int | None = None,
) -> tuple[CompileResult, ...]:
    """Compile each kernel's launches for each target (in parallel, cached); see the module
    docstring. Results are in (kernel, target, launch) order."""
    futures = [
        submit(k, t, launch, cache_dir, jobs)
        for k in kernels
        for t in targets
        for launch in launch_signatures(k, t, every_config)
    ]
    return tuple(f.result() for f in futures)


def submit(
    kernel: KernelSource,
    target: Target,
    launch: LaunchSignature,
    cache_dir: str | None = None,
    jobs: int | None = None,
    background: bool = False,
) -> Future[CompileResult]:
    """Start one compile (or return its cached result) without waiting for it. `background`
    compiles (the test suite's check of every kernel) wait behind all others, so a caller waiting
    for its own compile is not queued behind a backlog."""
    request = {
        "source": kernel.source,
        "name": kernel.name,
        "capability": target.capability,
        "pointers": list(launch.pointers),
        "aligned": launch.aligned,
        "sizes": list(launch.sizes),
        "constexprs": list(launch.config[:2]),
        "num_warps": launch.config[2],
    }
    key = _cache_key(request)
    with _LOCK:
        done = _RESULTS.get(key)
        if done is None and cache_dir is not None:
            done = _read_disk(cache_dir, key)
        if done is not None:
            fut: Future[CompileResult] = Future()
            fut.set_result(_result(kernel, target, launch, {**done, "cpu_seconds": 0.0}))
            return fut
        pending = _PENDING.get(key)
        if pending is None:
            pending = _pool(jobs).submit(request, background)
            _PENDING[key] = pending
            pending.add_done_callback(lambda f: _remember(key, f, cache_dir))
    out: Future[CompileResult] = Future()
    pending.add_done_callback(lambda f: out.set_result(_result(kernel, target, launch, f.result())))
    return out


def _result(
    kernel: KernelSource, target: Target, launch: LaunchSignature, answer: dict[str, Any]
) -> CompileResult:
    cpu = float(answer.get("cpu_seconds", 0.0))
    if not answer["ok"]:
        return CompileResult(
            kernel.name, kernel.key, target, launch, "", None, answer["error"], cpu
        )
    occ, limiter = occupancy(target, answer["registers"], answer["shared"], answer["num_warps"])
    resources = KernelResources(
        registers=answer["registers"],
        spill_stores=answer["spill_stores"],
        spill_loads=answer["spill_loads"],
        stack=answer["stack"],
        shared=answer["shared"],
        num_warps=answer["num_warps"],
        num_stages=answer["num_stages"],
        occupancy=occ,
        limiter=limiter,
    )
    error = None
    if answer["shared"] > target.limits.shared_per_block:
        # Triton compiles it, but the launch fails: "out of resource: shared memory"
        error = (
            f"needs {answer['shared']} B of shared memory per block; {target.value} allows "
            f"{target.limits.shared_per_block} B"
        )
    return CompileResult(
        kernel.name, kernel.key, target, launch, answer["signature"], resources, error, cpu
    )


def _cache_key(request: dict[str, Any]) -> str:
    import triton

    text = json.dumps({**request, "triton": triton.__version__}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


_LOCK = threading.RLock()  # a done future runs its callbacks at once, under the lock
_RESULTS: dict[str, dict[str, Any]] = {}  # cache key -> the worker's answer
_PENDING: dict[str, Future[dict[str, Any]]] = {}


def _remember(key: str, fut: Future[dict[str, Any]], cache_dir: str | None) -> None:
    answer = fut.result()
    with _LOCK:
        _RESULTS[key] = answer
        _PENDING.pop(key, None)
    if cache_dir is not None and "worker" not in answer:  # a crashed worker is not a result
        _write_disk(cache_dir, key, answer)


def _read_disk(cache_dir: str, key: str) -> dict[str, Any] | None:
    path = os.path.join(cache_dir, key[:2], f"{key}.json")
    try:
        with open(path) as f:
            answer: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    _RESULTS[key] = answer
    return answer


def _write_disk(cache_dir: str, key: str, answer: dict[str, Any]) -> None:
    folder = os.path.join(cache_dir, key[:2])
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{key}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(answer, f)
        os.replace(tmp, os.path.join(folder, f"{key}.json"))
    except OSError as e:  # a cache that cannot be written only costs time
        log.info("cuda check: cannot write the result cache under %s: %s", cache_dir, e)


# ---- worker pool ---------------------------------------------------------------------------


class _Pool:
    """Worker processes (runtime/cuda_worker.py), one thread each feeding it requests."""

    def __init__(self, jobs: int, nice: int, cache_dir: str | None = None) -> None:
        self.nice = nice
        self.cache_dir = cache_dir  # the workers' Triton cache: None, a private one
        self.procs: dict[int, subprocess.Popen[str]] = {}  # thread index -> its live worker
        # (priority, order, request, future); priority 2 with no request stops a thread
        self.requests: queue.PriorityQueue[
            tuple[int, int, dict[str, Any] | None, Future[dict[str, Any]] | None]
        ] = queue.PriorityQueue()
        self._order = itertools.count()
        self.threads = [
            threading.Thread(
                target=self._serve, args=(i,), name=f"aotc-cuda-check-{i}", daemon=True
            )
            for i in range(jobs)
        ]
        for t in self.threads:
            t.start()

    def submit(self, request: dict[str, Any], background: bool = False) -> Future[dict[str, Any]]:
        fut: Future[dict[str, Any]] = Future()
        self.requests.put((int(background), next(self._order), request, fut))
        return fut

    def close(self) -> None:
        for _ in self.threads:
            self.requests.put((2, next(self._order), None, None))
        for t in self.threads:
            t.join(timeout=30)

    def renice(self, nice: int) -> None:
        """Run the workers at `nice` from now on (raising their priority back needs privileges;
        without them they keep theirs)."""
        self.nice = nice
        for proc in list(self.procs.values()):
            try:
                os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
            except OSError:
                pass  # not allowed: the workers stay at their priority

    def _serve(self, slot: int) -> None:
        proc: subprocess.Popen[str] | None = None
        try:
            while True:
                _, _, request, fut = self.requests.get()
                if request is None or fut is None:
                    break
                if proc is None or proc.poll() is not None:
                    proc = _start_worker(self.nice, self.cache_dir)
                    self.procs[slot] = proc
                try:
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(json.dumps({**request, "id": 0}) + "\n")
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"the compile worker exited ({proc.wait()})")
                    fut.set_result(json.loads(line))
                except Exception as e:  # noqa: BLE001 - a dead worker fails its request only
                    fut.set_result({"ok": False, "error": f"{type(e).__name__}: {e}", "worker": 1})
                    proc.kill()
                    proc = None
        finally:
            if proc is not None:
                proc.stdin.close()  # type: ignore[union-attr]
                proc.wait(timeout=30)


def _start_worker(nice: int, cache_dir: str | None = None) -> subprocess.Popen[str]:
    # The child compiles for real: no interpreter switch. For the check its Triton cache is
    # private (its results are cached here, and a cache hit would skip the ptxas log the
    # resources come from); a precompile pool (`cache_dir`) shares the parent's.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache_dir is None:
        env["TRITON_CACHE_DIR"] = os.path.join(_worker_dir(), "triton-cache")
        env["TRITON_ALWAYS_COMPILE"] = "1"
    else:
        env["TRITON_CACHE_DIR"] = cache_dir
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_worker.py")
    return subprocess.Popen(
        [sys.executable, script, str(nice)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


_STATE: dict[str, Any] = {}


def _worker_dir() -> str:
    if "dir" not in _STATE:
        import shutil
        import tempfile

        _STATE["dir"] = tempfile.mkdtemp(prefix="aotc_cuda_check_")
        atexit.register(shutil.rmtree, _STATE["dir"], True)
    return str(_STATE["dir"])


def configure(jobs: int | None = None, nice: int = 0) -> None:
    """Worker processes for the compiles from now on (default: one per CPU, at most 4) and the
    niceness they run at (the test suite compiles behind its tests at a lower priority)."""
    shutdown()
    _STATE["config"] = (jobs, nice)


def _pool(jobs: int | None) -> _Pool:
    if "pool" not in _STATE:
        default_jobs, nice = _STATE.get("config", (None, 0))
        n = jobs or default_jobs or max(1, min(4, os.cpu_count() or 1))
        _STATE["pool"] = _Pool(n, nice)
        atexit.register(_STATE["pool"].close)
    pool: _Pool = _STATE["pool"]
    return pool


def renice(nice: int) -> None:
    """Change the priority of the running workers (see `configure`)."""
    _STATE["config"] = (_STATE.get("config", (None, 0))[0], nice)
    pool = _STATE.get("pool")
    if pool is not None:
        pool.renice(nice)


def shutdown() -> None:
    """Stop the worker processes (they also stop when this process exits)."""
    pool = _STATE.pop("pool", None)
    if pool is not None:
        pool.close()


# ---- reports -------------------------------------------------------------------------------


def resources_table(results: Sequence[CompileResult]) -> str:
    """One line per (kernel, target, launch): what `aotc explain`, the dump (09_kernels/) and
    AOTC_LOG=kernels show."""
    header = (
        f"{'kernel':<40} {'target':<6} {'block':>9} {'warps':>5} {'stages':>6} {'regs':>4} "
        f"{'spill st/ld B':>13} {'shared B':>8} {'occupancy':>16}  flags"
    )
    lines = [header]
    for r in results:
        block = f"{r.launch.config[0]}x{r.launch.config[1]}"
        if r.resources is None:
            lines.append(f"{r.kernel:<40} {r.target.value:<6} {block:>9}  FAILED: {r.error}")
            continue
        res = r.resources
        flags = "; ".join([*res.flags, *([r.error] if r.error else [])])
        lines.append(
            f"{r.kernel:<40} {r.target.value:<6} {block:>9} {res.num_warps:>5} "
            f"{res.num_stages:>6} {res.registers:>4} "
            f"{f'{res.spill_stores}/{res.spill_loads}':>13} {res.shared:>8} "
            f"{f'{res.occupancy:.0%} ({res.limiter})':>16}  {flags or '-'}"
        )
    return "\n".join(lines)


def describe_resources(
    kernels: Sequence[KernelSource],
    targets: Sequence[Target] = DEFAULT_TARGETS,
    cache_dir: str | None = None,
) -> str:
    """The resource table of `kernels` (CUDA kernels) at their default block configuration,
    compiled for `targets` now (or read from the cache), with a header saying how."""
    try:
        results = compile_kernels(kernels, targets, every_config=False, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - a report, not a compile: say why it is missing
        return f"# kernel resources unavailable: {type(e).__name__}: {e}\n"
    return (
        "# stage: kernel resources\n"
        f"# each kernel compiled for {', '.join(t.value for t in targets)} by Triton's compiler "
        "(no GPU needed), default block configuration;\n# regs per thread, shared memory per "
        f"block; occupancy = resident warps per SM / maximum (flagged below {LOW_OCCUPANCY:.0%})"
        "\n" + resources_table(results) + "\n"
    )
