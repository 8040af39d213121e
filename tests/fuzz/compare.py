"""Run one program under eager and under aotc and compare everything a user can observe.

`check(f, make_inputs, backward, write_outputs, mode) -> Outcome`. Modes: "trace"
(`aotc.compile(capture="trace")`, strict mode), "default" (`aotc.compile`, captured through
Dynamo), "triton" (strict mode with `backend="triton"`, Triton's interpreter on CPU) and "dynamo"
(`torch.compile(backend="aotc")`). Compared, for two calls on fresh inputs: the output
structure and every output's values, dtype, shape, strides, requires_grad, is_leaf, grad_fn
presence and view-ness; which outputs and inputs share storage and which output is the `._base`
of which; every input's values, shape, strides, requires_grad, leafness, grad_fn presence and
version after the call; the RNG state after the call; a backward through the chosen outputs
(gradients of every leaf reachable from the inputs and of outputs that are leaves, None vs
values); and, optionally, whether each output can be written in place afterwards and what that
does to the inputs. Modes "trace_inference" and "default_inference" make the inputs and run
the calls under `torch.inference_mode()` (inference tensors; no backward). Errors: where eager raises, aotc must raise too (the same type, or an
aotc error), at the same step.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

import aotc


class Verdict(enum.Enum):
    MATCH = "match"  # same observable behaviour, including the same errors
    REFUSED = "refused"  # aotc raised UnsupportedError where eager runs the program
    DIFFERS = "differs"  # a silent difference, or aotc failed otherwise


@dataclasses.dataclass
class Outcome:
    verdict: Verdict
    detail: str = ""  # what differs, or why it was refused (first line)

    def __str__(self) -> str:
        return f"{self.verdict.value}: {self.detail}" if self.detail else self.verdict.value


class _Differs(Exception):
    """A compiled run that differs from eager's (caught where the comparison reports it)."""


def _compiled(f: Callable[..., Any], mode: str) -> Callable[..., Any]:
    if mode == "trace":
        return aotc.compile(f, capture="trace", check_invariants=True)
    if mode == "default":
        torch._dynamo.reset()
        return aotc.compile(f, check_invariants=True)
    if mode == "triton":
        return aotc.compile(f, capture="trace", backend="triton", check_invariants=True)
    if mode == "dynamo":
        torch._dynamo.reset()
        return torch.compile(f, backend="aotc")
    if mode in ("trace_hit", "default_hit", "triton_hit"):  # see `check`
        return _compiled(f, mode.removesuffix("_hit"))
    if mode in ("trace_inference", "default_inference"):  # see `_observe`
        return _compiled(f, mode.removesuffix("_inference"))
    raise ValueError(f"unknown mode {mode!r}")


def check(
    f: Callable[..., Any],
    make_inputs: Callable[[], list[Any]],
    backward: list[int],
    write_outputs: bool = False,
    mode: str = "trace",
    calls: int = 2,
) -> Outcome:
    compiled = _compiled(f, mode)
    inference = mode.endswith("_inference")
    if mode.endswith("_hit"):
        # A disk-cache hit: the first compile stores its entry (one call on inputs of the same
        # signature), a fresh compile of the same function loads it (this user's own entry:
        # stored kernels and binding verdicts, Note [Trusted entries] in runtime/cache.py).
        _observe(compiled, make_inputs, backward, write_outputs, 99)
        aotc.cache_flush()
        compiled = _compiled(f, mode)
    for call in range(calls):
        want = _observe(f, make_inputs, backward, write_outputs, 100 + call, inference)
        got = _observe(compiled, make_inputs, backward, write_outputs, 100 + call, inference)
        refused = got.get("unsupported")
        if refused is None and mode == "dynamo" and want.get("error_step") != "call":
            refused = _dynamo_itself(f, make_inputs, backward, write_outputs, 100 + call, got)
        if refused is not None and want.get("error_step") != "call":
            return Outcome(Verdict.REFUSED, refused)
        try:
            _compare(want, got)
        except _Differs as e:
            return Outcome(Verdict.DIFFERS, f"call {call}: {e}")
        if want.get("error_step") is not None:
            break  # both refused the same step; the next call would only repeat it
    return Outcome(Verdict.MATCH)


def _dynamo_itself(
    f: Callable[..., Any],
    make_inputs: Callable[[], list[Any]],
    backward: list[int],
    write_outputs: bool,
    seed: int,
    got: dict[str, Any],
) -> str | None:
    """Dynamo's own failure, not aotc's: torch.compile raised at the call where eager ran, and
    torch.compile(backend="eager") raises the same on the same program (so no backend could run
    it): a Dynamo error of the same type (InternalTorchDynamoError, TorchRuntimeError), or any
    other error with the same type and first line (an AssertionError from Dynamo's fake-tensor
    conversion). Counted as a refusal, with Dynamo's message; None when the call did not fail
    that way (then it is compared as usual). An aotc error is never Dynamo's."""
    error = got.get("error")
    if got.get("error_step") != "call" or error is None or isinstance(error, aotc.AotcError):
        return None
    if isinstance(getattr(error, "inner_exception", None), aotc.AotcError):
        return None
    if isinstance(error, torch._dynamo.exc.BackendCompilerFailed):
        return None  # the backend (aotc) failed, not Dynamo
    torch._dynamo.reset()
    baseline = _observe(
        torch.compile(f, backend="eager"), make_inputs, backward, write_outputs, seed
    )
    torch._dynamo.reset()
    if baseline.get("error_step") != "call" or type(baseline.get("error")) is not type(error):
        return None
    if not isinstance(error, torch._dynamo.exc.TorchDynamoException) and _error_text(
        baseline
    ) != _error_text(got):
        return None
    return f"Dynamo itself (backend='eager' too): {_error_text(got)}"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _roots(args: list[Any]) -> list[torch.Tensor]:
    """Leaves requiring grad that the inputs are or hang off."""
    out: list[torch.Tensor] = []
    for t in _tensors(args):
        stack = [t, t._base] if t._base is not None else [t]
        if _grad_fn_state(t) is True:
            stack += [
                getattr(n, "variable", None)
                for n in _walk(t.grad_fn)
                if getattr(n, "variable", None) is not None
            ]
        for cand in stack:
            if cand is not None and cand.is_leaf and cand.requires_grad:
                if not any(cand is o for o in out):
                    out.append(cand)
    return out


def _walk(node: Any) -> list[Any]:
    seen, stack, out = set(), [node], []
    while stack and len(out) < 200:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        stack.extend(fn for fn, _ in n.next_functions)
    return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.layout is torch.strided and t.numel() else 0


def _grad_fn_state(t: torch.Tensor) -> object:
    """Whether `t` has a grad_fn; or eager's error when reading it fails (a view whose base
    was written under other grad modes regenerates its grad_fn on access)."""
    try:
        return t.grad_fn is not None
    except RuntimeError as e:
        return f"raises {_error_kind(e)}"


def _is_leaf(t: torch.Tensor) -> object:
    try:
        return t.is_leaf
    except RuntimeError as e:
        return f"raises {_error_kind(e)}"


def _error_kind(e: BaseException) -> str:
    """An autograd error without the node name it names (`Output 0 of SplitBackward0`): the
    regenerated views are as_strided views, eager's the original op's; for the same reason
    eager's "Output 0 of Select is a view of a view which was created in no_grad mode ..." is
    aotc's one-level "A view was created in no_grad mode ...": the same refusal."""
    text = re.sub(r"Output \d+ of \w+", "Output of a view", str(e))
    text = text.replace(
        "Output of a view is a view of a view which was created", "A view was created"
    )
    return text[:80]


def _tensor_state(t: torch.Tensor) -> dict[str, Any]:
    strides = [st for st, n in zip(t.stride(), t.shape) if n > 1]
    return {
        "shape": tuple(t.shape),
        "dtype": t.dtype,
        "strides": strides,
        "requires_grad": t.requires_grad,
        "is_leaf": _is_leaf(t),
        "has_grad_fn": _grad_fn_state(t),
        "is_view": t._is_view(),
        "value": t.detach().clone(),
        "is_inference": t.is_inference(),
    }


def _relations(outs: list[Any], args: list[Any]) -> list[tuple[Any, ...]]:
    """Storage sharing and `._base` links among outputs and inputs, by position."""
    items = [("out", j, o) for j, o in enumerate(outs) if isinstance(o, torch.Tensor)]
    items += [("arg", i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    rel = []
    for x in items:
        for y in items:
            if x is y:
                continue
            same = x[2] is y[2]
            shares = _storage(x[2]) != 0 and _storage(x[2]) == _storage(y[2])
            base = x[2]._base is not None and (x[2]._base is y[2] or x[2]._base is y[2]._base)
            if same or shares or base:
                rel.append((x[0], x[1], y[0], y[1], same, shares, base))
    return rel


def _observe(
    fn: Callable[..., Any],
    make_inputs: Callable[[], list[Any]],
    backward: list[int],
    write_outputs: bool,
    seed: int,
    inference: bool = False,
) -> dict[str, Any]:
    """One call of `fn` on fresh inputs, observed. `inference`: the inputs are made and the call
    and the writes run under `torch.inference_mode()` (inference tensors, no backward)."""
    with torch.inference_mode(inference):
        return _observe_in_mode(fn, make_inputs, [] if inference else backward, write_outputs, seed)


def _version(t: torch.Tensor) -> int:
    return 0 if t.is_inference() else t._version


def _observe_in_mode(
    fn: Callable[..., Any],
    make_inputs: Callable[[], list[Any]],
    backward: list[int],
    write_outputs: bool,
    seed: int,
) -> dict[str, Any]:
    torch.manual_seed(seed)
    args = make_inputs()
    tensors = _tensors(args)
    versions = [_version(t) for t in tensors]
    roots = _roots(args)
    result: dict[str, Any] = {}
    torch.manual_seed(seed + 1)
    try:
        out = fn(*args)
    except aotc.UnsupportedError as e:
        result.update(unsupported=str(e).strip().splitlines()[0][:300], error_step="call")
        result["error"] = e
        return result
    except Exception as e:  # noqa: BLE001 eager's refusal, compared with aotc's
        inner = getattr(e, "inner_exception", None)  # torch.compile's BackendCompilerFailed
        if isinstance(inner, aotc.UnsupportedError):
            result.update(unsupported=str(inner).strip().splitlines()[0][:300], error_step="call")
        result.update(error_step="call", error=e)
        return result
    result["rng"] = torch.get_rng_state()
    flat = pytree.tree_leaves(out)
    result["spec"] = pytree.tree_structure(out)
    result["outs"] = [_tensor_state(o) if isinstance(o, torch.Tensor) else o for o in flat]
    result["args"] = [
        {**_tensor_state(t), "version": _version(t) - v} for t, v in zip(tensors, versions)
    ]
    result["relations"] = _relations(flat, tensors)
    chosen = [flat[j] for j in backward if j < len(flat) and isinstance(flat[j], torch.Tensor)]
    try:
        if chosen and all(o.requires_grad for o in chosen):
            gen = torch.Generator().manual_seed(seed)
            cts = [
                torch.randn(o.shape, generator=gen, dtype=torch.float64, device="cpu").to(
                    o.device, o.dtype
                )
                for o in chosen
            ]
            torch.autograd.backward(chosen, cts)
        result["grads"] = [None if r.grad is None else r.grad.detach().clone() for r in roots]
        result["out_grads"] = [
            None
            if not (isinstance(o, torch.Tensor) and o.is_leaf and o.grad is not None)
            else o.grad.detach().clone()
            for o in flat
        ]
    except Exception as e:  # noqa: BLE001 compared with the other side
        result.update(error_step="backward", error=e)
        return result
    if write_outputs:
        written = []
        for o in flat:
            if not isinstance(o, torch.Tensor) or not o.is_floating_point():
                continue
            try:
                o.add_(1.0)
                written.append(True)
            except RuntimeError:
                written.append(False)
        result["written"] = written
        result["args_after_write"] = [t.detach().clone() for t in tensors]
    return result


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype in (torch.float16, torch.bfloat16) or want.dtype in (
        torch.float16,
        torch.bfloat16,
    ):
        rtol, atol = 1e-2, 1e-2
    elif got.dtype == torch.float64:
        rtol, atol = 1e-7, 1e-7
    else:
        rtol, atol = 1e-4, 1e-5
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        raise _Differs(f"{what}: {str(e).splitlines()[0]}") from None


def _compare_state(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    for key in ("shape", "dtype", "strides", "requires_grad", "is_leaf", "has_grad_fn"):
        if got[key] != want[key]:
            raise _Differs(f"{what} {key}: aotc {got[key]} vs eager {want[key]}")
    if got.get("version") != want.get("version"):
        raise _Differs(f"{what} version: aotc +{got['version']} vs eager +{want['version']}")
    _close(got["value"], want["value"], f"{what} value")


def _compare(want: dict[str, Any], got: dict[str, Any]) -> None:
    if want.get("error_step") != got.get("error_step"):
        raise _Differs(
            f"eager {'raised at ' + want['error_step'] if want.get('error_step') else 'ran'}"
            f" ({_error_text(want)}); aotc "
            f"{'raised at ' + got['error_step'] if got.get('error_step') else 'ran'}"
            f" ({_error_text(got)})"
        )
    if want.get("error_step") == "call":
        _same_error(want["error"], got["error"])
        return
    if got["spec"] != want["spec"]:
        raise _Differs(f"output structure {got['spec']} vs eager {want['spec']}")
    for j, (g, w) in enumerate(zip(got["outs"], want["outs"])):
        if isinstance(w, dict):
            if not isinstance(g, dict):
                raise _Differs(f"output {j}: {type(g).__name__} vs eager tensor")
            _compare_state(g, w, f"output {j}")
            if g["is_view"] != w["is_view"]:
                raise _Differs(
                    f"output {j} _is_view(): aotc {g['is_view']} vs eager {w['is_view']}"
                )
        elif g != w:
            raise _Differs(f"output {j}: {g!r} vs eager {w!r}")
    for i, (g, w) in enumerate(zip(got["args"], want["args"])):
        _compare_state(g, w, f"input {i} after the call")
    if got["relations"] != want["relations"]:
        extra = set(got["relations"]) ^ set(want["relations"])
        raise _Differs(f"aliasing differs: {sorted(extra, key=str)[:4]}")
    if not torch.equal(got["rng"], want["rng"]):
        raise _Differs("RNG state after the call differs")
    if want.get("error_step") == "backward":
        _same_error(want["error"], got["error"])
        return
    for kind in ("grads", "out_grads"):
        for i, (g, w) in enumerate(zip(got[kind], want[kind])):
            if (g is None) != (w is None):
                raise _Differs(
                    f"{kind} {i}: aotc {'None' if g is None else 'a tensor'}, eager "
                    f"{'None' if w is None else 'a tensor'}"
                )
            if w is not None:
                _close(g, w, f"{kind} {i}")
    if "written" in want:
        if got["written"] != want["written"]:
            raise _Differs(
                f"in-place writes into the outputs allowed: aotc {got['written']} vs eager "
                f"{want['written']}"
            )
        for i, (g, w) in enumerate(zip(got["args_after_write"], want["args_after_write"])):
            _close(g, w, f"input {i} after writing the outputs")


def _error_text(side: dict[str, Any]) -> str:
    e = side.get("error")
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}" if e else "-"


def _same_error(want: BaseException, got: BaseException) -> None:
    if isinstance(got, type(want)) or isinstance(got, aotc.AotcError):
        return
    raise _Differs(
        f"eager raised {_error_text({'error': want})}; aotc {_error_text({'error': got})}"
    )
