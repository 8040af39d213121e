"""On-disk compile cache: a plain, versioned entry format and a directory of entries.

Stage: `read_entry(dir, key) -> dict | None`, `write_entry(dir, key, body, max_bytes)`;
`encode(obj) -> JSON value` / `decode(value) -> obj` turn compiled records into JSON and back.
Requires: `key` is a hex digest (see aotc/persist.py for what it covers); records passed to
`encode` are frozen dataclasses registered with `register_records`, enums registered the same way,
fx GraphModules of ATen/prims ops, and plain values.
Ensures: an entry file is either complete and verified or ignored (with a warning) and rebuilt;
nothing in a cache directory can run code when loaded. See Note [Cache entry format].

Note [Cache entry format]
~~~~~~~~~~~~~~~~~~~~~~~~~
One file per entry, `<dir>/<key>.json`:

    line 1: {"format": "aotc-cache", "version": 3, "key": "<key>",
             "sha256": "<digest of the key, a newline and line 2>"}
    line 2: the body: {"record": ..., "plan": ..., "graphs": [...], "kernels": [...]}

The checksum covers the key the entry is stored under together with the body, so a body is
bound to its key: an entry copied from another program's file with only its header's key field
changed (same signature, other graphs) fails the check instead of serving wrong graphs.

Everything is JSON. Records are `{"R": "<registered class name>", "f": {field: value}}`; enums
`{"E": "<name>", "v": value}`; tuples `{"T": [...]}`; dtypes, devices, layouts and memory formats
are tagged strings resolved with `getattr(torch, name)` and a type check. Graphs are node lists;
each call target is a name resolved on load only against `torch.ops.aten`, `torch.ops.prims` and
`operator.getitem` (anything else is rejected as a foreign entry); tensor constants are raw bytes
(hex) plus dtype, shape and strides. There is no pickle and no exec of stored text: a cache
directory written by someone else can at worst make a compile fail over to a rebuild.

`kernels` holds the generated Triton kernels as `{"name", "source"}` records, for inspection and
as a consistency check only: the source is never compiled from the cache. On a hit the kernels
are regenerated from the cached (allowlisted) graphs, whose node values (shape, strides, storage
offset, dtype, device) are rebuilt as storage-less `ValueTensor`s on their devices for the
lowering; generation is a pure function of the graph, and Triton's own on-disk cache holds the
compiled binaries.

Writes go to a temporary file in the same directory, are flushed and fsynced, and are renamed over
the entry with `os.replace` (atomic on POSIX), so a concurrent reader sees the old entry, no entry,
or the complete new one. A reader verifies the header, the key and the checksum; on any mismatch
it warns and reports a miss, and the caller rebuilds and rewrites the entry. Size cap: after a
write, entries are deleted oldest-mtime-first until the directory is under `max_bytes`; a hit
touches the entry's mtime (least-recently-used eviction).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import operator
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import fx

from aotc.runtime.errors import CacheError
from aotc.runtime.schema import NODE_SOURCE_KEY, NodeSource

FORMAT = "aotc-cache"
FORMAT_VERSION = 3  # 2: node values keep their storage offset and device; 3: keyed checksum
_SUFFIX = ".json"

_RECORDS: dict[str, type] = {}


class Uncachable(Exception):
    """A value has no plain encoding: the compile result is used but not stored."""


def register_records(*classes: type) -> None:
    """Allow these frozen dataclasses / enums in cache entries (by qualified name)."""
    for cls in classes:
        _RECORDS[f"{cls.__module__}.{cls.__qualname__}"] = cls


# --------------------------------------------------------------------------- directory


def entry_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, key + _SUFFIX)


def read_entry(cache_dir: str, key: str) -> dict[str, Any] | None:
    """The verified body of entry `key`, or None (missing; or corrupt, with a warning)."""
    path = entry_path(cache_dir, key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"aotc cache: cannot read {path} ({e}); compiling instead.", stacklevel=3)
        return None
    try:
        body = _verify(data, key)
    except CacheError as e:
        warnings.warn(
            f"aotc cache: ignoring entry {path}: {e}. It will be rebuilt; delete the directory "
            "if this keeps happening.",
            stacklevel=3,
        )
        return None
    try:
        os.utime(path)  # least-recently-used: a hit makes the entry young
    except OSError:
        pass  # evicted or read-only directory: the entry was read, nothing to bump
    return body


def _verify(data: bytes, key: str) -> dict[str, Any]:
    head, sep, body = data.partition(b"\n")
    if not sep:
        raise CacheError("truncated (no header line)")
    try:
        header = json.loads(head)
    except ValueError as e:
        raise CacheError("header is not JSON") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CacheError("not an aotc cache entry")
    if header.get("version") != FORMAT_VERSION:
        raise CacheError(f"format version {header.get('version')!r}, expected {FORMAT_VERSION}")
    if header.get("key") != key:
        raise CacheError("entry belongs to another key")
    if checksum(key, body) != header.get("sha256"):
        raise CacheError("checksum mismatch (truncated, modified, or the body of another key)")
    try:
        value = json.loads(body)
    except ValueError as e:
        raise CacheError("body is not JSON") from e
    if not isinstance(value, dict):
        raise CacheError("body is not an object")
    return value


def checksum(key: str, body: bytes) -> str:
    """The digest that binds an entry's body to its key (see Note [Cache entry format])."""
    return hashlib.sha256(key.encode() + b"\n" + body).hexdigest()


def write_entry(cache_dir: str, key: str, body: dict[str, Any], max_bytes: int) -> str:
    """Atomically write entry `key`; then evict old entries beyond `max_bytes`."""
    os.makedirs(cache_dir, exist_ok=True)
    payload = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "key": key,
        "sha256": checksum(key, payload),
    }
    data = json.dumps(header, sort_keys=True).encode() + b"\n" + payload
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=cache_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, entry_path(cache_dir, key))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already renamed or removed
        raise
    evict(cache_dir, max_bytes)
    return entry_path(cache_dir, key)


def evict(cache_dir: str, max_bytes: int) -> list[str]:
    """Delete least-recently-used entries until the entries total at most `max_bytes`."""
    entries = []
    for name in os.listdir(cache_dir):
        if not name.endswith(_SUFFIX) or name.startswith(".tmp-"):
            continue
        path = os.path.join(cache_dir, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue  # removed by a concurrent process
        entries.append((st.st_mtime_ns, name, st.st_size, path))
    total = sum(e[2] for e in entries)
    removed = []
    for _, _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass  # another process evicted it first
        total -= size
    return removed


# --------------------------------------------------------------------------- values

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


# --------------------------------------------------------------------------- deferred decoding

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


class DeferredField:
    """A dataclass field that may hold a `Deferred`, resolved on first read. (A descriptor-typed
    field: reading it on the class raises AttributeError, so the field has no default.)"""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = "_deferred_" + name

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            raise AttributeError(self._slot)
        value = obj.__dict__[self._slot]
        if isinstance(value, Deferred):
            value = value.get()
            obj.__dict__[self._slot] = value
        return value

    def __set__(self, obj: object, value: Any) -> None:
        obj.__dict__[self._slot] = value


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


# --------------------------------------------------------------------------- graphs

_NAMESPACES = ("aten", "prims")


# Python functions of sizes and scalars that symbolic graphs call (`s0 * 4`, `-lr`): a fixed
# table, resolved by name on load like the ops.
_SCALAR_FUNCTIONS: dict[str, Callable[..., Any]] = {
    f"operator.{name}": getattr(operator, name)
    for name in (
        "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos",
        "abs", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_",
    )
}  # fmt: skip
_SCALAR_FUNCTIONS.update(
    {
        f"torch.{name}": getattr(torch, name)
        for name in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_ite")
        if hasattr(torch, name)
    }
)
_SCALAR_NAMES = {id(fn): name for name, fn in _SCALAR_FUNCTIONS.items()}


def _target_name(target: object) -> str:
    name = _SCALAR_NAMES.get(id(target))
    if name is not None:
        return name
    if isinstance(target, torch._ops.OpOverload) and target.namespace in _NAMESPACES:
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    raise Uncachable(f"graph calls {target}, which is not an aten/prims op")


def _resolve_target(name: object) -> object:
    """Allowlist: only aten/prims overloads and the scalar functions of `_SCALAR_FUNCTIONS` can
    come out of a cache."""
    if isinstance(name, str) and name in _SCALAR_FUNCTIONS:
        return _SCALAR_FUNCTIONS[name]
    if not isinstance(name, str) or "::" not in name:
        raise CacheError(f"bad call target {str(name)[:80]!r}")
    namespace, _, rest = name.partition("::")
    opname, _, overload = rest.partition(".")
    if namespace not in _NAMESPACES or not opname.isidentifier() or not overload.isidentifier():
        raise CacheError(f"call target {name!r} is not an aten/prims op")
    try:
        target = getattr(getattr(getattr(torch.ops, namespace), opname), overload)
    except (AttributeError, RuntimeError) as e:
        raise CacheError(f"op {name} does not exist in this torch") from e
    if not isinstance(target, torch._ops.OpOverload):
        raise CacheError(f"{name} is not an op overload")
    return target


def _encode_arg(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        return {"N": arg.name}
    if isinstance(arg, (list, tuple)) and not hasattr(arg, "_fields"):
        items = [_encode_arg(a) for a in arg]
        return items if isinstance(arg, list) else {"T": items}
    if isinstance(arg, dict):
        return {"D": {str(k): _encode_arg(v) for k, v in arg.items()}}
    if isinstance(arg, torch.Tensor):
        raise Uncachable("tensor inside node arguments")
    return encode(arg)


def _decode_arg(value: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(value, list):
        return [_decode_arg(v, env) for v in value]
    if isinstance(value, dict) and set(value) == {"N"}:
        node = env.get(value["N"])
        if node is None:
            raise CacheError(f"reference to unknown node {str(value['N'])[:40]!r}")
        return node
    if isinstance(value, dict) and set(value) == {"T"}:
        return tuple(_decode_arg(v, env) for v in _list(value["T"]))
    if isinstance(value, dict) and set(value) == {"D"}:
        return {str(k): _decode_arg(v, env) for k, v in dict(value["D"]).items()}
    return decode(value)


def _encode_val(val: Any) -> Any:
    if isinstance(val, torch.Tensor) and any(
        isinstance(v, torch.SymInt) for v in (*val.shape, *val.stride(), val.storage_offset())
    ):
        return None  # symbolic geometry: dropped like other symbolic values
    if isinstance(val, torch.Tensor):
        return {
            "t": [
                list(val.shape),
                list(val.stride()),
                encode(val.dtype),
                val.storage_offset(),
                encode(val.device),
            ]
        }
    if isinstance(val, (list, tuple)):
        return [_encode_val(v) for v in val]
    if val is None or isinstance(val, (bool, int, float)):
        return encode(val)
    return None  # symbolic or opaque values are dropped; only inspection reads them


class ValueTensor(torch.Tensor):
    """A node value of a cached graph that the Triton lowering reads: sizes, strides, storage
    offset, dtype and the real device, and no storage. It runs no ops (the lowering only reads
    geometry); building one costs a fraction of a fake tensor, which made up most of a Triton
    hit's load."""

    # torch's stubs type Tensor.__torch_function__ as a 4-argument classmethod; this is the
    # documented way to disable it on a subclass.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(  # noqa: PYI034
        cls,
        size: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> ValueTensor:
        return torch.Tensor._make_wrapper_subclass(
            cls, size, strides, offset, dtype=dtype, device=device, requires_grad=False
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise CacheError(f"{func} ran on the value of a cached graph node (values hold no data)")


def _decode_val(value: Any, on_device: bool) -> Any:
    """A node value: a meta tensor, or with `on_device` a ValueTensor on the stored device
    (what the Triton lowering reads, see Note [Cache entry format])."""
    if isinstance(value, dict) and set(value) == {"t"}:
        shape, stride, dtype, offset, device = _list(value["t"])
        size = tuple(int(s) for s in _list(shape))
        strides = tuple(int(s) for s in _list(stride))
        offset = int(offset)
        if len(size) != len(strides) or min((*size, *strides, offset, 0)) < 0:
            raise CacheError("bad tensor value")
        dtype = decode(dtype)
        if not isinstance(dtype, torch.dtype):
            raise CacheError("bad tensor dtype")
        if on_device:
            where = decode(device)
            if not isinstance(where, torch.device):
                raise CacheError("bad tensor device")
            return ValueTensor(size, strides, offset, dtype, where)
        if offset == 0:
            return torch.empty_strided(size, strides, dtype=dtype, device="meta")
        extent = (
            offset + 1 + sum((n - 1) * st for n, st in zip(size, strides)) if all(size) else offset
        )
        storage = torch.empty(extent, dtype=dtype, device="meta")
        return storage.as_strided(size, strides, offset)
    if isinstance(value, list):
        return [_decode_val(v, on_device) for v in value]
    return decode(value)


def _encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    if t.layout is not torch.strided or t.device.type != "cpu" or t.requires_grad:
        raise Uncachable("tensor constant that is not a plain CPU tensor")
    values = t.detach().contiguous().reshape(-1).view(torch.uint8)
    raw = values.numpy().tobytes() if values.numel() else b""
    return {
        "dtype": encode(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "bytes": raw.hex(),
    }


def _decode_tensor(value: dict[str, Any]) -> torch.Tensor:
    try:
        dtype = decode(value["dtype"])
        shape = tuple(int(s) for s in _list(value["shape"]))
        raw = bytearray.fromhex(value["bytes"])
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        values = flat.view(dtype).reshape(shape)
        out = torch.empty_strided(shape, tuple(int(s) for s in _list(value["stride"])), dtype=dtype)
        return out.copy_(values)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CacheError(f"bad tensor constant ({e})") from e


def encode_graph(module: fx.GraphModule) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []
    consts: dict[str, Any] = {}
    for node in module.graph.nodes:
        item: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            item["target"] = _target_name(node.target)
        elif node.op == "get_attr":
            target = str(node.target)
            value = _fetch_attr(module, target)
            if not isinstance(value, torch.Tensor):
                raise Uncachable(f"graph attribute {target} is not a tensor")
            consts[target] = _encode_tensor(value)
            item["target"] = target
        elif node.op in ("placeholder", "output"):
            item["target"] = str(node.target)
        else:
            raise Uncachable(f"graph node kind {node.op}")
        item["args"] = _encode_arg(node.args)
        item["kwargs"] = _encode_arg(node.kwargs)
        if "val" in node.meta:
            item["val"] = _encode_val(node.meta["val"])
        if node.meta.get("stack_trace"):
            item["stack_trace"] = str(node.meta["stack_trace"])
        source = node.meta.get(NODE_SOURCE_KEY)
        if isinstance(source, NodeSource):  # for inspection of a hit (aotc/provenance.py)
            item["source"] = [source.module, source.module_type, source.line, source.backward]
        nodes.append(item)
    return {"nodes": nodes, "consts": consts}


def decode_graph(value: Any, on_device: bool = False) -> fx.GraphModule:
    """`on_device`: node values become ValueTensors on their stored devices,
    as after tracing; otherwise meta tensors (enough to run and print the graph)."""
    if not isinstance(value, dict):
        raise CacheError("bad graph")
    root = torch.nn.Module()
    for target, t in dict(value.get("consts", {})).items():
        if not all(part.isidentifier() for part in str(target).split(".")) or "." in target:
            raise CacheError(f"bad constant name {str(target)[:40]!r}")
        root.register_buffer(target, _decode_tensor(t))
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for item in _list(value.get("nodes")):
        try:
            name, op, target = str(item["name"]), item["op"], item.get("target")
            args, kwargs = _decode_arg(item["args"], env), _decode_arg(item["kwargs"], env)
        except (KeyError, TypeError) as e:
            raise CacheError("bad node") from e
        if op == "call_function":
            target = _resolve_target(target)
        elif op == "get_attr":
            if not hasattr(root, str(target)):
                raise CacheError(f"unknown constant {str(target)[:40]!r}")
        elif op not in ("placeholder", "output"):
            raise CacheError(f"bad node kind {str(op)[:20]!r}")
        elif not isinstance(target, str) or not isinstance(args, (list, tuple)):
            raise CacheError("bad placeholder or output")
        node = graph.create_node(op, target, tuple(args), kwargs, name=name)
        if node.name != name:
            raise CacheError(f"node name {name!r} clashes")
        if "val" in item:
            node.meta["val"] = _decode_val(item["val"], on_device)
        if "stack_trace" in item:
            node.meta["stack_trace"] = str(item["stack_trace"])
        if "source" in item:
            module, kind, line, backward = _list(item["source"])
            node.meta[NODE_SOURCE_KEY] = NodeSource(
                str(module), str(kind), str(line), bool(backward)
            )
        env[name] = node
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def check_graph(value: Any) -> None:
    """The node kinds and call targets of an encoded graph, without building it."""
    if not isinstance(value, dict):
        raise CacheError("bad graph")
    for item in _list(value.get("nodes")):
        if not isinstance(item, dict):
            raise CacheError("bad node")
        op = item.get("op")
        if op == "call_function":
            _resolve_target(item.get("target"))
        elif op not in ("placeholder", "output", "get_attr"):
            raise CacheError(f"bad node kind {str(op)[:20]!r}")


def _fetch_attr(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
