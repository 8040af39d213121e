"""The `aotc` command: see what aotc compiled while a script ran.

    aotc dump SCRIPT.py [--out DIR] [-- script args]   every compiled graph under DIR + index.html
    aotc explain SCRIPT.py [-- script args]            a summary table per compiled graph
    aotc report DIR                                    write DIR/index.html again from a dump
    aotc --version

The script runs unchanged in this process (as `__main__`); compilations by `aotc.compile` and by
`torch.compile(backend="aotc")` are captured, failed ones with their error, and Dynamo's side of
the run (frames, graph breaks, guards, times; aotc/dynamo_log.py). Exit codes: 0 ok, 1 the script
failed (its traceback is shown), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

EXIT_OK, EXIT_SCRIPT_FAILED, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aotc",
        description="aotc: ahead-of-time joint forward/backward graph compiler for PyTorch. "
        "Run a script and see every graph it compiled.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    dump = sub.add_parser(
        "dump",
        help="run a script and write every compiled graph under a folder",
        usage="aotc dump SCRIPT [--out DIR] [-- SCRIPT_ARGS ...]",
        description="Run SCRIPT unchanged and write, per compiled graph, a folder with its source "
        "location, signature and guards, metadata, joint/forward/backward graphs, partition "
        "report and compile time (or its error), plus DIR/index.html (pictures per module, "
        "search, graph code), DIR/explain.txt (what `aotc explain` prints) and DIR/dynamo.json "
        "(Dynamo's frames, graph breaks, guards and times).",
    )
    dump.add_argument("script", help="the Python script to run")
    dump.add_argument(
        "--out",
        default="aotc_dump",
        metavar="DIR",
        help="where to write the dump (default: aotc_dump)",
    )
    explain = sub.add_parser(
        "explain",
        help="run a script and print a summary of every compiled graph",
        usage="aotc explain SCRIPT [-- SCRIPT_ARGS ...]",
        description="Run SCRIPT unchanged and print, per compiled graph: ops, ATen calls, saved "
        "bytes against save-everything, recomputed ops, compile time by stage, recompiles.",
    )
    explain.add_argument("script", help="the Python script to run")
    report = sub.add_parser(
        "report",
        help="write DIR/index.html again from a dump folder",
        usage="aotc report DIR",
        description="Re-render the HTML report of a dump folder written by `aotc dump` or "
        "`dump_dir=` (for example after installing Graphviz), without running anything.",
    )
    report.add_argument("dir", help="the dump folder")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    words = sys.argv[1:] if argv is None else list(argv)
    script_args: list[str] = []
    if "--" in words:  # everything after `--` belongs to the script
        cut = words.index("--")
        words, script_args = words[:cut], words[cut + 1 :]
    try:
        args = parser.parse_args(words)
    except SystemExit as e:  # argparse: 2 on usage errors, 0 on --help
        return int(e.code or 0)
    if args.version:
        import torch

        from aotc import __version__

        print(f"aotc {__version__} (torch {torch.__version__})")
        return EXIT_OK
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    if args.command == "report":
        return _report(args.dir)
    if not os.path.isfile(args.script):
        print(f"aotc {args.command}: no such script: {args.script!r}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "dump":
        return _dump(args.script, script_args, args.out)
    return _explain(args.script, script_args)


@dataclass
class _Run:
    """What one script run compiled: (function, record, recompile reason, Dynamo compile id)
    per compilation, the failed ones, and Dynamo's records (aotc/dynamo_log.py)."""

    compiled: list[tuple[Any, Any, str | None, str | None]] = field(default_factory=list)
    failed: list[tuple[Any, str | None]] = field(default_factory=list)
    dynamo: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _run_script(script: str, script_args: list[str]) -> tuple[int, _Run]:
    """Run `script` as __main__ with `script_args`, recording every compilation. Returns the
    exit code for the CLI and what was recorded."""
    import aotc.api
    import aotc.pipeline
    from aotc.debug import current_dynamo_compile_id
    from aotc.dynamo_log import listening
    from aotc.options import configure_logging

    run = _Run()

    def on_record(fn: Any, rec: Any, why: str | None) -> None:
        run.compiled.append((fn, rec, why, current_dynamo_compile_id()))

    def on_failure(failure: Any) -> None:
        run.failed.append((failure, current_dynamo_compile_id()))

    configure_logging("progress")
    aotc.api.COMPILE_LISTENERS.append(on_record)
    aotc.pipeline.COMPILE_FAILURE_LISTENERS.append(on_failure)
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = EXIT_OK
    start = time.perf_counter()
    with listening() as dynamo:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                print(f"aotc: {script} exited with {e.code}", file=sys.stderr)
                code = EXIT_SCRIPT_FAILED
        except BaseException:  # the script's own failure: show it, exit 1
            traceback.print_exc()
            print(f"aotc: {script} failed (traceback above)", file=sys.stderr)
            code = EXIT_SCRIPT_FAILED
        finally:
            sys.argv, sys.path[:] = old_argv, old_path
            aotc.api.COMPILE_LISTENERS.remove(on_record)
            aotc.pipeline.COMPILE_FAILURE_LISTENERS.remove(on_failure)
            logging.getLogger("aotc.progress").setLevel(logging.WARNING)
    run.dynamo = dynamo.summary()
    run.seconds = time.perf_counter() - start
    return code, run


def _dump(script: str, script_args: list[str], out: str) -> int:
    os.makedirs(out, exist_ok=True)
    os.environ["AOTC_DUMP_DIR"] = os.path.abspath(out)
    try:
        code, run = _run_script(script, script_args)
    finally:
        del os.environ["AOTC_DUMP_DIR"]
    from aotc.report import DYNAMO_FILE, EXPLAIN_FILE, write_report

    with open(os.path.join(out, DYNAMO_FILE), "w") as f:
        json.dump(run.dynamo, f, indent=1, sort_keys=True)
    with open(os.path.join(out, EXPLAIN_FILE), "w") as f:
        f.write(explain_text(run.compiled, run.failed, run.dynamo) + "\n")
    start = time.perf_counter()
    report = write_report(out)
    failed = f", {len(run.failed)} failed compile(s)" if run.failed else ""
    print(f"aotc dump: {len(run.compiled)} compiled graph(s){failed} written under {out}/")
    print(
        f"aotc dump: the script ran {run.seconds:.1f} s; the report took "
        f"{time.perf_counter() - start:.1f} s ({report.pictures} pictures)"
    )
    print(f"aotc dump: open {report.html_path} to browse them")
    for note in report.notes:
        print(f"aotc dump: note: {note}")
    return code


def _explain(script: str, script_args: list[str]) -> int:
    code, run = _run_script(script, script_args)
    print(explain_text(run.compiled, run.failed, run.dynamo))
    return code


def _report(folder: str) -> int:
    if not os.path.isdir(folder):
        print(f"aotc report: no such folder: {folder!r}", file=sys.stderr)
        return EXIT_USAGE
    from aotc.report import write_report

    report = write_report(folder)
    if not report.graphs:
        print(f"aotc report: {folder} holds no graph folder (with 08_graph.json)", file=sys.stderr)
    print(f"aotc report: {len(report.graphs)} graph(s), {report.pictures} pictures")
    print(f"aotc report: open {report.html_path} to browse them")
    for note in report.notes:
        print(f"aotc report: note: {note}")
    return EXIT_OK


def _kernels_text(rec: Any, aten_calls: int) -> str:
    kernels = getattr(rec, "kernels", ())
    if not kernels:
        return f"{aten_calls} ATen calls (backend 'aten'; backend='triton' generates kernels)"
    from aotc.pipeline import kernel_resources_text

    names = ", ".join(k.name for k in kernels[:6]) + (" ..." if len(kernels) > 6 else "")
    text = f"{len(kernels)} generated Triton kernels ({names}) plus ATen calls for the rest"
    # per kernel on sm_90 and sm_80: registers, spills, shared memory, warps, stages, occupancy
    table = kernel_resources_text(rec).splitlines()
    return text + "".join(f"\n      {line}" for line in table if not line.startswith("# stage"))


def explain_text(
    compiled: Sequence[tuple[Any, ...]],
    failed: Sequence[tuple[Any, str | None]] = (),
    dynamo: Mapping[str, Any] | None = None,
) -> str:
    """One table per compiled graph, from (compiled function, record, recompile reason[,
    Dynamo compile id]); then the failed compiles and Dynamo's graph breaks."""
    dynamo = dynamo or {}
    frames = dynamo.get("frames", {})
    breaks = dynamo.get("graph_breaks", [])
    if not compiled and not failed:
        text = "aotc explain: the script compiled nothing with aotc."
        return "\n".join([text, *_break_lines(breaks)])
    lines: list[str] = []
    for i, (fn, rec, why, *rest) in enumerate(compiled):
        compile_id = rest[0] if rest else None
        rows = _graph_rows(fn, rec, why)
        rows += _dynamo_rows(frames.get(compile_id) if compile_id else None, compile_id)
        width = max(len(k) for k, _ in rows)
        lines.append(f"== graph {i}: {rec.name}")
        lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    for failure, compile_id in failed:
        lines.append(f"== failed: {failure.name}  ({failure.source})")
        where = f" (Dynamo frame {compile_id})" if compile_id else ""
        lines.append(f"  {failure.error_type}{where}: {failure.error}")
    lines += _break_lines(breaks)
    for compile_id, frame in sorted(frames.items()):
        if frame.get("fail_type"):
            lines.append(
                f"== Dynamo frame {compile_id} ({frame.get('function', '?')} at "
                f"{frame.get('where', '?')}) failed: {frame['fail_type']}: "
                f"{_cut(str(frame.get('fail_reason', '')), 300)}"
            )
    return "\n".join(lines)


def _graph_rows(fn: Any, rec: Any, why: str | None) -> list[tuple[str, str]]:
    graphs = [("joint", rec.joint), ("forward", rec.forward), ("backward", rec.backward)]
    ops = {
        label: sum(1 for n in g.graph.nodes if n.op == "call_function")
        for label, g in graphs
        if g is not None
    }
    part = rec.partition
    rows = [
        ("function", f"{rec.name}  ({rec.source})"),
        ("mode", "training (forward + backward)" if rec.training else "inference (forward)"),
        ("ops", ", ".join(f"{k} {v}" for k, v in ops.items())),
        ("kernels", _kernels_text(rec, ops.get("forward", 0) + ops.get("backward", 0))),
    ]
    if part is not None:
        ratio = part.saved_bytes / part.save_everything_bytes if part.save_everything_bytes else 0
        rows += [
            (
                "saved",
                f"{part.saved_bytes} B in {len(part.saved)} values "
                f"({ratio:.0%} of save-everything {part.save_everything_bytes} B)",
            ),
            (
                "recomputed",
                f"{len(part.recomputed)} ops"
                + (f": {', '.join(part.recomputed[:8])}" if part.recomputed else "")
                + (" ..." if len(part.recomputed) > 8 else ""),
            ),
        ]
    times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rec.stage_seconds.items())
    if getattr(rec, "is_cache_hit", False):
        cold = rec.cold_stage_seconds
        cold_times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in cold.items())
        rows.append(
            ("compile time", f"cache hit: loaded in {rec.compile_seconds * 1e3:.1f} ms ({times})")
        )
        rows.append(("original compile", f"{sum(cold.values()) * 1e3:.1f} ms ({cold_times})"))
    else:
        rows.append(("compile time", f"{rec.compile_seconds * 1e3:.1f} ms ({times})"))
    rows.append(("compiled because", why or "first call"))
    rows.append(("signatures", f"{len(fn.records)} compiled for this function"))
    return rows


def _dynamo_rows(frame: Mapping[str, Any] | None, compile_id: str | None) -> list[tuple[str, str]]:
    if compile_id is None:
        return []
    if frame is None:
        return [("dynamo frame", compile_id)]
    rows = [
        ("dynamo frame", f"{compile_id}: {frame.get('function', '?')} at {frame.get('where', '?')}")
    ]
    if frame.get("resumes_after"):
        rows.append(("resumes after", str(frame["resumes_after"])))
    for found in frame.get("graph_breaks", []):
        where = f" at {found['where']}" if found.get("where") else ""
        rows.append(("graph break", f"{found['reason']}{where}"))
    if frame.get("dynamo_seconds") is not None:
        rows.append(
            (
                "dynamo time",
                f"{frame['dynamo_seconds'] * 1e3:.1f} ms (frame {frame['frame_seconds'] * 1e3:.1f}"
                f" ms, aotc backend {frame['backend_seconds'] * 1e3:.1f} ms)",
            )
        )
    guards = frame.get("guards", [])
    if guards or frame.get("guard_count"):
        on_inputs = [g for g in guards if "L[" in g or "G[" in g] or guards
        shown = "; ".join(_cut(g, 100) for g in on_inputs[:3]) + (" ..." if len(guards) > 3 else "")
        rows.append(("guards", f"{frame.get('guard_count', len(guards))}: {shown}"))
    return rows


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _break_lines(breaks: Sequence[Mapping[str, Any]]) -> list[str]:
    if not breaks:
        return []
    lines = [f"== Dynamo graph breaks: {len(breaks)}"]
    for found in breaks:
        where = f" at {found['where']}" if found.get("where") else ""
        lines.append(f"  frame {found.get('compile_id', '?')}: {found['reason']}{where}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
