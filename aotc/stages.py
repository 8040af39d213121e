"""The compile driver's stage runner: each stage timed, linted, and kept as a printable record.

Records: `Stage` (the driver's stages, in pipeline order), `StageRun` (one run of a stage: its
time and, for graph stages, the graph it produced as text).
Stage: `StageRunner.run(stage, fn, *args) -> fn(*args)`.
Ensures: `seconds` holds the time of every stage that ran (summed when a stage runs twice, as
the Triton stages do for forward and backward), in first-run order, keyed by `Stage.value`
(what `aotc.inspect(...).stage_seconds` and 07_compile_time.txt show); with invariant checks
on, every graph a stage returns is linted (passes.lint) before the next stage runs.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from aotc.passes.ir import StageGraph
from aotc.passes.lint import lint_graph

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Stage(enum.Enum):
    CACHE_KEY = "cache_key"
    CACHE_LOAD = "cache_load"
    METADATA = "metadata"
    TRACE = "trace"
    CLEANUP = "cleanup"
    PARTITION = "partition"
    EPILOGUE = "epilogue"
    DECOMPOSE = "decompose"
    LOWER = "lower"
    FUSE = "fuse"
    GENERATE = "generate"
    ASSEMBLE = "assemble"
    CACHE_STORE = "cache_store"


@dataclass(frozen=True, slots=True)
class StageRun:
    stage: Stage
    seconds: float
    label: str  # what it ran on ("forward", "backward"), or ""


class StageRunner:
    """Runs the driver's stages (see module docstring)."""

    def __init__(self, check_invariants: bool) -> None:
        self.check_invariants = check_invariants
        self.seconds: dict[str, float] = {}
        self.runs: list[StageRun] = []

    def run(self, stage: Stage, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return self.labeled(stage, "", fn, *args, **kwargs)

    def labeled(
        self, stage: Stage, label: str, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs
    ) -> _R:
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[stage.value] = self.seconds.get(stage.value, 0.0) + elapsed
            self.runs.append(StageRun(stage, elapsed, label))
        if self.check_invariants:
            self._lint(stage, label, result)
        return result

    def merge(self, stage: Stage, into: Stage) -> None:
        """Count `stage`'s time as `into`'s (a cache read that found no usable entry was part
        of keying)."""
        seconds = self.seconds.pop(stage.value, None)
        if seconds is not None:
            self.seconds[into.value] = self.seconds.get(into.value, 0.0) + seconds

    def _lint(self, stage: Stage, label: str, result: object) -> None:
        """Lint the graphs a stage returns: a stage graph, or a partition's two."""
        if isinstance(result, StageGraph):
            lint_graph(result, f"{stage.value} {label}".strip())
            return
        for part in ("forward", "backward"):
            graph = getattr(result, part, None)
            if isinstance(graph, StageGraph):
                lint_graph(graph, part)


__all__ = ["Stage", "StageRun", "StageRunner"]
