"""Random ops that the traced backward draws again: pairing them with the forward's draws.

Stage: `with draws.tracking(): make_fx(...)` around the joint trace records where the program
read and restored the CPU generator's state; `draws.pair(module, forward_names)` then makes each
random op the backward ran again (activation checkpointing's recomputation) use the forward's
draw, and refuses the ones it cannot pair.
Requires: `forward_names` are the graph's node names when the traced backward began (None: no
backward was traced); the graph is make_fx's, before any pass erased nodes.
Ensures: the returned graph has no random op in its backward that eager would have drawn with
restored state; every random op left in the backward draws from the state eager's backward
would find (none, in practice: a live draw is refused, see the Note).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from aotc.passes.recompute import is_random
from aotc.runtime.errors import UnsupportedError
from aotc.sharedpatch import SharedPatch

# Note [Random ops the traced backward draws again]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Activation checkpointing (`torch.utils.checkpoint`, and Hugging Face's gradient checkpointing
# built on it) reads the CPU generator's state (`torch.get_rng_state()`) before the checkpointed
# function runs, and in the backward restores it (`torch.set_rng_state`, inside
# `torch.random.fork_rng`, which restores the state it found afterwards) before running the
# function again: the recomputed dropout draws the forward's mask, and the generator ends where
# the forward left it. In the joint trace the random ops run on fake tensors, so the real state
# never moves and the recomputation's draws would be new graph nodes drawing new numbers.
#
# So the trace keeps the generator's *position* instead: the random draws are numbered in trace
# order. Each `get_rng_state()` the trace makes is remembered with the position at that point
# (the state tensor it returned, by identity), and a `set_rng_state(t)` of such a tensor moves the
# position back to it. Walking the graph in trace order with those events, a draw at the end of
# the list is a new draw; a draw at an earlier position replays the draw made there, and is
# replaced by it (same op, same constant arguments, tensor arguments of the same shape, dtype and
# device: the recomputation recomputes its inputs from the same values). The partitioner never
# recomputes a random op, so the forward's draw (a dropout's output or mask) is saved for the
# backward: more bytes than eager's checkpoint saves (its generator state), never more than
# eager without checkpointing.
#
# The same walk covers the forward: `with torch.random.fork_rng(): a = torch.rand(3)` followed by
# `b = torch.rand(3)` draws the same numbers twice in eager, and b becomes a in the graph (the
# generator moves once in both).
#
# Refused, since a compiled call would draw other numbers than eager's and move the generator
# differently: a backward draw at the end of the list (checkpointing with
# `preserve_rng_state=False`); a replayed draw whose op or shapes differ from the one it repeats;
# any draw after library code reseeded (`torch.manual_seed`, `torch.seed`; user code doing so is
# refused earlier, aotc/interpose.py) or restored a state the trace did not read. Ops tagged
# random whose probability is zero (`dropout_p=0.0`, `p=0.0`) or told not to train
# (`train=False`) draw nothing and are not counted, nor do ops handed the seed a forward drew
# (`philox_seed`: CUDA's efficient and cuDNN attention backwards). Only the CPU generator is followed (the one
# `torch.get_rng_state` reads): a draw on another device that the backward runs again is
# refused, as before.

_ACTIVE: list[RandomDraws] = []  # the trackers in progress (one per joint trace), innermost last


def _patched_get() -> torch.Tensor:
    state = _PATCH.saved["get_rng_state"]()
    draws = _ACTIVE[-1] if _ACTIVE else None
    if draws is not None and draws.thread == threading.get_ident():
        draws.note("get", state)
    return state


def _patched_set(new_state: torch.Tensor) -> None:
    draws = _ACTIVE[-1] if _ACTIVE else None
    if draws is not None and draws.thread == threading.get_ident():
        draws.note("set", new_state)
    _PATCH.saved["set_rng_state"](new_state)


def _patched_manual_seed(seed: int) -> Any:
    _note_reseed()
    return _PATCH.saved["manual_seed"](seed)


def _patched_seed() -> int:
    _note_reseed()
    return _PATCH.saved["seed"]()


def _note_reseed() -> None:
    draws = _ACTIVE[-1] if _ACTIVE else None
    if draws is not None and draws.thread == threading.get_ident():
        draws.note("set", None)


_PATCH = SharedPatch(
    torch,
    {
        "get_rng_state": _patched_get,
        "set_rng_state": _patched_set,
        "manual_seed": _patched_manual_seed,
        "seed": _patched_seed,
    },
)


def draws_random(node: fx.Node) -> bool:
    """A call of an op tagged random that draws: not one whose probability argument is zero
    (`dropout_p=0.0`, `p=0.0`), that is told not to train (`train=False`), or that is handed the
    seed of an earlier draw (`philox_seed`)."""
    if not is_random(node):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    if any(arg.name == "philox_seed" for arg in schema.arguments):
        return False  # replays the seed its arguments carry (the attention backwards)
    for k, arg in enumerate(schema.arguments):
        if arg.name not in ("p", "dropout_p", "train"):
            continue
        if arg.kwarg_only or k >= len(node.args):
            value = node.kwargs.get(arg.name, arg.default_value)
        else:
            value = node.args[k]
        if arg.name == "train" and value is False:
            return False
        if arg.name != "train" and isinstance(value, (int, float)) and value == 0:
            return False
    return True


class RandomDraws:
    """The generator-state reads and restores of one joint trace; see the Note."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        # (kind, state tensor (None: reseeded), last graph node then: None before any node)
        self.events: list[tuple[str, torch.Tensor | None, fx.Node | None]] = []

    def note(self, kind: str, state: torch.Tensor | None) -> None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None:
            return
        graph = mode.tracer.graph
        last = graph._root.prev
        self.events.append((kind, state, None if last is graph._root else last))

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        with _PATCH.held():
            _ACTIVE.append(self)
            try:
                yield
            finally:
                _ACTIVE.remove(self)

    def pair(self, module: fx.GraphModule, forward: frozenset[str] | None) -> None:
        """Replace each draw that replays an earlier one by it; refuse the backward draws that
        replay none (`forward`: None when no backward was traced)."""
        if not self.events:
            return _refuse_backward_draws(module, forward)
        graph = module.graph
        after: dict[fx.Node | None, list[tuple[str, torch.Tensor | None]]] = {}
        for kind, state, anchor in self.events:
            after.setdefault(anchor, []).append((kind, state))
        position = 0
        made: list[fx.Node] = []  # draws in generator order
        marks: dict[int, int | None] = {}  # id(state read) -> position then
        unknown = False  # a state restored that the trace did not read: positions are lost

        def apply(events: list[tuple[str, torch.Tensor | None]]) -> None:
            nonlocal position, unknown
            for kind, state in events:
                if kind == "get":
                    marks[id(state)] = None if unknown else position
                else:
                    mark = None if state is None else marks.get(id(state))
                    unknown = mark is None
                    position = mark if mark is not None else len(made)

        apply(after.pop(None, []))
        replaced: list[tuple[fx.Node, fx.Node]] = []
        for node in list(graph.nodes):
            if draws_random(node) and not _on_cpu(node):  # another generator: not followed
                if forward is not None and node.name not in forward:
                    _refuse(node)
            elif draws_random(node):
                backward = forward is not None and node.name not in forward
                if unknown or (backward and position == len(made)):
                    _refuse(node)
                if position < len(made):
                    twin = made[position]
                    if not _same_draw(node, twin):
                        _refuse(node)
                    replaced.append((node, twin))
                else:
                    made.append(node)
                position += 1
            apply(after.pop(node, []))
        if after:  # an anchor node is gone: the positions cannot be trusted
            return _refuse_backward_draws(module, forward)
        for node, twin in replaced:
            node.replace_all_uses_with(twin)
            graph.erase_node(node)
        if replaced:
            module.recompile()


def _on_cpu(node: fx.Node) -> bool:
    """The draw uses the CPU generator (the one `torch.get_rng_state` reads)."""
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) and val else val
    return isinstance(first, torch.Tensor) and first.device.type == "cpu"


def _refuse_backward_draws(module: fx.GraphModule, forward: frozenset[str] | None) -> None:
    if forward is None:
        return
    for node in module.graph.nodes:
        if draws_random(node) and node.name not in forward:
            _refuse(node)


def _same_draw(node: fx.Node, twin: fx.Node) -> bool:
    if node.target != twin.target or len(node.args) != len(twin.args):
        return False
    if node.kwargs.keys() != twin.kwargs.keys():
        return False
    pairs = list(zip(node.args, twin.args)) + [
        (node.kwargs[k], twin.kwargs[k]) for k in node.kwargs
    ]
    return all(_same_arg(a, b) for a, b in pairs)


def _same_arg(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            return (
                va.shape == vb.shape
                and va.dtype == vb.dtype
                and va.device == vb.device
                and va.stride() == vb.stride()
            )
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_arg(x, y) for x, y in zip(a, b))
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return False
    return type(a) is type(b) and a == b


def _refuse(node: fx.Node) -> None:
    raise UnsupportedError(
        f"joint trace: the random op {node.target} draws from a generator state aotc cannot "
        "follow: the backward runs it again without restoring the forward's state (activation "
        "checkpointing with preserve_rng_state=False), library code reseeded or restored a "
        "state the trace did not read, or a restored state is drawn from by another op or "
        "shape than before. A compiled call would draw other numbers than eager. Use the "
        "default capture mode (aotc.compile without capture='trace'), or keep random ops "
        "outside the checkpointed function."
    )
