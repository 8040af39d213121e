"""On-disk compile cache: a plain, versioned entry format and a directory of entries.

Stage: `read_entry(dir, key) -> dict | None` (`read_trusted` adds whether this user's aotc wrote
it), `write_entry(dir, key, body, max_bytes)`, `evict(dir, max_bytes)`. The body's values are written by the plain codec (runtime/codec.py,
runtime/fxcodec.py); what a body holds is aotc/persist.py's `CacheEntry`.
Requires: `key` is a hex digest (see aotc/persist.py for what it covers); records passed to
`encode` are frozen dataclasses registered with `register_records`, enums registered the same way,
fx GraphModules of ATen/prims ops, and plain values.
Ensures: an entry file is either complete and verified or ignored (with a warning) and rebuilt;
nothing in a cache directory can run code when loaded unless this user's aotc wrote it. See
Note [Cache entry format] and Note [Trusted entries].

Note [Cache entry format]
~~~~~~~~~~~~~~~~~~~~~~~~~
One file per entry, `<dir>/<key>.json` (and an empty `<dir>/families/<family>` per key family
stored, Note [Keys of programs never stored] in aotc/cachekey.py):

    line 1: {"format": "aotc-cache", "version": 4, "key": "<key>",
             "sha256": "<digest of the key, a newline and line 2>",
             "mac": "<HMAC-SHA256 of the same bytes under the writer's secret>"}
    line 2: the body: {"entry": <CacheEntry>, "graphs": [...], "kernels": [...],
                       "lowerings": [...]}

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
as a consistency check. On a hit of an entry that is not trusted (Note [Trusted entries]) the
source is never compiled: the kernels are regenerated from the cached (allowlisted) graphs, whose
node values (shape, strides, storage offset, dtype, device) are rebuilt as storage-less
`ValueTensor`s on their devices for the lowering; generation is a pure function of the graph, and
Triton's own on-disk cache holds the compiled binaries. `lowerings` holds, per lowered graph, the
kernels as generated (with their GPU twins), the fusion plan's text and the kernel figures: what
a trusted hit runs instead of generating them again.

Writes go to a temporary file in the same directory, are flushed and fsynced, and are renamed over
the entry with `os.replace` (atomic on POSIX), so a concurrent reader sees the old entry, no entry,
or the complete new one. A reader verifies the header, the key and the checksum; on any mismatch
it warns and reports a miss, and the caller rebuilds and rewrites the entry. Size cap: after a
write, entries are deleted oldest-mtime-first until the directory is under `max_bytes`; a hit
touches the entry's mtime (least-recently-used eviction).

Note [Trusted entries]
~~~~~~~~~~~~~~~~~~~~~~
Generating a hit's Triton kernels again (lower, fuse, generate) was most of a warm start with
that backend: 186 of 225 ms on the GPT block example, 15% of its cold compile. Running the stored
kernel source instead is only safe if it is the source aotc generated, and a checksum anyone can
recompute does not say that. So each user has a secret: 32 random bytes in
`$XDG_CONFIG_HOME/aotc/cache-secret` (else `~/.config/aotc/cache-secret`), created on first use
with mode 0600 (written to a temporary file and linked into place, so concurrent processes agree
on one), used only if it is a regular file of this user's, unreadable by others. A write adds
`mac`, an HMAC-SHA256 under the secret of what `sha256` covers. A read whose `mac` verifies under
this user's secret is *trusted*: aotc/persist.py then hands the stored lowerings to the driver,
which runs the stored kernel source (the same text the cold compile ran). Any other entry, one
written by another user, copied from another machine, edited, or written without a secret, is
read as before: its graphs are decoded against the allowlist and its kernels regenerated. A
cache directory written by someone else still cannot run code.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import tempfile
import threading
import warnings
from typing import Any

from aotc.runtime.errors import CacheError

FORMAT = "aotc-cache"
FORMAT_VERSION = 4  # 2: node values keep their storage offset and device; 3: keyed checksum;
# 4: the body is a `CacheEntry` record (a `CompiledProgram` and its inspection record)
_SUFFIX = ".json"
_FAMILIES = "families"  # marker files of stored key families

# --------------------------------------------------------------------------- directory


def entry_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, key + _SUFFIX)


def family_path(cache_dir: str, family: str) -> str:
    return os.path.join(cache_dir, _FAMILIES, family)


def has_family(cache_dir: str, family: str) -> bool:
    """Whether an entry of key family `family` was ever stored here (Note [Keys of programs
    never stored] in aotc/cachekey.py)."""
    return os.path.exists(family_path(cache_dir, family))


def mark_family(cache_dir: str, family: str) -> None:
    """Mark `family` as stored in (an empty file; an existing one is left as it is)."""
    path = family_path(cache_dir, family)
    try:
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "ab"):
                pass
    except OSError:
        pass  # the entry's own write reports an unwritable directory


def read_entry(cache_dir: str, key: str) -> dict[str, Any] | None:
    """The verified body of entry `key`, or None (missing; or corrupt, with a warning)."""
    read = read_trusted(cache_dir, key)
    return read[0] if read is not None else None


def read_trusted(cache_dir: str, key: str) -> tuple[dict[str, Any], bool] | None:
    """`read_entry`, and whether this user's aotc wrote the entry (Note [Trusted entries])."""
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
        body, trusted = _verify(data, key)
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
    return body, trusted


def _verify(data: bytes, key: str) -> tuple[dict[str, Any], bool]:
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
    mac, secret = header.get("mac"), user_secret()
    trusted = (
        isinstance(mac, str)
        and secret is not None
        and hmac.compare_digest(mac, _mac(secret, key, body))
    )
    return value, trusted


def checksum(key: str, body: bytes) -> str:
    """The digest that binds an entry's body to its key (see Note [Cache entry format])."""
    return hashlib.sha256(key.encode() + b"\n" + body).hexdigest()


def _mac(secret: bytes, key: str, body: bytes) -> str:
    return hmac.new(secret, key.encode() + b"\n" + body, hashlib.sha256).hexdigest()


_SECRET_BYTES = 32
_SECRET: list[bytes | None] = []  # this process's secret, once looked up
_SECRET_LOCK = threading.Lock()


def secret_path() -> str:
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "aotc", "cache-secret")


def user_secret() -> bytes | None:
    """This user's cache secret, created on first use; None when it cannot be had safely
    (Note [Trusted entries])."""
    with _SECRET_LOCK:
        if not _SECRET:
            _SECRET.append(_load_secret(secret_path()))
        return _SECRET[0]


def _load_secret(path: str) -> bytes | None:
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-secret-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as f:  # mkstemp made it 0600
                f.write(os.urandom(_SECRET_BYTES))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # fails if another process made one first: use that one
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
        return _read_secret(path)
    except OSError:
        return None


def _read_secret(path: str) -> bytes | None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.getuid()
            or st.st_mode & 0o077
            or st.st_size != _SECRET_BYTES
        ):
            return None
        data = f.read()
    return data if len(data) == _SECRET_BYTES else None


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
    secret = user_secret()
    if secret is not None:  # See Note [Trusted entries]
        header["mac"] = _mac(secret, key, payload)
    data = json.dumps(header, sort_keys=True).encode() + b"\n" + payload
    _replace_atomically(entry_path(cache_dir, key), data, _SUFFIX)
    evict(cache_dir, max_bytes)
    return entry_path(cache_dir, key)


def _replace_atomically(path: str, data: bytes, suffix: str = "") -> None:
    """Write `data` to a temporary file beside `path`, fsync it, rename it over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already renamed or removed
        raise


def read_signed(path: str, kind: str) -> dict[str, Any] | None:
    """The body of a file `write_signed` wrote with this user's secret, or None (missing,
    unsigned, another's, or damaged: Note [Trusted entries])."""
    secret = user_secret()
    if secret is None:
        return None
    try:
        with open(path, "rb") as f:
            head, _, body = f.read().partition(b"\n")
        header = json.loads(head)
        if not isinstance(header, dict) or header.get("format") != kind:
            return None
        mac = header.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, kind, body)):
            return None
        value = json.loads(body)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_signed(path: str, kind: str, body: dict[str, Any]) -> bool:
    """Atomically write `body` signed with this user's secret; False without a secret."""
    secret = user_secret()
    if secret is None:
        return False
    payload = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    header = {"format": kind, "mac": _mac(secret, kind, payload)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _replace_atomically(path, json.dumps(header).encode() + b"\n" + payload)
    return True


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
