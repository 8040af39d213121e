"""Note [Settled heap thresholds] (runtime/heap.py): the first compiled CPU program raises glibc's
dynamic malloc thresholds, so a step's blocks stay in the heap between steps; a user's setting
(`AOTC_SETTLE_HEAP=0`) leaves them alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aotc.runtime import heap

pytestmark = pytest.mark.skipif(not heap.is_glibc(), reason="glibc's malloc thresholds")

ROOT = Path(__file__).resolve().parents[2]

# In a fresh process: compile and run one training step on CPU, then ask glibc whether a 20 MiB
# block is served by mmap (its mapped bytes grow) or from the heap.
PROBE = r"""
import ctypes, json, resource, torch, aotc

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def step(x, w):
    return (x @ w).relu().mul(2.0).sum()

f = aotc.compile(step, capture="trace", cache=False)
x = torch.randn(256, 512, requires_grad=True)
w = torch.randn(512, 512, requires_grad=True)
got = f(x, w)
got.backward()
before = libc.mallinfo2().hblkhd
block = libc.malloc(20 << 20)
mapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(json.dumps({"mapped": mapped, "loss": got.item(), "eager": step(x, w).item()}))
"""


def _probe(env_extra: dict[str, str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_first_cpu_program_settles_thresholds() -> None:
    settled = _probe({})
    assert settled["mapped"] == 0  # served from the heap: thresholds raised
    assert settled["loss"] == pytest.approx(settled["eager"], rel=1e-5)


def test_settling_can_be_turned_off() -> None:
    untouched = _probe({"AOTC_SETTLE_HEAP": "0"})
    assert untouched["mapped"] >= 20 << 20  # glibc's start-up threshold: mmap


def test_settle_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_settled", False)
    assert heap.settle() is heap.enabled()
    assert heap.settle() is False  # once per process
