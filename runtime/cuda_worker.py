"""A worker process that compiles Triton kernels for a CUDA target without a GPU.

Run as a script by `runtime.cuda_check` (never imported by aotc): it imports only the standard
library and triton, reads one JSON request per line on stdin and writes one JSON answer per line
on stdout. It runs in its own process so that Triton's compiler sees real compiler functions
(the parent may have imported triton with TRITON_INTERPRET=1), so that compiles run in parallel
(Triton's compiler holds the GIL), and so that a crash of the compiler cannot take the caller
down.

A request names a kernel source, its function name, a target capability (90, 80) and one launch:
the element type of each pointer argument and whether pointers are 16-byte aligned, the integer
arguments as the launch passes them, the constexpr block sizes and `num_warps`. The worker runs
the same steps as `JITFunction.run` on a GPU up to the compile (Triton's binder computes the
specialization from the arguments, `_pack_args` turns it into the signature, constexprs and
attributes), then `triton.compile(..., target=GPUTarget("cuda", capability, 32))`, which runs
TTIR -> TTGIR -> LLVM IR -> PTX -> cubin (with the `ptxas` the triton wheel ships). The answer
carries the signature Triton used and, from the `ptxas -v` log and the kernel metadata, the
registers per thread, spill stores/loads, stack frame, shared memory, warps and stages.

A request with `"warm": true` (runtime/precompile.py) only compiles: into the Triton cache the
parent names, where the parent's own `JITFunction` launch finds it, with the launcher stub Triton
builds for the kernel's signature (where the CUDA driver is installed), and answers
`{"launcher": built}`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

_MODULES: dict[str, Any] = {}
_DIR = tempfile.mkdtemp(prefix="aotc_cuda_worker_")
atexit.register(shutil.rmtree, _DIR, True)  # the parent closes stdin: the loop ends, this runs


class _Pointer:
    """What Triton's binder needs of a tensor argument: an element type and an address."""

    def __init__(self, dtype: Any, address: int) -> None:
        self.dtype, self.address = dtype, address

    def data_ptr(self) -> int:
        return self.address


def _function(source: str, name: str) -> Any:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    if key not in _MODULES:
        path = os.path.join(_DIR, f"{name}_{key}.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"aotc_cuda_{key}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for attr, value in list(vars(module).items()):  # compiler functions, never interpreted
            if isinstance(value, InterpretedFunction):
                keep = value.kwargs.get("do_not_specialize")
                setattr(module, attr, JITFunction(value.fn, do_not_specialize=keep))
        _MODULES[key] = module
    return getattr(_MODULES[key], name)


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _resources(log: str, name: str) -> dict[str, int]:
    # ptxas -v prints one block per entry function; ours has one entry function.
    regs = _REGS.search(log)
    spill = _SPILL.search(log)
    if regs is None or spill is None:
        raise RuntimeError(f"no resource usage for {name} in the ptxas log:\n{log}")
    return {
        "registers": int(regs.group(1)),
        "stack": int(spill.group(1)),
        "spill_stores": int(spill.group(2)),
        "spill_loads": int(spill.group(3)),
    }


def compile_one(request: dict[str, Any]) -> dict[str, Any]:
    if request.get("ping"):  # runtime.precompile.start: get the imports done before the work
        import triton.compiler  # noqa: F401

        return {}
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = _function(request["source"], request["name"])
    target = GPUTarget("cuda", int(request["capability"]), 32)
    backend = make_backend(target)
    address = 0 if request["aligned"] else 4  # fresh allocations are 256-byte aligned
    pointers = [_Pointer(tl.str_to_ty(t, None), address) for t in request["pointers"]]
    args = [*pointers, *request["sizes"], *request["constexprs"]]
    kwargs = {"num_warps": request["num_warps"], "debug": False, "instrumentation_mode": ""}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    if request.get("warm"):  # runtime.precompile: the compile lands in Triton's cache
        src = ASTSource(fn, signature, constexprs, attrs)
        kernel = triton.compile(src, target=target, options=options.__dict__)
        return {"launcher": _build_launcher(src, kernel)}
    knobs.nvidia.dump_ptxas_log = True  # printed to stdout by make_cubin: captured below
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    if "cubin" not in kernel.asm:
        raise RuntimeError("Triton produced no cubin (is the ptxas of the triton wheel there?)")
    described = ", ".join(
        f"{name}: {ty}"
        + (f" = {constexprs[(i,)]}" if (i,) in constexprs else "")
        + (
            " (divisible by 16)"
            if any(a[0] == "tt.divisibility" for a in attrs.get((i,), []))
            else ""
        )
        for i, (name, ty) in enumerate(signature.items())
    )
    meta = kernel.metadata
    return {
        "signature": described,
        "shared": int(meta.shared),
        "num_warps": int(meta.num_warps),
        "num_stages": int(meta.num_stages),
        **_resources(log.getvalue(), request["name"]),
    }


def _build_launcher(src: Any, kernel: Any) -> bool:
    """Build the C launcher stub Triton loads with a kernel of this signature (a C compile of
    ~0.3 s, cached by its source in the same directory) as its first launch would; needs the
    CUDA driver library (a GPU machine), else does nothing and answers False."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(src, kernel.metadata)
    except Exception:  # noqa: BLE001 - no driver here: the launch builds it
        return False
    return True


def _cpu_seconds() -> float:
    """CPU time of this worker and the ptxas processes it ran (independent of machine load)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main() -> None:
    if len(sys.argv) > 1 and int(sys.argv[1]):
        os.nice(int(sys.argv[1]))  # argv[1]: niceness (the test suite compiles behind its tests)
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the answers
    for line in sys.stdin:
        request = json.loads(line)
        start = _cpu_seconds()
        try:
            answer = {"id": request["id"], "ok": True, **compile_one(request)}
        except Exception as e:  # noqa: BLE001 - every failure is an answer, the worker lives on
            text = f"{type(e).__name__}: {e}".strip()
            answer = {
                "id": request["id"],
                "ok": False,
                "error": text[:4000],
                "traceback": traceback.format_exc()[-4000:],
            }
        answer["cpu_seconds"] = round(_cpu_seconds() - start, 4)
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
