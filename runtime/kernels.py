"""Compile, cache, autotune and launch generated Triton kernels; run a lowered graph.

Records: `KernelSource` (one generated kernel), `CompiledGraph` (the ordered steps of one graph:
kernel launches and ATen calls, with a buffer plan). `CompiledGraph.callable` has the calling
convention of `runtime.launch.make_callable`: the graph's placeholders positionally in, the
output tuple out.

Ensures:
- a kernel is compiled once per process per (source hash, device) and reused by every graph
  and signature that generates the same source;
- on CUDA the first launch of a kernel at a shape times a few block configurations and keeps
  the fastest for that shape; the interpreter uses one configuration;
- intermediate buffers of one call share storage when their lifetimes do not overlap (the slots
  are planned at compile time, allocated once per call);
- a kernel that fails to compile or launch is logged on `aotc.kernels` (warning) and its group
  runs as ATen calls from then on; results never depend on which path ran;
- a graph with symbolic sizes (`CompiledGraph.symbols`) reads the symbols' values from each
  call's arguments, evaluates its kernels' `xnumel`/`rnumel`, size arguments, grids and buffer
  sizes from them, and passes the values to the kernels; the same compiled kernels serve every
  size (runtime.symsizes).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from aotc.runtime.symexpr import SizeExpr
from aotc.runtime.symsizes import SymSource, compile_sizes, read_symbols

log = logging.getLogger("aotc.kernels")


@dataclass(frozen=True)
class KernelSource:
    name: str
    source: str  # the Triton module text
    reduction: bool
    inputs: tuple[str, ...]  # buffer names, in parameter order
    outputs: tuple[str, ...]  # buffer names, in parameter order after the inputs
    # int, or a sympy expression over `symbols` (a `runtime.symexpr.SizeExpr` in a stored
    # program), evaluated at launch
    xnumel: Any
    rnumel: Any
    persistent_rblock: int  # RBLOCK of a persistent reduction (-1: at launch); 0 otherwise
    device: str
    bytes_read: Any
    bytes_written: Any
    tiled: bool = False  # 2-D tiled pointwise: xnumel = columns, rnumel = rows
    # a reduction whose loads are contiguous along x, not r (a sum over rows): wide x blocks
    outer: bool = False
    symbols: tuple[str, ...] = ()  # size parameters after xnumel, rnumel (symbolic sizes)
    # len == len(inputs) + len(outputs): the element type of each pointer parameter, in order
    arg_dtypes: tuple[torch.dtype, ...] = ()
    # A CPU kernel (run by Triton's interpreter): the same group's kernel generated for CUDA,
    # the one a GPU would run (the two differ in places, see passes.codegen). None otherwise.
    cuda: KernelSource | None = None

    @property
    def for_cuda(self) -> KernelSource:
        """This kernel as a GPU runs it."""
        return self.cuda if self.cuda is not None else self

    @cached_property
    def key(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    def format(self) -> str:
        return self.source


@dataclass(frozen=True)
class BufferSpec:
    name: str
    size: tuple[Any, ...]  # ints, or sympy expressions (stored: SizeExprs) over the symbols
    stride: tuple[Any, ...]
    dtype: torch.dtype
    device: str
    slot: int | None  # shared storage slot for intermediates; None: a fresh tensor per call


@dataclass(frozen=True)
class KernelStep:
    kernel: KernelSource
    outputs: tuple[BufferSpec, ...]  # len == len(kernel.outputs)
    fallback: Callable[[dict[str, Any]], None]  # computes the outputs with ATen into env
    frees: tuple[str, ...] = ()  # buffers dead after this step
    # The fallback as data (runtime.steps.StepProgram): the decomposed graph's nodes it runs,
    # and those whose values it keeps.
    nodes: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()


@dataclass(frozen=True)
class AtenStep:
    name: str
    run: Callable[[dict[str, Any]], None]
    frees: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()  # as in KernelStep: what `run` runs, as data
    keep: tuple[str, ...] = ()


Step = KernelStep | AtenStep


@dataclass(frozen=True)
class KernelFigures:
    """How much of one graph runs as generated kernels, and the memory traffic they cause
    (static, from the fusion plan; passes.kernel_figures). Byte counts are None when sizes are
    symbolic."""

    eligible_ops: int  # pointwise/reduction/indexing/scan nodes of the decomposed graph
    kernel_ops: int  # how many of them run inside generated kernels
    fallback_ops: tuple[tuple[str, int], ...]  # (ATen op, count) of the others, sorted
    kernel_bytes: int | None  # read + written by the generated kernels
    aten_bytes: int | None  # read + written by the ATen calls (views: 0)
    min_bytes: int | None  # every graph input read once, every graph output written once
    fusion_min_bytes: int | None  # what kernels must move given the ATen calls (see module)

    @property
    def coverage(self) -> float:
        return self.kernel_ops / self.eligible_ops if self.eligible_ops else 1.0

    def format(self) -> str:
        fallback = ", ".join(f"{op} x{n}" for op, n in self.fallback_ops) or "none"
        text = (
            f"{self.kernel_ops}/{self.eligible_ops} pointwise/reduction ops in generated "
            f"kernels ({self.coverage:.0%}); as ATen calls: {fallback}"
        )
        if self.kernel_bytes is not None and self.min_bytes:
            text += (
                f"; traffic: kernels {self.kernel_bytes} B + ATen {self.aten_bytes} B vs minimum "
                f"{self.min_bytes} B ({(self.kernel_bytes + (self.aten_bytes or 0)) / self.min_bytes:.2f}x)"
            )
        return text


@dataclass(frozen=True)
class CompiledGraph:
    kernels: tuple[KernelSource, ...]  # generated kernels, in execution order
    steps: tuple[Step, ...]
    placeholders: tuple[str, ...]  # len == number of graph inputs
    outputs: tuple[object, ...]  # per graph output: a buffer name or a constant
    num_slots: int
    fusion_text: str = ""  # the fusion plan, printable
    # per placeholder: the strides kernels index it with (None: not a tensor); see run()
    input_strides: tuple[tuple[Any, ...] | None, ...] = field(default=())
    symbols: tuple[SymSource, ...] = ()  # symbolic sizes: where each symbol's value is read
    decomposed: Any = (
        None  # the decomposed fx graph the kernels come from (the disk cache keeps it)
    )
    figures: KernelFigures | None = None
    # names of the decomposed graph's view nodes -> the buffer they read (ATen steps resolve
    # them; runtime.steps)
    aliases: tuple[tuple[str, str], ...] = ()

    @property
    def gpu_kernels(self) -> tuple[KernelSource, ...]:
        """len == len(kernels): the kernels a GPU runs for the same groups."""
        return tuple(k.for_cuda for k in self.kernels)

    @cached_property
    def callable(self) -> Callable[..., tuple[Any, ...]]:
        return _make_runner(self)


# ---- compile and cache -------------------------------------------------------------------

_KERNELS: dict[tuple[str, str], Any] = {}  # (source hash, device) -> jit function
_FAILED: set[tuple[str, str]] = set()
_BEST: dict[tuple[str, str, int, int], tuple[int, int, int]] = {}  # tuned config per shape
# (source hash, device, config) -> its compile in a worker (runtime.precompile, Note [Warm
# compiles]); a first launch with that config finds it in Triton's cache if it has finished
WARMING: dict[tuple[str, str, tuple[int, int, int]], Any] = {}
# first launches on CUDA: seconds in all, how many, and how many configurations had their warm
# compile finished by then (bench/gpu.py reports them)
FIRST_LAUNCH = {"total": 0.0, "launches": 0, "warm": 0}
_DIR: list[str] = []


def load_kernel(kernel: KernelSource) -> Any:
    """The jit function of `kernel`, compiled (imported) once per process: a Triton interpreter
    function for a CPU kernel, a compiler function for a CUDA one, whatever TRITON_INTERPRET
    said when triton was imported (see Note [Interpreter-safe Triton] in passes.codegen)."""
    key = (kernel.key, kernel.device)
    if key in _KERNELS:
        return _KERNELS[key]
    module = kernel_module(kernel.source, kernel.name, kernel.key)
    bind_triton_functions(module, interpret=not kernel.device.startswith("cuda"))
    fn = getattr(module, kernel.name)
    _KERNELS[key] = fn
    return fn


def kernel_module(source: str, name: str, key: str) -> Any:
    """Import a kernel's source text as module `aotc_kernel_<key>` (from a file: Triton reads a
    function's source with `inspect`)."""
    if not _DIR:  # one folder per process, removed when it exits
        _DIR.append(tempfile.mkdtemp(prefix="aotc_kernels_"))
        atexit.register(shutil.rmtree, _DIR[0], True)
    path = os.path.join(_DIR[0], f"{name}_{key}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"aotc_kernel_{key}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bind_triton_functions(module: Any, interpret: bool) -> None:
    """Rebuild every `@triton.jit` function of a kernel module as an interpreter function
    (`interpret`) or a compiler function, keeping its `do_not_specialize` list. `triton.jit`
    picks one of the two from TRITON_INTERPRET when the module runs; the kernel's device must
    decide instead. Helpers are rebuilt too: a kernel calls them through the module globals."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, value in list(vars(module).items()):
        if isinstance(value, JITFunction):
            if interpret:
                keep = list(value.do_not_specialize) or None
                setattr(module, name, InterpretedFunction(value.fn, do_not_specialize=keep))
        elif isinstance(value, InterpretedFunction) and not interpret:
            keep = value.kwargs.get("do_not_specialize")
            setattr(module, name, JITFunction(value.fn, do_not_specialize=keep))


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def candidate_configs(
    kernel: KernelSource, on_cuda: bool, xnumel: int | None = None, rnumel: int | None = None
) -> list[tuple[int, int, int]]:
    """(XBLOCK, RBLOCK or YBLOCK, num_warps) choices; the first is used when not autotuning.
    `xnumel`/`rnumel`: the launch's sizes (default: the kernel's static ones).

    Heuristic (not yet measured on a GPU): block sizes common for memory-bound kernels; every
    candidate costs one Triton compile on the first launch at a shape, so the sets stay small."""
    x = max(kernel.xnumel if xnumel is None else xnumel, 1)
    if kernel.tiled:
        rows = max(kernel.rnumel if rnumel is None else rnumel, 1)
        if not on_cuda:
            return [(min(_next_pow2(x), 64), min(_next_pow2(rows), 64), 4)]
        return [(32, 32, 4), (64, 16, 4), (16, 64, 4)]
    if not kernel.reduction:
        if not on_cuda:
            return [(min(_next_pow2(x), 4096), 1, 4)]
        # Measured on an H200 (bench/gpu_variants.py, a 10-op chain on 2**26 elements): blocks
        # of 512-4096 with 4-16 warps all within 5% (float32 0.75-0.78 of the copy bandwidth,
        # bfloat16 0.35-0.43, 1024x4 the best or near it in both), so one configuration, no
        # autotuning: each candidate is a compile.
        return [(min(1024, max(_next_pow2(x), 128)), 1, 4)]
    if kernel.persistent_rblock:
        r = kernel.persistent_rblock
        if r < 0:  # chosen at launch (symbolic row length; see passes.codegen)
            r = _next_pow2(max(kernel.rnumel if rnumel is None else rnumel, 1))
        cap = max(1, (4096 if on_cuda else 16384) // r)
        first = min(cap, _next_pow2(x))
        # Heuristic: at most three row blocks, so cold compiles stay few (each config is a compile)
        smaller = {first // 2, first // 4} if kernel.outer else {max(1, first // 4), 1}
        xb = [first] + (
            [b for b in sorted(smaller) if b < first and (b >= 16 or not kernel.outer)]
            if on_cuda
            else []
        )
        return [(b, r, _persistent_warps(b * r)) for b in xb]
    if not on_cuda:
        return [(min(8, _next_pow2(x)), 256, 4)]
    if kernel.outer:
        # Heuristic: contiguous runs of 32-128 columns (128-512 bytes of fp32) per row step
        cap = max(_next_pow2(x), 16)
        return [(min(b, cap), rb, w) for b, rb, w in ((64, 8, 4), (32, 32, 4), (128, 8, 8))]
    return [(1, 1024, 8), (4, 256, 4), (8, 128, 4)]


def cuda_configs(kernel: KernelSource) -> list[tuple[int, int, int]]:
    """Every configuration `launch` may use for `kernel` on CUDA, the default first: the
    candidates at its sizes, or for symbolic sizes at every size (the candidates depend on the
    sizes only through their next powers of two, up to the caps below)."""
    if isinstance(kernel.xnumel, int) and isinstance(kernel.rnumel, int) and not kernel.symbols:
        return candidate_configs(kernel, True)
    out: list[tuple[int, int, int]] = []
    for x in (1 << i for i in range(0, 25)):
        for r in (1 << i for i in range(0, 25)):
            for cfg in candidate_configs(kernel, True, x, r):
                if cfg not in out:
                    out.append(cfg)
    return out


# Heuristic: at most 16 elements of a persistent block per thread. Measured with the compile
# check (runtime.cuda_check, sm_90 and sm_80): 64x64 blocks of softmax/LayerNorm kernels use
# 220-255 registers at 2 warps (64 elements per thread; spills, 12% occupancy) and 57 at 8 warps.
PERSISTENT_ELEMENTS_PER_THREAD = 16


def _persistent_warps(elements: int) -> int:
    return min(8, max(2, elements // (32 * PERSISTENT_ELEMENTS_PER_THREAD)))


def launch(
    kernel: KernelSource,
    args: list[torch.Tensor],
    sizes: tuple[int, int, tuple[int, ...]] | None = None,
) -> None:
    """`sizes`: (xnumel, rnumel, size arguments) of a kernel with symbolic sizes, evaluated for
    this call; block sizes and the grid are chosen from them here."""
    fn = _KERNELS.get((kernel.key, kernel.device)) or load_kernel(kernel)
    xnumel, rnumel, extra = sizes if sizes is not None else (kernel.xnumel, kernel.rnumel, ())
    if xnumel == 0 or (kernel.tiled and rnumel == 0):
        return
    shape_key = (kernel.key, kernel.device, xnumel, rnumel)
    best = _BEST.get(shape_key)
    if best is None:
        on_cuda = kernel.device.startswith("cuda")
        configs = candidate_configs(kernel, on_cuda, xnumel, rnumel)
        if on_cuda:  # warm compiles: not waited for (Note [Warm compiles])
            start = time.perf_counter()
            warming = [WARMING.pop((kernel.key, kernel.device, c), None) for c in configs]
            FIRST_LAUNCH["warm"] += sum(1 for f in warming if f is not None and f.done())
        best = (
            _autotune(fn, kernel, args, configs, (xnumel, rnumel, extra))
            if on_cuda and len(configs) > 1
            else configs[0]
        )
        if on_cuda:
            FIRST_LAUNCH["total"] += time.perf_counter() - start
            FIRST_LAUNCH["launches"] += 1
        _BEST[shape_key] = best
    _run(fn, kernel, args, best, xnumel, rnumel, extra)


def _run(
    fn: Any,
    kernel: KernelSource,
    args: list[torch.Tensor],
    config: tuple[int, int, int],
    xnumel: int,
    rnumel: int,
    extra: tuple[int, ...],
) -> None:
    xblock, second, warps = config  # second: RBLOCK, or YBLOCK of a tiled kernel
    tiles = (xnumel + xblock - 1) // xblock
    if kernel.tiled:
        tiles *= (rnumel + second - 1) // second
    if kernel.device.startswith("cuda"):
        fn[(tiles,)](*args, xnumel, rnumel, *extra, xblock, second, num_warps=warps)
        return
    # Triton's interpreter evaluates masked-off lanes too (numpy, on whatever the loads' `other`
    # gave): their NaN/overflow warnings are noise, the stores are masked.
    import numpy as np

    with np.errstate(all="ignore"):
        fn[(tiles,)](*args, xnumel, rnumel, *extra, xblock, second, num_warps=warps)


def _autotune(
    fn: Any,
    kernel: KernelSource,
    args: list[torch.Tensor],
    configs: list[tuple[int, int, int]],
    sizes: tuple[int, int, tuple[int, ...]],
) -> tuple[int, int, int]:
    from triton.testing import do_bench

    timings = []
    for cfg in configs:
        try:
            t = do_bench(lambda cfg=cfg: _run(fn, kernel, args, cfg, *sizes), warmup=2, rep=8)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
            log.info("%s: config %s failed: %s", kernel.name, cfg, e)
            continue
        timings.append((t, cfg))
    if not timings:
        return configs[0]
    return min(timings)[1]


# ---- run a compiled graph ------------------------------------------------------------------


def _make_runner(graph: CompiledGraph) -> Callable[..., tuple[Any, ...]]:
    if graph.symbols:
        return _make_symbolic_runner(graph)
    steps, placeholders, outputs = graph.steps, graph.placeholders, graph.outputs
    num_slots = graph.num_slots
    strides = graph.input_strides or (None,) * len(placeholders)

    def run_boxed(box: list[Any]) -> tuple[Any, ...]:
        # Kernels bake the traced strides of their inputs into index expressions; a tensor that
        # arrives with other strides (a cotangent autograd made non-contiguous) is copied into
        # the traced layout first. Guards make this impossible for user inputs.
        env: dict[str, Any] = dict(zip(placeholders, map(_restride, box, strides), strict=True))
        box.clear()  # each input is freed at its last use (Note [Boxed backward])
        slots: list[torch.Tensor | None] = [None] * num_slots
        for step in steps:
            if isinstance(step, KernelStep):
                _run_kernel_step(step, env, slots)
            else:
                step.run(env)
            for name in step.frees:
                env.pop(name, None)
        return tuple(env[o] if isinstance(o, str) else o for o in outputs)

    def run(*args: Any) -> tuple[Any, ...]:
        return run_boxed(list(args))

    run.boxed = run_boxed  # type: ignore[attr-defined]
    return run


SYMS = "\x00syms"  # env key of the symbols' values in a symbolic graph (no fx name clashes)


def _make_symbolic_runner(graph: CompiledGraph) -> Callable[..., tuple[Any, ...]]:
    """Like `_make_runner`, with every size evaluated per call from the symbols' values."""
    steps, placeholders, outputs = graph.steps, graph.placeholders, graph.outputs
    sources, num_slots = graph.symbols, graph.num_slots
    names = [src.symbol for src in sources]
    strides = graph.input_strides or (None,) * len(placeholders)
    strided = [(i, len(st)) for i, st in enumerate(strides) if st is not None]
    stride_fn = compile_sizes(
        [e for _, st in enumerate(strides) if st is not None for e in st], names
    )
    plans: list[tuple[Callable[[Sequence[int]], tuple[int, ...]], int, int] | None] = []
    for step in steps:
        if not isinstance(step, KernelStep):
            plans.append(None)
            continue
        k = step.kernel
        exprs = [k.xnumel, k.rnumel, *[_symbol(name) for name in k.symbols]]
        for spec in step.outputs:
            exprs += [*spec.size, *spec.stride]
        plans.append((compile_sizes(exprs, names), len(k.symbols), len(step.outputs)))

    def run_boxed(args_l: list[Any]) -> tuple[Any, ...]:
        values = read_symbols(sources, args_l)
        flat = stride_fn(values)
        pos = 0
        for i, n in strided:
            args_l[i] = _restride(args_l[i], flat[pos : pos + n])
            pos += n
        env: dict[str, Any] = dict(zip(placeholders, args_l, strict=True))
        args_l.clear()  # each input is freed at its last use (Note [Boxed backward])
        env[SYMS] = values
        slots: list[torch.Tensor | None] = [None] * num_slots
        for step, plan in zip(steps, plans, strict=True):
            if plan is None:
                step.run(env)  # type: ignore[union-attr]
            else:
                _run_symbolic_step(step, plan, values, env, slots)  # type: ignore[arg-type]
            for name in step.frees:
                env.pop(name, None)
        return tuple(env[o] if isinstance(o, str) else o for o in outputs)

    def run(*args: Any) -> tuple[Any, ...]:
        return run_boxed(list(args))

    run.boxed = run_boxed  # type: ignore[attr-defined]
    return run


def _symbol(name: str) -> SizeExpr:
    return SizeExpr(name)


def _run_symbolic_step(
    step: KernelStep,
    plan: tuple[Any, int, int],
    values: tuple[int, ...],
    env: dict[str, Any],
    slots: list[torch.Tensor | None],
) -> None:
    kernel = step.kernel
    if (kernel.key, kernel.device) in _FAILED:
        step.fallback(env)
        return
    fn, n_sym, _ = plan
    sizes = fn(values)
    xnumel, rnumel, extra = sizes[0], sizes[1], sizes[2 : 2 + n_sym]
    pos = 2 + n_sym
    outs = []
    for spec in step.outputs:
        n = len(spec.size)
        size, stride = sizes[pos : pos + n], sizes[pos + n : pos + 2 * n]
        pos += 2 * n
        t = slots[spec.slot] if spec.slot is not None else None
        if t is None:
            t = torch.empty_strided(size, stride, dtype=spec.dtype, device=spec.device)
            if spec.slot is not None:
                slots[spec.slot] = t
        env[spec.name] = t
        outs.append(t)
    try:
        launch(kernel, [env[b] for b in kernel.inputs] + outs, (xnumel, rnumel, extra))
    except Exception as e:  # noqa: BLE001 - see the module docstring: fall back, never crash
        _FAILED.add((kernel.key, kernel.device))
        log.warning(
            "kernel %s failed (%s: %s); running its ops as ATen calls instead",
            kernel.name,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        step.fallback(env)


def _restride(arg: Any, stride: tuple[int, ...] | None) -> Any:
    if stride is None or not isinstance(arg, torch.Tensor) or arg.stride() == stride:
        return arg
    if all(st == want for st, want, n in zip(arg.stride(), stride, arg.shape) if n > 1):
        return arg
    return torch.empty_strided(arg.shape, stride, dtype=arg.dtype, device=arg.device).copy_(arg)


def _run_kernel_step(
    step: KernelStep, env: dict[str, Any], slots: list[torch.Tensor | None]
) -> None:
    kernel = step.kernel
    if (kernel.key, kernel.device) in _FAILED:
        step.fallback(env)
        return
    outs = []
    for spec in step.outputs:
        t = slots[spec.slot] if spec.slot is not None else None
        if t is None:
            t = torch.empty_strided(spec.size, spec.stride, dtype=spec.dtype, device=spec.device)
            if spec.slot is not None:
                slots[spec.slot] = t
        env[spec.name] = t
        outs.append(t)
    try:
        launch(kernel, [env[b] for b in kernel.inputs] + outs)
    except Exception as e:  # noqa: BLE001 - see the module docstring: fall back, never crash
        _FAILED.add((kernel.key, kernel.device))
        log.warning(
            "kernel %s failed (%s: %s); running its ops as ATen calls instead",
            kernel.name,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        step.fallback(env)
