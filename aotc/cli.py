"""The `aotc` command: see what aotc compiled while a script ran.

    aotc dump SCRIPT.py [--out DIR] [-- script args]   every compiled graph under DIR + index.html
    aotc explain SCRIPT.py [-- script args]            a summary table per compiled graph
    aotc --version

The script runs unchanged in this process (as `__main__`); compilations by `aotc.compile` and by
`torch.compile(backend="aotc")` are captured. Exit codes: 0 ok, 1 the script failed (its
traceback is shown), 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Sequence
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
        "report and compile time, plus DIR/index.html with pictures of the graphs.",
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
    if not os.path.isfile(args.script):
        print(f"aotc {args.command}: no such script: {args.script!r}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "dump":
        return _dump(args.script, script_args, args.out)
    return _explain(args.script, script_args)


def _run_script(script: str, script_args: list[str], on_record: Callable[..., None]) -> int:
    """Run `script` as __main__ with `script_args`, calling `on_record(fn, record)` per
    compilation. Returns the exit code for the CLI."""
    import aotc.api
    from aotc.options import configure_logging

    configure_logging("progress")
    aotc.api.COMPILE_LISTENERS.append(on_record)
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            print(f"aotc: {script} exited with {e.code}", file=sys.stderr)
            return EXIT_SCRIPT_FAILED
    except BaseException:  # the script's own failure: show it, exit 1
        traceback.print_exc()
        print(f"aotc: {script} failed (traceback above)", file=sys.stderr)
        return EXIT_SCRIPT_FAILED
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
        aotc.api.COMPILE_LISTENERS.remove(on_record)
        logging.getLogger("aotc.progress").setLevel(logging.WARNING)
    return EXIT_OK


def _dump(script: str, script_args: list[str], out: str) -> int:
    os.makedirs(out, exist_ok=True)
    os.environ["AOTC_DUMP_DIR"] = os.path.abspath(out)
    records: list[Any] = []
    code = _run_script(script, script_args, lambda fn, rec, why: records.append(rec))
    del os.environ["AOTC_DUMP_DIR"]
    from aotc.report import write_report

    report = write_report(out)
    print(f"aotc dump: {len(records)} compiled graph(s) written under {out}/")
    print(f"aotc dump: open {report.html_path} to browse them")
    for note in report.notes:
        print(f"aotc dump: note: {note}")
    return code


def _explain(script: str, script_args: list[str]) -> int:
    seen: list[tuple[Any, Any, str | None]] = []
    code = _run_script(script, script_args, lambda fn, rec, why: seen.append((fn, rec, why)))
    print(explain_text(seen))
    return code


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


def explain_text(compiled: list[tuple[Any, Any, str | None]]) -> str:
    """One table per compiled graph, from (compiled function, record, recompile reason)."""
    if not compiled:
        return "aotc explain: the script compiled nothing with aotc."
    lines: list[str] = []
    for i, (fn, rec, why) in enumerate(compiled):
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
            ratio = (
                part.saved_bytes / part.save_everything_bytes if part.save_everything_bytes else 0
            )
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
        rows.append(("compile time", f"{rec.compile_seconds * 1e3:.1f} ms ({times})"))
        rows.append(("compiled because", why or "first call"))
        rows.append(("signatures", f"{len(fn.records)} compiled for this function"))
        width = max(len(k) for k, _ in rows)
        lines.append(f"== graph {i}: {rec.name}")
        lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
