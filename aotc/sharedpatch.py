"""Replacing attributes of a library object while any of aotc's traces needs it.

Stage: `patch = SharedPatch(owner, {name: replacement})`; `with patch.held(): ...` around each
trace that needs the replacements. The first holder installs them, the last one restores what it
found; `patch.saved[name]` is the replaced value, for a replacement that calls through.
Requires: replacements check for themselves which thread or trace they serve (other threads see
them too while any holder is inside).
Ensures: nested and concurrent holders install once and restore once, to the values found on the
first install (a patch installed by someone else after that is undone with it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_MISSING = object()


class SharedPatch:
    """`owner` is an object whose attributes are replaced, or a dict whose items are (an item
    missing at install is removed again at restore). `after` runs after every install and
    restore (to drop caches built from the replaced values)."""

    def __init__(
        self,
        owner: object,
        replacements: dict[Any, Any],
        after: Callable[[], object] | None = None,
    ) -> None:
        self.owner = owner
        self.replacements = replacements
        self.after = after
        self.saved: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self._holders = 0

    def _get(self, name: Any) -> Any:
        if isinstance(self.owner, dict):
            return self.owner.get(name, _MISSING)
        if isinstance(self.owner, type) and name in vars(self.owner):
            return vars(self.owner)[name]  # as defined: a staticmethod comes back as one
        return getattr(self.owner, name)

    def _set(self, name: Any, value: Any) -> None:
        if not isinstance(self.owner, dict):
            setattr(self.owner, name, value)
        elif value is _MISSING:
            self.owner.pop(name, None)
        else:
            self.owner[name] = value

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                for name, value in self.replacements.items():
                    self.saved[name] = self._get(name)
                    self._set(name, value)
                if self.after is not None:
                    self.after()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    for name in self.replacements:
                        self._set(name, self.saved.pop(name))
                    if self.after is not None:
                        self.after()
