"""The `aotc` command. This version has `--version` and `--help`; `dump` and `explain` come
with the CLI issue. Exit codes: 0 ok, 2 usage error."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aotc",
        description="aotc: ahead-of-time joint forward/backward graph compiler for PyTorch. "
        "Compile with `aotc.compile(fn_or_module)`; set AOTC_DUMP_DIR=DIR (or "
        "aotc.compile(..., dump=DIR)) to write every compiled graph under DIR.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    if args.version:
        import torch

        from aotc import __version__

        print(f"aotc {__version__} (torch {torch.__version__})")
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
