"""Fast path: one straight-line call function per compiled entry whose plan needs no fix-ups.

Stage: `make_fast_call(plan, fwd, apply, general) -> Callable[[list], object] | None`, once per
entry at build time.
Requires: `plan` is the entry's RuntimePlan; `apply(holder, *graph_args)` is its autograd node's
apply (None for an inference entry); `general(leaves)` is the entry's full call path.
Ensures: None unless the plan is *direct* (see Note [Direct plans]); otherwise a function that
returns what `general(leaves)` returns for every call, doing only the work the plan needs.

Note [Direct plans]
~~~~~~~~~~~~~~~~~~~
Most entries have no synthetic bases, no mutated inputs, no arguments to detach, and only outputs
that are fresh tensors, constants or inputs returned as they are. For those, the whole of
`CompiledEntry._run` (convention, autograd apply, holder fix-up, epilogue, unflatten) reduces to
picking graph args out of the leaves, one call, and picking user outputs out of its results.
That is generated as Python source with every index inlined, like runtime/launch.py does for
graphs, so a call allocates no plan-sized lists and runs no per-output `match`:

    def call(leaves):
        if any_autocast() or functorch_active():
            return general(leaves)
        d = apply(None, leaves[0], leaves[1])   # None: Note [No holder when every output
        return d[0]                             # is differentiable] in runtime/autograd.py

Note [Calls after a guard hit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The same source also defines `hit(leaves)`, the call without its first two lines: the
dispatchers run it after a generated signature check passed (Note [Guard checks] in
runtime/guards.py), which has just checked that no autocast is on and no functorch transform is
active, so the call need not ask again (two C calls, ~0.3 us of a tiny training call). The
dispatchers inline that body after the check, in one generated function (Note [Fused guard and
call] in runtime/guards.py), from `call.aotc_hit_body`. Any other caller (a key lookup) runs
`call`; the torch.compile backend's closure for graphs that lift nothing is `call.aotc_run`, the
same code taking the leaves as arguments (no closure frame, no list per call).

Calls under autocast or inside a functorch transform take `general` (it switches autocast off and
goes through `Function.apply`, see Note [Direct apply] in runtime/wrappers.py). Anything else
(views of inputs or intermediates, mutations, duplicates folded into synthetic bases) takes
`general` always: those steps carry the aliasing semantics and stay in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from aotc.runtime.epilogue import StepKind, buffer_versions, write_buffers
from aotc.runtime.schema import OutputKind

_DIRECT_OUTPUTS = (OutputKind.FRESH, OutputKind.NOT_TENSOR, OutputKind.IS_INPUT)


def _plain(plan: Any, outputs: tuple[OutputKind, ...]) -> bool:
    """What direct plans and plans a replaying call takes through `general` share: no synthetic
    bases, leaves made inside or regrad, no anchor, outputs only of `outputs`' kinds, none made
    a view again in the epilogue (Note [Views a custom Function returns])."""
    conv, epi = plan.convention, plan.epilogue
    if conv.synthetic_bases or epi.new_leaves or plan.enable_grad or plan.refuse_saved_hooks:
        return False
    if plan.autograd is not None and plan.autograd.anchor:
        return False
    if any(s.kind not in outputs for s in epi.outputs):
        return False
    return not any(s.custom_arg is not None or s.custom_out is not None for s in epi.outputs)


def is_direct(plan: Any, replaying: bool = False) -> bool:
    """Whether `plan` is direct (Note [Direct plans]). `replaying`: for a call whose backward
    eager's autograd records, which gives args no gradient by itself (`detach_args`) and checks
    the versions of the outputs it saved (the compiled pair watches them: `watch_outputs`)."""
    epi = plan.epilogue
    if epi.mutations or epi.versions or not _plain(plan, _DIRECT_OUTPUTS):
        return False
    if replaying:
        return True
    return not plan.detach_args and not (plan.autograd and plan.autograd.watch_outputs)


def eager_replayable(plan: Any) -> bool:
    """Whether a call of `plan` may let eager's autograd record its backward, as far as the
    plan goes (Note [Eager autograd on the ATen path] in aotc/eagerautograd.py): direct plans
    (the generated call runs the forward), and through `general` plans that also return one
    output twice or write inputs that need no grad without autograd history (a BatchNorm's
    running statistics, with eager's version bumps)."""
    epi = plan.epilogue
    if plan.autograd is None or epi.make_require_grad or epi.roots:
        return False
    if not _plain(plan, (*_DIRECT_OUTPUTS, OutputKind.IS_OUTPUT)):
        return False
    if any(s.detach or s.new_leaf for s in epi.outputs):
        return False
    return all(m.kind is StepKind.COPY and m.no_grad and not m.via_view for m in epi.mutations)


def writes_buffers(plan: Any) -> bool:
    """Whether `plan` is direct but for writes into inputs that need no grad without autograd
    history (copies under no_grad into the inputs themselves: a BatchNorm's running statistics
    and step counter, with eager's version steps), so that a replaying call can be generated
    with those writes inlined (Note [Generated buffer writes])."""
    epi = plan.epilogue
    return (
        bool(epi.mutations or epi.versions)
        and eager_replayable(plan)
        and _plain(plan, _DIRECT_OUTPUTS)
    )


# Note [Generated buffer writes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A replaying entry that writes buffers (a conv net's BatchNorm) went through `general`: the
# convention, `apply_mutations` (a grad-mode context per write, a dict of view targets) and
# `build_outputs`, ~30 us of a conv net step whose eager forward's own Python overhead is ~60 us.
# For plans whose only fix-ups are such writes (`writes_buffers`), the generated call runs the
# forward, then `epilogue.write_buffers` with the targets, values and version steps picked out by
# index, all under MUTATION_LOCK as `general` would hold it (Note [Concurrent mutations] in
# runtime/wrappers.py); the writes are the same copies in the same order, and the versions
# are set as `apply_mutations` sets them, from the versions read before the forward (which
# may do some writes itself: Note [Buffers written in place] in runtime/replay.py).


def make_fast_call(
    plan: Any,
    fwd: Callable[..., Any],
    apply: Callable[..., Any] | None,
    general: Callable[[list[object]], object],
    fills_holder: bool = True,
    replay: Callable[..., Any] | None = None,
    lock: Any = None,
) -> Callable[[list[object]], object] | None:
    """`replay`: the forward of an entry whose calls let eager's autograd record the backward
    (Note [Eager autograd on the ATen path] in aotc/eagerautograd.py); it is then called in
    place of `apply`, with grad on (the entry is a training entry: calls run it with grad on).
    `lock`: held around the call and its buffer writes, for plans `writes_buffers` accepts."""
    writes = replay is not None and lock is not None and writes_buffers(plan)
    if not writes and not is_direct(plan, replaying=replay is not None):
        return None
    conv, epi = plan.convention, plan.epilogue
    namespace: dict[str, Any] = {
        "any_autocast": torch._C._is_any_autocast_enabled,
        "functorch_active": torch._C._are_functorch_transforms_active,
        "general": general,
    }
    args = ", ".join(f"leaves[{i}]" for i in conv.graph_sources)
    if list(conv.graph_sources) == list(range(conv.num_user_leaves)):
        args = "*leaves"
    if replay is not None or apply is None:
        # An inference entry's forward, or the forward eager's autograd records: the latter
        # takes `general` under a functorch transform too (the compiled pair has its rules).
        namespace["fwd"] = replay if replay is not None else fwd
        check = "any_autocast() or functorch_active()" if replay is not None else "any_autocast()"
        lines = [f"    if {check}:", "        return general(leaves)", f"    d = fwd({args})"]
        if writes:  # See Note [Generated buffer writes]
            namespace["lock"], namespace["write_buffers"] = lock, write_buffers
            namespace["buffer_versions"] = buffer_versions
            src = conv.graph_sources
            # Note [Buffers written in place] in runtime/replay.py: the forward did these.
            done = frozenset(plan.writes_in_place)
            copies = [m for m in epi.mutations if (m.target, m.new_value) not in done]
            targets = "".join(f"leaves[{src[m.target]}], " for m in copies)
            values = "".join(f"d[{m.new_value}], " for m in copies)
            bumped = "".join(f"leaves[{a}], " for a, _ in epi.versions)
            bumps = "".join(f"{n}, " for _, n in epi.versions)
            lines[2:] = [
                "    with lock:",
                f"        vs = buffer_versions(({bumped}), ({bumps}))",
                f"        d = fwd({args})",
                f"        write_buffers(({targets}), ({values}), vs)",
            ]

        def fwd_out(k: int) -> str:
            return f"d[{k}]"

    else:
        namespace["apply"] = apply
        diff_pos = {k: pos for pos, k in enumerate(plan.autograd.diff_outs)}
        # See Note [No holder when every output is differentiable] in runtime/autograd.py.
        holder = "h := []" if fills_holder else "None"
        lines = [
            "    if any_autocast() or functorch_active():",
            "        return general(leaves)",
            f"    d = apply({holder}, {args})" if args else f"    d = apply({holder})",
        ]

        def fwd_out(k: int) -> str:
            assert k in diff_pos or fills_holder, "a non-differentiable output needs the holder"
            return f"d[{diff_pos[k]}]" if k in diff_pos else f"h[{k}]"

    exprs = []
    for j, s in enumerate(epi.outputs):
        if s.kind is OutputKind.FRESH:
            detach = ".detach().requires_grad_()" if s.new_leaf else ".detach()"
            exprs.append(fwd_out(s.source) + (detach if s.detach else ""))
        elif s.kind is OutputKind.IS_INPUT:
            exprs.append(f"leaves[{s.source}]")
        else:
            namespace[f"k{j}"] = s.constant
            exprs.append(f"k{j}")
    spec = plan.out_spec
    if spec.is_leaf():
        lines.append(f"    return {exprs[0]}")
    elif spec.type is tuple and all(c.is_leaf() for c in spec.children()):
        # (A replayed forward may return the saved values after the outputs: runtime/replay.py.)
        if (
            replay is None
            and apply is not None
            and exprs == [f"d[{p}]" for p in range(len(exprs))]
            and len(plan.autograd.diff_outs) == len(exprs)
        ):
            lines.append("    return d")  # autograd's own tuple holds exactly the outputs
        else:
            lines.append(f"    return ({''.join(e + ', ' for e in exprs)})")
    else:
        namespace["unflatten"] = pytree.tree_unflatten
        namespace["spec"] = spec
        lines.append(f"    return unflatten([{', '.join(exprs)}], spec)")
    body = "\n".join(lines[2:]) + "\n"
    varargs = "\n".join(lines).replace("general(leaves)", "general([*leaves])", 1)
    source = (
        "def call(leaves):\n"
        + "\n".join(lines)
        + "\n\n\ndef hit(leaves):\n"
        + body
        + "\n\ndef run(*leaves):\n"
        + varargs
        + "\n"
    )
    exec(compile(source, f"<aotc fast call {plan.name}>", "exec"), namespace)  # noqa: S102
    call = namespace["call"]
    call.__aotc_source__ = source
    call.aotc_hit = namespace["hit"]  # See Note [Calls after a guard hit]
    # See Note [Fused guard and call]: the hit's body, to be inlined after a generated guard
    # (its names: `apply`/`fwd`, `general`, `unflatten`, `spec`, constants `k<j>`; it reads
    # `leaves`, a list or a tuple).
    call.aotc_hit_body = (
        body,
        {k: v for k, v in namespace.items() if k not in ("__builtins__", "call", "hit", "run")},
    )
    call.aotc_run = namespace["run"]  # `call` taking the leaves as arguments (Dynamo's closure)
    return call  # type: ignore[no-any-return]
