"""Dynamo's side of a run, for `aotc dump` and `aotc explain`: frames, graph breaks, guards, times.

Not a stage. `DynamoLog` is a logging handler on torch's structured trace log (the stream that
`TORCH_TRACE=dir` writes and tlparse reads): while attached it receives Dynamo's records, keyed
by compile id (`frame_id/frame_compile_id`):

    compilation_metrics          -> the frame's function and file, whole-frame and backend time,
                                    guard count, failure
    dynamo_graph_break_reason    -> why Dynamo split the frame, and at which user line
    dynamo_cpp_guards_str        -> the guards Dynamo installed for the frame

`DynamoLog.summary()` is plain JSON (written as DIR/dynamo.json by `aotc dump`); the report and
`aotc explain` join it with aotc's graphs on the compile id each graph was compiled under
(`aotc.debug.current_dynamo_compile_id`). Attaching a handler turns structured tracing on for the
run, which costs Dynamo some time formatting its records (measured: about 5% of a 12-layer
GPT-2's compile).
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import re
from collections.abc import Iterator
from typing import Any

_GUARD_LEAF = re.compile(r"^[\s|]*\+- ([A-Z][A-Z0-9_]+): (.*)$")
_RESUME = re.compile(r"^torch_dynamo_resume_in_(\w+)_at_(\d+)$")


class DynamoLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.frames: dict[str, dict[str, Any]] = {}
        self.graph_breaks: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None)
        if not isinstance(metadata, dict):
            return
        try:
            self._take(metadata, getattr(record, "payload", None))
        except Exception:  # noqa: BLE001 a record we cannot read must not fail the user's run
            return

    def _take(self, metadata: dict[str, Any], payload: object) -> None:
        if "frame_id" not in metadata or "frame_compile_id" not in metadata:
            return
        compile_id = f"{metadata['frame_id']}/{metadata['frame_compile_id']}"
        frame = self.frames.setdefault(compile_id, {"graph_breaks": [], "guards": []})
        if "compilation_metrics" in metadata:
            _take_metrics(frame, metadata["compilation_metrics"])
        elif "dynamo_cpp_guards_str" in metadata and isinstance(payload, str):
            frame["guards"] = _guard_lines(payload)
        elif metadata.get("artifact", {}).get("name") == "dynamo_graph_break_reason":
            found = _graph_break(str(payload or ""))
            found["compile_id"] = compile_id
            frame["graph_breaks"].append(found)
            self.graph_breaks.append(found)

    def summary(self) -> dict[str, Any]:
        return {"frames": self.frames, "graph_breaks": self.graph_breaks}


def _take_metrics(frame: dict[str, Any], metrics: dict[str, Any]) -> None:
    name = str(metrics.get("co_name") or "?")
    where = f"{metrics.get('co_filename')}:{metrics.get('co_firstlineno')}"
    frame.update(function=name, where=_short(where))
    resume = _RESUME.match(name)
    if resume:
        frame["resumes_after"] = (
            f"a graph break in {resume.group(1)} at line {resume.group(2)} of "
            f"{_short(str(metrics.get('co_filename')))}"
        )
    whole = metrics.get("entire_frame_compile_time_s")
    backend = metrics.get("backend_compile_time_s") or 0.0
    if isinstance(whole, (int, float)):
        frame["frame_seconds"] = float(whole)
        frame["backend_seconds"] = float(backend)
        frame["dynamo_seconds"] = max(float(whole) - float(backend), 0.0)
    for key in ("guard_count", "graph_op_count", "fail_type", "fail_reason"):
        if metrics.get(key) is not None:
            frame[key] = metrics[key]


def _guard_lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        m = _GUARD_LEAF.match(line)
        if m:
            code = m.group(2).split("  # ", 1)[0].strip()
            out.append(f"{m.group(1)}: {code}")
    return out


def _graph_break(text: str) -> dict[str, str]:
    """`reason` and `where` (file:line  code) from a dynamo_graph_break_reason payload."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    where, reason = "", ""
    for i, line in enumerate(lines):
        if line.startswith("Graph break in user code at ") and not where:
            where = _with_code(line.removeprefix("Graph break in user code at ").strip())
        elif line.startswith("Graph Break Reason: ") and not reason:
            reason = line.removeprefix("Graph Break Reason: ").strip()
            detail = [ln.strip() for ln in lines[i + 1 : i + 6] if ln.strip()]
            explanation = next((d for d in detail if d.startswith("Explanation:")), "")
            if detail and not detail[0].startswith(("Explanation:", "Hint:", "User code")):
                reason = detail[0]
            if explanation:
                reason = f"{reason}: {explanation.removeprefix('Explanation:').strip()}"
    if not reason:
        first = next((ln for ln in lines if ln.strip()), "graph break")
        reason = first.strip()
    return {"reason": reason[:400], "where": where}


def _with_code(where: str) -> str:
    path, _, line = where.rpartition(":")
    if path and line.isdigit():
        code = linecache.getline(path, int(line)).strip()
        return f"{_short(path)}:{line}  {code}".rstrip()
    return where


def _short(path: str) -> str:
    from aotc.passes.provenance import short_path

    file, sep, line = path.rpartition(":")
    if sep and line.isdigit():
        return f"{short_path(file)}:{line}"
    return short_path(path)


@contextlib.contextmanager
def listening() -> Iterator[DynamoLog]:
    """A DynamoLog attached to torch's structured trace log for the duration."""
    from torch._logging._internal import trace_log

    handler = DynamoLog()
    trace_log.addHandler(handler)
    try:
        yield handler
    finally:
        trace_log.removeHandler(handler)
