"""The generated guard check (Note [Guard checks] in runtime/guards.py) is True exactly when the
call's key equals the entry's signature: over every pair of leaf sets below, in every grad and
autocast state, `signature_check(sig)(leaves) == (signature_key(leaves) == sig)`. The dispatcher
that runs it first still picks the right entry, and a call that changes any property compiles."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

import aotc
from aotc.runtime.guards import MISS, make_probe, signature_check, signature_key
from aotc.runtime.stateguard import Compare, GuardItem, StateGuard
from tests.conftest import assert_matches_eager


def _leaf_sets() -> dict[str, list[object]]:
    base = torch.randn(4, 3)
    w = torch.randn(3, 2, requires_grad=True)
    shared = torch.randn(12)
    empty_a, empty_b = torch.empty(0), torch.empty(0)
    return {
        "base": [base, w, 2, 0.5],
        "same objects again": [base, w, 2, 0.5],
        "new tensors same geometry": [
            torch.randn(4, 3),
            torch.randn(3, 2, requires_grad=True),
            2,
            0.5,
        ],
        "dtype": [base.double(), w, 2, 0.5],
        "device": [base.to("meta"), w, 2, 0.5],
        "shape": [torch.randn(5, 3), w, 2, 0.5],
        "stride": [torch.randn(3, 4).t(), w, 2, 0.5],
        "offset only": [torch.randn(13)[1:].view(4, 3), w, 2, 0.5],
        "requires_grad": [base.requires_grad_(False).clone().requires_grad_(), w, 2, 0.5],
        "non-leaf": [base, w * 1, 2, 0.5],
        "int value": [base, w, 3, 0.5],
        "int vs bool": [base, w, True, 0.5],
        "int vs float": [base, w, 2.0, 0.5],
        "float value": [base, w, 2, 0.25],
        "nan": [base, w, 2, math.nan],
        "negative zero": [base, w, 2, -0.0],
        "zero": [base, w, 2, 0.0],
        "none": [base, w, None, 0.5],
        "string": [base, w, "2", 0.5],
        "slice": [base, w, slice(0, 2), 0.5],
        "other slice": [base, w, slice(0, 3), 0.5],
        "dtype value": [base, w, torch.float32, 0.5],
        "tensor for int": [base, w, torch.tensor(2), 0.5],
        "int for tensor": [2, w, 2, 0.5],
        "fewer leaves": [base, w, 2],
        "same tensor twice": [base, base, 2, 0.5],
        "views of one storage": [shared[:12].view(4, 3), shared[:6].view(3, 2), 2, 0.5],
        "two empty tensors": [empty_a, empty_b, 2, 0.5],
        "empty and base": [empty_a, w, 2, 0.5],
        "parameter": [torch.nn.Parameter(torch.randn(4, 3)), w, 2, 0.5],
    }


STATES = [
    ("grad", lambda: torch.enable_grad()),
    ("no_grad", lambda: torch.no_grad()),
    ("autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
]


def _signature_pairs():  # type: ignore[no-untyped-def]
    """(signature, its leaves, a call's leaves, the call's grad/autocast state) for every pair of
    leaf sets and states."""
    sets = _leaf_sets()
    for (_, sig_state), (_, call_state) in itertools.product(STATES, STATES):
        for sig_leaves, leaves in itertools.product(sets.values(), sets.values()):
            with sig_state():
                sig = signature_key(sig_leaves)
            yield sig, sig_leaves, leaves, call_state


def test_check_equals_key_equality_on_every_pair():
    checked = 0
    for sig, sig_leaves, leaves, call_state in _signature_pairs():
        check = signature_check(sig)
        if check is None:
            assert sig[1] is not None or sig[3] is not None  # shared storage or autocast
            continue
        with call_state():
            want = signature_key(leaves) == sig
            got = check(leaves)
        assert got == want, (sig_leaves, leaves)
        checked += 1
    assert checked > 1000


def test_check_source_inlines_every_field():
    x, w = torch.randn(4, 3), torch.randn(3, 2, requires_grad=True)
    check = signature_check(signature_key([x, w, 7]))
    source = check.__aotc_source__
    for field in ("dtype is", "device ==", "shape ==", "stride() ==", "requires_grad is True"):
        assert field in source
    assert "is_leaf is True" in source and "untyped_storage().data_ptr()" in source
    assert "grad_enabled() is True" in source and "not any_autocast()" in source


def _f(x, w, k):
    return (x @ w * k).relu().sum()


def test_dispatcher_switches_entries_and_recompiles_on_each_change():
    compiled = aotc.compile(_f, capture="trace")  # aotc's own dispatcher
    calls = [
        (torch.randn(4, 3), torch.randn(3, 2, requires_grad=True), 2.0),
        (torch.randn(5, 3), torch.randn(3, 2, requires_grad=True), 2.0),
        (torch.randn(4, 3), torch.randn(3, 2, requires_grad=True), 3.0),
        (
            torch.randn(4, 3).double(),
            torch.randn(3, 2, dtype=torch.float64, requires_grad=True),
            2.0,
        ),
    ]
    for _ in range(2):  # the second round hits the entries, alternating signatures
        for x, w, k in calls:
            w.grad = None
            got = compiled(x, w, k)
            got.backward()
            w2 = w.detach().clone().requires_grad_()
            want = _f(x, w2, k)
            want.backward()
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(w.grad, w2.grad)
    assert len(compiled.records) == len(calls)


@pytest.mark.parametrize("k", [2.0, -0.0, math.inf])
def test_repeated_calls_take_the_checked_entry(k):
    compiled = assert_matches_eager(
        _f,
        lambda: (torch.randn(4, 3), torch.randn(3, 2, requires_grad=True), k),
        runs=3,
        capture="trace",
    )
    assert len(compiled.records) == 1
    assert compiled._dispatch._last is not None


def test_check_fails_under_functorch_transform():
    """A passing check lets the dispatcher skip the entry's own autocast/functorch checks (Note
    [Calls after a guard hit] in runtime/fastpath.py), so it must fail inside a transform."""
    x, y = torch.randn(3), torch.randn(3)
    check = signature_check(signature_key([x, y]))
    assert check is not None and check([x, y])
    seen = []

    def inner(t):
        seen.append(check([x, y]))
        return t * 2

    torch.func.vmap(inner)(torch.randn(2, 3))
    assert seen == [False]


def test_compiled_entry_under_transform_after_hit():
    """The entry checked last, then called inside torch.func.grad: eager's values."""

    def f(x, w):
        return (x * w).sin().sum()

    compiled = aotc.compile(f, capture="trace", cache=False)
    x, w = torch.randn(4), torch.randn(4, requires_grad=True)
    compiled(x, w).backward()
    got = torch.func.grad(compiled)(x, w)
    torch.testing.assert_close(got, torch.func.grad(f)(x, w))


# Note [Fused guard and call]: the probe the dispatchers keep for the entry they ran last.


class _Entry:
    """A stand-in entry without a generated call: the probe ends with `return hit(leaves)`."""

    def __init__(self) -> None:
        self.seen: list[object] = []
        self.call = self.hit = self._hit

    def _hit(self, leaves: list[object]) -> object:
        assert type(leaves) is list
        self.seen.append(leaves)
        return ("ran", len(leaves))


def test_probe_runs_the_entry_exactly_when_the_check_passes():
    checked = 0
    for sig, sig_leaves, leaves, call_state in _signature_pairs():
        plain = all(type(t) is torch.Tensor for t in sig_leaves)
        for exact in (0, len(sig_leaves)) if plain else (0,):
            entry = _Entry()
            probe = make_probe(sig, entry, None, exact)
            if probe is None:
                assert signature_check(sig) is None
                continue
            with call_state():
                want = signature_key(leaves) == sig
                if exact:  # an arity key: the call's leaves were plain tensors
                    want = want and all(type(t) is torch.Tensor for t in leaves)
                got = probe(leaves)
            assert (got is not MISS) == want, (sig_leaves, leaves, exact)
            assert entry.seen == ([leaves] if want else [])
            if want:
                assert got == ("ran", len(leaves))
            checked += 1
    assert checked > 1000


def test_probe_with_the_c_tensor_check_runs_exactly_when_the_key_matches():
    """Note [Tensor checks in C]: a probe built from a call's leaves checks its leading plain
    tensors in one C call; it still runs the entry exactly when the key would match."""
    checked = with_c_check = 0
    for sig, sig_leaves, leaves, call_state in _signature_pairs():
        exact = next(
            (i for i, t in enumerate(sig_leaves) if type(t) is not torch.Tensor), len(sig_leaves)
        )
        if not exact:
            continue
        entry = _Entry()
        probe = make_probe(sig, entry, None, exact, sig_leaves)
        if probe is None:
            assert signature_check(sig) is None
            continue
        with_c_check += "tensor_check(" in probe.__aotc_source__
        with call_state():
            want = signature_key(leaves) == sig and all(
                type(t) is torch.Tensor for t in leaves[:exact]
            )
            got = probe(leaves)
        assert (got is not MISS) == want, (sig_leaves, leaves, exact)
        assert entry.seen == ([leaves] if want else [])
        checked += 1
    assert checked > 500 and with_c_check == checked


def test_c_tensor_check_refuses_what_the_key_does_not_hold():
    """The C check compares dispatch keys too: a conjugate view of a complex input misses the
    probe (the key path then decides), and the compiled function still matches eager."""
    x = torch.randn(3, dtype=torch.complex64)
    sig = signature_key([x])
    entry = _Entry()
    probe = make_probe(sig, entry, None, 1, [x])
    assert "tensor_check(" in probe.__aotc_source__
    assert probe([torch.randn(3, dtype=torch.complex64)]) is not MISS
    assert probe([x.conj()]) is MISS

    def f(t: torch.Tensor) -> torch.Tensor:
        return (t * 2).abs()

    compiled = aotc.compile(f, capture="trace")
    for arg in (x, x.conj(), x, x.conj()):
        torch.testing.assert_close(compiled(arg), f(arg))


def test_probe_checks_the_state_guard_after_the_signature():
    x, w = torch.randn(3), torch.randn(3, requires_grad=True)
    box = {"k": 2.0, "mod": "a"}
    items = [
        GuardItem(lambda: box["mod"], "a", Compare.IDENTITY, "mod"),
        GuardItem(lambda: box["k"], 2.0, Compare.VALUE, "k"),
        GuardItem(lambda: box["missing"], None, Compare.EQUAL, "missing"),
    ]
    entry = _Entry()
    probe = make_probe(signature_key([x, w]), entry, StateGuard(items[:2]).inline())
    assert probe([x, w]) == ("ran", 2)
    box["k"] = float("2.0")  # an equal constant, another object: passes, and is remembered
    assert probe([x, w]) == ("ran", 2)
    box["k"] = 3.0
    assert probe([x, w]) is MISS
    box["k"], box["mod"] = 2.0, "b"
    assert probe([x, w]) is MISS
    # A reader that raises fails the probe (the key path then explains it), never the call.
    raising = make_probe(signature_key([x, w]), entry, StateGuard(items).inline())
    box["mod"] = "a"
    assert raising([x, w]) is MISS
    assert len(entry.seen) == 2


def test_plain_probe_sends_a_subclass_argument_down_the_key_path():
    """A call of plain tensors keys on its arity; a Parameter in the same place keys on a tree
    spec (another key). The probe __call__ runs on the argument tuple must not take it."""

    def f(x, w):
        return (x * w).sum()

    compiled = aotc.compile(f, capture="trace", cache=False)
    x, w = torch.randn(4), torch.randn(4, requires_grad=True)
    compiled(x, w).backward()
    assert compiled._dispatch.plain_probe is not None
    p = torch.nn.Parameter(torch.randn(4))
    got = compiled(x, p)
    got.backward()
    want_p = p.detach().clone().requires_grad_()
    f(x, want_p).backward()
    torch.testing.assert_close(p.grad, want_p.grad)
    assert len(compiled.records) == 2  # compiled for the other key, as before the probe
    assert compiled._dispatch.plain_probe is None  # the last key was a tree spec
    compiled(x, w)
    assert compiled._dispatch.plain_probe is not None


def test_plain_probe_rechecks_state_and_grad_mode():
    scale = [2.0]

    def f(x, w):
        return (x * w * scale[0]).sum()

    compiled = aotc.compile(f, capture="trace", cache=False)
    x, w = torch.randn(4), torch.randn(4, requires_grad=True)
    for k in (2.0, 2.0, 3.0, 3.0, 2.0):
        scale[0] = k
        w.grad = None
        compiled(x, w).backward()
        torch.testing.assert_close(w.grad, x * k)
    with torch.no_grad():
        out = compiled(x, w)
    assert not out.requires_grad
    torch.testing.assert_close(out, (x * w * 2.0).sum())


def test_c_tensor_check_takes_parameter_leaves():
    """A module's lifted weights are Parameters: the probe checks them in the same C call (Note
    [Tensor checks in C]), by exact type, and still runs the entry exactly when the key matches
    (a plain tensor where the probe saw a Parameter misses, and the key path decides)."""
    w = torch.nn.Parameter(torch.randn(3, 2))
    b = torch.nn.Parameter(torch.randn(2))
    x = torch.randn(4, 3)
    sig = signature_key([x, w, b, 2])
    entry = _Entry()
    probe = make_probe(sig, entry, None, 1, [x, w, b, 2])
    assert "tensor_check(l0, l1, l2, )" in probe.__aotc_source__
    calls = {
        "same": [x, w, b, 2],
        "new parameters": [torch.randn(4, 3), torch.nn.Parameter(torch.randn(3, 2)), b, 2],
        "plain tensor for a parameter": [x, w.detach().requires_grad_(), b, 2],
        "shape": [x, torch.nn.Parameter(torch.randn(3, 3)), b, 2],
        "requires_grad": [x, torch.nn.Parameter(torch.randn(3, 2), requires_grad=False), b, 2],
        "non-leaf": [x, w * 1, b, 2],
        "shared storage": [x, w, w.detach()[0], 2],
        "constant": [x, w, b, 3],
    }
    for name, leaves in calls.items():
        want = signature_key(leaves) == sig and all(
            type(t) is type(s) for t, s in zip(leaves, [x, w, b, 2])
        )
        assert (probe(leaves) is not MISS) == want, name
    assert probe(calls["same"]) is not MISS and probe(calls["plain tensor for a parameter"]) is MISS

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    twin = copy.deepcopy(model)
    compiled = aotc.compile(twin, capture="trace")
    for _ in range(4):
        x = torch.randn(5, 3)
        want, got = model(x), compiled(x)
        torch.testing.assert_close(got, want)
        want.sum().backward()
        got.sum().backward()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(q.grad, p.grad)
        for p, q in zip(model.buffers(), twin.buffers()):
            torch.testing.assert_close(q, p)


class _Sub(torch.Tensor):
    """A tensor subclass with no behaviour of its own: only its type differs."""


def test_c_tensor_check_leaves_subclass_leaves_to_python():
    """A tensor subclass among the leaves keeps its Python conditions; the plain tensors and
    Parameters beside it are still checked in C, and the probe matches key equality."""
    x, w = torch.randn(4, 3), torch.nn.Parameter(torch.randn(3, 2))
    s = torch.randn(2).as_subclass(_Sub)
    sig = signature_key([x, s, w])
    probe = make_probe(sig, _Entry(), None, 1, [x, s, w])
    assert "tensor_check(l0, l2, )" in probe.__aotc_source__
    assert "isinstance(l1, Tensor)" in probe.__aotc_source__
    for leaves in ([x, s, w], [x, torch.randn(3).as_subclass(_Sub), w], [x, s, w.detach()]):
        want = signature_key(leaves) == sig and type(leaves[2]) is torch.nn.Parameter
        assert (probe(leaves) is not MISS) == want
