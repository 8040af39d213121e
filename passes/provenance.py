"""Provenance of graph nodes, for people: the user's module path and source line of each node.

`source_of(node) -> NodeSource`: what aotc/provenance.py recorded after tracing, or (for graphs
traced before it ran, or built by hand) what the node's `stack_trace` tells. `user_line(text)`
is the innermost frame of a stack trace that is the user's code: frames inside torch, aotc,
generated fx code (`<eval_with_key>`) and the standard library's contextlib/functools are
skipped, so a Linear's matmul points at `self.c_attn(x)` in the model, not at
torch/nn/modules/linear.py.

    File ".../torch/nn/modules/module.py", line 1787, in _call_impl
    File "/home/me/model.py", line 51, in forward
      x = x + self.attn(self.ln1(x))
    File ".../torch/nn/modules/linear.py", line 134, in forward
      return F.linear(input, self.weight, self.bias)
    -> user_line(...) == "/home/me/model.py:51  x = x + self.attn(self.ln1(x))"
"""

from __future__ import annotations

import os
import re
import sys

import torch
import torch.fx as fx

from aotc.runtime.schema import NODE_SOURCE_KEY, NodeSource

SOURCE_KEY = NODE_SOURCE_KEY  # node.meta[SOURCE_KEY]: NodeSource
_UNKNOWN = NodeSource("", "", "", False)

_OWN_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (
        torch.__file__,
        __file__,
        sys.modules["aotc.runtime"].__file__ or "",
        sys.modules["aotc"].__file__ or "",  # a parent package is imported before its children
    )
)  # torch, aotc.passes, aotc.runtime, aotc (separate folders in a development checkout)
_SKIP_SUFFIXES = (os.sep + "contextlib.py", os.sep + "functools.py", os.sep + "runpy.py")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')


def is_internal_file(path: str) -> bool:
    """Frames no user writes: torch, aotc, generated fx code, decorator plumbing."""
    if path.startswith("<"):  # <eval_with_key>.3, <string>, <frozen runpy>
        return True
    full = os.path.abspath(path)
    return full.startswith(_OWN_DIRS) or full.endswith(_SKIP_SUFFIXES)


def user_line(stack_trace: str | None) -> str:
    """`file:line  code` of the innermost user frame of a formatted stack trace, or ''."""
    lines = (stack_trace or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if m is None or is_internal_file(m.group(1)):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if _FRAME.match(code) or set(code) <= {"^", "~", " "}:
            code = ""
        return f"{short_path(m.group(1))}:{m.group(2)}  {code}".rstrip()
    return ""


def short_path(path: str) -> str:
    """A path as people read it: relative to the working directory when under it, from the
    package root when installed (`transformers/models/gpt2/modeling_gpt2.py`), else as given."""
    full = os.path.abspath(path)
    cwd = os.getcwd() + os.sep
    if full.startswith(cwd):
        return full[len(cwd) :]
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in full:
            return full.split(marker, 1)[1]
    return path


def source_of(node: fx.Node) -> NodeSource:
    found = node.meta.get(SOURCE_KEY)
    if isinstance(found, NodeSource):
        return found
    line = user_line(node.meta.get("stack_trace"))
    return NodeSource("", "", line, False) if line else _UNKNOWN


_ROOT = re.compile(r"^[LG]\['([^']*)'\]")
_ITEM = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]|\[['\"]?([^\]'\"]*)['\"]?\]")


def readable_path(source: str) -> str:
    """A Dynamo source or module-stack path as a dotted attribute path.

    >>> readable_path("L['self']._modules['h']._modules['0']._parameters['weight']")
    'h.0.weight'
    >>> readable_path("L['self'].transformer.h[3].attn")
    'transformer.h.3.attn'
    >>> readable_path("L['x']")
    'x'
    """
    text = source.strip()
    root = _ROOT.match(text)
    head = ""
    if root:
        head = "" if root.group(1) == "self" else root.group(1)
        text = text[root.end() :]
    text = _ITEM.sub(lambda m: "." + (m.group(1) if m.group(1) is not None else m.group(2)), text)
    return (head + text).strip(".") if head else text.strip(".")


def describe_source(source: NodeSource) -> str:
    """One line for a comment: `h.0.attn (GPT2Attention): model.py:40  q = self.c_attn(x)`,
    prefixed `backward of` for a backward node; '' when nothing is known."""
    module = f"{source.module} ({source.module_type})" if source.module else source.module_type
    text = ": ".join(part for part in (module, source.line) if part)
    if text and source.backward:
        return f"backward of {text}"
    return text
