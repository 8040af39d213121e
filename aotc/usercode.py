"""What counts as the user's code, and what a code object loads: shared by strict mode's recorder
(aotc/recording.py) and its guards (aotc/strict.py).

Stage: helpers, no records of their own besides `CodeFacts`.
Ensures: `is_user_file(path)` is False for torch, aotc, the standard library and installed packages
(library code: its state is taken as constant, see Note [Strict capture guards] in aotc/strict.py);
`code_facts(code)` lists the globals a code object (and the code nested in it) loads and stores,
the cells it stores, the names it calls mutating methods on, and every name it loads (locals,
cells, globals, attributes), each with its first line.
"""

from __future__ import annotations

import contextlib
import dis
import enum
import importlib
import linecache
import os
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import Any

import torch


class _Missing:
    """The value of a location that holds nothing (an absent attribute or global)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<absent>"


MISSING: Any = _Missing()

_CONSTANT_TYPES = (
    type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis),
    type(NotImplemented), torch.dtype, torch.device, torch.layout, torch.memory_format,
)  # fmt: skip


def is_constant(value: object) -> bool:
    """Immutable values compared by value: numbers, strings, dtypes, enum members, and tuples,
    frozensets and slices of constants."""
    if isinstance(value, _CONSTANT_TYPES):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(map(is_constant, value))
    if isinstance(value, slice):
        return is_constant((value.start, value.stop, value.step))
    return isinstance(value, enum.Enum)


MUTATORS = frozenset(
    {
        "append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update",
        "setdefault", "popitem", "add", "discard", "appendleft", "extendleft", "popleft",
        "__setitem__", "__delitem__", "__iadd__",
    }
)  # fmt: skip

# ---------------------------------------------------------------- user code and library code


def _library_dirs() -> tuple[str, ...]:
    import aotc

    dirs = {
        os.path.dirname(os.path.abspath(torch.__file__)),
        os.path.dirname(os.path.abspath(aotc.__file__)),
    }
    for name in ("aotc.passes", "aotc.runtime"):  # imported here: aotc.passes is lazy
        module = importlib.import_module(name)
        if module.__file__:
            dirs.add(os.path.dirname(os.path.abspath(module.__file__)))
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            dirs.add(os.path.abspath(paths[key]))
    with contextlib.suppress(Exception):
        import site

        dirs.update(os.path.abspath(p) for p in site.getsitepackages())
    return tuple(d.rstrip(os.sep) + os.sep for d in sorted(dirs))


_LIBRARY: tuple[str, ...] | None = None
_USER_FILE: dict[str, bool] = {}


def is_user_file(filename: str) -> bool:
    """Code outside torch, aotc, the standard library and installed packages: the user's own.
    Library code and library state are taken as constant (see Note [Strict capture guards])."""
    known = _USER_FILE.get(filename)
    if known is not None:
        return known
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = _library_dirs()
    if filename.startswith("<frozen"):
        user = False
    else:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        user = not path.startswith(_LIBRARY)
    _USER_FILE[filename] = user
    return user


def is_user_function(fn: object) -> bool:
    code = getattr(fn, "__code__", None)
    return isinstance(code, types.CodeType) and is_user_file(code.co_filename)


def is_user_class(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    return bool(path) and is_user_file(path)  # type: ignore[arg-type]


def user_line(skip: int = 1) -> str:
    """`file:line (source)` of the innermost user frame on the stack, or ""."""
    frame = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            return format_line(code.co_filename, frame.f_lineno)
        frame = frame.f_back  # type: ignore[assignment]
    return ""


def format_line(filename: str, lineno: int | None) -> str:
    if lineno is None:
        return filename
    source = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno}" + (f" ({source})" if source else "")


# ---------------------------------------------------------------- what code can load


@dataclass(frozen=True, slots=True)
class CodeFacts:
    """Names a code object (and the code nested in it) loads and stores, with first lines."""

    load_globals: dict[str, int]
    store_globals: dict[str, int]
    store_derefs: dict[str, int]
    mutations: dict[str, int]  # `name.append(...)`-like calls: the loaded name -> line
    uses: dict[str, int]  # every name loaded (local, cell, global, attribute) -> first line


# id(code) -> (code, facts): keyed by identity, since hashing a code object hashes its constants
# (a generated code may hold an unhashable one); the code is kept so its id stays its own
_FACTS: dict[int, tuple[types.CodeType, CodeFacts]] = {}


def code_facts(code: types.CodeType) -> CodeFacts:
    known = _FACTS.get(id(code))
    if known is None:
        known = _FACTS[id(code)] = (code, _scan(code))
    return known[1]


def _scan(code: types.CodeType) -> CodeFacts:
    loads: dict[str, int] = {}
    stores: dict[str, int] = {}
    derefs: dict[str, int] = {}
    mutations: dict[str, int] = {}
    uses: dict[str, int] = {}
    todo = [code]
    while todo:
        current = todo.pop()
        line = current.co_firstlineno
        previous: dis.Instruction | None = None
        for ins in dis.get_instructions(current):
            if ins.positions is not None and ins.positions.lineno is not None:
                line = ins.positions.lineno
            if ins.opname in _LOADS_A_NAME and isinstance(ins.argval, str):
                uses.setdefault(ins.argval, line)
            if ins.opname == "LOAD_GLOBAL":
                loads.setdefault(ins.argval, line)
            elif ins.opname == "STORE_GLOBAL" or ins.opname == "DELETE_GLOBAL":
                stores.setdefault(ins.argval, line)
            elif ins.opname in ("STORE_DEREF", "DELETE_DEREF"):
                derefs.setdefault(ins.argval, line)
            elif (
                ins.opname in ("LOAD_METHOD", "LOAD_ATTR")
                and ins.argval in MUTATORS
                and previous is not None
                and previous.opname
                in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_FAST", "LOAD_ATTR", "LOAD_NAME")
            ):
                mutations.setdefault(previous.argval, line)
            previous = ins
        todo.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return CodeFacts(loads, stores, derefs, mutations, uses)


_LOADS_A_NAME = frozenset(
    {"LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR",
     "LOAD_METHOD", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST"}
)  # fmt: skip
