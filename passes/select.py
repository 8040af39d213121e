"""Backend selection for one stage graph: generated Triton kernels or plain ATen calls.

Stage: `select_backend(module, backend, interpret) -> CompiledGraph | None`.
Requires: a forward or backward stage graph; `backend` in "aten", "triton", "auto".
Ensures: None means "run the graph as ATen calls" (runtime.launch.make_callable): for "aten",
for "auto" unless the graph's tensors are on CUDA, for "triton" when triton is not installed
(logged). CPU graphs run their kernels in Triton's interpreter, CUDA graphs compile them; the
choice is per kernel, never by import order (see Note [Interpreter-safe Triton] in
passes.codegen). Graphs with symbolic sizes (dynamic=True) are lowered with sympy sizes
(see Note [Symbolic sizes] in passes.loop_ir). Any failure of the Triton path is logged on
`aotc.kernels` and falls back to ATen for the whole graph; failures of single kernels fall back
per group (see passes.kernelize).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import fx

from aotc.runtime.kernels import CompiledGraph

log = logging.getLogger("aotc.kernels")


@dataclass(frozen=True, slots=True)
class TritonTarget:
    """A graph goes to Triton: its kernels run in the interpreter (CPU tensors) or compiled."""

    interpret: bool


def triton_target(module: fx.GraphModule, backend: str) -> TritonTarget | None:
    """Whether `module` is lowered to Triton under `backend` (None: it runs as ATen calls)."""
    if backend == "aten":
        return None
    from aotc.passes.kernelize import graph_device

    device = graph_device(module)
    on_cuda = device is not None and device.type == "cuda"
    if backend == "auto" and not on_cuda:
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("backend=%r: triton is not installed; running ATen calls instead", backend)
        return None
    return TritonTarget(interpret=not on_cuda)


def select_backend(
    module: fx.GraphModule, backend: str, interpret: bool, decomposed: fx.GraphModule | None = None
) -> CompiledGraph | None:
    """`interpret`: CompileOptions.triton_interpret (part of the cache key; the interpreter is
    picked per kernel by its device). `decomposed`: the decomposed graph of `module` from a disk-cache entry (skips decompose)."""
    target = triton_target(module, backend)
    if target is None:
        return None
    from aotc.passes.kernelize import lower_graph

    try:
        return lower_graph(module, interpret=target.interpret, decomposed=decomposed)
    except Exception as e:  # noqa: BLE001 - the ATen graph is always a correct fallback
        log.warning(
            "Triton lowering failed (%s: %s); running this graph as ATen calls", type(e).__name__, e
        )
        return None
