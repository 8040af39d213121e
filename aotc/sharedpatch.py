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
from collections.abc import Iterator
from typing import Any


class SharedPatch:
    def __init__(self, owner: object, replacements: dict[str, Any]) -> None:
        self.owner = owner
        self.replacements = replacements
        self.saved: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._holders = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                for name, value in self.replacements.items():
                    self.saved[name] = getattr(self.owner, name)
                    setattr(self.owner, name, value)
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    for name in self.replacements:
                        setattr(self.owner, name, self.saved.pop(name))
