"""Inputs with a lazy conjugate or negative bit (`b.conj()`, `z.conj().imag`), against eager.

See Note [Conjugate and negative bits] in runtime/guards.py: such inputs key apart from plain
tensors, and the traces see their bits (Dynamo's fakes included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import aotc

MODES = ("trace", "default", "torch_compile")


def compiled(fn: Any, mode: str) -> Any:
    torch._dynamo.reset()
    if mode == "trace":
        return aotc.compile(fn, capture="trace", cache=False)
    if mode == "default":
        return aotc.compile(fn, cache=False)
    return torch.compile(fn, backend="aotc")


PROGRAMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "resolve_conj": lambda x: x.resolve_conj(),
    "view_as_real_of_resolved": lambda x: torch.view_as_real(x.resolve_conj()) * 2,
    "real": lambda x: x.real * 1,
    "imag_resolved": lambda x: x.imag.resolve_neg() + 0,
    "mul": lambda x: x * (1 + 2j),
}


def inputs(kind: str) -> torch.Tensor:
    torch.manual_seed(0)
    b = torch.randn(3, dtype=torch.complex64)
    return b.conj() if kind == "conj" else b


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_conjugate_views_match_eager(mode: str, name: str) -> None:
    fn = PROGRAMS[name]
    compiled_fn = compiled(fn, mode)
    for kind in ("conj", "plain", "conj"):  # one entry, then another signature, then the first
        x = inputs(kind)
        want, got = fn(x), compiled_fn(x)
        assert got.is_conj() == want.is_conj() and got.is_neg() == want.is_neg()
        torch.testing.assert_close(
            got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg()
        )
        assert (got is x) == (want is x)


def test_negative_bit_keys_apart() -> None:
    fn = aotc.compile(lambda t: t.resolve_neg(), capture="trace", cache=False)
    z = torch.randn(3, dtype=torch.complex64)
    neg = z.conj().imag
    assert neg.is_neg()
    plain = neg.resolve_neg()
    for t in (plain, neg, plain):
        out = fn(t)
        assert not out.is_neg()
        torch.testing.assert_close(out, t.resolve_neg())
