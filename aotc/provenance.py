"""Record, while tracing, which user module and source line every graph node comes from.

Not a stage: helpers the tracer and the Dynamo backend call so that inspection (graph files, the
partition report, the HTML report) can name the user's code. Each node of a traced joint graph
gets `node.meta["aotc_source"]: NodeSource` (runtime/schema.py; read through
passes/provenance.py::source_of).

Note [Node provenance]
~~~~~~~~~~~~~~~~~~~~~~
Forward nodes: with torch.fx's node-meta preservation on (`recording()`), a node traced while an
fx.Interpreter runs a Dynamo graph inherits that Dynamo node's `nn_module_stack` and
`stack_trace` (Dynamo recorded both from the user's frames); a node traced directly from the
user's Python (aotc's own capture) has the Python stack of the trace (`record_stack_traces`).
Either way `passes.provenance.user_line` picks the innermost frame that is the user's.

Backward nodes are traced while autograd runs the grad_fn nodes of the forward, where no user
frame is on the stack. Every autograd node carries the sequence number it was created with; fx
stores the current one in each forward node's `seq_nr`. `Recorder.backward` registers a pre-hook
and a post-hook on each autograd node reachable from the differentiated outputs that set (and
clear) torch.fx's "current grad_fn sequence number", so a node traced during that grad_fn's
backward gets the same `seq_nr` as the forward node that created it, plus the
`autograd_backward` mark. `Recorder.annotate` then gives each backward node the module and line
of the first forward node with its `seq_nr`:

    forward:  mm   seq_nr=7  module=h.0.attn.c_attn  line=model.py:40  (x @ self.w)
    backward: mm_3 seq_nr=7  autograd_backward  ->  module=h.0.attn.c_attn, backward=True

Nodes the autograd engine adds between grad_fns (summing two gradients of a value used twice)
run outside any hook; they take the provenance of their first backward input.

Note [Stack traces from the frames fx keeps]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For every node it creates, make_fx(record_stack_traces=True) takes the whole Python stack
(`CapturedTraceback.extract().summary()`, which reads the source line of each of its 50-100
frames), then keeps only the frames of `forward` methods and of registered anchors (the
`_record_forward_stack_traces_only` filter make_fx sets), less torch's own files. On a GPT block
that was a fifth of a cold compile. While `recording()` is on, torch.fx's name
`CapturedTraceback` means `_UserFrames` instead: its summary walks the same frames and keeps
only those that filter would keep, reading their lines alone. fx's own filter and format then run
on the short list, so `stack_trace` is the same text (tests/aotc/test_provenance.py compares the
two). A call from another thread, from a tracer that keeps every frame, or asking for more than
Python frames gets torch's own class.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.fx.proxy as fx_proxy
import torch.fx.traceback as fx_traceback

from aotc.passes.provenance import SOURCE_KEY, readable_path, user_line
from aotc.runtime.schema import NodeSource


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Node-meta preservation on for one trace (see Note [Node provenance]), stack traces taken
    from the frames fx keeps (Note [Stack traces from the frames fx keeps])."""
    with fx_traceback.preserve_node_meta(), _user_frames():
        yield


_REAL_TRACEBACK: Any = getattr(fx_proxy, "CapturedTraceback", None)
_ON = threading.local()  # `.on`: this thread is inside `recording()`
_INSTALL = threading.Lock()
_installed = 0  # how many `recording()` contexts, in all threads, are open


@contextlib.contextmanager
def _user_frames() -> Iterator[None]:
    global _installed
    if _REAL_TRACEBACK is None or not hasattr(_REAL_TRACEBACK, "extract"):
        yield  # another torch: fx takes stacks its own way
        return
    outer = getattr(_ON, "on", False)
    with _INSTALL:
        if _installed == 0:
            setattr(fx_proxy, "CapturedTraceback", _UserFrames)  # noqa: B010 a module global
        _installed += 1
    _ON.on = True
    try:
        yield
    finally:
        _ON.on = outer
        with _INSTALL:
            _installed -= 1
            if _installed == 0:
                setattr(fx_proxy, "CapturedTraceback", _REAL_TRACEBACK)  # noqa: B010


class _UserFrames:
    """torch.fx.proxy's `CapturedTraceback` while aotc traces: Note [Stack traces from the
    frames fx keeps]."""

    __slots__ = ("frame",)

    def __init__(self, frame: Any) -> None:
        self.frame = frame

    @staticmethod
    def extract(*, script: bool = False, cpp: bool = False, skip: int = 0) -> Any:
        caller = sys._getframe(1)
        tracer = caller.f_locals.get("self")
        if (
            script
            or cpp
            or skip
            or not getattr(_ON, "on", False)
            or getattr(tracer, "_record_forward_stack_traces_only", False) is not True
        ):
            return _REAL_TRACEBACK.extract(script=script, cpp=cpp, skip=skip + 1)
        return _UserFrames(caller)

    def summary(self) -> traceback.StackSummary:
        anchors = getattr(fx_proxy, "_STACK_TRACE_ANCHORS", ())
        kept = []
        frame = self.frame
        while frame is not None:
            code = frame.f_code
            name, filename = code.co_name, code.co_filename
            if (
                name == "forward"
                or filename.endswith("torch/__init__.py")
                or (filename, name) in anchors
            ):
                kept.append(traceback.FrameSummary(filename, frame.f_lineno, name))
            frame = frame.f_back
        kept.reverse()  # outermost first, as traceback.extract_stack gives them
        return traceback.StackSummary.from_list(kept)


class Recorder:
    """Collects, during one joint trace, which nodes the forward traced (see
    Note [Node provenance]). Local to `trace_joint`; its result is `annotate`'s meta."""

    def __init__(self) -> None:
        self.forward_names: frozenset[str] | None = None  # None: no backward was traced

    @contextlib.contextmanager
    def backward(self, outputs: Sequence[torch.Tensor]) -> Iterator[None]:
        """Around `torch.autograd.grad(outputs, ...)` inside make_fx."""
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is not None:
            self.forward_names = frozenset(n.name for n in mode.tracer.graph.nodes)
        graph = None if mode is None else mode.tracer.graph
        entered: list[fx.Node] = []  # the graph's last node when each running grad_fn began
        handles = []
        for grad_fn in _autograd_nodes(outputs):
            seq = grad_fn._sequence_nr()
            handles.append(grad_fn.register_prehook(_enter_hook(seq, graph, entered)))
            handles.append(grad_fn.register_hook(_leave_hook(graph, entered)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def annotate(self, module: fx.GraphModule) -> None:
        """Set `node.meta["aotc_source"]` on every node of a freshly traced joint graph."""
        owners: dict[int, NodeSource] = {}
        forward = self.forward_names
        for node in module.graph.nodes:
            if node.op == "output":
                continue
            is_backward = (
                forward is not None and node.name not in forward and node.op != "placeholder"
            )
            if not is_backward:
                source = _forward_source(node)
                seq = node.meta.get("seq_nr")
                if isinstance(seq, int) and node.op != "placeholder":
                    owners.setdefault(seq, source)
            elif node.meta.get("autograd_backward") and node.meta.get("seq_nr") in owners:
                owner = owners[node.meta["seq_nr"]]
                source = NodeSource(owner.module, owner.module_type, owner.line, True)
            else:
                source = _inherited(node)
            node.meta[SOURCE_KEY] = source


def _forward_source(node: fx.Node) -> NodeSource:
    path, kind = "", ""
    stack = node.meta.get("nn_module_stack")
    if stack:
        raw_path, raw_type = list(stack.values())[-1]
        path = readable_path(str(raw_path))
        kind = getattr(raw_type, "__name__", None) or str(raw_type).rsplit(".", 1)[-1]
    return NodeSource(path, kind, user_line(node.meta.get("stack_trace")), False)


def _inherited(node: fx.Node) -> NodeSource:
    for arg in node.all_input_nodes:
        source = arg.meta.get(SOURCE_KEY)
        if isinstance(source, NodeSource) and source.backward:
            return source
    return NodeSource("", "", "", True)


def _autograd_nodes(outputs: Sequence[torch.Tensor]) -> list[Any]:
    seen: set[Any] = set()
    queue = deque(t.grad_fn for t in outputs if t.grad_fn is not None)
    out = []
    while queue:
        fn = queue.popleft()
        if fn in seen:
            continue
        seen.add(fn)
        out.append(fn)
        queue.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return out


def _enter_hook(seq: int, graph: fx.Graph | None, entered: list[fx.Node]) -> Callable[[Any], None]:
    def enter(grad_outputs: Any) -> None:
        fx_traceback.set_grad_fn_seq_nr(seq)
        fx_traceback.current_meta["autograd_backward"] = True
        if graph is not None:
            entered.append(_last_node(graph))

    return enter


def _leave_hook(graph: fx.Graph | None, entered: list[fx.Node]) -> Callable[[Any, Any], None]:
    def leave(grad_inputs: Any, grad_outputs: Any) -> None:
        fx_traceback.reset_grad_fn_seq_nr()
        if "in_grad_fn" not in fx_traceback.current_meta:
            fx_traceback.current_meta.pop("autograd_backward", None)
        if graph is not None and entered:
            # torch 2.13's tracer copies `autograd_backward` from the current meta onto each node
            # it creates; torch 2.11's does not, so the nodes this grad_fn traced (those after
            # the graph's last node when it began) are marked here, on every torch.
            node = entered.pop().next
            while node.op != "root":
                node.meta["autograd_backward"] = True
                node = node.next

    return leave


def _last_node(graph: fx.Graph) -> fx.Node:
    """The node new nodes are appended after (make_fx appends at the end)."""
    return graph._root.prev  # fx.Graph's nodes are a ring through this sentinel


def run_with_node_meta(gm: fx.GraphModule) -> Callable[..., Any]:
    """`gm`'s forward through an fx.Interpreter, so nodes traced from it inherit each Dynamo
    node's module stack and user stack trace (see Note [Node provenance])."""

    def run(*args: Any) -> Any:
        return fx.Interpreter(gm).run(*args)

    return run


def graph_input_names(gm: fx.GraphModule) -> list[str]:
    """Readable names of a Dynamo graph's inputs, from the source Dynamo read each from:
    `transformer.h.0.attn.c_attn.weight` for `L['self']._modules['transformer']...`."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        name = getattr(source, "name", None)
        text = name() if callable(name) else name
        names.append(readable_path(text) if isinstance(text, str) and text else node.name)
    return names
