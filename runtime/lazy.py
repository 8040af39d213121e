"""Values decoded on first use: `Deferred` (one value) and `GraphTable` (an entry's graphs).

A cache hit decodes what the call path needs (forward and backward graphs, the plan) and defers
what only inspection reads (the joint graphs, the partition report).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from torch import fx

from aotc.runtime.errors import CacheError
from aotc.runtime.fxcodec import check_graph

_T = TypeVar("_T")


class Deferred(Generic[_T]):
    """A value decoded on first use, once, under a lock. A hit decodes what the call path needs
    (forward and backward graphs, the plan) and defers what only inspection reads (the joint
    graphs: ~60% of a training entry's nodes). A deferred value that fails to decode raises
    CacheError then, naming the entry (the checksum already passed, so only a foreign or
    hand-edited entry can get there)."""

    def __init__(self, make: Callable[[], _T], where: str) -> None:
        self._make: Callable[[], _T] | None = make
        self._where = where
        self._lock = threading.Lock()
        self._value: _T | None = None

    @classmethod
    def of(cls, value: _T) -> Deferred[_T]:
        """A value that is already decoded (a cold compile's)."""
        out: Deferred[_T] = cls(lambda: value, "a value")
        out.get()
        return out

    @property
    def decoded(self) -> bool:
        """Whether the value was built (read, or given already decoded)."""
        return self._make is None

    def get(self) -> _T:
        with self._lock:
            if self._make is not None:
                try:
                    self._value = self._make()
                except (CacheError, RecursionError, ValueError, TypeError, KeyError) as e:
                    raise CacheError(
                        f"aotc cache: {self._where} cannot be decoded ({e}); delete "
                        "the entry or compile with cache=False"
                    ) from e
                self._make = None
        return self._value  # type: ignore[return-value]


class GraphTable(Sequence[fx.GraphModule]):
    """An entry's graphs, each built on first index (see `Deferred`). Every graph's node kinds
    and call targets are checked up front (`check_graph`, cheap), so a foreign op is still
    caught on load and the entry rebuilt."""

    def __init__(self, encoded: list[Any], decode_one: Callable[[int, Any], fx.GraphModule]):
        for g in encoded:
            check_graph(g)
        self._encoded = encoded
        self._decode_one = decode_one
        self._done: dict[int, fx.GraphModule] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._encoded)

    def __getitem__(self, i: int) -> fx.GraphModule:  # type: ignore[override]
        with self._lock:
            if i not in self._done:
                self._done[i] = self._decode_one(i, self._encoded[i])
            return self._done[i]


__all__ = ["Deferred", "GraphTable"]
