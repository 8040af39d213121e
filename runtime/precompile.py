"""Compile a CUDA graph's kernels ahead of their first launch, in parallel, into Triton's cache.

`start()` starts a pool of worker processes (runtime/cuda_worker.py); `warm(kernels, device)`
submits one compile per (kernel, launch configuration the autotuner may try) to it and returns
at once. A kernel's first launch (`runtime.kernels.launch`) does not wait: a configuration whose
compile has finished is found by Triton's `JITFunction` in its on-disk cache, one still compiling
is compiled by the launch itself, as without warm compiles, so a cold compile is never slower
than without them for want of a worker (only for want of a core).

Note [Warm compiles]
~~~~~~~~~~~~~~~~~~~~
Triton compiles a kernel on its first launch with each configuration, one at a time, holding
the GIL (TTIR to cubin, ~0.1-0.3 s each), and builds a C launcher stub for each new signature
(a C compile); a GPT block has 17 kernels, most with three configurations, most of a cold
compile on a GPU (measured on an H200, bench/results/gpu_variants.json: first launches 7.9 s of
a 10.9 s cold compile; 2.4 s for Inductor's whole compile, which compiles in a process pool).
Measured there too: waiting for the workers instead cut that to 8.6 s for the GPT block but
took the MLP (6 kernels) from 4.5 to 7.2 s, the workers' start-up (~5 s) dominating; hence
`start` as soon as a CUDA graph is lowered, and launches that never wait.

The worker runs the steps `JITFunction.run` runs up to the compile (Triton's binder on stand-ins of the launch's arguments: aligned
pointers of each buffer's element type, the static sizes, the block sizes as constexprs, the
warps; see Note [Launch signatures] in runtime/cuda_check.py), so its `triton.compile` has the
cache key the launch will compute, and writes to the same cache directory (the parent's
`TRITON_CACHE_DIR`, or Triton's default). Nothing here can change a result: a compile that
fails, or lands under another key, only means the launch compiles as it would have anyway.
Kernels with symbolic sizes are not warmed (their launches do not specialize sizes, and a
stand-in size could pick another integer width).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import torch

from aotc.runtime.cuda_check import _POINTER_TYPES, _Pool
from aotc.runtime.kernels import WARMING, KernelSource, cuda_configs

log = logging.getLogger("aotc.kernels")

_STATE: dict[str, Any] = {}
_LOCK = threading.Lock()  # one pool, however many threads compile at once


def triton_cache_dir() -> str:
    """Where this process's Triton keeps compiled kernels."""
    from triton import knobs

    return str(knobs.cache.dir)


def _pool() -> _Pool:
    with _LOCK:
        return _pool_locked()


def _pool_locked() -> _Pool:
    pool = _STATE.get("pool")
    if pool is None:
        # Heuristic: one worker per core but one (the caller keeps compiling), at most 16.
        jobs = max(1, min(16, (os.cpu_count() or 2) - 1))
        pool = _Pool(jobs, 0, cache_dir=triton_cache_dir())
        _STATE["pool"] = pool
        import atexit

        atexit.register(pool.close)
    return pool


def start() -> None:
    """Start the worker processes now (each imports Triton, ~1-5 s on a loaded machine), so
    they are ready when the first kernels are generated; a no-op once started."""
    with _LOCK:
        if "pool" in _STATE:
            return
        pool = _pool_locked()
    for _ in pool.threads:
        pool.submit({"ping": True})


def warm(kernels: Iterable[KernelSource], device: str | torch.device) -> int:
    """Start compiling every configuration of each static-size CUDA kernel in `kernels` for
    `device`'s architecture; returns how many compiles were submitted."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(dev)
    submitted = 0
    for kernel in kernels:
        if (
            kernel.symbols
            or not isinstance(kernel.xnumel, int)
            or not isinstance(kernel.rnumel, int)
        ):
            continue
        if kernel.xnumel == 0 or (kernel.tiled and kernel.rnumel == 0):
            continue
        if any(d not in _POINTER_TYPES for d in kernel.arg_dtypes):
            continue
        for config in cuda_configs(kernel):
            key = (kernel.key, str(dev), config)
            if key in WARMING:
                continue
            WARMING[key] = _pool().submit(warm_request(kernel, major * 10 + minor, config))
            submitted += 1
    return submitted


def finished(futures: Iterable[Future[dict[str, Any]]]) -> bool:
    """Have all of these warm compiles finished (so their launches will find them cached)?"""
    return all(f.done() for f in futures)


def warm_request(
    kernel: KernelSource, capability: int, config: tuple[int, int, int]
) -> dict[str, Any]:
    """The worker request compiling `kernel`'s launch with `config` (XBLOCK, RBLOCK or YBLOCK,
    warps) at its static sizes with aligned pointers, for compute capability `capability`."""
    return {
        "source": kernel.source,
        "name": kernel.name,
        "capability": capability,
        "pointers": [_POINTER_TYPES[d] for d in kernel.arg_dtypes],
        "aligned": True,
        "sizes": [kernel.xnumel, kernel.rnumel],
        "constexprs": list(config[:2]),
        "num_warps": config[2],
        "warm": True,
    }


def wait(futures: Iterable[Future[dict[str, Any]]], timeout: float = 60.0) -> float:
    """(Launches never call this; tests and benchmarks do.) Block until these warm compiles finish, at most `timeout` seconds in all (failures and
    stragglers are ignored: the launch compiles); returns the seconds waited."""
    start = time.perf_counter()
    for fut in futures:
        try:
            answer = fut.result(timeout=max(0.0, timeout - (time.perf_counter() - start)))
        except Exception as e:  # noqa: BLE001 - see the module docstring
            log.info("warm compile did not finish: %s", e)
            continue
        if not answer.get("ok", False):
            log.info("warm compile failed: %s", str(answer.get("error", ""))[:300])
    return time.perf_counter() - start


def shutdown() -> None:
    """Stop the worker processes (they also stop when this process exits)."""
    pool = _STATE.pop("pool", None)
    if pool is not None:
        pool.close()
