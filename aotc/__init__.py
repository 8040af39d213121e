"""aotc: an ahead-of-time joint forward/backward graph compiler for PyTorch."""

from aotc.api import CompiledFunction, CompiledModule, compile, inspect
from aotc.errors import AotcError, GraphInvariantError, GuardError, UnsupportedError
from aotc.options import CompileOptions, configure_logging

configure_logging()

__version__ = "0.1.0"

__all__ = [
    "AotcError",
    "CompileOptions",
    "CompiledFunction",
    "CompiledModule",
    "GraphInvariantError",
    "GuardError",
    "UnsupportedError",
    "__version__",
    "compile",
    "inspect",
]
