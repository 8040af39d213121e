"""State guards: the Python state a compiled entry was traced with, re-checked on every call.

Stage: `StateGuard(items)` once per compiled entry (aotc/strict.py builds the items, see Note
[Strict capture guards] there); `guard()` on every call; `GuardedDispatcher`, strict mode's
dispatcher: per guard key a chain of entries, each with its state guard (and, with dynamic=True,
its shape guard); the first entry whose guards hold runs.
Requires: each `GuardItem.reader` is a cheap zero-argument callable re-reading one location the
trace read (a module attribute, a global, a closure cell, a container's length or keys); readers
are C-level partials where possible, so a check runs no Python frame per item.
Ensures: `guard()` is True only if every item reads what the trace read: the same object
(`Compare.IDENTITY`), an equal constant of the same type (`Compare.VALUE`), or an equal value
(`Compare.EQUAL`). A reader that raises fails the guard. `why()` names the first item that
differs, old and new value, and the user's line that read it.

Cost: the common case (nothing changed) is one generated straight-line function (Note [Generated
guard checks]); VALUE items start as identity checks too and fall back to an exact comparison only
when the object differs (`x.p = 0.1` assigned again), after which the new object is remembered.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from aotc.runtime.errors import GuardError, UnsupportedError
from aotc.runtime.guards import MISS, explain_bad_leaves, remember_probe, signature_key
from aotc.runtime.symbolic import coarse_key, make_guard
from aotc.runtime.wrappers import COMPILE_LOCK, describe_change

log = logging.getLogger("aotc.recompiles")


class Compare(enum.Enum):
    IDENTITY = "is"  # the same object (modules, functions, objects, containers)
    VALUE = "value"  # an equal constant of the same type (floats, bools, strings, tuples of them)
    EQUAL = "=="  # equal by `==` (lengths, key lists, snapshots of containers of constants)


@dataclass(frozen=True, slots=True)
class GuardItem:
    reader: Callable[[], object]
    expected: object
    compare: Compare
    what: str  # e.g. "self.drop.p", "global SCALE", "len(closure log)"
    where: str = ""  # the user's line that read it, when known


class StateGuard:
    """All state items of one compiled entry. `check()` checks them (generated straight-line
    code, see Note [Generated guard checks]); `why()` explains a failure."""

    __slots__ = ("items", "check", "_expected")

    def __init__(self, items: Sequence[GuardItem]) -> None:
        self.items = tuple(items)
        self._expected = [i.expected for i in self.items]  # VALUE entries refreshed in place
        self.check = _generate_check(self.items, self._expected, self._refresh)

    def __call__(self) -> bool:
        return self.check()

    def inline(self) -> tuple[list[str], dict[str, object]]:
        """The check's lines for a `try:` body that returns MISS on a failing item, and their
        names (prefixed `s_`): Note [Fused guard and call] in runtime/guards.py. A reader that
        raises must make the caller return MISS too (its `except Exception`)."""
        return _check_lines(self.items, self._expected, self._refresh, "MISS", "s_")

    def _refresh(self, k: int) -> bool:
        """Item k (VALUE) read a different object: equal constants pass, and the new object is
        remembered so the next check is an identity check again."""
        value = self.items[k].reader()
        if same_constant(value, self._expected[k]):
            self._expected[k] = value
            return True
        return False

    def why(self) -> str | None:
        """The first item that fails, in words (off the hot path)."""
        for k, item in enumerate(self.items):
            try:
                value = item.reader()
            except Exception as e:
                return f"{item.what} cannot be read any more ({type(e).__name__}: {e})" + _at(item)
            expected = self._expected[k]
            if item.compare is Compare.IDENTITY:
                ok = value is expected
            elif item.compare is Compare.VALUE:
                ok = same_constant(value, expected)
            else:
                try:
                    ok = bool(value == expected)
                except Exception:
                    ok = False
            if not ok:
                return f"{item.what} changed: {_short(expected)} -> {_short(value)}" + _at(item)
        return None

    def format(self) -> str:
        return "\n".join(
            f"{i.what} {i.compare.value} {_short(i.expected)}" + _at(i) for i in self.items
        )


# Note [Generated guard checks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A check runs on every call, so it is generated once per entry as straight-line Python with
# every reader and expected object bound as a name, like runtime/fastpath.py does for calls:
#
#     def check():
#         try:
#             if r0() is not x0: return False                        # IDENTITY
#             if r1() is not e[1] and not refresh(1): return False   # VALUE
#             if r2() != x2: return False                            # EQUAL
#             return True
#         except Exception:
#             return False
#
# Measured on the tiny program of bench/overhead.py (two items): ~0.2 us, against ~1.2 us for a
# `map` over the readers (building two lists per call).


def _check_lines(
    items: Sequence[GuardItem],
    expected: list[object],
    refresh: Callable[[int], bool],
    fail: str,
    prefix: str = "",
) -> tuple[list[str], dict[str, object]]:
    """One line per item (indented for a `try:` body) that returns `fail` when the item fails,
    and the names they use, each starting with `prefix`."""
    e, fresh = f"{prefix}e", f"{prefix}refresh"
    namespace: dict[str, object] = {e: expected, fresh: refresh}
    lines = []
    for k, item in enumerate(items):
        r, x = f"{prefix}r{k}", f"{prefix}x{k}"
        namespace[r] = item.reader
        if item.compare is Compare.VALUE:
            lines.append(f"        if {r}() is not {e}[{k}] and not {fresh}({k}): return {fail}")
        elif item.compare is Compare.IDENTITY:
            namespace[x] = item.expected
            lines.append(f"        if {r}() is not {x}: return {fail}")
        else:
            namespace[x] = item.expected
            lines.append(f"        if {r}() != {x}: return {fail}")
    return lines, namespace


def _generate_check(
    items: Sequence[GuardItem], expected: list[object], refresh: Callable[[int], bool]
) -> Callable[[], bool]:
    body, namespace = _check_lines(items, expected, refresh, "False")
    lines = ["def check():", "    try:", *body]
    lines += [
        "        return True",
        "    except Exception:  # a location that cannot be read any more: the state changed",
        "        return False",
    ]
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<aotc state guard>", "exec"), namespace)  # noqa: S102
    return namespace["check"]  # type: ignore[return-value]


def same_constant(a: object, b: object) -> bool:
    """Exact equality of constants: same type and value (1, 1.0 and True differ; so do 0.0 and
    -0.0; NaN equals NaN), elementwise for tuples."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(map(same_constant, a, b))
    if isinstance(a, float) and isinstance(b, float):
        if a != a:  # noqa: PLR0124 (NaN)
            return b != b  # noqa: PLR0124
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _short(value: object) -> str:
    if type(value).__name__ == "_Missing":
        return "<absent>"
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return repr(value)
    text = repr(value) if isinstance(value, (tuple, list)) and len(value) <= 8 else ""
    if text and len(text) <= 80:
        return text
    return f"<{type(value).__name__} object at {id(value):#x}>"


def _at(item: GuardItem) -> str:
    return f" (read at {item.where})" if item.where else ""


class Retry(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by a compile callback: the caller must read its inputs again and call again (the
    locations the function reads moved, see aotc/api.py)."""


@dataclass
class History:
    """Shared by the dispatchers of one compiled function (one per lifting generation)."""

    reasons: list[str] = field(default_factory=list)
    count: int = 0  # entries compiled, all generations
    pending: str | None = None  # the reason for the next compile, when known before it


class _Link:
    __slots__ = ("entry", "guard", "state", "shape")

    def __init__(
        self,
        entry: object,
        guard: StateGuard | None,
        shape: Callable[[list[object]], bool] | None,
    ) -> None:
        self.entry, self.guard, self.shape = entry, guard, shape
        self.state = guard.check if guard is not None else None

    def admits(self, leaves: list[object]) -> bool:
        return (self.state is None or self.state()) and (self.shape is None or self.shape(leaves))


# (leaves, key) -> (entry, shape guard expression or None, state guard or None)
CompileFn = Callable[
    [list[object], tuple[object, ...]], tuple[object, str | None, StateGuard | None]
]


class GuardedDispatcher:
    """Maps guard keys to chains of compiled entries. Compiles under a lock, so concurrent first
    calls compile once; calls whose entry admits them take no lock."""

    def __init__(
        self,
        compile_entry: CompileFn,
        name: str,
        warn_limit: int,
        max_signatures: int,
        history: History,
        symbolic: bool = False,
    ) -> None:
        self._compile = compile_entry
        self._heads: dict[tuple[object, ...], _Link] = {}
        self._chains: dict[tuple[object, ...], list[_Link]] = {}
        self._all: list[object] = []
        self._lock = threading.Lock()
        self._name = name
        self._warn_limit = warn_limit
        self._max = max_signatures
        self._history = history
        self._symbolic = symbolic
        self._key: Callable[[Sequence[object]], tuple[object, ...]]
        if symbolic:
            self._key = coarse_key
        else:
            self._key = signature_key
        # The link that ran last: its key's extra part and its probe, the signature check,
        # state guard and call in one generated function (static keys only): see Note [Fused
        # guard and call] in runtime/guards.py.
        self._last: tuple[object, Callable[[Sequence[object]], object]] | None = None
        self._probes: dict[tuple[object, ...], Callable[[Sequence[object]], object] | None] = {}
        # The last link's probe when the key's extra part is the arity of a call of plain tensors
        # and nothing else is a leaf: aotc/api.py runs it on the call's arguments directly.
        self.plain_probe: Callable[[Sequence[object]], object] | None = None

    @property
    def entries(self) -> list[object]:
        return list(self._all)

    @property
    def recompile_reasons(self) -> list[str]:
        return self._history.reasons

    def __call__(self, leaves: list[object], extra: object) -> object:
        return self.run(leaves, extra)

    def run(self, leaves: list[object], extra: object) -> object:
        """The call's entry run on `leaves` (callers on the hot path call this method: calling
        the instance goes through its `__call__` slot, ~0.3 us more)."""
        last = self._last
        if last is not None and extra == last[0]:
            out = last[1](leaves)
            if out is not MISS:
                return out
        return self.run_missed(leaves, extra)

    def run_missed(self, leaves: list[object], extra: object) -> object:
        """`run` after the last link's probe missed (or without one)."""
        try:
            key = (extra, self._key(leaves))
            link = self._heads.get(key)
        except (RuntimeError, TypeError) as e:
            reason = explain_bad_leaves(leaves, ())
            if reason is None:
                raise
            raise UnsupportedError(f"{self._name}: {reason}") from e
        if link is None or not (link.state is None or link.state()):
            link = self._miss(key, leaves)
        elif link.shape is not None and not link.shape(leaves):
            link = self._miss(key, leaves)
        if not self._symbolic:
            self._remember(key, link, leaves)
        return link.entry.call(leaves)  # type: ignore[attr-defined]

    def _remember(self, key: tuple[object, ...], link: _Link, leaves: list[object]) -> None:
        """Make `link` the one checked first (its check is generated once per key, `leaves` are
        the call's that made it)."""
        self._last = last = remember_probe(
            self._probes, key, link.entry, link.guard, arity_extra=True, leaves=leaves
        )
        extra = key[0]
        plain = last is not None and type(extra) is int and extra == len(key[1][0])  # type: ignore[index]
        self.plain_probe = last[1] if plain else None  # type: ignore[index]

    def _miss(self, key: tuple[object, ...], leaves: list[object]) -> _Link:
        with COMPILE_LOCK, self._lock:
            chain = self._chains.get(key, [])
            for link in chain:  # another thread compiled it, or an older entry admits the state
                if link.admits(leaves):
                    self._heads[key] = link
                    return link
            history = self._history
            reason = history.pending
            history.pending = None
            if reason is None and chain:
                guard = chain[0].guard
                reason = guard.why() if guard is not None else None
                reason = reason or "the input sizes fall outside the symbolic guards"
            if reason is None and self._heads:
                reason = describe_change(next(reversed(self._heads)), key)
            if reason is not None:
                history.reasons.append(reason)
                log.info("recompiling %s: %s", self._name, reason)
                self._check_limits(reason)
            try:
                entry, shape_code, state = self._compile(leaves, key)
            except Retry:  # the caller calls again with other leaves: that miss records it
                if reason is not None:
                    history.reasons.pop()
                history.pending = reason
                raise
            shape = _shape_guard(shape_code) if self._symbolic else None
            link = _Link(entry, state, shape)
            chain.insert(0, link)
            self._chains[key] = chain
            self._heads[key] = link
            self._all.append(entry)
            history.count += 1
            return link

    def _check_limits(self, reason: str) -> None:
        count = self._history.count
        if count >= self._max:
            raise GuardError(
                f"{self._name} has been compiled {count} times (max_signatures={self._max}); "
                f"the last change was {reason}. Keep shapes, dtypes and the Python values it "
                "reads stable, or raise max_signatures."
            )
        if count == self._warn_limit:
            warnings.warn(
                f"aotc: {self._name} recompiled {count} times; the last change was {reason}. "
                "Frequent recompiles cost compile time.",
                stacklevel=5,
            )


def _shape_guard(code: str | None) -> Callable[[list[object]], bool] | None:
    if code is None:
        return None
    guard = make_guard(code)
    tensor = torch.Tensor
    return lambda leaves: guard([t for t in leaves if isinstance(t, tensor)])
