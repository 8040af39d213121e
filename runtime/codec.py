"""The plain codec: compiled records as JSON values and back, with no pickle and no code.

Stage: `encode(obj, graphs, ids) -> JSON value` / `decode(value, graphs) -> obj`.
Requires: records are frozen dataclasses and enums registered with `register_records` (by
qualified name; runtime/records.py registers the runtime's), fx GraphModules of ATen/prims ops
(written by runtime/fxcodec.py into the `graphs` list and referenced by index), and plain values.
Ensures: `decode(encode(x))` rebuilds `x`; `decode` raises CacheError on anything `encode` does
not write. Used by the disk cache (runtime/cache.py) and exported artifacts
(runtime/artifact.py). Tags: records `{"R": name, "f": {field: value}}`; enums `{"E": name,
"v": value}`; tuples `{"T": [...]}`; dicts `{"D": {...}}`; graphs `{"G": index}`; dtypes,
devices, layouts and memory formats as tagged names resolved against a fixed table.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from aotc.runtime.errors import CacheError


class Uncachable(Exception):
    """A value has no plain encoding: the compile result is used but not stored."""


_RECORDS: dict[str, type] = {}


def register_records(*classes: type) -> None:
    """Allow these frozen dataclasses / enums in cache entries (by qualified name)."""
    for cls in classes:
        _RECORDS[f"{cls.__module__}.{cls.__qualname__}"] = cls


_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_LAYOUTS = {
    str(x).removeprefix("torch."): x for x in vars(torch).values() if isinstance(x, torch.layout)
}
_FORMATS = {
    str(x).removeprefix("torch."): x
    for x in vars(torch).values()
    if isinstance(x, torch.memory_format)
}


def encode(
    value: Any,
    graphs: list[dict[str, Any]] | None = None,
    graph_ids: dict[int, int] | None = None,
    symbols_as_text: bool = False,
) -> Any:
    """A JSON value for `value`; GraphModules go to `graphs` (shared ones stored once).
    `symbols_as_text`: symbolic sizes (in records only inspection reads, e.g. the shapes of saved
    values of a symbolic compilation) become their text; elsewhere they are not encodable."""
    enc: Callable[[Any], Any] = lambda v: encode(v, graphs, graph_ids, symbols_as_text)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if symbols_as_text and isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {"Y": str(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {"F": repr(value)}
    if isinstance(value, complex):
        return {"C": [enc(value.real), enc(value.imag)]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"mf": str(value).removeprefix("torch.")}
    if isinstance(value, enum.Enum):
        return {"E": _registered_name(type(value)), "v": enc(value.value)}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"T": [enc(v) for v in value]}
    if isinstance(value, list):
        return [enc(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"D": {k: enc(v) for k, v in value.items()}}
    if isinstance(value, pytree.TreeSpec):
        try:
            return {"S": pytree.treespec_dumps(value)}
        except Exception as e:  # any type without a serialization name
            raise Uncachable(f"output structure {value} is not serializable ({e})") from e
    if isinstance(value, fx.GraphModule):
        if graphs is None or graph_ids is None:
            raise Uncachable("graph outside a cache body")
        if id(value) not in graph_ids:
            graph_ids[id(value)] = len(graphs)
            from aotc.runtime.fxcodec import encode_graph  # graphs hold plain values: a cycle

            graphs.append(encode_graph(value))
        return {"G": graph_ids[id(value)]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = _registered_name(type(value))
        return {
            "R": name,
            "f": {f.name: enc(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    raise Uncachable(f"value of type {type(value).__name__} has no cache encoding")


def _registered_name(cls: type) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _RECORDS.get(name) is not cls:
        raise Uncachable(f"{name} is not a registered cache record")
    return name


class SymbolText(str):
    """A symbolic size of a cached record, as text (see `encode(symbols_as_text=True)`)."""


def decode(value: Any, graphs: Sequence[fx.GraphModule] | None = None) -> Any:
    """Inverse of `encode`. Raises CacheError on anything not produced by `encode`."""
    dec: Callable[[Any], Any] = lambda v: decode(v, graphs)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [dec(v) for v in value]
    if not isinstance(value, dict) or len(value) not in (1, 2):
        raise CacheError(f"unexpected value {str(value)[:80]}")
    tag = next(iter(value))
    arg = value[tag]
    match tag:
        case "T":
            return tuple(dec(v) for v in _list(arg))
        case "Y":
            return SymbolText(str(arg))
        case "D":
            return {str(k): dec(v) for k, v in dict(arg).items()}
        case "F":
            return float(_choice(arg, {"inf": "inf", "-inf": "-inf", "nan": "nan"}))
        case "C":
            re, im = _list(arg)
            return complex(dec(re), dec(im))
        case "dtype":
            return _choice(arg, _DTYPES)
        case "layout":
            return _choice(arg, _LAYOUTS)
        case "mf":
            return _choice(arg, _FORMATS)
        case "device":
            try:
                return torch.device(str(arg))
            except RuntimeError as e:
                raise CacheError(f"bad device {arg!r}") from e
        case "E":
            return _choice(arg, _RECORDS)(dec(value["v"]))
        case "S":
            try:
                return pytree.treespec_loads(str(arg))
            except Exception as e:  # unknown type name in this process
                raise CacheError(f"output structure cannot be loaded ({e})") from e
        case "G":
            if graphs is None or not isinstance(arg, int) or not 0 <= arg < len(graphs):
                raise CacheError("bad graph reference")
            return graphs[arg]
        case "R":
            cls = _choice(arg, _RECORDS)
            fields = value.get("f")
            if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
                raise CacheError(f"bad record {arg!r}")
            if not isinstance(fields, dict):
                raise CacheError(f"bad record {arg!r}")
            try:
                return cls(**{k: dec(v) for k, v in fields.items()})
            except TypeError as e:
                raise CacheError(f"record {arg} does not match this aotc version") from e
    raise CacheError(f"unknown tag {tag!r}")


def _choice(name: object, table: dict[str, Any]) -> Any:
    if not isinstance(name, str) or name not in table:
        raise CacheError(f"unknown name {str(name)[:80]!r}")
    return table[name]


def _list(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise CacheError("expected a list")
    return value


__all__ = ["SymbolText", "Uncachable", "decode", "encode", "register_records"]
