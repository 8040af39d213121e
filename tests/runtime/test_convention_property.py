"""Property test: random patterns of duplicate, aliased and mutated inputs match eager.

Each example picks, for four argument slots, either a fresh tensor, the same object as an earlier
slot, or a row view of one shared base; and picks which slots the program mutates in place.
Whatever the pattern, outputs, gradients and inputs after the call must equal eager's.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotc.runtime.convention import apply_convention, expand_graph_args, plan_convention
from tests.conftest import assert_matches_eager

slot = st.sampled_from(["fresh", "dup", "row"])


@settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    kinds=st.lists(slot, min_size=4, max_size=4),
    mutated=st.sets(st.integers(0, 3), max_size=2),
    base_requires_grad=st.booleans(),
)
def test_random_alias_and_mutation_patterns(kinds, mutated, base_requires_grad):
    def make():
        base = torch.randn(4, 5, requires_grad=base_requires_grad) * 1.0
        args = []
        for i, kind in enumerate(kinds):
            if kind == "dup" and args:
                args.append(args[-1])
            elif kind == "row":
                args.append(base[i])
            else:
                args.append(torch.randn(5))
        return tuple(args)

    def f(a, b, c, d):
        args = [a, b, c, d]
        for i in sorted(mutated):
            args[i].mul_(1.5).add_(0.25)
        return a * b + c - d, (a + d).sum()

    assert_matches_eager(f, make, runs=1)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(pattern=st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_dedupe_round_trip(pattern):
    """Expanding the planned graph args gives back exactly the user's leaves."""
    pool = [torch.randn(3) for _ in range(4)]
    leaves = [pool[i] for i in pattern] + ["const"]
    plan = plan_convention(leaves)
    graph_args = apply_convention(plan, leaves)
    assert len(graph_args) == len(set(pattern))
    assert len({id(a) for a in graph_args}) == len(graph_args)
    constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    rebuilt = expand_graph_args(plan, graph_args, constants)
    assert all(r is x for r, x in zip(rebuilt, leaves))
