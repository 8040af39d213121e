"""torch.fx's generated code for graphs that call an op whose name has a Python keyword in it.

Not a stage: importing this module (runtime/fxcodec.py and passes/ir.py do) makes fx write such
ops as `getattr(...)`, once per process (Note [Op names that are Python keywords]).

Note [Op names that are Python keywords]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`torch.empty(4).random_(0, 5)` traces as `aten.random.from`, and `from` is a keyword. torch.fx
names every torch op in the code it generates by its dotted name, so a graph holding that node
printed `torch.ops.aten.random.from(x, 0, 5, None)`, a SyntaxError: make_fx failed to build the
strict-mode trace, and `.code` (dumps, `aotc.inspect`) of any graph holding it raised. The name
fx takes comes from `torch.fx.graph._get_qualified_name`; its wrapper here writes a name with a
keyword part as attribute lookups by string, `getattr(torch.ops.aten.random, 'from')`, which
resolves to the same op, and returns every other name as torch wrote it (a name it changes was
never valid code, so no working graph's code changes). aotc's own code generator
(runtime/launch.py) binds each op to a generated identifier and passes keyword arguments whose
names are keywords through `**{...}`.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable
from typing import Any

import torch.fx.graph as fx_graph


def attribute_path(dotted: str) -> str:
    """`dotted` as a Python expression: attribute access, or `getattr(..., 'part')` for each part
    that is not a plain identifier (a keyword).

    >>> attribute_path("torch.ops.aten.random.from")
    "getattr(torch.ops.aten.random, 'from')"
    >>> attribute_path("torch.ops.aten.add.Tensor")
    'torch.ops.aten.add.Tensor'
    """
    head, *parts = dotted.split(".")
    expr = head
    for part in parts:
        usable = part.isidentifier() and not keyword.iskeyword(part)
        expr = f"{expr}.{part}" if usable else f"getattr({expr}, {part!r})"
    return expr


def _keyword_safe(qualified: Callable[[Any], str]) -> Callable[[Any], str]:
    def name(func: Any) -> str:
        return attribute_path(qualified(func))

    name.aotc_keyword_safe = True  # type: ignore[attr-defined]
    return name


def install() -> None:
    """Idempotent: wraps fx's namer once (see Note [Op names that are Python keywords])."""
    current = fx_graph._get_qualified_name
    if not getattr(current, "aotc_keyword_safe", False):
        fx_graph._get_qualified_name = _keyword_safe(current)  # type: ignore[assignment]


install()

__all__ = ["attribute_path", "install"]
