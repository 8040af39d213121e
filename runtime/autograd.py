"""The one autograd node a compiled training call adds to the user's graph.

Stage: `make_autograd_function(fwd, bwd, plan) -> type[torch.autograd.Function]`.
Requires: `fwd(*graph_args)` returns the fwd outputs then the saved values; `bwd(*saved,
*tangents)` returns the gradients of `plan.grad_args`, in order.
Ensures: `apply(holder, *graph_args)` runs the forward once, saves exactly the partition's saved
values (so saved-tensor hooks see them), puts every fwd output in `holder` (FwdOut order; not
when the class's `aotc_fills_holder` is False, see Note [No holder when every output is
differentiable]) and returns the differentiable ones; backward runs the compiled backward once.

Note [Raw outputs through a holder]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Only differentiable outputs go through autograd.Function's return value. Everything else (outputs
that do not require grad, the graph's own views used only for their geometry, mutated values
copied back under no_grad) is handed back in `holder`, a list the caller passes in. Returning
views or non-differentiable values through the Function would make autograd wrap them (views of
inputs become un-mutatable; floating outputs become requires_grad), which eager would not do.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from aotc.runtime.errors import UnsupportedError
from aotc.runtime.schema import FwdOut, GraphArg


@dataclass(frozen=True, slots=True)
class AutogradPlan:
    num_graph_args: int
    num_fwd_outs: int
    diff_outs: tuple[FwdOut, ...]  # fwd outputs returned through autograd; tangent order
    num_saved: int  # saved tensors, then saved sizes (ints)
    grad_args: tuple[GraphArg, ...]  # graph args the backward returns gradients for, in order
    num_saved_symints: int = 0  # the last saved values are sizes: kept on ctx as ints
    # Positions in diff_outs whose backward eager refuses, with eager's reason. See Note
    # [Backward eager would refuse].
    refused: tuple[tuple[int, str], ...] = ()
    # Per grad_args entry: the positions in diff_outs its gradient depends on; None when every
    # gradient depends on every differentiable output. See Note [None gradients].
    grad_deps: tuple[tuple[int, ...], ...] | None = None
    # Apply takes one more argument, a shared leaf that requires grad, so that the outputs
    # require grad although no graph arg does (they depend on leaves made inside the call).
    anchor: bool = False
    # Graph args whose versions the forward notes for a double backward: those the
    # differentiable backward recomputes from that no saved value holds (saved ones are checked
    # when unpacked). See Note [Graph args for double backward].
    watch_args: tuple[int, ...] = ()
    # The device type ("cpu", "cuda") whose generator state the forward notes for a double
    # backward that recomputes random ops; None: it recomputes none.
    rng_device: str | None = None
    # Graph args whose version the backward checks as eager's saved values would: see Note
    # [Inputs changed after the call].
    watch: tuple[GraphArg, ...] = ()
    # Per watch entry: the positions in diff_outs whose backward uses the saved value; the
    # backward checks an entry only when one of them received a gradient. None: every entry
    # is used by every differentiable output.
    watch_deps: tuple[tuple[int, ...], ...] | None = None
    # Saved tensors (positions among them) that are a watched graph arg or a view of one, saved
    # as an alias with a version counter of its own: with watch_deps, the watch decides whether
    # their change refuses a backward, not save_for_backward's check on every unpack.
    unversioned_saved: tuple[int, ...] = ()
    # User outputs (flat positions) whose versions the backward checks, and per entry the
    # positions in diff_outs whose backward uses the saved value (None: every output's). See
    # Note [Outputs changed after the call].
    watch_outputs: tuple[int, ...] = ()
    watch_output_deps: tuple[tuple[int, ...], ...] | None = None


# Whether plans get the generated node of Note [Generated node] (tests compare it with the generic).
GENERATED_NODES = True

# One leaf requiring grad that anchored calls pass to autograd (Note [Grad anchor]). The backward
# returns None for it, so nothing ever accumulates into it.
GRAD_ANCHOR = torch.empty(0, requires_grad=True)


# The differentiable backward of an entry (aotc.higher_order.DifferentiableBackward, built by the
# compiler): (graph args, their versions at the call, gradients of the outputs) -> the gradients
# of plan.grad_args, recorded by autograd. See Note [Double backward].
HigherOrder = Callable[
    [Sequence[object], Sequence["int | None"], Sequence[torch.Tensor], "torch.Tensor | None"],
    tuple[torch.Tensor, ...],
]

# Whether the running backward keeps the graph (retain_graph); false: autograd frees each node's
# saved values once it ran.
keep_graph = torch._C._autograd._get_current_graph_task_keep_graph
# Releases a node's saved values unless the running backward keeps the graph (None: this torch
# has no such method; the backward then keeps them to its end, as before; Note [Boxed backward]).
clear_saved = getattr(torch._C._FunctionBase, "maybe_clear_saved_tensors", None)


def make_autograd_function(
    fwd: Callable[..., tuple[torch.Tensor, ...]],
    bwd: Callable[..., tuple[torch.Tensor, ...]],
    plan: AutogradPlan,
    name: str,
    higher: HigherOrder | None = None,
    written: frozenset[int] = frozenset(),
    bwd_graph: Any = None,
    rng_state: Callable[[], torch.Tensor] | None = None,
    kept_args: int | None = None,
    original_args: Callable[[], Sequence[torch.Tensor]] | None = None,
) -> type[torch.autograd.Function]:
    """`written`: graph args the entry's epilogue writes into (Note [Graph args for double
    backward]); `bwd_graph`: the backward fx graph, pruned when some outputs get no gradient
    (Note [Absent gradients] in runtime/absent.py; None: absent gradients are zeros);
    `rng_state`: where the forward reads the generator state of the call (default: the device's
    generator now; a segment node reads the state from before the call's forward graph ran,
    Note [Segments] in passes/segments.py); `kept_args`: how many leading args the node keeps for
    a double backward (None: all; a segment node keeps its graph args, not the outputs of other
    segments it takes); `original_args`: where the node finds the args to keep for a double
    backward when some it is given are detached (Note [Edges of a segment node] in
    runtime/segments.py)."""
    n_out = plan.num_fwd_outs
    diff = plan.diff_outs
    n_args = plan.num_graph_args
    n_result = 1 + n_args + (1 if plan.anchor else 0)
    n_tensors = n_out + plan.num_saved - plan.num_saved_symints
    has_sizes = plan.num_saved_symints > 0
    # See Note [Per-plan forward and backward]
    pick_diff = _picker(diff, n_out)
    any_autocast = torch._C._is_any_autocast_enabled
    grad_enabled = torch.is_grad_enabled
    anchored = plan.anchor
    # See Note [None gradients]: which grads arrived decides which gradients exist.
    watch = plan.watch
    watch_deps = plan.watch_deps
    watch_outs = plan.watch_outputs  # Note [Outputs changed after the call]
    watch_out_deps = plan.watch_output_deps
    track = (
        plan.grad_deps is not None
        or bool(plan.refused)
        or watch_deps is not None
        or watch_out_deps is not None
    )
    # See Note [Absent gradients] in runtime/absent.py
    absent_run = _absent_runner(bwd_graph, len(diff)) if len(diff) > 1 else None
    single = len(diff) == 1
    n_bwd_outs = _num_outputs(bwd_graph) if absent_run is not None else 0
    dwatch = plan.watch_args
    rng = plan.rng_device
    unversioned = tuple(n_out + i for i in plan.unversioned_saved)
    get_rng = rng_state or (
        torch.cuda.get_rng_state if rng == "cuda" else torch.random.get_rng_state
    )

    def forward(ctx, holder: list, *args: torch.Tensor):  # type: ignore[no-untyped-def]
        if anchored:
            args = args[:n_args]
        if rng is not None:
            ctx.aotc_rng = get_rng()
        try:  # Note [Version snapshots under inference mode]
            if dwatch:
                ctx.aotc_versions = [args[i]._version for i in dwatch]
            if watch:
                ctx.aotc_watch = [_watched(args[g]) for g in watch]
        except RuntimeError:
            ctx.aotc_versions = ctx.aotc_watch = None
        outs = fwd(*args)
        # See Note [Graph args for double backward]
        kept = args if original_args is None else original_args()
        if written:
            ctx.aotc_args = tuple(None if i in written else a for i, a in enumerate(kept))
        else:
            ctx.aotc_args = kept if kept_args is None else kept[:kept_args]
        # Every saved tensor goes through save_for_backward, so saved-tensor hooks
        # (saved_tensors_hooks, save_on_cpu) around the call see exactly these values.
        if unversioned:
            outs = _unversioned(outs, unversioned)
        if has_sizes:
            ctx.save_for_backward(*outs[n_out:n_tensors])
            ctx.aotc_sizes = tuple(outs[n_tensors:])
        else:
            ctx.save_for_backward(*outs[n_out:n_tensors])
        holder.extend(outs[:n_out])
        if track or absent_run is not None or single:
            ctx.materialize_grads = False
        if track:
            ctx.aotc_like = [(outs[k].shape, outs[k].dtype, outs[k].device) for k in diff]
        return pick_diff(outs)

    def _double_backward(ctx, grads: tuple) -> tuple:  # type: ignore[no-untyped-def]
        if higher is None:
            raise UnsupportedError(
                f"double backward (create_graph=True) through {name}: this entry was loaded "
                "without the compiler (aotc.load), which builds the differentiable backward. "
                "Compile the function with aotc.compile instead, or call backward without "
                "create_graph."
            )
        if ctx.aotc_args is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved "
                "tensors after they have already been freed). Saved intermediate values of the "
                "graph are freed when you call .backward() or autograd.grad(). Specify "
                "retain_graph=True if you need to backward through the graph a second time or "
                "if you need to access saved tensors after calling backward."
            )
        # Unpacking checks the saved values' versions, as eager's double backward does (an
        # output the forward saved, modified in place since, is refused with eager's error).
        _ = ctx.saved_tensors
        if not all(map(_is_contiguous, grads)):
            grads = tuple(g if g.is_contiguous() else g.contiguous() for g in grads)
        args, versions = ctx.aotc_args, ctx.aotc_versions if dwatch else ()
        state = ctx.aotc_rng if rng is not None else None
        if not keep_graph():
            ctx.aotc_args = ctx.aotc_versions = ctx.aotc_rng = None
        if any_autocast():
            with torch._C._DisableAutocast():
                return higher(args, versions, grads, state)
        return higher(args, versions, grads, state)

    refused = plan.refused
    deps = plan.grad_deps
    boxed: Callable[[list], tuple] | None = (
        getattr(bwd, "boxed", None) if clear_saved is not None else None
    )
    place = _placer(tuple(1 + g for g in plan.grad_args), n_result)

    def run_backward(ctx, grads: tuple) -> tuple:  # type: ignore[no-untyped-def]
        if absent_run is not None and None in grads:
            return run_absent(ctx, grads)
        if grad_enabled() and _differentiable(ctx.aotc_args, grads):
            return _double_backward(ctx, grads)
        release = not keep_graph()
        if release:  # See Note [Graph args for double backward]
            ctx.aotc_args = ctx.aotc_versions = ctx.aotc_rng = None
        if not all(map(_is_contiguous, grads)):
            grads = tuple(g if g.is_contiguous() else g.contiguous() for g in grads)
        saved = (
            (ctx.saved_tensors if n_tensors > n_out else ()) + ctx.aotc_sizes
            if has_sizes
            else (ctx.saved_tensors if n_tensors > n_out else ())
        )
        # The backward graph carries its dtypes already (Note [Graphs run without autocast]).
        if release and boxed is not None:  # Note [Boxed backward]
            box = [*saved, *grads]
            del saved
            clear_saved(ctx)  # type: ignore[misc]  # not None where `boxed` is set
            if any_autocast():
                with torch._C._DisableAutocast():
                    return boxed(box)
            return boxed(box)
        if any_autocast():
            with torch._C._DisableAutocast():
                return bwd(*saved, *grads)
        return bwd(*saved, *grads)

    def run_absent(ctx, grads: tuple) -> tuple:  # type: ignore[no-untyped-def]
        """A backward where some outputs got no gradient (Note [Absent gradients])."""
        assert absent_run is not None
        if all(g is None for g in grads):
            # Reached only through an edge no gradient flows along (another node's input that
            # this node's outputs feed, where the loss used none of them): eager never runs
            # this node, so it reads nothing it saved (which may have been written since).
            return (None,) * n_bwd_outs
        pruned, zeros = absent_run(frozenset(k for k, g in enumerate(grads) if g is None))
        filled = zeros(grads)
        if pruned is None or (grad_enabled() and _differentiable(ctx.aotc_args, filled)):
            return run_backward(ctx, filled)  # the full graph on zeros, as before
        if not keep_graph():
            ctx.aotc_args = ctx.aotc_versions = ctx.aotc_rng = None
        grads = tuple(g if g is None or g.is_contiguous() else g.contiguous() for g in grads)
        saved = (
            (ctx.saved_tensors if n_tensors > n_out else ()) + ctx.aotc_sizes
            if has_sizes
            else (ctx.saved_tensors if n_tensors > n_out else ())
        )
        with torch._C._DisableAutocast() if any_autocast() else contextlib.nullcontext():
            return pruned(*saved, *grads)  # type: ignore[no-any-return]

    def backward(ctx, *grads: torch.Tensor):  # type: ignore[no-untyped-def]
        if single and grads[0] is None:
            # No gradient reached the one output (as in the generated node): eager never runs
            # this node, so every input's gradient stays None, not zeros (fuzz seed 36810).
            return (None,) * n_result
        if watch_outs:
            _check_watched_outputs(ctx, watch_out_deps, grads)
        if watch and watch_deps is None:
            _check_watched(ctx.aotc_watch)
        if not track:
            return place(run_backward(ctx, grads))
        present = [g is not None for g in grads]
        if watch_deps is not None:
            _check_watched(
                [w for w, dep in zip(ctx.aotc_watch, watch_deps) if any(present[p] for p in dep)]
            )
        for pos, reason in refused:
            if present[pos]:
                raise UnsupportedError(
                    f"backward through aotc-compiled {name}: {reason} Eager PyTorch refuses this "
                    "backward too. Use the out-of-place op, or .clone() the value before "
                    "modifying it."
                )
        if absent_run is None:
            grads = tuple(
                g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                for g, (shape, dtype, device) in zip(grads, ctx.aotc_like)
            )
        computed = run_backward(ctx, grads)
        if deps is not None:
            computed = tuple(
                c if any(present[p] for p in dep) else None for c, dep in zip(computed, deps)
            )
        return place(computed)

    generated = GENERATED_NODES and not (
        anchored or rng is not None or written or track or unversioned
    )
    if generated:  # Note [Generated node]
        forward, backward = _generate_node(
            plan,
            name,
            {
                "fwd": fwd,
                "bwd": bwd,
                "grad_enabled": grad_enabled,
                "differentiable": _differentiable,
                "double_backward": _double_backward,
                "place": place,
                "keep_graph": keep_graph,
                "any_autocast": any_autocast,
                "no_autocast": torch._C._DisableAutocast,
                "watched": _watched,
                "check_watched": _check_watched,
                "check_watched_outputs": _check_watched_outputs,
                "watch_output_deps": watch_out_deps,
                "boxed": boxed,
                "clear_saved": clear_saved,
                "kept_args": kept_args,
                "absent": (lambda ctx, grads: place(run_absent(ctx, grads)))
                if absent_run is not None
                else None,
            },
        )
    return type(
        f"AotcFunction_{name}",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "backward": staticmethod(backward),
            # Whether apply fills its holder: see Note [No holder when every output is
            # differentiable]. Callers that get False pass None, or a list of n_out Nones.
            "aotc_fills_holder": not generated or fills_holder(plan),
            **_CLASS_DEFAULTS,  # Note [Class attributes apply reads]
        },
    )


# Note [Class attributes apply reads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On every call, torch's C `Function.apply` reads a few attributes of the Function class by
# name (`_backward_cls`, `forward`, `setup_context`, `boxed_grads_call`,
# `clear_saved_tensors_on_access`), each through a lookup that torch's fresh name string makes
# miss Python's attribute cache: the lookup walks the metaclass's and then the class's MRO dict by
# dict until it finds the name. The last three are defined two classes up, on
# `_SingleLevelFunction`; the class repeats them (the same objects, so apply sees no override:
# `setup_context` is the base's own staticmethod) and each lookup stops at its first dict
# (callgrind: ~900 fewer instructions a call on bench/overhead.py's tiny step). Attributes a torch
# version does not have are left out.
_CLASS_DEFAULTS: dict[str, Any] = {
    name: torch.autograd.function._SingleLevelFunction.__dict__[name]
    for name in ("setup_context", "boxed_grads_call", "clear_saved_tensors_on_access")
    if name in torch.autograd.function._SingleLevelFunction.__dict__
}


def fills_holder(plan: AutogradPlan) -> bool:
    """Whether the generated forward puts its outputs in `holder` (Note [No holder when every
    output is differentiable])."""
    return sorted(plan.diff_outs) != list(range(plan.num_fwd_outs))


# Note [No holder when every output is differentiable]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The holder (Note [Raw outputs through a holder]) carries the outputs autograd does not return.
# When every forward output is differentiable, autograd's returned tuple holds all of them, so the
# generated forward leaves the holder alone: the fast call (runtime/fastpath.py) passes None and
# picks the outputs out of the returned tuple, and `CompiledEntry._run` passes `[None] * n_out`,
# which its placement of the returned outputs fills. A training call then allocates no list for
# it. The generic forward (anchored, random or tracked plans) always fills the holder.


# Note [Generated node]
# ~~~~~~~~~~~~~~~~~~~~~
# The forward and backward above run once per training call each. For plans without an anchor,
# random ops to replay, graph args the epilogue writes, gradients to track, or saved aliases
# that need a version counter of their own (`unversioned_saved`: nearly all plans), they
# are generated as straight-line source with every index inlined, like runtime/fastpath.py does
# for calls: no per-call branches on the plan, no slicing of the output tuple, no picker or
# placer frames, and the version snapshots the plan needs (`watch_args` for a double backward,
# `watch` for inputs changed after the call) written out per graph arg. For the tiny program of
# bench/overhead.py:
#
#     def forward(ctx, holder, *args):
#         outs = fwd(*args)
#         ctx.aotc_args = args
#         ctx.to_save = (outs[1], )    # what save_for_backward sets, without its frame
#         return (outs[0], )            # no holder: Note [No holder when every output is ...]
#
#     def backward(ctx, g0):
#         if grad_enabled() and differentiable(ctx.aotc_args, (g0,)):
#             return double_backward(ctx, (g0,))   # placed as the generic backward does
#         if not g0.is_contiguous():
#             g0 = g0.contiguous()
#         if not keep_graph():
#             ctx.aotc_args = None
#             box = [*ctx.saved_tensors, g0]       # Note [Boxed backward]
#             clear_saved(ctx)
#             r = boxed(box)                       # (the autocast check as below)
#         else:
#             s0, = ctx.saved_tensors
#             if any_autocast():
#                 with no_autocast():
#                     r = bwd(s0, g0)
#             else:
#                 r = bwd(s0, g0)
#         return (None, r[0], None)
#
# Each does what the generic function does for the same plan, in the same order (tests/runtime/
# test_generated_node.py compares both over plans with sizes, watches and several outputs).


# Note [Tangents are contiguous]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The backward hands its graph each incoming gradient contiguous (`.contiguous()` when autograd
# made it otherwise), and the joint trace (aotc/tracer.py) traces the tangents contiguous too, so
# every op of the backward graph gets the layout it was traced with. They once differed: the
# trace took each tangent with its forward output's strides, so for an output that is not
# contiguous (a `transpose` of a result) the graph was traced on one layout and run on another.
# Views the trace chose could then fail, and worse, a backward formula's `grad.contiguous()` that
# was a no-op in the trace was missing at run time: torch's CPU `native_group_norm_backward`
# reads a gradient of another layout than its input's as if it had the input's, and returned
# wrong gradients without an error (GroupNorm between two transposes). The Triton runners copy
# any argument into its traced layout as well (runtime/kernels.py).


# Note [Boxed backward]
# ~~~~~~~~~~~~~~~~~~~~~
# Eager's engine frees a node's saved values as soon as that node has run, so a backward of many
# nodes never holds all of them at once. One compiled node holds every saved value of the program
# three times over while its backward graph runs: in the node's SavedVariables, in the unpacked
# tuple, and in the call's arguments; they would all live until the graph returns (on CPU the
# higher peak showed as page faults and a slower training step than eager's). So when the running
# backward does not keep the graph (no retain_graph / create_graph), the backward unpacks the
# saved values into a list (unpack hooks and version checks run there, as before), releases the
# node's own references (`ctx.maybe_clear_saved_tensors()`, which does nothing when the graph is
# kept), and hands the list to the graph's boxed twin (`bwd.boxed`, runtime/launch.py and the
# Triton runners in runtime/kernels.py), which empties it: each saved value then dies right after
# the graph's last op reading it, sooner than eager's per-node release. The gradients are held by
# the engine's call and are not affected. With the graph kept, the saved values stay with the node
# (a second backward needs them) and the plain call is used. A second backward after a release
# raises eager's "backward through the graph a second time" error from `ctx.saved_tensors`.
# tests/runtime/test_memory.py::test_backward_frees_each_saved_value_at_its_last_use.


def _autocast_call(call: str, indent: str) -> list[str]:
    return [
        f"{indent}if any_autocast():",
        f"{indent}    with no_autocast():",
        f"{indent}        r = {call}",
        f"{indent}else:",
        f"{indent}    r = {call}",
    ]


def _generate_node(
    plan: AutogradPlan, name: str, namespace: dict[str, Any]
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    n_out = plan.num_fwd_outs
    n_tensors = n_out + plan.num_saved - plan.num_saved_symints
    n_all = n_out + plan.num_saved
    # One version snapshot per graph arg: an arg both watched (inputs changed after the call)
    # and noted for a double backward reads its version once, into its watch record. Taken
    # before the graph runs (it writes no input), see Note [Version snapshots under inference
    # mode].
    both = set(plan.watch) & set(plan.watch_args)
    snap = [f"w{g} = watched(args[{g}])" for g in plan.watch if g in both]
    if plan.watch_args:
        versions = "".join(
            f"w{i}[1], " if i in both else f"args[{i}]._version, " for i in plan.watch_args
        )
        snap.append(f"ctx.aotc_versions = [{versions}]")
    if plan.watch:
        watched = "".join(f"w{g}, " if g in both else f"watched(args[{g}]), " for g in plan.watch)
        snap.append(f"ctx.aotc_watch = [{watched}]")
    fl = ["def forward(ctx, holder, *args):"]
    if snap:
        fl += ["    try:", *(f"        {line}" for line in snap)]
        fl += ["    except RuntimeError:", "        ctx.aotc_versions = ctx.aotc_watch = None"]
    kept = namespace.get("kept_args")
    fl += [
        "    outs = fwd(*args)",
        f"    ctx.aotc_args = {'args' if kept is None else f'args[:{kept}]'}",
    ]
    # `to_save` is what `ctx.save_for_backward(*tensors)` sets (a tuple); set here without the
    # Python frame of that method. Autograd reads it after forward returns, as it would then.
    saved = "".join(f"outs[{k}], " for k in range(n_out, n_tensors))
    fl.append(f"    ctx.to_save = ({saved})")
    if plan.num_saved_symints:
        sizes = "".join(f"outs[{k}], " for k in range(n_tensors, n_all))
        fl.append(f"    ctx.aotc_sizes = ({sizes})")
    # See Note [No holder when every output is differentiable]
    if not fills_holder(plan):
        pass
    elif n_out == 1:
        fl.append("    holder.append(outs[0])")
    elif n_out:
        fl.append(f"    holder.extend(outs[:{n_out}])")
    single = len(plan.diff_outs) == 1
    if namespace.get("absent") is not None or single:  # Note [Absent gradients] (absent.py)
        fl.append("    ctx.materialize_grads = False")
    fl.append(f"    return ({''.join(f'outs[{k}], ' for k in plan.diff_outs)})")

    grads = [f"g{p}" for p in range(len(plan.diff_outs))]
    gtuple = f"({''.join(g + ', ' for g in grads)})"
    bl = [f"def backward(ctx{''.join(', ' + g for g in grads)}):"]
    if plan.watch_outputs:  # Note [Outputs changed after the call]
        bl.append(f"    check_watched_outputs(ctx, watch_output_deps, {gtuple})")
    if plan.watch:
        bl.append("    check_watched(ctx.aotc_watch)")
    if namespace.get("absent") is not None:
        bl += [
            f"    if {' or '.join(g + ' is None' for g in grads)}:",
            f"        return absent(ctx, {gtuple})",
        ]
    elif single:
        # No gradient reached the one output: the node is on the engine's path only through an
        # edge of another node whose loss used none of its outputs. Eager never runs this node,
        # so it reads nothing it saved (values written since would raise).
        bl += ["    if g0 is None:", f"        return ({'None, ' * (1 + plan.num_graph_args)})"]
    bl += [
        f"    if grad_enabled() and differentiable(ctx.aotc_args, {gtuple}):",
        f"        return place(double_backward(ctx, {gtuple}))",
    ]
    for g in grads:
        bl += [f"    if not {g}.is_contiguous():", f"        {g} = {g}.contiguous()"]
    release = [
        "    if not keep_graph():",
        "        ctx.aotc_args = ctx.aotc_versions = None"
        if plan.watch_args
        else "        ctx.aotc_args = None",
    ]
    num_saved_tensors = n_tensors - n_out
    svars = [f"s{k}" for k in range(num_saved_tensors)]
    sizes = " *ctx.aotc_sizes," if plan.num_saved_symints else ""
    if svars and namespace.get("boxed") is not None:
        # Note [Boxed backward]: the saved values go to the graph in a list it empties, and
        # the node's own references are released first, unless the graph is kept.
        box = f"[*ctx.saved_tensors,{sizes} {''.join(g + ', ' for g in grads)}]"
        bl += [*release, f"        box = {box}", "        clear_saved(ctx)"]
        bl += _autocast_call("boxed(box)", indent="        ")
        bl.append("    else:")
        indent = "        "
    else:
        bl += release
        indent = "    "
    if svars:
        bl.append(f"{indent}{''.join(v + ', ' for v in svars)}= ctx.saved_tensors")
    # Nothing saved: nothing to unpack. Eager's nodes that save no tensor run any number of
    # backwards (`o[0].backward(); o[1].backward()` through `x + 1`), and so does this one.
    if plan.num_saved_symints:
        bl.append(f"{indent}sizes = ctx.aotc_sizes")
        svars.append("*sizes")
    bl += _autocast_call(f"bwd({', '.join(svars + grads)})", indent=indent)
    n_result = 1 + plan.num_graph_args
    slots = {1 + g: k for k, g in enumerate(plan.grad_args)}
    result = "".join(f"r[{slots[i]}], " if i in slots else "None, " for i in range(n_result))
    bl.append(f"    return ({result})")
    source = "\n".join(fl) + "\n\n\n" + "\n".join(bl) + "\n"
    exec(compile(source, f"<aotc autograd node {name}>", "exec"), namespace)  # noqa: S102
    forward, backward = namespace["forward"], namespace["backward"]
    forward.__aotc_source__ = backward.__aotc_source__ = source
    return forward, backward


_is_contiguous = torch.Tensor.is_contiguous
_TensorBase = torch._C.TensorBase  # a C-level isinstance (torch.Tensor's is Python-level)


def _differentiable(args: tuple | None, grads: tuple) -> bool:
    """Whether a backward under grad mode records anything: some graph arg or gradient requires
    grad (else the plain compiled backward gives the same values, and nothing to record)."""
    if args is None:
        return True  # released: the double-backward path raises eager's error
    # None: an arg the entry wrote into (not kept): its gradient may have history.
    return any(a is None or isinstance(a, _TensorBase) and a.requires_grad for a in args) or any(
        g is not None and g.requires_grad for g in grads
    )


# Note [Inputs changed after the call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `y = torch.maximum(x, w)` saves x and w for the backward; if the caller then changes x in place
# (`x.add_(1)` under no_grad, or through a view or a detached alias), eager's backward through y
# raises "modified by an inplace operation". The compiled backward saves what its partition
# chose (here a mask), not x, so nothing would notice. The metadata pass finds the graph args
# whose version counter a value eager saved shares (`SavedValues.sharing_version`: the values
# already stale at the end of the call are Note [Backward eager would refuse]); the forward keeps
# each with its version (`ctx.aotc_watch`; a non-leaf only as an empty alias sharing its version
# counter, so no activation is kept alive), the entry sets those versions again after its
# epilogue (an epilogue that writes an input moves the version, as eager's in-place op did
# before it saved the value), and the backward raises eager's error when one moved.
# Eager refuses only a backward that runs a node unpacking the changed value: `return x * w,
# x + 1` with w changed after the call still gives gradients from the second output. So when the
# call has several differentiable outputs, the metadata pass runs a fake backward from each and
# notes which saved values it unpacked (`SavedValues.recording`); each watched arg keeps the
# outputs whose backward reaches one of its saved values (`watch_deps`, in diff_outs positions;
# an arg no backward reaches is not watched), and the backward checks an arg only when one of
# those outputs received a gradient. The granularity is the output: autograd.grad(out, inputs=)
# that eager would prune to nodes not using the value is still refused when out's backward uses
# it for another input's gradient (refusing more than eager, never less).


def _unversioned(outs: tuple, positions: tuple[int, ...]) -> tuple:
    """outs with each tensor at `positions` replaced by an alias of its memory that has a
    version counter of its own (Note [Inputs changed after the call])."""
    result = list(outs)
    for i in positions:
        t = result[i]
        alias = t.new_empty(0)
        try:
            with torch.no_grad():
                alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        except Exception:  # noqa: BLE001 a subclass without set_: keep t (checked on unpack)
            continue
        result[i] = alias
    return tuple(result)


_Watched = tuple[torch.Tensor, int, torch.Size]  # the tensor (or its counter), version, shape


# Note [Version snapshots under inference mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The forward notes the versions of some graph args (for a double backward, and to refuse a
# backward after an input changed). An inference tensor has no version counter: reading it
# raises. Such an arg reaches a node recorded for autograd only in a call under
# `torch.inference_mode()` whose graph Dynamo compiled with the mode off (an `enable_grad`
# region; the mode is hidden from the backend), where no backward can ever run. So a failed
# snapshot leaves the records empty instead of failing the call. The snapshot is taken before
# the graph runs (the forward graph writes no input; mutations are copied back after it), so a
# failure has nothing to undo, and a `try` costs nothing when nothing fails.
def _watched(t: torch.Tensor) -> _Watched:
    """A leaf (a parameter) is kept as is: its module keeps it alive anyway. Any other input is
    kept as an empty alias that shares only its version counter, so that the node does not keep
    an activation alive that the compiled backward does not need."""
    if t.is_leaf:
        return (t, t._version, t.shape)
    counter = t.detach()
    try:
        with _preserve_version(counter):
            counter.set_()  # type: ignore[call-overload]  # torch's stubs lack the empty form
    except Exception:  # noqa: BLE001 a subclass or functorch wrapper without set_: keep t
        return (t, t._version, t.shape)
    return (counter, t._version, t.shape)


_preserve_version = torch.autograd._unsafe_preserve_version_counter


def _check_watched(watched: list[_Watched]) -> None:
    for t, version, shape in watched:
        if t._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been {STALE}: "
                f"[{t.type()} {list(shape)}] is at version {t._version}; expected version "
                f"{version} instead (changed after the aotc-compiled call that saved it)."
            )


# Note [Outputs changed after the call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Eager's autograd also saves some ops' results: `amax`, `exp`, `softmax`, `sigmoid`, `tanh`
# keep their output. When the caller changes such an output in place (`out.unsqueeze_(0)`,
# `out.mul_(2)` under no_grad, through a view), eager's backward through it raises "modified by
# an inplace operation". The compiled backward saves what its partition chose (for `amax` a
# mask of the input), so nothing would notice. The metadata pass finds the user outputs whose
# version counter a value eager saved shares, once the args have taken theirs (a value sharing an
# input's counter is Note [Inputs changed after the call]'s); an output the compiled forward
# itself saves as it is is left out, since autograd checks its version when the backward unpacks
# it. After the epilogue has built the outputs, the call notes each watched output's version on
# the node (`ctx.aotc_watch_outs`, a non-leaf as an empty alias sharing the counter, as for
# inputs), and the backward raises eager's error when one moved, only for the outputs whose
# backward unpacks the value (`watch_output_deps`, found by the same fake backwards). A plan
# with watched outputs takes the general call path, not the generated one (runtime/fastpath.py).
def watch_outputs(
    diff: tuple[torch.Tensor, ...], outputs: list[object], positions: tuple[int, ...]
) -> None:
    """After the epilogue: note the versions of the user outputs at `positions` on the node
    (Note [Outputs changed after the call])."""
    node = next((d.grad_fn for d in diff if d.grad_fn is not None), None)
    if node is None:
        return
    try:  # Note [Version snapshots under inference mode]
        watched = [_watched(cast(torch.Tensor, outputs[j])) for j in positions]
    except RuntimeError:
        return
    node.aotc_watch_outs = watched  # type: ignore[attr-defined]


def _check_watched_outputs(
    ctx: Any, deps: tuple[tuple[int, ...], ...] | None, grads: tuple[object, ...]
) -> None:
    watched = getattr(ctx, "aotc_watch_outs", None)
    if not watched:
        return
    if deps is not None:
        watched = [w for w, dep in zip(watched, deps) if any(grads[p] is not None for p in dep)]
    _check_watched(watched)


def refresh_watched(diff: tuple[torch.Tensor, ...]) -> None:
    """After the epilogue: the versions the backward expects are those at the end of the call
    (Note [Inputs changed after the call])."""
    for d in diff:
        node = d.grad_fn
        watched = getattr(node, "aotc_watch", None)
        if watched is not None:
            node.aotc_watch = [(t, t._version, shape) for t, _, shape in watched]  # type: ignore[union-attr]
            return


def _picker(diff: tuple[int, ...], n_out: int) -> Callable[[tuple[torch.Tensor, ...]], tuple]:
    """outs -> the tuple of outs[k] for k in diff."""
    if diff == tuple(range(len(diff))):
        n = len(diff)
        return lambda outs: tuple(outs[:n])
    if len(diff) == 1:
        (k,) = diff
        return lambda outs: (outs[k],)
    return operator.itemgetter(*diff)


def _placer(slots: tuple[int, ...], n_result: int) -> Callable[[tuple], tuple]:
    """computed gradients -> backward's result tuple with each at its slot, None elsewhere."""
    first = slots[0] if slots else 1
    if slots == tuple(range(first, first + len(slots))):
        head, tail = (None,) * first, (None,) * (n_result - first - len(slots))
        return lambda computed: (*head, *computed, *tail)

    def place(computed: tuple) -> tuple:
        result: list[object] = [None] * n_result
        for slot, g in zip(slots, computed):
            result[slot] = g
        return tuple(result)

    return place


# Note [Per-plan forward and backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The forward and backward run once per training call, so what they can decide from the plan they
# decide here: how to pick the differentiable outputs (a slice when they lead the outputs, else an
# itemgetter), where each gradient goes in backward's result (one tuple display when the gradients
# are for consecutive graph args), whether sizes were saved, and whether any gradient needs
# `.contiguous()` (one C-level `all(map(...))` in the common case where none does). Autocast is
# switched off around the backward graph only when it is on.


# Note [Graph args for double backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A backward under grad mode (create_graph=True) with something requiring grad runs the entry's
# differentiable backward (Note [Double backward] in aotc/higher_order.py), which recomputes the
# saved values from the graph args the forward ran on. So the forward keeps a reference to its
# graph args on ctx (one tuple: the args are the inputs of the node, alive in the caller anyway
# during the call), and the versions of those it recomputes from that no saved value holds
# (`watch_args`, usually few: biases; one attribute read each per call). Not through save_for_backward: that would check their
# versions in every backward and refuse programs eager runs (an input modified after the call,
# e.g. by the entry's own input mutation). The reference lives as long as autograd's saved values:
# a backward without retain_graph (after which autograd frees them) drops it, so the graph args
# are not kept alive by a graph that is already spent.
# Graph args the epilogue writes into are not kept (None): their value from the call is gone
# after the write anyway, and the write makes this node part of their history, so a reference
# from the node back to them would be a cycle through C++ that Python's collector cannot free
# (a forward without backward would leak them).

# Note [Backward eager would refuse]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `y = x.sin(); x.mul_(2); y.backward(...)` fails in eager: sin saved x, and x changed before the
# backward (its version counter moved). The functional graph has no such problem (it saved the old
# value), so aotc would silently compute gradients where eager raises. The metadata pass runs the
# program on plain fake tensors with autograd, exactly as eager records it, under saved-tensor
# hooks (`SavedValues`) that note each saved value with its version and keep eager's check on
# unpack. When some saved value went stale, a fake backward from each differentiable forward
# output shows which of them eager's backward refuses (a stale value on a path it takes, also
# inside CopySlices nodes that a graph walk cannot see). The entry's backward raises the same
# error when a gradient arrives for one of those outputs (forward-only use is fine, as in eager).

# Note [None gradients]
# ~~~~~~~~~~~~~~~~~~~~~
# Eager leaves `x.grad` None when the backward never reaches x, e.g. when x feeds only outputs the
# loss does not use; optimizers skip such parameters. autograd.Function would hand the backward
# zeros for unused outputs and return zero gradients. So when some gradient depends on only some
# of the differentiable outputs (read off the backward graph: `grad_deps`), the forward asks for
# unmaterialized gradients, the backward fills absent ones with zeros for the graph, and returns
# None for each gradient none of whose outputs received one.

# Note [Grad anchor]
# ~~~~~~~~~~~~~~~~~~
# `v = a.detach().requires_grad_(); return v * 2` gives an output that requires grad although no
# input does (it depends on a leaf made inside the call). autograd.Function marks outputs as
# requiring grad only if an input does, so such calls pass one extra argument, GRAD_ANCHOR, a
# process-wide empty leaf that requires grad; the backward returns None for it.


STALE = "modified by an inplace operation"


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been {STALE}: "
            f"[{t.dtype}{list(t.shape)}] is at version {t._version}; expected version {version} "
            "instead."
        )
    return t


# Nonzero while SavedValues packs a value: the ops it runs then are not the program's (the
# cache key's recorders in aotc/keytrace.py skip them).
PACKING = [0]


class _Packed:
    """A value SavedValues saved, as autograd holds it."""

    __slots__ = ("tensor", "version", "index", "__weakref__")

    def __init__(self, tensor: torch.Tensor, version: int, index: int) -> None:
        self.tensor, self.version, self.index = tensor, version, index


class SavedValues:
    """Saved-tensor hooks for the plain metadata run: note every value autograd saves with its
    version, and keep eager's version check on unpack (the compile runs under identity hooks
    that would skip it). See Note [Backward eager would refuse]."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.Tensor, int]] = []
        # What autograd holds for each saved value: dead once its node was freed (the value
        # fed no output), so no backward can unpack it.
        self._held: list[weakref.ref[_Packed]] = []
        self._unpacked: set[int] | None = None  # while recording: indices into _saved

    def _pack(self, t: torch.Tensor) -> _Packed:
        # A detached alias (same storage and version counter, no autograd history): holding the
        # tensor itself would hold its node, and a node that saves its own output (`amax`,
        # `exp`) would then hold itself through the packed value and never be freed, so
        # `held` would say a backward could still unpack a value that fed no output. Autograd
        # restores the history of what an unpack hook returns from its own records.
        PACKING[0] += 1  # not an op of the program: the cache key's check must not see it
        try:
            alias = t.detach()
        finally:
            PACKING[0] -= 1
        packed = _Packed(alias, t._version, len(self._saved))
        self._saved.append((alias, t._version))
        self._held.append(weakref.ref(packed))
        return packed

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        if self._unpacked is not None:
            self._unpacked.add(packed.index)
        return _unpack((packed.tensor, packed.version))

    def held(self, index: int) -> bool:
        """Whether some autograd node still holds saved value `index`."""
        return self._held[index]() is not None

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @contextlib.contextmanager
    def recording(self) -> Iterator[set[int]]:
        """Notes which saved values (indices, as in `sharing_version`) a backward unpacks."""
        found: set[int] = set()
        self._unpacked = found
        try:
            yield found
        finally:
            self._unpacked = None

    def any_stale(self) -> bool:
        return any(t._version != version for t, version in self._saved)

    def sharing_version(
        self, args: list[torch.Tensor]
    ) -> tuple[tuple[GraphArg, frozenset[int]], ...]:
        """The args whose version counter some saved value, still current, shares, each with
        those values' indices: found by moving each arg's counter (and setting it back) and
        seeing which saved values move with it (views and detached aliases share it; nothing
        else tells that apart on fake tensors)."""
        current = [(i, t) for i, (t, version) in enumerate(self._saved) if t._version == version]
        found = []
        for g, a in enumerate(args):
            if not current:
                break
            if a.is_inference():
                continue  # no version counter to share (and autograd saves no inference tensor)
            before = [t._version for _, t in current]
            with _preserve_version(a):
                torch.autograd.graph.increment_version(a)
                moved = [t._version != b for (_, t), b in zip(current, before)]
            if any(moved):
                found.append((GraphArg(g), frozenset(i for (i, _), m in zip(current, moved) if m)))
                current = [c for c, m in zip(current, moved) if not m]
        return tuple(found)


def autograd_nodes(roots: Iterable[object]) -> Iterator[Any]:
    """Every autograd graph node reachable from the tensors among `roots`, each once."""
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    # Each node kept alive with its id: torch 2.11 frees a node's Python object with its last
    # reference and reuses its id (Note [Autograd nodes' Python objects] in aotc/aliasing.py).
    visited: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        yield node
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)


def _num_outputs(graph: Any) -> int:
    out = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    return len(out.args[0])


def _absent_runner(
    graph: Any, num_tangents: int
) -> Callable[[frozenset[int]], tuple[Callable[..., Any] | None, Callable[[tuple], tuple]]] | None:
    """Per absence pattern: the pruned backward (None: not prunable) and a function filling
    absent gradients with zeros (Note [Absent gradients] in runtime/absent.py). None when the
    graph is unknown or its tangents' sizes are symbolic (then absent gradients are zeros)."""
    if graph is None:
        return None
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    like = []
    for node in placeholders[len(placeholders) - num_tangents :]:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not all(type(s) is int for s in val.shape):
            return None
        like.append((tuple(val.shape), val.dtype))
    built: dict[frozenset[int], Callable[..., Any] | None] = {}

    def zeros(grads: tuple) -> tuple:
        device = next(g.device for g in grads if g is not None)
        return tuple(
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype) in zip(grads, like)
        )

    def get(absent: frozenset[int]) -> tuple[Callable[..., Any] | None, Callable[[tuple], tuple]]:
        if absent not in built:
            from aotc.runtime.absent import absent_backward
            from aotc.runtime.launch import make_callable

            pruned = absent_backward(graph, num_tangents, absent)
            built[absent] = make_callable(pruned) if pruned is not None else None
        return built[absent], zeros

    return get
