"""The min-cut partitioner's contracted, split flow network (Note [Contracted flow network] in
passes/partition.py) saves exactly what the plain network of split nodes saves: on random
programs, both executors, with and without nodes unbanned by a memory budget."""

from __future__ import annotations

import math

import networkx as nx
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aotc
import aotc.passes.partition as P
from aotc.passes.cleanup import cleanup
from aotc.passes.ir import node_nbytes
from aotc.passes.recompute import Executor, is_sym_node
from tests.passes.test_partition_property import OPS, build


def _plain_min_cut(roles, costs, unbanned) -> set[fx.Node]:
    """The reference: every relevant forward node split in two, source and sink joined to them
    by infinite edges, one Boykov-Kolmogorov max-flow over the whole network."""
    inf = math.inf
    flow = nx.DiGraph()
    for node in roles.relevant:
        if node in roles.bwd_required:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            cap: float = node_nbytes(P._view_root(node)) * P._TIE_SCALE
        else:
            cap = P._SYM_BYTES * P._TIE_SCALE if is_sym_node(node) else inf
        if cap != inf and node not in roles.fwd_required:
            cap += 1
        flow.add_edge((node, "in"), (node, "out"), capacity=cap)
        if node.op == "placeholder" or (
            node in roles.fwd_required and node not in unbanned and not costs[node].is_free
        ):
            flow.add_edge(P._SOURCE, (node, "in"), capacity=inf)
        for user in node.users:
            if user in roles.bwd_required:
                flow.add_edge((node, "out"), P._SINK, capacity=inf)
            elif user in roles.relevant:
                flow.add_edge((node, "out"), (user, "in"), capacity=inf)
    if P._SOURCE not in flow or P._SINK not in flow:
        return set()
    _, (side, _) = nx.minimum_cut(
        flow, P._SOURCE, P._SINK, flow_func=nx.algorithms.flow.boykov_kolmogorov
    )
    saved = {n for n in roles.relevant if (n, "in") in side and (n, "out") not in side}
    return P._drop_views_of_saved(saved)


def _check(fn, *args) -> None:
    compiled = aotc.compile(fn, capture="trace", cache=False)
    compiled(*args).backward()
    joint = cleanup(aotc.inspect(compiled)[0].joint_graph)
    roles = P._roles(joint)
    for executor in (Executor.ATEN, Executor.TRITON):
        costs = P._costs(roles, executor, P._DEFAULT_POLICY)
        candidates = sorted(
            (n for n in costs if n in roles.fwd_required and n.op == "call_function"),
            key=roles.order.__getitem__,
        )
        for unbanned in (frozenset(), frozenset(candidates[::2]), frozenset(candidates)):
            got = P._min_cut_saved(roles, costs, unbanned)
            assert got == _plain_min_cut(roles, costs, unbanned), (executor, sorted(map(str, got)))


@settings(
    max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(program=st.lists(st.sampled_from(OPS), min_size=1, max_size=8))
def test_contracted_network_saves_what_the_plain_network_saves(program):
    _check(build(program), torch.randn(6, 6, requires_grad=True), torch.randn(6, 6))


def test_chain_splits_into_many_parts_with_the_same_cut():
    # sin/cos chains: each backward-only cos(x_i) is its own small part of the network.
    def chain(x):
        for _ in range(12):
            x = x.sin().cos() * 0.5 + 0.1
        return x.sum()

    _check(chain, torch.randn(8, requires_grad=True))
