"""The aotc error hierarchy (re-exported as `aotc.errors`).

It lives in `runtime` because the runtime raises these too, and `runtime` imports nothing above it.
Message shape: what happened, where (op, argument, source line), why, and how to fix it.
"""

from __future__ import annotations


class AotcError(RuntimeError):
    """Base class of every error aotc raises on its own behalf."""


class UnsupportedError(AotcError):
    """The user program does something aotc cannot compile."""


class GuardError(AotcError):
    """Run-time inputs do not match any compiled signature and recompiling is not allowed."""


class GraphInvariantError(AotcError):
    """A graph broke an invariant between stages: a bug in aotc."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"{message}\nThis is a bug in aotc; please report it with the dump from "
            "AOTC_DUMP_DIR=<dir>."
        )


class CacheError(AotcError):
    """A cache entry could not be read or written."""


def check(cond: bool, make_message: object) -> None:
    """Raise UnsupportedError with a lazily built message when `cond` is false (hot paths)."""
    if not cond:
        raise UnsupportedError(make_message())  # type: ignore[operator]
