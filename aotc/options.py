"""Every knob of a compilation. Environment variables are read here and nowhere else.

The string switches are str-valued enums, so a member and its string are the same option:

>>> from aotc.options import Backend, CompileOptions
>>> Backend("triton") is Backend.TRITON and Backend.TRITON == "triton"
True
>>> CompileOptions(backend="aten", partitioner="simple").backend
<Backend.ATEN: 'aten'>

A misspelt value fails at once, listing the choices:

>>> CompileOptions(partitioner="mincut")
Traceback (most recent call last):
    ...
ValueError: aotc.compile(partitioner='mincut'): expected one of 'min_cut', 'simple' (or aotc.Partitioner.<NAME>); did you mean 'min_cut'?
"""

from __future__ import annotations

import difflib
import enum
import logging
import os
from dataclasses import dataclass, fields, replace
from typing import TypeVar

from aotc.passes.recompute import RecomputePolicy


class Capture(enum.StrEnum):
    """How `aotc.compile` captures the user's program (see docs/guide.md, "Capture modes")."""

    DYNAMO = "dynamo"  # through torch.compile's Dynamo: guards on Python state, graph breaks
    TRACE = "trace"  # strict: aotc's whole-program tracer; refuses what it cannot guard


class Backend(enum.StrEnum):
    """How compiled graphs run (see docs/guide.md, "Options")."""

    AUTO = "auto"  # generated Triton kernels for CUDA graphs, ATen calls elsewhere
    ATEN = "aten"  # the fx graphs run as ATen calls
    TRITON = "triton"  # generated Triton kernels (on CPU through Triton's interpreter)


class Partitioner(enum.StrEnum):
    """How the joint graph is split into forward and backward (see passes/partition.py)."""

    MIN_CUT = "min_cut"  # save the fewest bytes (recomputing cheap ops in the backward)
    SIMPLE = "simple"  # save what the backward reads


_E = TypeVar("_E", bound=enum.StrEnum)


def choice(kind: type[_E], value: object, option: str) -> _E:
    """`value` (a member of `kind` or its string) as a member of `kind`; a ValueError naming
    `option`, listing the choices and suggesting the nearest one otherwise."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind(value.strip().lower())
        except ValueError:
            pass
    choices = [m.value for m in kind]
    listed = ", ".join(repr(c) for c in choices)
    near = difflib.get_close_matches(str(value), choices, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else "."
    where = f"{option}={value!r}" if option.isupper() else f"aotc.compile({option}={value!r})"
    raise ValueError(f"{where}: expected one of {listed} (or aotc.{kind.__name__}.<NAME>){hint}")


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """The options of one compilation (the keyword arguments of `aotc.compile`). The enum
    fields also take their strings, checked here: see `choice`."""

    # How the program is captured: through Dynamo (the default) or aotc's strict tracer.
    capture: Capture = Capture.DYNAMO
    # How graphs run: "aten" runs the fx graphs as ATen ops; "triton" runs generated Triton
    # kernels (on CPU through Triton's interpreter); "auto" uses Triton for CUDA graphs only.
    backend: Backend = Backend.AUTO
    triton_interpret: bool = False  # set by from_env: Triton's interpreter runs CPU kernels
    # Symbolic sizes. None: Dynamo's automatic dynamic in the default capture mode (static
    # first, symbolic once a size changes), static in strict mode; True: symbolic from the first
    # call (aotc/symbolic.py); False: always static (one compilation per shape).
    dynamic: bool | None = None
    recompile_warn_limit: int = 8  # warn once a function has this many compiled signatures
    max_signatures: int = 64  # refuse to compile more signatures than this (GuardError)
    check_invariants: bool = False  # lint graphs between stages
    dump_dir: str | None = None  # write every stage's record for each compiled signature
    partitioner: Partitioner = Partitioner.MIN_CUT  # fewest saved bytes, or save what bwd reads
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

    def __post_init__(self) -> None:
        # A string (or a member) for each enum field becomes its member; a typo fails here.
        for f in fields(self):
            kind = _ENUM_FIELDS.get(f.name)
            if kind is not None:
                object.__setattr__(self, f.name, choice(kind, getattr(self, f.name), f.name))
        _check_partition_options(self)

    @staticmethod
    def from_env(**overrides: object) -> CompileOptions:
        backend = os.environ.get("AOTC_BACKEND") or "auto"  # e.g. the OpInfo sweep on Triton
        opts = CompileOptions(
            backend=choice(Backend, backend, "AOTC_BACKEND"),
            dump_dir=os.environ.get("AOTC_DUMP_DIR") or None,
            check_invariants=os.environ.get("AOTC_CHECK_INVARIANTS", "0") == "1",
            cache=os.environ.get("AOTC_CACHE", "1").strip().lower() not in ("0", "false", "off"),
            cache_dir=default_cache_dir(),
            cache_max_bytes=int(os.environ.get("AOTC_CACHE_MAX_BYTES") or (1 << 30)),
        )
        known = [f.name for f in fields(CompileOptions)]
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            near = [m for u in unknown for m in difflib.get_close_matches(u, known, n=1)]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise TypeError(
                f"aotc.compile() got unknown option(s) {unknown}{hint}; known options: "
                f"{sorted(known)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        opts = replace(opts, **given)  # type: ignore[arg-type]  # checked in __post_init__
        if opts.backend is Backend.TRITON:
            opts = replace(opts, triton_interpret=_triton_interpreter_available())
        return opts


_ENUM_FIELDS: dict[str, type[enum.StrEnum]] = {
    "capture": Capture,
    "backend": Backend,
    "partitioner": Partitioner,
}


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
