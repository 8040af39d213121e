"""Run mypy over aotc/, passes/ and runtime/ as the one package `aotc` (see `make typecheck`).

Note [Type-checking the one import name]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Installed, `passes/` and `runtime/` are `aotc.passes` and `aotc.runtime` (pyproject's
package-dir); in a checkout `aotc/__init__.py` binds them at import time. mypy knows neither
mapping: it names a file by the folders above it, so `passes/ir.py` would be `passes.ir`, and
`from aotc.passes.ir import ...` would not resolve. mypy's own command line runs here, with one
change: the files it collects from passes/ and runtime/ are given their installed module names
(`passes.ir` -> `aotc.passes.ir`) before the build. mypy then checks the real files, at their real
paths (errors name `passes/ir.py`), and every `aotc.passes.*`/`aotc.runtime.*` import resolves to
them. The settings (strictness per package) are in pyproject.toml under [tool.mypy].
"""

from __future__ import annotations

import os
import sys
import time

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAPPED = ("passes", "runtime")  # top-level folders installed as aotc.<name>


def main() -> int:
    os.chdir(ROOT)
    # Extra files (e.g. a script using aotc) are checked along with the package, whose folders
    # must be sources for the mapping below.
    extra = sys.argv[1:]
    args = [
        "--config-file",
        "pyproject.toml",
        *extra,
        *(["aotc", "passes", "runtime"] * bool(extra)),
    ]
    t0 = time.time()
    fscache = FileSystemCache()
    sources, options = process_options(args, fscache=fscache)
    for source in sources:
        if (source.module or "").split(".")[0] in MAPPED:
            source.module = f"aotc.{source.module}"
    _, messages, blockers = run_build(sources, options, fscache, t0, sys.stdout, sys.stderr)
    n_errors, n_notes, n_files = util.count_stats(messages)
    if n_errors:
        print(f"Found {n_errors} errors in {n_files} files (checked {len(sources)} source files)")
        return 2 if blockers else 1
    print(f"Success: no issues found in {len(sources)} source files ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as mypy does: freeing the build's objects takes longer than the check
