"""The persistent compile cache for the Triton backends: a hit of this user's own entry runs the
stored kernels (Note [Trusted entries] in runtime/cache.py), any other hit regenerates them from
the cached graphs (never compiles stored source); both give eager's results and the cold
compile's kernels; "auto" entries are stored; entries of different backends never serve each
other."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import aotc
from tests.conftest import assert_matches_eager
from tests.runtime.test_cache import ROOT, _rewrite_body, entries, keys, stages
from tests.triton_helpers import needs_interpreter


def block(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # A matmul (ATen call), fused pointwise and reduction kernels, and a sliced view with a
    # storage offset (node values keep their offsets in the entry).
    h = torch.nn.functional.gelu(x @ w + b)
    h = torch.nn.functional.layer_norm(h, (h.shape[-1],))
    return h[1:].softmax(-1) * 2.0


def block_args() -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(6, 8),
        torch.randn(8, 16, requires_grad=True),
        torch.randn(16, requires_grad=True),
    )


def _kernel_texts(compiled: object) -> list[tuple[str, str]]:
    return [(k.name, k.source) for k in aotc.inspect(compiled)[0].kernels]


def _untrust(path: str) -> None:
    """The entry as another user (or machine) wrote it: its checksum holds, no MAC of ours."""
    with open(path, "rb") as f:
        head, _, body = f.read().partition(b"\n")
    header = json.loads(head)
    assert "mac" in header  # this user's aotc signed its own entry
    del header["mac"]
    with open(path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n" + body)


LOWERING_STAGES = {"decompose", "lower", "fuse", "generate"}


@needs_interpreter
@pytest.mark.parametrize("trusted", [True, False], ids=["own_entry", "foreign_entry"])
def test_triton_hit_runs_the_cold_kernels(tmp_path, trusted):
    d = str(tmp_path)
    cold = assert_matches_eager(block, block_args, backend="triton", cache_dir=d)
    assert "cache_load" not in stages(cold)
    assert len(entries(d)) == 1
    if not trusted:
        _untrust(os.path.join(d, entries(d)[0]))
    warm = assert_matches_eager(block, block_args, backend="triton", cache_dir=d)
    assert "cache_load" in stages(warm) and "trace" not in stages(warm)
    assert _kernel_texts(cold) and _kernel_texts(warm) == _kernel_texts(cold)
    assert aotc.inspect(warm)[0].kernels == aotc.inspect(cold)[0].kernels
    # Every stage prints as on the cold compile (fusion plans and kernels included).
    for (name_a, text_a), (name_b, text_b) in zip(
        aotc.inspect(cold)[0].stages[:-1], aotc.inspect(warm)[0].stages[:-1]
    ):
        assert (name_a, text_a) == (name_b, text_b), name_a
    # The entry keeps the sources for inspection, as plain JSON.
    with open(os.path.join(d, entries(d)[0]), "rb") as f:
        body = json.loads(f.read().partition(b"\n")[2])
    assert [(k["name"], k["source"]) for k in body["kernels"]] == _kernel_texts(cold)
    # The entry holds the same CompiledProgram an exported artifact holds: both graphs' Triton
    # lowerings as step programs, with their decomposed graphs (a hit skips the decomposition).
    program = body["entry"]["f"]["program"]
    assert program["R"] == "aotc.runtime.artifact.CompiledProgram"
    for lowering in ("forward_kernels", "backward_kernels"):
        assert program["f"][lowering]["f"]["decomposed"]["G"] >= 0
    # Own entry: the stored kernels run, nothing is generated. Another's: generated again from
    # the stored decomposed graphs (a hit never decomposes).
    if trusted:
        assert not LOWERING_STAGES & stages(warm)
    else:
        assert "decompose" not in stages(warm) and "generate" in stages(warm)


@needs_interpreter
def test_stored_kernel_source_is_never_run(tmp_path, caplog):
    """A cache directory cannot run code: a hit generates kernels from the graphs again and only
    compares them with the stored text."""
    d = str(tmp_path)
    cold = assert_matches_eager(block, block_args, backend="triton", cache_dir=d)

    def plant(body: dict) -> dict:
        for k in body["kernels"]:
            k["source"] = "raise SystemExit('stored kernel source was executed')\n"
        return body

    warm = _warm_after(d, _rewrite_body, plant, caplog)
    assert "cache_load" in stages(warm)
    assert _kernel_texts(warm) == _kernel_texts(cold)
    assert any("differ from the stored" in r.getMessage() for r in caplog.records)


def _warm_after(d: str, rewrite, edit, caplog):  # type: ignore[no-untyped-def]
    """The hit of `block` after `rewrite(entry, edit)`, its cache warnings in `caplog`."""
    rewrite(os.path.join(d, entries(d)[0]), edit)
    with caplog.at_level(logging.WARNING, logger="aotc.cache"):
        return assert_matches_eager(block, block_args, backend="triton", cache_dir=d)


def test_auto_is_cached_and_backends_have_distinct_entries(tmp_path):
    d = str(tmp_path)

    def f(x, w):
        return (x @ w).relu().sum(-1)

    def make():
        return torch.randn(5, 4), torch.randn(4, 3, requires_grad=True)

    # "triton" needs the interpreter on CPU; without it, it runs ATen calls (still its own entry).
    for backend in ("aten", "auto", "triton"):
        cold = assert_matches_eager(f, make, backend=backend, cache_dir=d)
        assert "cache_load" not in stages(cold), backend  # no other backend's entry served
        warm = assert_matches_eager(f, make, backend=backend, cache_dir=d)
        assert "cache_load" in stages(warm), backend
        assert _kernel_texts(warm) == _kernel_texts(cold)
    assert len(entries(d)) == 3
    x, w = make()
    assert len({keys(f, x, w, backend=b) for b in ("aten", "auto", "triton")}) == 3
    # "auto" on CPU tensors runs ATen calls: no kernels, nothing to regenerate on a hit.
    auto = aotc.compile(f, backend="auto", cache_dir=d)
    torch.testing.assert_close(auto(x, w), f(x, w))
    assert "cache_load" in stages(auto) and not _kernel_texts(auto)


CHILD = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    import torch, aotc
    from tests.runtime.test_cache_triton import block, block_args

    torch.manual_seed(0)
    args = block_args()
    compiled = aotc.compile(block, backend="triton", cache_dir={d!r})
    out = compiled(*args)
    out.sum().backward()
    grads = [a.grad.clone() for a in args[1:]]
    for a in args[1:]:
        a.grad = None
    ref = block(*args)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for g, a in zip(grads, args[1:]):
        torch.testing.assert_close(g, a.grad)
    rec = aotc.inspect(compiled)[0]
    print(json.dumps({{"hit": "cache_load" in rec.stage_seconds,
                      "kernels": [[k.name, k.source] for k in rec.kernels]}}))
""")


@needs_interpreter
def test_new_process_hits_a_triton_entry(tmp_path):
    """The entry written here serves a fresh process, whose kernel caches are empty."""
    d = str(tmp_path / "cache")
    cold = assert_matches_eager(block, block_args, backend="triton", cache_dir=d)
    aotc.cache_flush()  # the entry is queued (Note [Deferred cache stores]); the child reads it
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=ROOT, d=d))
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hit"]
    assert [tuple(k) for k in result["kernels"]] == _kernel_texts(cold)


def _resign(path: str, edit) -> None:  # type: ignore[no-untyped-def]
    """Edit the body and sign it with this user's secret, as this user's own aotc would."""
    from aotc.runtime import cache as store

    with open(path, "rb") as f:
        head, _, body = f.read().partition(b"\n")
    new = json.dumps(edit(json.loads(body))).encode()
    header = json.loads(head)
    header["sha256"] = store.checksum(header["key"], new)
    secret = store.user_secret()
    assert secret is not None
    header["mac"] = store._mac(secret, header["key"], new)
    with open(path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n" + new)


@needs_interpreter
def test_own_entry_whose_lowerings_do_not_fit_is_generated_again(tmp_path, caplog):
    d = str(tmp_path)
    cold = assert_matches_eager(block, block_args, backend="triton", cache_dir=d)

    def rename_stored(body: dict) -> dict:  # only the stored lowerings' kernel names
        text = json.dumps(body["lowerings"])
        body["lowerings"] = json.loads(text.replace('"name": "', '"name": "x'))
        return body

    warm = _warm_after(d, _resign, rename_stored, caplog)
    assert "generate" in stages(warm)
    assert _kernel_texts(warm) == _kernel_texts(cold)
    assert any("does not fit" in r.getMessage() for r in caplog.records)


def test_cache_secret_is_private_and_shared(tmp_path, monkeypatch):
    """Note [Trusted entries]: the secret is made once, 0600, and reused; a secret others can
    read is not used, so entries are written unsigned and never trusted."""
    from aotc.runtime import cache as store

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(store, "_SECRET", [])
    secret = store.user_secret()
    path = store.secret_path()
    assert secret is not None and len(secret) == 32
    assert os.stat(path).st_mode & 0o777 == 0o600
    monkeypatch.setattr(store, "_SECRET", [])  # a new process reads the same one
    assert store.user_secret() == secret
    d = str(tmp_path / "cache")
    store.write_entry(d, "ab" * 32, {"x": 1}, 1 << 20)
    assert store.read_trusted(d, "ab" * 32) == ({"x": 1}, True)
    os.chmod(path, 0o644)
    monkeypatch.setattr(store, "_SECRET", [])
    assert store.user_secret() is None
    assert store.read_trusted(d, "ab" * 32) == ({"x": 1}, False)
    store.write_entry(d, "cd" * 32, {"y": 2}, 1 << 20)
    with open(store.entry_path(d, "cd" * 32), "rb") as f:
        assert "mac" not in json.loads(f.readline())
