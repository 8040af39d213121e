"""aotc: an ahead-of-time joint forward/backward graph compiler for PyTorch.

Importing `aotc` is cheap and imports no compiler stage: the public names below resolve on first
use (PEP 562), so a process that only runs compiled artifacts (`aotc.runtime`) never imports
`aotc.passes`, networkx or sympy.

Note [One import name]
~~~~~~~~~~~~~~~~~~~~~~
Everything aotc installs lives under the import name `aotc`: the compiler front end (`aotc.*`),
the graph passes (`aotc.passes`) and the runtime (`aotc.runtime`). The repository keeps the passes
and the runtime in the top-level folders `passes/` and `runtime/` (the project's required
layout); pyproject's `package-dir` maps them to `aotc.passes` and `aotc.runtime` when installed.
Run from a checkout without installing (`PYTHONPATH=.`, as on GPU machines), `_map_checkout`
below binds the same two names to those folders. Nothing named `runtime` or `passes` is ever
imported at top level, so a user's own `runtime/` folder or `runtime.py` cannot shadow ours.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _map_checkout() -> None:
    """See Note [One import name]: in a checkout (this package has no runtime/ of its own and the
    repository's runtime/ and passes/ sit beside it), bind aotc.runtime and aotc.passes to them.
    Decided by the layout on disk, so a second checkout on PYTHONPATH uses its own folders even
    where an editable install of another checkout is present. `aotc.runtime` is imported here
    (the errors below live in it); `aotc.passes` only when first imported (a finder at the front of
    `sys.meta_path`), so a process that only loads artifacts never imports the compiler."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    for name in ("runtime", "passes"):
        full = f"{__name__}.{name}"
        init = os.path.join(root, name, "__init__.py")
        if full in sys.modules or os.path.isdir(os.path.join(here, name)):
            continue  # already bound, or installed inside this package
        if not os.path.isfile(init):
            continue  # not a checkout: the installer's mapping finds it
        if name == "passes":
            sys.meta_path.insert(0, _CheckoutFinder(full, init))  # before an editable install's
            continue
        spec = _CheckoutFinder(full, init).find_spec(full)
        assert spec is not None and spec.loader is not None, init
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
        globals()[name] = module


class _CheckoutFinder:
    """Finds one package of the checkout (`aotc.passes` -> <root>/passes) by its full name."""

    def __init__(self, name: str, init: str) -> None:
        self.name, self.init = name, init

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(
            fullname, self.init, submodule_search_locations=[os.path.dirname(self.init)]
        )


_map_checkout()

from aotc.runtime.errors import (  # noqa: E402  (needs _map_checkout in a checkout)
    AotcError,
    CacheError,
    GraphInvariantError,
    GuardError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from aotc.api import CompiledFunction, CompiledModule, cache_flush, compile, inspect
    from aotc.capture import DynamoFunction, DynamoModule
    from aotc.exporting import export
    from aotc.options import Backend, Capture, CompileOptions, Partitioner, configure_logging
    from aotc.runtime.artifact import ArtifactError, LoadedArtifact, load

# Public name -> the module that defines it (imported on first access).
_LAZY = {
    "CompiledFunction": "aotc.api",
    "CompiledModule": "aotc.api",
    "DynamoFunction": "aotc.capture",
    "DynamoModule": "aotc.capture",
    "compile": "aotc.api",
    "inspect": "aotc.api",
    "cache_flush": "aotc.api",
    "CompileOptions": "aotc.options",
    "Backend": "aotc.options",
    "Capture": "aotc.options",
    "Partitioner": "aotc.options",
    "configure_logging": "aotc.options",
    # export needs the compiler; load and its records only the runtime (runtime/artifact.py)
    "export": "aotc.exporting",
    "load": "aotc.runtime.artifact",
    "LoadedArtifact": "aotc.runtime.artifact",
    "ArtifactError": "aotc.runtime.artifact",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aotc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AotcError",
    "Backend",
    "ArtifactError",
    "CacheError",
    "Capture",
    "CompileOptions",
    "CompiledFunction",
    "CompiledModule",
    "DynamoFunction",
    "DynamoModule",
    "GraphInvariantError",
    "GuardError",
    "Partitioner",
    "LoadedArtifact",
    "UnsupportedError",
    "__version__",
    "cache_flush",
    "compile",
    "configure_logging",
    "export",
    "inspect",
    "load",
]


def _skip_own_frames() -> None:
    from aotc.dynamo_skip import skip_own_frames
    from aotc.fake_log import quiet_fake_tensor_errors

    skip_own_frames()
    quiet_fake_tensor_errors()  # Note [Fake tensor error logs] in aotc/fake_log.py


_skip_own_frames()  # Note [aotc frames under Dynamo] in aotc/dynamo_skip.py


class _BackendEntry:
    """Stands in for the installed entry point: Dynamo calls `load()` the first time a
    `torch.compile` asks for `backend="aotc"`, so `import aotc` alone loads no compiler."""

    name = "aotc"
    value = "aotc.backend:aotc_backend"
    group = "torch_dynamo_backends"

    def load(self) -> Any:
        from aotc.backend import aotc_backend

        return aotc_backend


def _register_backend_name() -> None:
    """`torch.compile(model, backend="aotc")` where no entry point names the backend: a checkout
    on PYTHONPATH (uninstalled, as on a lent GPU machine) or a vendored copy. An installed aotc's
    entry point, once Dynamo reads the installed ones, takes the place of this one (the same
    function either way)."""
    try:
        from torch._dynamo.backends import registry
    except ImportError:  # a torch without Dynamo: the name has nothing to register with
        return
    backends = getattr(registry, "_BACKENDS", None)
    compilers = getattr(registry, "_COMPILER_FNS", None)
    if not isinstance(backends, dict) or not isinstance(compilers, dict):
        return  # another registry layout: only the installed entry point names the backend
    if "aotc" not in compilers and backends.get("aotc") is None:
        backends["aotc"] = _BackendEntry()


_register_backend_name()
