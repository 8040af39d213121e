"""Running a Dynamo graph module eagerly with eager's activation checkpointing.

Stage: `eager_graph(gm)` is the callable the default mode runs when it runs a Dynamo graph as
Dynamo's graph module instead of compiling it (Note [Refused graphs run eagerly] and Note
[Inference mode switches in Dynamo graphs] in aotc/backend.py).
Requires: `gm` is a Dynamo graph module.
Ensures: the result computes what `gm` does, except that each `tag_activation_checkpoint` call
runs `torch.utils.checkpoint` as the user's code asked for it (see the Note); `gm` itself is
returned when it has no such call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

# Note [Checkpointed regions of a graph run eagerly]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo captures `torch.utils.checkpoint(fn, ...)` as the `tag_activation_checkpoint` operator.
# Run eagerly, that operator calls checkpoint with `preserve_rng_state=False`, leaving random
# numbers to the compiler that is expected to trace it (Inductor functionalizes RNG), so the
# backward's recomputation of a dropout draws a new mask: gradients differ from eager's
# (torch.compile(backend="eager") shows it on T5 with gradient checkpointing). When aotc runs
# such a graph as Dynamo's graph module, each of those calls runs non-reentrant checkpoint
# itself with the generator state preserved (what the user's call asked for unless it said
# otherwise, which Dynamo does not keep) and the selective-checkpointing context Dynamo kept, as
# eager does.


def eager_graph(gm: fx.GraphModule) -> Callable[..., Any]:
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    if hop is None or not any(n.op == "call_function" and n.target is hop for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_function" and node.target is hop:
            new.target = _checkpoint_eagerly
        env[node] = new
    return fx.GraphModule(gm, graph)  # takes the body submodules from gm


def _checkpoint_eagerly(gmod: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    hop = torch.ops.higher_order.tag_activation_checkpoint
    ckpt_kwargs, _ = hop.divide_kwargs(kwargs)  # the body was traced without its kwargs
    ckpt_kwargs["use_reentrant"] = False
    ckpt_kwargs.pop("preserve_rng_state", None)  # checkpoint's default: preserved
    context_fn = gmod.meta.get("_checkpoint_context_fn")
    if context_fn is not None:
        ckpt_kwargs["context_fn"] = context_fn

    def body(*inner: Any) -> Any:
        return fx.Interpreter(gmod).run(*inner)

    return checkpoint(body, *args, **ckpt_kwargs)
