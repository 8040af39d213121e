"""`torch.compile(model, backend="aotc")`: Dynamo hands each captured FX graph to aotc.

Registered through the `torch_dynamo_backends` entry point in pyproject, so the name resolves
after install with no import. Options pass through `torch.compile(..., options={...})`.

This version compiles each Dynamo graph (one per graph break) with `aotc.compile` on its first
real call and lets aotc's own guards pick the entry; reusing Dynamo's fake mode and ShapeEnv, and
dynamic shapes, come with the torch.compile issue (#5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from aotc.api import CompiledFunction, compile


def aotc_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any
) -> Callable[..., Any]:
    del example_inputs  # aotc traces on its own fake copies of the first real call's inputs
    options = dict(options.pop("options", None) or {}, **options)
    compiled: CompiledFunction = compile(gm.forward, **options)

    def run(*args: Any) -> Any:
        return compiled(*args)

    run.aotc_compiled = compiled  # type: ignore[attr-defined]
    return run
