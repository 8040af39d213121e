"""The differential fuzzer in the test suite: random programs (tests/fuzz/generate.py) run under
eager and under aotc (tests/fuzz/compare.py) must behave the same or be refused with
UnsupportedError. A failure prints the shrunk program as a runnable file.

Profiles: the default suite runs a small derandomized set (fixed seeds, every mode); `-m slow`
runs a longer one. Long campaigns: `python -m tests.fuzz.campaign` (see its docstring).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.fuzz.campaign import run_program, shrink_failure
from tests.fuzz.compare import Verdict, check
from tests.fuzz.generate import generate
from tests.fuzz.shrink import shrink

# Heuristic: sizes of the two profiles, chosen so the default one stays under ~60 s on a loaded
# 2-core CI machine (trace ~0.2 s, dynamo ~0.5 s, triton interpreter ~1 s per program).
CI_SEEDS = {
    "trace": range(0, 60),
    "default": range(0, 10),
    "dynamo": range(0, 10),
    "triton": range(0, 8),
    "trace_hit": range(0, 10),  # a disk-cache hit of the program (tests/fuzz/compare.py)
    "default_hit": range(0, 6),
    "triton_hit": range(0, 6),
}
SLOW_SEEDS = {
    "trace": range(10_000, 10_600),
    "default": range(10_000, 10_150),
    "dynamo": range(10_000, 10_150),
    "triton": range(10_000, 10_100),
    "trace_hit": range(10_000, 10_150),
    "default_hit": range(10_000, 10_100),
    "triton_hit": range(10_000, 10_100),
}


@pytest.fixture(autouse=True)
def _quiet_fake_tensor_log():
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # eager refusals the generator probes log at ERROR
    yield
    logger.setLevel(level)


def _check_seeds(mode: str, seeds: range) -> dict[str, int]:
    counts = {v.value: 0 for v in Verdict}
    for seed in seeds:
        program = generate(seed)
        outcome = run_program(program, mode)
        counts[outcome.verdict.value] += 1
        if outcome.verdict is Verdict.DIFFERS:
            small = shrink_failure(program, mode, outcome)
            pytest.fail(
                f"{mode}: program {seed} differs from eager: {outcome.detail}\n"
                f"shrunk program:\n{small.source(mode)}"
            )
    return counts


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", sorted(CI_SEEDS))
def test_random_programs_match_eager(mode):
    counts = _check_seeds(mode, CI_SEEDS[mode])
    # refusals must stay rare: most random programs compile
    assert counts["refused"] <= len(CI_SEEDS[mode]) // 5, counts


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mode", sorted(SLOW_SEEDS))
def test_random_programs_match_eager_long(mode):
    counts = _check_seeds(mode, SLOW_SEEDS[mode])
    assert counts["refused"] <= len(SLOW_SEEDS[mode]) // 5, counts


@pytest.mark.filterwarnings("ignore")
def test_programs_are_runnable_source_and_deterministic():
    first, again = generate(7), generate(7)
    assert first.source() == again.source()
    namespace: dict[str, object] = {}
    exec(compile(first.source(), "<program>", "exec"), namespace)  # noqa: S102
    assert callable(namespace["f"]) and callable(namespace["make_inputs"])


@pytest.mark.filterwarnings("ignore")
def test_shrinker_keeps_only_what_the_failure_needs():
    """A stand-in failure (the program writes into an input with `mul_`): the shrunk program
    keeps that statement and drops everything else it can."""
    program = next(p for p in map(generate, range(200)) if _writes(p) and len(p.body) > 3)
    small = shrink(program, _writes)
    assert _writes(small)
    assert len(small.body) == 1 and len(small.outputs) == 1 and not small.write_outputs


def _writes(program) -> bool:
    return any(".mul_(" in line for stmt in program.body for line in stmt)


def _view_of_split_then_version_bump(a0, a1, a2):
    v0 = a2.split(1, 1)[0]
    a1.as_strided_(a1.shape, a1.stride())  # a graph break; bumps the version of a2's base
    return (v0,)


def _inputs_split_bump():
    x0 = torch.randn((3, 2, 4), dtype=torch.float64, requires_grad=True) * 1.0
    return [x0[2], x0[1], x0[:, 1]]


def _copy_into_an_alias_then_read_another(a1, a2, a3):
    v0 = a1.unbind(0)[1]
    a2.copy_(v0)  # a2 comes to require grad; a3 shares its base
    a3.abs()  # Dynamo's fake-tensor conversion of a3 asserts on requires_grad
    return (v0,)


def _inputs_copy_alias():
    x2 = torch.randn((3, 2, 4))
    return [torch.randn((3,), requires_grad=True), x2[2], x2[0]]


DYNAMO_OWN_FAILURES = {
    # campaign seed 1000: a resumed frame reads `is_leaf` of a split view whose base moved on
    "split_view_then_version_bump": (
        _view_of_split_then_version_bump,
        _inputs_split_bump,
        torch._dynamo.exc.InternalTorchDynamoError,
    ),
    # campaign seed 3005: an AssertionError from Dynamo's meta conversion
    "copy_into_an_alias_then_read_another": (
        _copy_into_an_alias_then_read_another,
        _inputs_copy_alias,
        AssertionError,
    ),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(DYNAMO_OWN_FAILURES))
def test_dynamo_own_failure_counts_as_refusal_only_when_every_backend_fails(name):
    """torch.compile raises with backend="eager" as with "aotc" where eager runs: the comparison
    counts that as a refusal (Dynamo's, named so), never as a match or a silent difference;
    trace capture runs the program like eager."""
    f, make, error = DYNAMO_OWN_FAILURES[name]
    torch._dynamo.reset()
    try:
        torch.compile(f, backend="eager")(*make())
        dynamo_failed = False  # torch 2.11's Dynamo runs split_view_then_version_bump
    except error:
        dynamo_failed = True
    torch._dynamo.reset()
    outcome = check(f, make, backward=[], mode="dynamo")
    if dynamo_failed:
        assert outcome.verdict is Verdict.REFUSED, outcome
        assert "Dynamo itself" in outcome.detail, outcome.detail
    else:  # nothing to refuse: the default mode matches eager
        assert outcome.verdict is Verdict.MATCH, outcome
    assert check(f, make, backward=[], mode="trace").verdict is Verdict.MATCH
