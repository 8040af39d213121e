"""The key trace: one run of the user's program that writes every ATen call as canonical text.

Stage: `trace_text(program, leaves, grad_enabled, tracer) -> str`, `tracer` "meta" or "fake".
`meta_eligible(leaves) -> bool` says whether the meta tracer accepts the inputs.
Requires: `program` and `leaves` as `aotc.pipeline._compile_signature` compiles them.
Ensures: the text names every ATen call with its arguments, grad mode and results (see Note
[Cache key] in aotc/persist.py for why equal texts mean equal compiled graphs); raises
`Unkeyable` when the program does something the text cannot describe.

Note [Meta key trace]
~~~~~~~~~~~~~~~~~~~~~
The compile itself traces on fake tensors, so the key trace must see what a fake-tensor run
sees. Running on FakeTensorMode costs ~0.7 ms per op (its Python dispatch, device logic and
reference implementations), most of a warm start. The "meta" tracer is a small wrapper
subclass: each tensor reports the real device, dtype, sizes, strides and offset, and holds a
meta tensor; one dispatch mode unwraps, runs the op's meta kernel, wraps the results and writes
the line. It is ~5x cheaper, but it is not FakeTensor: a few ops have fake-tensor rules of
their own (devices of factory calls, special strides), where the two could answer a query
differently.

So the meta text is trusted only once verified. An entry is stored under a meta key only if,
on the cold compile, a fake-tensor trace of the same program wrote the *same* text
(`persist.store_verified`). Otherwise the entry goes under the program's fake key and the meta
key holds only a redirect ("key this program with the fake tracer"), which is sound whatever
program later reaches it, since fake keys need no verification. Why that suffices: every
property a program can read from a tensor in the trace (dtype, shape, strides, offset, device;
requires_grad and autograd structure, which both get from the same autograd layer) is written
in the text for every result, so a run's answers to its queries are a function of the text
before them. Let P be verified (meta text == fake text == T) and P' a later program with meta
text T. By induction over T's lines: if P' under fake tensors has issued the same calls as
under meta up to line k, each tensor it holds has the fake results of those calls, which are
T's recorded results (P's fake run recorded them), so every query gets the same answer under
fake as under meta and P' issues line k+1 the same way. Hence P' writes T under fake tensors,
the text the entry was compiled from. Things the text cannot hold make the meta trace fail
(and so the program unkeyable, or keyed by the fake tracer): storage pointers (`untyped_storage`,
`data_ptr` raise), values (`.item()` has no meta kernel), results not on the meta device.
Inputs the wrapper does not model (views, non-leaves requiring grad, shared storage, conj/neg
bits, non-strided layouts) use the fake tracer; the two tracers' texts start with different
headers so their keys never meet.

Note [Verifying on the compile's own run]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The fake-tensor text that verifies a meta key does not need a run of its own: a cold compile
already runs the program on fresh plain fake tensors, with the inputs' requires_grad and the
grad mode, under eager autograd (the metadata pass's second run, aotc/metadata.py). That run is
a fake-tensor run of the program in every respect the text records, so `FakeRunObserver` pushes
the fake recorder on top of that run's dispatch modes (it sees the program's calls before any
mode below it, as the standalone fake trace does; fake tensors' dispatch cache and the overlap
check below it change no result) and writes the same text. The observer wraps the program, not
the pass: it starts recording on the first call whose graph arguments are plain fake tensors
(not functional wrappers, not symbolic) and leaves every other run alone. Soundness needs only
that the verifying text comes from a fake-tensor run of the program, which it does; if the
observer saw no such run, or its text differs from the meta text, `persist.store_verified` falls
back to what it did before (a standalone fake trace, then a redirect). Measured on the 10-op
pointwise chain: the key's cold-compile cost falls from ~25 ms (meta trace + fake trace + store)
to the meta trace and the store.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from aotc.functional import (
    FlatProgram,
    SymbolicIndexing,
    fakeify,
    symbolic_dispatch,
    transform_state,
)
from aotc.runtime import autograd
from aotc.runtime.autograd import PACKING
from aotc.runtime.convention import apply_convention, expand_graph_args, plan_convention

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
PLAIN = (
    int,
    float,
    bool,
    str,
    complex,
    type(None),
    torch.dtype,
    torch.device,
    slice,
    type(Ellipsis),
    torch.layout,
    torch.memory_format,
)


class Unkeyable(Exception):
    """The program does something the key text cannot describe; it is compiled, not stored."""


def storage_id(t: torch.Tensor) -> int:
    """Which storage `t` uses: its data pointer, or for a fake tensor (the inputs of a Dynamo
    graph stand for real ones) the identity of its storage object."""
    if isinstance(t, FakeTensor):
        return int(t.untyped_storage()._cdata)
    return t.untyped_storage().data_ptr()


def meta_eligible(leaves: list[object]) -> bool:
    """Inputs the meta tracer models exactly: plain strided leaves (or tensors without grad)
    that are not views, do not share storage and carry no conj/neg bit; fake tensors (a Dynamo
    graph's inputs) with static geometry count as the real tensors they stand for."""
    storages: set[int] = set()
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        if type(leaf) is not torch.Tensor and type(leaf) is not torch.nn.Parameter:
            if type(leaf) is not FakeTensor or not _static(leaf):
                return False
        if (
            leaf.layout is not torch.strided
            or leaf._base is not None
            or leaf.is_conj()
            or leaf.is_neg()
            or (leaf.requires_grad and not leaf.is_leaf)
            or leaf.is_inference()
            or leaf.device.type == "meta"
        ):
            return False
        ptr = storage_id(leaf)
        if ptr in storages and ptr != 0:
            return False  # a duplicate (same tensor twice) included: the fake tracer dedupes
        storages.add(ptr)
    return True


def _static(t: torch.Tensor) -> bool:
    return not any(
        isinstance(v, torch.SymInt) for v in (*t.shape, *t.stride(), t.storage_offset())
    ) and not isinstance(getattr(t, "item_memo", None), torch.SymFloat)


def trace_text(
    program: FlatProgram,
    leaves: list[object],
    grad_enabled: bool,
    tracer: str,
    facts: Any = None,
) -> str:
    """The canonical text of one run (see the module docstring). `facts`: an
    `aotc.symkey.ShapeFacts` for leaves with symbolic sizes (the fake tracer runs in their
    ShapeEnv and prints symbols canonically; see Note [Symbolic cache entries])."""
    convention = plan_convention(leaves)
    graph_args = apply_convention(convention, leaves)
    constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    if tracer == "meta":
        tensors: list[torch.Tensor] = [_MetaKeyTensor.of(t) for t in graph_args]
        recorder: _Recorder = _MetaRecorder(tensors)
        # transform_state: a failed run of a torch.func transform leaves no state behind.
        with transform_state(), recorder, torch.set_grad_enabled(grad_enabled):
            user_leaves = expand_graph_args(convention, tensors, constants)
            outs, out_spec = program(user_leaves)
    else:
        shape_env = facts.shape_env if facts is not None else None
        mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=shape_env)
        # Heuristic: one run sees most ops once, so fake tensors' dispatch cache mostly costs: in
        # a cProfile of the GPT block's key trace in a fresh process, building its keys and
        # entries took ~75 of 255 ms.
        mode.cache_enabled = False
        with mode:
            tensors = fakeify(mode, graph_args, as_leaves=False)
        recorder = _FakeRecorder(tensors, facts)
        with (
            # Note [Symbolic sizes need the Python dispatcher]
            symbolic_dispatch(shape_env is not None),
            transform_state(),
            mode,
            recorder,
            torch.set_grad_enabled(grad_enabled),
            SymbolicIndexing() if shape_env is not None else contextlib.nullcontext(),
        ):
            user_leaves = expand_graph_args(convention, tensors, constants)
            outs, out_spec = program(user_leaves)
    return _finish(recorder, outs, out_spec, tensors)


def _finish(
    recorder: _Recorder, outs: list[object], out_spec: object, tensors: list[torch.Tensor]
) -> str:
    """The text of a finished run: its op lines, then outputs, structure and inputs after."""
    if recorder.unkeyable is not None:
        raise Unkeyable(recorder.unkeyable)
    facts = getattr(recorder, "facts", None)  # symbolic fake runs: canonical symbol names
    lines = recorder.lines
    out_text = []
    for o in outs:
        if isinstance(o, torch.Tensor):
            out_text.append(f"{recorder.name(o)} rg={o.requires_grad} leaf={o.is_leaf}")
        elif isinstance(o, PLAIN):
            out_text.append(f"{type(o).__name__} {o!r}")
        elif isinstance(o, _SYM) and facts is not None:
            out_text.append(facts.text(o))
        else:
            raise Unkeyable(f"output of type {type(o).__name__}")
    lines.append("outputs " + ", ".join(out_text))
    lines.append(f"out_spec {out_spec}")
    lines.append(
        "inputs after " + ", ".join(f"rg={f.requires_grad} leaf={f.is_leaf}" for f in tensors)
    )
    _check_autograd(outs, tensors, recorder.seen)
    return "\n".join(lines)


class FakeRunObserver:
    """The fake tracer's text, written while the compile runs the program on fake tensors anyway
    (see Note [Verifying on the compile's own run]).

    `observe(program)` returns a program that, on its first call with plain fake tensors as its
    graph arguments (the metadata pass's eager-like run), writes what `trace_text(..., "fake")`
    would; every other call runs `program` untouched. `text` is None until then (or when the run
    cannot be described: `reason` says why)."""

    def __init__(self, leaves: list[object]) -> None:
        self._convention = plan_convention(leaves)
        self.text: str | None = None
        self.reason = "the compile made no plain fake-tensor run of the program"
        self.unkeyable = False  # the run did something the text cannot describe
        self._done = False

    @property
    def ran(self) -> bool:
        """Whether the observer saw the program's plain fake-tensor run."""
        return self._done

    def observe(self, program: FlatProgram) -> FlatProgram:
        def observed(user_leaves: list[object]) -> tuple[list[object], object]:
            if self._done:
                return program(user_leaves)
            graph_args = apply_convention(self._convention, user_leaves)
            if not all(_is_plain_fake(t) for t in graph_args):
                return program(user_leaves)
            self._done = True
            recorder = _FakeRecorder(graph_args)
            with recorder:
                outs, out_spec = program(user_leaves)
            try:
                self.text = _finish(recorder, outs, out_spec, graph_args)
            except Unkeyable as e:
                self.reason, self.unkeyable = str(e), True
            except Exception as e:  # noqa: BLE001 the observer must never fail a compile
                self.reason = f"key text failed ({type(e).__name__})"
            return outs, out_spec

        return observed


def _is_plain_fake(t: object) -> bool:
    return (
        isinstance(t, FakeTensor)
        and not torch._is_functional_tensor(t)
        and t.fake_mode.shape_env is None  # symbolic compilations are never stored
    )


def _check_autograd(
    outs: list[object], inputs: list[torch.Tensor], seen: list[torch.Tensor]
) -> None:
    """Python code the op text cannot see: custom autograd.Functions and tensor hooks."""
    for t in seen:
        if getattr(t, "_backward_hooks", None):
            raise Unkeyable("a tensor hook registered inside the function")
    for node in autograd.autograd_nodes([*outs, *inputs]):
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            raise Unkeyable(f"custom autograd.Function {type(node).__name__}")


class _Recorder(TorchDispatchMode):
    """Writes each ATen call as canonical text (see Note [Cache key] in aotc/persist.py)."""

    def __init__(self, inputs: list[torch.Tensor], facts: Any = None) -> None:
        super().__init__()
        self.facts = facts  # canonical symbol names, for symbolic inputs
        self.seen: list[torch.Tensor] = []  # keeps every tensor alive, so ids stay unique
        self.names: dict[int, str] = {}
        self.lines: list[str] = []
        # Never raise inside __torch_dispatch__ (some callers are C++ that cannot propagate a
        # Python error); the reason is raised after the program returns.
        self.unkeyable: str | None = None
        for t in inputs:
            self._new(t)
        for t in inputs:  # autograd replays views of inputs on their bases
            if t._base is not None and id(t._base) not in self.names:
                self.lines.append(f"{self._new(t._base)} = base of {self.names[id(t)]}")

    def _new(self, t: torch.Tensor) -> str:
        name = self.names.get(id(t))
        if name is None:
            name = self.names[id(t)] = f"t{len(self.seen)}"
            self.seen.append(t)
        return name

    def name(self, t: torch.Tensor) -> str:
        name = self.names.get(id(t))
        if name is None:
            raise Unkeyable("a tensor reached without a dispatched op (e.g. `.data`)")
        return name

    def _arg(self, a: Any) -> str:
        if isinstance(a, torch.Tensor):
            if id(a) in self.names:
                return self.names[id(a)] + (" rg" if a.requires_grad else "")
            if type(a) is not torch.Tensor:
                self.unkeyable = "a tensor reached without a dispatched op (e.g. `.data`)"
                return self._new(a)
            return self._constant(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self._arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k}={self._arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, PLAIN):
            return repr(a)
        if isinstance(a, _SYM) and self.facts is not None:
            return self.facts.text(a)
        self.unkeyable = f"op argument of type {type(a).__name__}"
        return "?"

    def _constant(self, t: torch.Tensor) -> str:
        """A real tensor inside the program (`torch.tensor([...])`): named by its value."""
        with unset_fake_temporarily():  # the fake tracer's mode is still on below this one
            data = t.detach().contiguous().reshape(-1).view(torch.uint8)
            digest = hashlib.sha256(data.numpy().tobytes() if data.numel() else b"").hexdigest()
        name = self._new(t)
        return f"{name}=const({t.dtype} {tuple(t.shape)} {t.stride()} {digest})"

    def record(self, func: Any, text: str, out: Any) -> None:
        try:
            results = []
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    if self.facts is None:
                        geometry = f"{list(o.shape)}/{o.stride()}+{o.storage_offset()}"
                    else:
                        dims = self.facts.dims
                        geometry = (
                            f"{dims(o.shape)}/{dims(o.stride())}+{dims([o.storage_offset()])}"
                        )
                    results.append(f"{self._new(o)}:{o.dtype}{geometry}@{o.device}")
                else:
                    results.append(self._arg(o))
            self.lines.append(f"{', '.join(results)} = {text}")
        except Exception as e:  # noqa: BLE001 see __init__
            self.unkeyable = f"cannot print the result of {func} ({e})"

    def call_text(self, func: Any, args: Any, kwargs: Any) -> str:
        try:
            return f"{func}({self._arg(args)}, {self._arg(kwargs)}) grad={int(torch.is_grad_enabled())}"
        except Exception as e:  # noqa: BLE001 see __init__: never raise from here
            self.unkeyable = f"cannot print the arguments of {func} ({e})"
            return ""


_DEVICE_QUERY = torch.ops.prim.device.default


class _FakeRecorder(_Recorder):
    """Runs above FakeTensorMode. Device queries (fake tensors dispatch them) are not written:
    every result's device is in the text already, so they add nothing (Note [Meta key trace])."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _DEVICE_QUERY or PACKING[0]:  # PACKING: an op of aotc's saved-value hooks
            return func(*args, **kwargs)
        text = self.call_text(func, args, kwargs)
        out = func(*args, **kwargs)
        self.record(func, text, out)
        return out


class _MetaKeyTensor(torch.Tensor):
    """A tensor of the meta key trace: the real device and geometry, a meta tensor inside.
    Only _MetaRecorder runs ops on it; storage pointers are refused (Note [Meta key trace])."""

    meta: torch.Tensor
    # torch's stubs type Tensor.__torch_function__ as a 4-argument classmethod; this is the
    # documented way to disable it on a subclass.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device) -> _MetaKeyTensor:  # noqa: PYI034
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.size(),
            meta.stride(),
            meta.storage_offset(),
            dtype=meta.dtype,
            device=device,
            layout=meta.layout,
            requires_grad=False,
        )
        out.meta = meta
        return out

    @classmethod
    def of(cls, t: torch.Tensor) -> _MetaKeyTensor:
        """A key tensor with `t`'s geometry, dtype, device and requires_grad (a leaf)."""
        extent = (
            t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
            if t.numel()
            else t.storage_offset()
        )
        storage = torch.empty(extent, dtype=t.dtype, device="meta")
        out = cls(storage.as_strided(t.shape, t.stride(), t.storage_offset()), t.device)
        out.requires_grad_(t.requires_grad)
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise Unkeyable(f"{func} ran on a key-trace tensor outside the key trace")

    def untyped_storage(self) -> Any:
        raise Unkeyable("the program reads a tensor's storage")

    def data_ptr(self) -> int:
        raise Unkeyable("the program reads a tensor's data pointer")

    storage = untyped_storage
    _typed_storage = untyped_storage


class _MetaRecorder(_Recorder):
    """Runs each op's meta kernel on the wrapped meta tensors and writes the line."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__(inputs)
        self.constants: dict[int, _MetaKeyTensor] = {}

    def _unwrap(self, a: Any, pairs: list[tuple[torch.Tensor, _MetaKeyTensor]]) -> Any:
        """`a` with meta tensors for key tensors (and for real constants, `torch.tensor(...)`);
        `pairs` collects (meta, key tensor) per tensor argument."""
        if isinstance(a, torch.Tensor):
            wrapped = a if isinstance(a, _MetaKeyTensor) else self.constants.get(id(a))
            if wrapped is None:
                wrapped = self.constants[id(a)] = _MetaKeyTensor(a.to("meta"), a.device)
            pairs.append((wrapped.meta, wrapped))
            return wrapped.meta
        if isinstance(a, (list, tuple)) and any(
            isinstance(x, (torch.Tensor, list, tuple)) for x in a
        ):
            return type(a)(self._unwrap(x, pairs) for x in a)
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        text = self.call_text(func, args, kwargs)
        pairs: list[tuple[torch.Tensor, _MetaKeyTensor]] = []
        meta_args = self._unwrap(args, pairs)
        meta_kwargs = {k: self._unwrap(v, pairs) for k, v in kwargs.items()}
        if "device" in kwargs:
            device = _factory_device(kwargs["device"])
            meta_kwargs["device"] = "meta"
        elif pairs:
            device = _common_device([(w.device, w.dim()) for _, w in pairs])
            if device is None:
                self.unkeyable = f"{func} mixes devices {sorted({str(w.device) for _, w in pairs})}"
                device = pairs[0][1].device
        else:
            device = _CPU
        meta_out = func(*meta_args, **meta_kwargs)
        # In-place and out= calls return an argument: give back its key tensor, keeping identity.
        by_id = {id(m): w for m, w in pairs}
        out = pytree.tree_map(lambda o: self._wrap(func, o, device, by_id), meta_out)
        self.record(func, text, out)
        return out

    def _wrap(self, func: Any, o: Any, device: torch.device, by_id: dict[int, Any]) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        same = by_id.get(id(o))
        if same is not None:
            return same
        if o.device.type != "meta":
            self.unkeyable = f"{func} returned a tensor on {o.device}, not a meta tensor"
            return o
        return _MetaKeyTensor(o, device)


_CPU = torch.device("cpu")


def _factory_device(device: object) -> torch.device:
    """The device a factory call's result lands on: None is CPU at this level (a default device
    set by `torch.set_default_device` is filled in above the dispatcher), and "cuda" means the
    current CUDA device, as fake tensors write it."""
    if device is None:
        return _CPU
    out = torch.device(device)  # type: ignore[call-overload]
    if out.type == "cuda" and out.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return out


def _common_device(devices: list[tuple[torch.device, int]]) -> torch.device | None:
    """The device of an op's results from its tensor arguments' (device, dim): all the same, or
    one non-CPU device with CPU scalars (0-dim) beside it, as eager allows; None when mixed."""
    first = devices[0][0]
    if all(d == first for d, _ in devices):
        return first
    others = {d for d, _ in devices if d.type != "cpu"}
    if len(others) == 1 and all(n == 0 for d, n in devices if d.type == "cpu"):
        return others.pop()
    return None


__all__ = ["PLAIN", "FakeRunObserver", "Unkeyable", "meta_eligible", "storage_id", "trace_text"]
