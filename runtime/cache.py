"""On-disk compile cache: a plain, versioned entry format and a directory of entries.

Stage: `read_entry(dir, key) -> dict | None`, `write_entry(dir, key, body, max_bytes)`,
`evict(dir, max_bytes)`. The body's values are written by the plain codec (runtime/codec.py,
runtime/fxcodec.py); what a body holds is aotc/persist.py's `CacheEntry`.
Requires: `key` is a hex digest (see aotc/persist.py for what it covers); records passed to
`encode` are frozen dataclasses registered with `register_records`, enums registered the same way,
fx GraphModules of ATen/prims ops, and plain values.
Ensures: an entry file is either complete and verified or ignored (with a warning) and rebuilt;
nothing in a cache directory can run code when loaded. See Note [Cache entry format].

Note [Cache entry format]
~~~~~~~~~~~~~~~~~~~~~~~~~
One file per entry, `<dir>/<key>.json`:

    line 1: {"format": "aotc-cache", "version": 4, "key": "<key>",
             "sha256": "<digest of the key, a newline and line 2>"}
    line 2: the body: {"entry": <CacheEntry>, "graphs": [...], "kernels": [...]}

The checksum covers the key the entry is stored under together with the body, so a body is
bound to its key: an entry copied from another program's file with only its header's key field
changed (same signature, other graphs) fails the check instead of serving wrong graphs.

The body is written by the plain codec (runtime/codec.py, runtime/fxcodec.py). Everything is
JSON. Records are `{"R": "<registered class name>", "f": {field: value}}`; enums
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

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any

from aotc.runtime.errors import CacheError

FORMAT = "aotc-cache"
FORMAT_VERSION = 4  # 2: node values keep their storage offset and device; 3: keyed checksum;
# 4: the body is a `CacheEntry` record (a `CompiledProgram` and its inspection record)
_SUFFIX = ".json"

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
