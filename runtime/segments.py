"""Segment nodes: a compiled training call as one autograd node per segment.

Record: `SegmentProgram` (one segment: the forward outputs its node returns, the outputs of
earlier segments it takes, which saved values it keeps, its autograd plan and backward graph).
Stage: `SegmentNodes(fwd, segments, num_graph_args, num_fwd_outs, name, highers)` once per entry;
`.run(args)` per call.
Requires: `fwd(*graph_args)` returns the entry's forward outputs then its saved values; each
segment's plan takes the graph args then its consumed outputs as node arguments (in that order)
and its backward computes the gradients its plan's `grad_args` name; segments are in creation
order (a segment's consumed outputs are owned by earlier ones). See Note [Segments] in
passes/segments.py.
Ensures: `run` runs the forward graph once, inside the first segment's node, and creates one node
per segment; it returns every forward output (an owned output from its segment's node, the rest as
the graph produced them) and each node's returned tuple.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from aotc.runtime.autograd import AutogradPlan, HigherOrder, make_autograd_function
from aotc.runtime.launch import make_callable
from aotc.runtime.schema import FwdOut
from aotc.runtime.steps import GraphProgram


@dataclass(frozen=True, slots=True)
class SegmentProgram:
    owned: tuple[FwdOut, ...]  # the entry's diff outputs this segment's node returns
    consumes: tuple[FwdOut, ...]  # earlier segments' outputs its node takes after the graph args
    saved: tuple[int, ...]  # positions among the entry's saved values that its node keeps
    autograd: AutogradPlan  # the node's plan (its args: graph args, then `consumes`)
    backward: fx.GraphModule  # (its saved values, gradients of `owned`) -> its gradients
    backward_kernels: GraphProgram | None = None  # its Triton lowering (None: ATen calls)


class SegmentNodes:
    """The autograd Functions of a segmented entry, and the call that creates its nodes."""

    __slots__ = ("_nodes", "_num_fwd_outs", "_stash", "_rng", "_views", "_regenerate", "plans")

    def __init__(
        self,
        fwd: Callable[..., tuple[torch.Tensor, ...]],
        segments: Sequence[SegmentProgram],
        num_graph_args: int,
        num_fwd_outs: int,
        name: str,
        highers: Sequence[HigherOrder | None],
        backwards: Sequence[Callable[..., Any] | None] = (),
        written: frozenset[int] = frozenset(),
        views: dict[int, tuple[int, int | None]] | None = None,
        regenerate: Callable[
            [int, Sequence[torch.Tensor], torch.Tensor | None, Sequence[object]], torch.Tensor
        ]
        | None = None,
    ) -> None:
        """`backwards`: per segment, the callable of its Triton lowering (None: its graph runs
        as ATen calls); `written`: graph args the epilogue writes (under no_grad); `views`: the
        consumed outputs the runtime regenerates as views, each with its user output and its
        base's FwdOut (None: a view of an input), and `regenerate(j, fwd_outs, base, leaves)`
        making user output j from the tensor its base's node returned (Note [Views other
        outputs are computed from])."""
        self._views = views or {}
        self._regenerate = regenerate
        stash = threading.local()  # this thread's call in flight: the forward graph's results
        self._stash = stash
        self._num_fwd_outs = n_out = num_fwd_outs
        rng = segments[0].autograd.rng_device
        self._rng: Callable[[], torch.Tensor] | None = None
        if rng is not None:
            self._rng = torch.cuda.get_rng_state if rng == "cuda" else torch.random.get_rng_state
        nodes: list[
            tuple[Callable[..., Any], type[torch.autograd.Function], tuple, tuple, tuple]
        ] = []
        for s, seg in enumerate(segments):
            picks = (*seg.owned, *(n_out + p for p in seg.saved))
            fwd_s = (
                _first_forward(fwd, stash, picks, num_graph_args) if s == 0 else _rest(stash, picks)
            )
            higher = highers[s]
            lowered = backwards[s] if s < len(backwards) else None
            # See Note [Edges of a segment node]
            sends = {g for g in seg.autograd.grad_args if g < num_graph_args}
            cut = tuple(g for g in range(num_graph_args) if g not in sends)
            if not sends and not seg.consumes:
                cut = ()  # its outputs require grad through leaves made inside: keep the edges
            fn = make_autograd_function(
                fwd_s,
                lowered if lowered is not None else make_callable(seg.backward),
                seg.autograd,
                f"{name}.segment{s}",
                _graph_args_only(higher, num_graph_args) if higher is not None else None,
                written,
                bwd_graph=seg.backward,
                rng_state=(lambda: stash.rng) if rng is not None else None,
                kept_args=num_graph_args if seg.consumes else None,
                original_args=(lambda: stash.args) if cut else None,
            )
            _direct(fn)
            # torch's stubs declare `apply` on Function only, not on its C base.
            apply = super(torch.autograd.Function, fn).apply  # type: ignore[misc]
            nodes.append((apply, fn, seg.owned, seg.consumes, cut))
        self._nodes = tuple(nodes)
        self.plans = tuple(seg.autograd for seg in segments)

    def run(
        self, args: Sequence[torch.Tensor], leaves: Sequence[object] = ()
    ) -> tuple[list[torch.Tensor], list[tuple], dict[int, torch.Tensor]]:
        """Also returns the user outputs regenerated between nodes, by UserOut."""
        stash = self._stash
        functorch = torch._C._are_functorch_transforms_active()
        if self._rng is not None:
            stash.rng = self._rng()
        produced: dict[int, torch.Tensor] = {}
        diffs: list[tuple] = []
        made: dict[int, torch.Tensor] = {}
        stash.args = args
        try:
            for apply, fn, owned, consumes, cut in self._nodes:
                node_args: Sequence[torch.Tensor] = args
                if cut:  # Note [Edges of a segment node]
                    node_args = list(args)
                    for g in cut:
                        if _needs_grad(args[g]):
                            node_args[g] = args[g].detach()
                if consumes:
                    taken = []
                    for k in consumes:
                        if k in produced:
                            taken.append(produced[k])
                            continue
                        j, b = self._views[k]
                        if j not in made:
                            assert self._regenerate is not None
                            if b is None:  # a view of an input: before any node ran
                                made[j] = self._regenerate(j, (), None, leaves)
                            else:
                                made[j] = self._regenerate(j, stash.outs, produced[b], leaves)
                        taken.append(made[j])
                    node_args = (*node_args, *taken)
                holder: list[torch.Tensor] = []
                diff = fn.apply(holder, *node_args) if functorch else apply(holder, *node_args)
                diffs.append(diff)
                for k, t in zip(owned, diff):
                    produced[k] = t
            outs = stash.outs
        finally:
            stash.outs = stash.rng = stash.args = None
        return [produced.get(k, outs[k]) for k in range(self._num_fwd_outs)], diffs, made


# Note [Edges of a segment node]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A node gets an edge to the history of every argument that requires grad, and autograd's engine
# runs every node an edge reaches, with or without a gradient (a node whose saved values were
# freed then raises "backward through the graph a second time"). Eager's nodes reach only what
# their outputs are computed from: `b = x * 1.0; return a.sigmoid(), b.abs()` runs a backward
# from the first output without touching `b`'s node, so a later backward from the second one
# works. Each segment node therefore takes, with history, only the graph args its backward sends
# gradients to; the others are passed detached (same storage and version counter), which the
# forward graph computes from just the same. A segment computed from an arg without a
# gradient path into it (`a * (b > 0)`) gives `b` no gradient in eager either. A double
# backward recomputes the segment from its graph args, with history: the node keeps the args
# as the call got them (`original_args`), not the detached ones. A segment that sends gradients
# to no arg and takes no other segment's output (its outputs come from leaves the call makes)
# keeps every edge: without one its outputs would not require grad.


def _needs_grad(a: object) -> bool:
    return isinstance(a, torch.Tensor) and a.requires_grad


def _first_forward(
    fwd: Callable[..., tuple[torch.Tensor, ...]],
    stash: threading.local,
    picks: tuple[int, ...],
    num_graph_args: int,
) -> Callable[..., tuple[torch.Tensor, ...]]:
    def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = fwd(*args[:num_graph_args])
        stash.outs = outs
        return tuple(outs[i] for i in picks)

    return run


def _rest(
    stash: threading.local, picks: tuple[int, ...]
) -> Callable[..., tuple[torch.Tensor, ...]]:
    def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = stash.outs
        return tuple(outs[i] for i in picks)

    return run


def _graph_args_only(higher: HigherOrder, num_graph_args: int) -> HigherOrder:
    """A segment node's differentiable backward recomputes from the graph args alone (its
    consumed outputs are computed from them; the node keeps only the graph args)."""

    def run(
        args: Sequence[object],
        versions: Sequence[int | None],
        grads: Sequence[torch.Tensor],
        rng: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        return higher(args[:num_graph_args], versions, grads, rng)

    return run


def _direct(fn: type[torch.autograd.Function]) -> None:
    """Note [Direct backward] in runtime/wrappers.py, for segment nodes."""
    backward_cls = getattr(fn, "_backward_cls", None)
    if (
        backward_cls is not None
        and fn.vjp is torch.autograd.Function.vjp
        and not getattr(fn, "boxed_grads_call", False)
        and backward_cls.apply is torch.autograd.function.BackwardCFunction.apply
    ):
        backward_cls.apply = fn.backward


__all__ = ["SegmentNodes", "SegmentProgram"]
