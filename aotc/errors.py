"""aotc's error hierarchy. Defined in `runtime.errors` so the runtime can raise them too."""

from aotc.runtime.errors import (
    AotcError,
    CacheError,
    GraphInvariantError,
    GuardError,
    UnsupportedError,
)

__all__ = ["AotcError", "CacheError", "GraphInvariantError", "GuardError", "UnsupportedError"]
