"""Every knob of a compilation. Environment variables are read here and nowhere else."""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, replace

from aotc.passes.recompute import RecomputePolicy


class Capture(enum.Enum):
    """How `aotc.compile` captures the user's program (see docs/guide.md, "Capture modes")."""

    DYNAMO = "dynamo"  # through torch.compile's Dynamo: guards on Python state, graph breaks
    TRACE = "trace"  # strict: aotc's whole-program tracer; refuses what it cannot guard


@dataclass(frozen=True, slots=True)
class CompileOptions:
    # How the program is captured: through Dynamo (the default) or aotc's strict tracer.
    capture: Capture = Capture.DYNAMO
    # How graphs run: "aten" runs the fx graphs as ATen ops; "triton" runs generated Triton
    # kernels (on CPU through Triton's interpreter); "auto" uses Triton for CUDA graphs only.
    backend: str = "auto"
    triton_interpret: bool = False  # set by from_env: Triton's interpreter runs CPU kernels
    # Symbolic sizes. None: Dynamo's automatic dynamic in the default capture mode (static
    # first, symbolic once a size changes), static in strict mode; True: symbolic from the first
    # call (aotc/symbolic.py); False: always static (one compilation per shape).
    dynamic: bool | None = None
    recompile_warn_limit: int = 8  # warn once a function has this many compiled signatures
    max_signatures: int = 64  # refuse to compile more signatures than this (GuardError)
    check_invariants: bool = False  # lint graphs between stages
    dump_dir: str | None = None  # write every stage's record for each compiled signature
    partitioner: str = "min_cut"  # "min_cut" (fewest saved bytes) or "simple" (save what bwd reads)
    # Activation memory cap: a fraction (0, 1] of "save everything", or a byte count (int).
    memory_budget: float | int | None = None
    recompute: RecomputePolicy = RecomputePolicy()
    # Persistent compile cache (runtime/cache.py): on unless AOTC_CACHE=0; the directory is
    # AOTC_CACHE_DIR, else $XDG_CACHE_HOME/aotc, else ~/.cache/aotc. None: no disk cache.
    cache: bool = True
    cache_dir: str | None = None
    cache_max_bytes: int = (
        1 << 30
    )  # least-recently-used entries go beyond this (AOTC_CACHE_MAX_BYTES)

    @staticmethod
    def from_env(**overrides: object) -> CompileOptions:
        opts = CompileOptions(
            backend=os.environ.get("AOTC_BACKEND") or "auto",  # e.g. the OpInfo sweep on Triton
            dump_dir=os.environ.get("AOTC_DUMP_DIR") or None,
            check_invariants=os.environ.get("AOTC_CHECK_INVARIANTS", "0") == "1",
            cache=os.environ.get("AOTC_CACHE", "1").strip().lower() not in ("0", "false", "off"),
            cache_dir=default_cache_dir(),
            cache_max_bytes=int(os.environ.get("AOTC_CACHE_MAX_BYTES") or (1 << 30)),
        )
        unknown = set(overrides) - set(CompileOptions.__dataclass_fields__)
        if unknown:
            raise TypeError(
                f"aotc.compile() got unknown option(s) {sorted(unknown)}; known options: "
                f"{sorted(CompileOptions.__dataclass_fields__)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        if "capture" in given:
            given["capture"] = _capture(given["capture"])
        opts = replace(opts, **given)  # type: ignore[arg-type]
        _check_partition_options(opts)
        if opts.backend not in ("aten", "auto", "triton"):
            raise ValueError(
                f"aotc.compile(backend={opts.backend!r}): expected 'aten', 'triton' or 'auto'."
            )
        if opts.backend == "triton":
            opts = replace(opts, triton_interpret=_triton_interpreter_available())
        return opts


def _capture(value: object) -> Capture:
    try:
        return Capture(value.value if isinstance(value, Capture) else value)
    except ValueError:
        choices = ", ".join(repr(c.value) for c in Capture)
        raise ValueError(f"aotc.compile(capture={value!r}): expected one of {choices}.") from None


def default_cache_dir() -> str:
    """AOTC_CACHE_DIR, else $XDG_CACHE_HOME/aotc, else ~/.cache/aotc."""
    explicit = os.environ.get("AOTC_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aotc")


def cuda_check_cache_dir() -> str | None:
    """Where compiles for GPU targets (runtime.cuda_check: kernel resources in `aotc explain`,
    the dump and AOTC_LOG=kernels) keep their results: under the cache directory, unless
    AOTC_CACHE=0."""
    if os.environ.get("AOTC_CACHE", "1").strip().lower() in ("0", "false", "off"):
        return None
    return os.path.join(default_cache_dir(), "cuda-check")


def _triton_interpreter_available() -> bool:
    """Whether Triton's interpreter can run CPU kernels: whenever triton is installed. The
    interpreter is chosen per kernel, by its device, when the kernel is loaded
    (runtime.kernels.load_kernel; see Note [Interpreter-safe Triton] in passes.codegen), so it
    does not matter whether TRITON_INTERPRET was set or triton (or torch._dynamo) imported first.
    """
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _check_partition_options(opts: CompileOptions) -> None:
    if opts.partitioner not in ("min_cut", "simple"):
        raise ValueError(
            f"aotc.compile(partitioner={opts.partitioner!r}): expected 'min_cut' or 'simple'."
        )
    budget = opts.memory_budget
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(
            f"aotc.compile(memory_budget={budget!r}): pass a fraction in (0, 1] of the "
            "save-everything activation bytes, or a byte count (int >= 0)."
        )
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(
            f"aotc.compile(memory_budget={budget!r}): a float budget is a fraction and must be "
            "in (0, 1]; pass an int for a byte count."
        )
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"aotc.compile(memory_budget={budget!r}): a byte count must be >= 0.")


def full_tracebacks() -> bool:
    """AOTC_FULL_TRACEBACK=1: errors from tracing keep torch's and aotc's internal frames and the
    exception they were raised from (see Note [User-facing tracebacks] in aotc/pipeline.py)."""
    return os.environ.get("AOTC_FULL_TRACEBACK", "0").strip().lower() in ("1", "true", "on")


LOG_CATEGORIES = ("graphs", "partition", "kernels", "recompiles", "progress")


def configure_logging(categories: str | None = None) -> list[str]:
    """Turn on `aotc.<category>` loggers (INFO, to stderr) for a comma-separated list, by default
    from AOTC_LOG (e.g. AOTC_LOG=graphs,partition,recompiles; "all" for every category)."""
    text = os.environ.get("AOTC_LOG", "") if categories is None else categories
    wanted = [c.strip() for c in text.split(",") if c.strip()]
    if "all" in wanted:
        wanted = list(LOG_CATEGORIES)
    unknown = sorted(set(wanted) - set(LOG_CATEGORIES))
    if unknown:
        raise ValueError(
            f"AOTC_LOG: unknown categories {unknown}; choose from {', '.join(LOG_CATEGORIES)}"
        )
    root = logging.getLogger("aotc")
    if wanted and not any(getattr(h, "_aotc", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        handler._aotc = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    for category in wanted:
        logging.getLogger(f"aotc.{category}").setLevel(logging.INFO)
    return wanted
