"""The differential fuzzer in the test suite: random programs (tests/fuzz/generate.py) run under
eager and under aotc (tests/fuzz/compare.py) must behave the same or be refused with
UnsupportedError. A failure prints the shrunk program as a runnable file.

Profiles: the default suite runs a small derandomized set (fixed seeds, every mode); `-m slow`
runs a longer one. Long campaigns: `python -m tests.fuzz.campaign` (see its docstring).
"""

from __future__ import annotations

import logging

import pytest

from tests.fuzz.campaign import run_program, shrink_failure
from tests.fuzz.compare import Verdict
from tests.fuzz.generate import generate
from tests.fuzz.shrink import shrink

# Heuristic: sizes of the two profiles, chosen so the default one stays under ~60 s on a loaded
# 2-core CI machine (trace ~0.2 s, dynamo ~0.5 s, triton interpreter ~1 s per program).
CI_SEEDS = {
    "trace": range(0, 60),
    "default": range(0, 10),
    "dynamo": range(0, 10),
    "triton": range(0, 8),
}
SLOW_SEEDS = {
    "trace": range(10_000, 10_600),
    "default": range(10_000, 10_150),
    "dynamo": range(10_000, 10_150),
    "triton": range(10_000, 10_100),
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
