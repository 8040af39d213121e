"""Lifting: tensors a program reads without receiving them become graph inputs.

Stage: `find_free_tensors(fn) -> tuple[Access, ...]`.
Ensures: one `Access` per distinct location (closure cell, global name, module parameter, buffer or
plain tensor attribute, or an element of a list/tuple/dict held there). Each call re-reads every
location, so rebinding (`model.weight = new`, `global w; w = ...`) is seen, and the trace swaps
fake tensors into exactly these locations, so nothing real is baked into a graph.

Objects aotc does not walk into (an optimizer, a custom class) are not lifted: a tensor reached
through them reaches the trace as a real tensor, and the trace raises UnsupportedError naming it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

_MAX_DEPTH = 3


@dataclass(frozen=True, slots=True)
class Access:
    name: str  # e.g. "closure w", "global table[2]", "self.linear.weight"
    get: Callable[[], object]
    set: Callable[[object], None]


def module_accesses(module: torch.nn.Module, prefix: str) -> list[Access]:
    out: list[Access] = []
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        where = f"{prefix}.{mod_name}" if mod_name else prefix
        for name in list(mod._parameters):
            if mod._parameters[name] is not None:
                out.append(_dict_access(f"{where}.{name}", mod._parameters, name))
        for name in list(mod._buffers):
            if mod._buffers[name] is not None:
                out.append(_dict_access(f"{where}.{name}", mod._buffers, name))
        for name, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor) and not name.startswith("__"):
                out.append(_dict_access(f"{where}.{name}", vars(mod), name))
    return out


def module_training_flags(module: torch.nn.Module) -> Callable[[], tuple[bool, ...]]:
    modules = [m for _, m in module.named_modules()]
    return lambda: tuple(m.training for m in modules)


def find_free_tensors(fn: Callable[..., object]) -> tuple[Access, ...]:
    found: list[Access] = []
    if isinstance(fn, types.MethodType) and isinstance(fn.__self__, torch.nn.Module):
        found += module_accesses(fn.__self__, "self")
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        return tuple(found)
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        found += _visit(value, f"closure {name}", _cell_setter(cell), 0)
    globals_ = getattr(fn, "__globals__", {})
    for name in sorted(_global_names(code)):
        if name in globals_:
            found += _visit(globals_[name], f"global {name}", _dict_setter(globals_, name), 0)
    return tuple(_dedupe(found))


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _visit(
    value: object, name: str, setter: Callable[[object], None], depth: int
) -> list[Access]:
    if isinstance(value, torch.Tensor):
        return [Access(name, setter.read, setter)]  # type: ignore[attr-defined]
    if isinstance(value, torch.nn.Module):
        return module_accesses(value, name.split(" ", 1)[-1])
    if depth >= _MAX_DEPTH:
        return []
    out: list[Access] = []
    if isinstance(value, list):
        for i, item in enumerate(value):
            out += _visit(item, f"{name}[{i}]", _dict_setter(value, i), depth + 1)  # type: ignore[arg-type]
    elif isinstance(value, dict):
        for key in list(value):
            out += _visit(value[key], f"{name}[{key!r}]", _dict_setter(value, key), depth + 1)
    return out


class _dict_setter:
    """Reads and writes one slot of a dict or list (globals, module dicts, containers)."""

    __slots__ = ("container", "key")

    def __init__(self, container: dict | list, key: object) -> None:  # type: ignore[type-arg]
        self.container, self.key = container, key

    def __call__(self, value: object) -> None:
        self.container[self.key] = value  # type: ignore[index]

    def read(self) -> object:
        return self.container[self.key]  # type: ignore[index]


class _cell_setter:
    __slots__ = ("cell",)

    def __init__(self, cell: types.CellType) -> None:
        self.cell = cell

    def __call__(self, value: object) -> None:
        self.cell.cell_contents = value

    def read(self) -> object:
        return self.cell.cell_contents


def _dict_access(name: str, container: dict, key: str) -> Access:  # type: ignore[type-arg]
    slot = _dict_setter(container, key)
    return Access(name, slot.read, slot)


def _dedupe(accesses: list[Access]) -> list[Access]:
    seen: set[tuple[int, object]] = set()
    out = []
    for a in accesses:
        slot = a.set
        ident = (id(getattr(slot, "container", getattr(slot, "cell", slot))), getattr(slot, "key", None))
        if ident not in seen:
            seen.add(ident)
            out.append(a)
    return out


@contextlib.contextmanager
def swapped(accesses: Sequence[Access], values: Sequence[object]) -> Iterator[None]:
    """Put `values` into the accessed locations for the duration of a trace."""
    old = [a.get() for a in accesses]
    try:
        for a, v in zip(accesses, values, strict=True):
            a.set(v)
        yield
    finally:
        for a, v in zip(reversed(accesses), reversed(old)):
            a.set(v)
