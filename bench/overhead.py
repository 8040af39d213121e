"""Per-call runtime overhead on tiny inputs: eager vs aotc vs AOTAutograd's runtime.

f(x, y) = (x * y).sum() on 4-element tensors, x requires grad. Modes:
  fwd_no_grad  forward under torch.no_grad() (inference entries for aotc and AOTAutograd)
  fwd_grad     forward with grad enabled, output discarded without backward
  fwd_bwd      out = f(x, y); out.backward()
AOTAutograd is `aot_function(f, nop, nop)` with boxed no-op compilers (functorch.compile.nop).
Each mode gets its own compiled objects, compiled (warmed up) in that mode. All systems run in the
same process, interleaved inside every round; reported: median over rounds of per-call means.

Run from the repo root: .venv/bin/python bench/overhead.py [--iters N] [--rounds R] [--profile]
`--profile` adds a breakdown of aotc's fwd+bwd call path (manual timing of each piece + cProfile).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import fmt_table, interleaved_rounds, median, noop_compiler, ratio, write_results  # noqa: E402
from torch._functorch.aot_autograd import aot_function  # noqa: E402

import aotc  # noqa: E402

FWD_BWD_TARGET_US = 45.0
GOAL = (
    f"fwd_bwd: aotc < {FWD_BWD_TARGET_US:g} us/call and aotc/aot_autograd <= 1.0 "
    "(tiny inputs, CPU, median of per-round means)"
)
# aotc_strict: aotc.compile(capture="trace"); aotc_strict_unguarded: the same compiled object
# type with its entries' state guards removed, to measure what the guards cost (diagnostics).
SYSTEMS = ("eager", "aotc", "aotc_strict", "aotc_strict_unguarded", "aot_autograd")
MODES = ("fwd_no_grad", "fwd_grad", "fwd_bwd")


def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * y).sum()


def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, requires_grad=True), torch.randn(4)


def build(system: str, mode: str, x: torch.Tensor, y: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A callable for `system`, compiled (first call made) in `mode`'s grad mode."""
    if system == "eager":
        return f

    def fresh(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # new object per compile
        return (x * y).sum()

    if system == "aotc":
        fn = aotc.compile(fresh)
    elif system.startswith("aotc_strict"):
        fn = aotc.compile(fresh, capture="trace")
    else:
        fn = aot_function(fresh, noop_compiler, noop_compiler)
    if mode == "fwd_no_grad":
        with torch.no_grad():
            fn(x, y)
    else:
        fn(x, y).backward()
        x.grad = None
    if system == "aotc_strict_unguarded":
        for link in fn._dispatch._heads.values():  # type: ignore[attr-defined]
            link.state = None
    return fn


def loop_for(mode: str, fn: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    if mode == "fwd_no_grad":

        def run_n(n: int) -> None:
            with torch.no_grad():
                for _ in range(n):
                    fn(x, y)

    elif mode == "fwd_grad":

        def run_n(n: int) -> None:
            for _ in range(n):
                fn(x, y)

    else:

        def run_n(n: int) -> None:
            for _ in range(n):
                fn(x, y).backward()

    return run_n


def check_correct(fns: dict[str, Callable[..., torch.Tensor]]) -> None:
    x, y = make_inputs()
    grads = {}
    for name, fn in fns.items():
        x.grad = None
        out = fn(x, y)
        out.backward()
        grads[name] = (out.detach().clone(), x.grad.clone())
    ref = grads["eager"]
    for name, (out, g) in grads.items():
        torch.testing.assert_close(out, ref[0], msg=f"{name}: output differs from eager")
        torch.testing.assert_close(g, ref[1], msg=f"{name}: grad differs from eager")


def run(iters: int = 2000, rounds: int = 15, verbose: bool = True) -> dict[str, object]:
    x, y = make_inputs()
    per_mode_fns = {m: {s: build(s, m, x, y) for s in SYSTEMS} for m in MODES}
    check_correct(per_mode_fns["fwd_bwd"])
    results: dict[str, object] = {}
    for mode in MODES:
        fns = per_mode_fns[mode]
        systems = {s: loop_for(mode, fns[s], x, y) for s in SYSTEMS}
        samples = interleaved_rounds(systems, iters=iters, rounds=rounds)
        x.grad = None
        med = {s: median(samples[s]) * 1e6 for s in SYSTEMS}
        entry: dict[str, object] = {
            "median_us_per_call": med,
            "round_means_us": {s: [round(v * 1e6, 3) for v in samples[s]] for s in SYSTEMS},
            "ratio": {
                "aotc/eager": ratio(med["aotc"], med["eager"]),
                "aotc/aot_autograd": ratio(med["aotc"], med["aot_autograd"]),
                "aot_autograd/eager": ratio(med["aot_autograd"], med["eager"]),
                "aotc_strict/eager": ratio(med["aotc_strict"], med["eager"]),
                "aotc/aotc_strict": ratio(med["aotc"], med["aotc_strict"]),
            },
            "aotc_minus_eager_us": med["aotc"] - med["eager"],
            "aotc_strict_minus_eager_us": med["aotc_strict"] - med["eager"],
            "strict_state_guard_us": med["aotc_strict"] - med["aotc_strict_unguarded"],
            "aot_autograd_minus_eager_us": med["aot_autograd"] - med["eager"],
        }
        if mode == "fwd_bwd":
            entry["meets_goal"] = bool(
                med["aotc"] < FWD_BWD_TARGET_US and med["aotc"] <= med["aot_autograd"]
            )
        results[mode] = entry
        if verbose:
            print(
                f"  {mode:12s} eager {med['eager']:7.2f} us  aotc {med['aotc']:7.2f} us  "
                f"strict {med['aotc_strict']:7.2f} us (unguarded "
                f"{med['aotc_strict_unguarded']:7.2f})  aot_autograd {med['aot_autograd']:7.2f} us",
                flush=True,
            )
    return results


def table(results: dict[str, object]) -> str:
    rows = []
    for mode, r in results.items():
        m = r["median_us_per_call"]  # type: ignore[index]
        q = r["ratio"]  # type: ignore[index]
        rows.append(
            [
                mode,
                m["eager"],
                m["aotc"],
                m["aotc_strict"],
                m["aotc_strict_unguarded"],
                m["aot_autograd"],
                q["aotc/eager"],
                q["aotc_strict/eager"],
                q["aotc/aot_autograd"],
            ]
        )
    return fmt_table(
        [
            "overhead (us/call)",
            "eager",
            "aotc",
            "strict",
            "strict unguarded",
            "aot_autograd",
            "aotc/eager",
            "strict/eager",
            "aotc/aot",
        ],
        rows,
    )


# --------------------------------------------------------------------------- breakdown


def breakdown(iters: int = 2000, rounds: int = 9) -> dict[str, float]:
    """Time each piece of aotc's fwd+bwd call path in isolation (median of per-round means, us).

    Uses private attributes of the compiled object (diagnostics only; nothing is modified).
    """
    import torch.utils._pytree as pytree  # noqa: F401

    from aotc.runtime.convention import apply_convention
    from aotc.runtime.epilogue import build_outputs
    from aotc.runtime.guards import signature_key

    x, y = make_inputs()
    cf = build("aotc_strict", "fwd_bwd", x, y)
    disp = cf._dispatch
    ((key, link),) = disp._heads.items()
    entry = link.entry
    state_guard = link.state
    plan = entry.plan
    leaves = [x, y]
    args = apply_convention(plan.convention, leaves)
    holder: list[torch.Tensor] = []
    diff = entry._fn.apply(holder, *args)
    fwd_outs = list(holder)
    record = entry.record
    bwd = _closure_var(entry._fn.backward, "bwd")  # the callable the runtime really calls
    if bwd is None and record is not None and record.backward is not None:
        bwd = record.backward.forward
    fwd_graph_outs = entry._fwd(*args)
    n_out = plan.autograd.num_fwd_outs
    saved = fwd_graph_outs[n_out:]
    tangent = torch.ones_like(diff[0])
    # the apply the runtime calls: a direct C++ apply if the entry has one, else Function.apply
    apply = getattr(entry, "_apply", None) or entry._fn.apply
    fwd = entry._fwd
    extra = len(leaves)

    def loop(body: Callable[[], object]) -> Callable[[int], None]:
        def run_n(n: int) -> None:
            for _ in range(n):
                body()

        return run_n

    def fn_apply() -> object:
        return apply([], *args)

    def fn_apply_bwd() -> None:
        apply([], *args)[0].backward()

    pieces: dict[str, Callable[[int], None]] = {
        "empty loop body (harness)": loop(lambda: None),
        "eager f(x,y) fwd": loop(lambda: f(x, y)),
        "eager f(x,y) fwd+bwd": loop(lambda: f(x, y).backward()),
        "aotc cf(x,y) fwd (grad on)": loop(lambda: cf(x, y)),
        "aotc cf(x,y) fwd+bwd": loop(lambda: cf(x, y).backward()),
        "CompiledFunction.__call__ prelude (type check + leaves)": loop(
            lambda: (not {} and all(type(a) is torch.Tensor for a in (x, y)), list((x, y)))
        ),
        "Dispatcher.__call__ (key + lookup + run)": loop(lambda: disp(leaves, extra)),
        "signature_key(leaves)": loop(lambda: signature_key(leaves)),
        "dict lookup of key": loop(lambda: disp._heads.get(key)),
        "strict state guard check": loop(state_guard),
        "CompiledEntry.run(leaves) fwd": loop(lambda: entry.run(leaves)),
        "apply_convention": loop(lambda: apply_convention(plan.convention, leaves)),
        "autograd apply(holder,*args) fwd (incl. fwd graph)": loop(fn_apply),
        "fwd graph callable alone": loop(lambda: fwd(*args)),
        "autograd apply + .backward()": loop(fn_apply_bwd),
        "build_outputs + unflatten": loop(
            lambda: entry._unflatten(build_outputs(plan.epilogue, leaves, fwd_outs))
        ),
    }
    if bwd is not None:
        pieces["bwd graph callable alone"] = loop(lambda: bwd(*saved, tangent))

    class _Ctx:
        saved_tensors = tuple(saved)

    ctx = _Ctx()
    py_backward = entry._fn.backward

    def fn_py_backward() -> None:
        with torch.no_grad():
            py_backward(ctx, tangent)

    pieces["AotcFunction.backward staticmethod (under no_grad, incl. bwd graph)"] = loop(
        fn_py_backward
    )

    # Floor of any autograd.Function-based runtime: a minimal Function running the same eager ops
    class _MinimalFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(b)
            return (a * b).sum()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            (b,) = ctx.saved_tensors
            return g.expand(4) * b, None

    min_apply = _MinimalFn.apply
    pieces["minimal autograd.Function (eager ops) fwd"] = loop(lambda: min_apply(x, y))
    pieces["minimal autograd.Function (eager ops) fwd+bwd"] = loop(
        lambda: min_apply(x, y).backward()
    )

    # inference path (what fwd_no_grad runs)
    with torch.no_grad():
        cf(x, y)  # compile the inference entry
    inf_entry = next(lk.entry for k, lk in disp._heads.items() if k[1][2] is False)

    def under_no_grad(body: Callable[[], object]) -> Callable[[int], None]:
        def run_n(n: int) -> None:
            with torch.no_grad():
                for _ in range(n):
                    body()

        return run_n

    pieces["no_grad: eager f(x,y)"] = under_no_grad(lambda: f(x, y))
    pieces["no_grad: aotc cf(x,y)"] = under_no_grad(lambda: cf(x, y))
    pieces["no_grad: signature_key(leaves)"] = under_no_grad(lambda: signature_key(leaves))
    pieces["no_grad: CompiledEntry.run(leaves)"] = under_no_grad(lambda: inf_entry.run(leaves))
    pieces["no_grad: fwd graph callable alone"] = under_no_grad(lambda: inf_entry._fwd(*args))

    # signature_key's parts, per call of 2 tensors
    pieces["  sig part: 2x t.untyped_storage().data_ptr()"] = loop(
        lambda: (x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr())
    )
    pieces["  sig part: 2x (dtype, device, shape, stride(), requires_grad, is_leaf)"] = loop(
        lambda: (
            (x.dtype, x.device, x.shape, x.stride(), x.requires_grad, x.is_leaf),
            (y.dtype, y.device, y.shape, y.stride(), y.requires_grad, y.is_leaf),
        )
    )
    pieces["  sig part: is_grad_enabled + 2x is_autocast_enabled (old key)"] = loop(
        lambda: (
            torch.is_grad_enabled(),
            torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"),
        )
    )
    pieces["  sig part: is_grad_enabled + _is_any_autocast_enabled (new key)"] = loop(
        lambda: (torch.is_grad_enabled(), torch._C._is_any_autocast_enabled())
    )
    pieces["  sig part: hash of the key tuple"] = loop(lambda: hash(key))
    samples = interleaved_rounds(pieces, iters=iters, rounds=rounds)
    x.grad = None
    return {k: median(v) * 1e6 for k, v in samples.items()}


def _closure_var(fn: object, name: str) -> object:
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None:  # type: ignore[attr-defined]
        return None
    cells = dict(zip(code.co_freevars, fn.__closure__))  # type: ignore[attr-defined]
    cell = cells.get(name)
    return cell.cell_contents if cell is not None else None


def knockout(iters: int = 2000, rounds: int = 9) -> dict[str, dict[str, float]]:
    """Whole-call cost with one runtime piece replaced by a precomputed result (same inputs every
    call, so the result is valid). Baseline minus knocked-out = what that piece costs in situ.

    Pieces timed alone (breakdown) tend to under-count on this machine: their in-situ cost is
    larger than their standalone cost. This swaps attributes of the strict-mode dispatcher and of
    its entry inside this process only, around each timed loop; nothing on disk changes.
    """
    x, y = make_inputs()
    cf = build("aotc_strict", "fwd_bwd", x, y)
    disp = cf._dispatch
    ((key, link),) = disp._heads.items()
    entry = link.entry
    sig = key[1]
    assert hasattr(entry.call, "__aotc_source__"), "expected the fast path for this entry"

    # apply_convention and build_outputs run only on the general path; this entry's plan is
    # direct, so its calls take the generated fast call (runtime/fastpath.py) without them.
    variants: dict[str, list[tuple[object, str, object]]] = {
        "baseline": [],
        "signature_key -> const": [(disp, "_key", lambda lv: sig)],
        "state guard -> none": [(link, "state", None)],
    }
    out: dict[str, dict[str, float]] = {}
    for mode in ("fwd_grad", "fwd_bwd"):
        systems = {}
        for name, patch in variants.items():
            inner = loop_for(mode, cf, x, y)

            def run_n(n: int, patch=patch, inner=inner) -> None:  # noqa: ANN001
                saved = [(o, a, getattr(o, a)) for o, a, _ in patch]
                for o, a, v in patch:
                    setattr(o, a, v)
                try:
                    inner(n)
                finally:
                    for o, a, v in saved:
                        setattr(o, a, v)

            systems[name] = run_n
        samples = interleaved_rounds(systems, iters=iters, rounds=rounds)
        out[mode] = {k: median(v) * 1e6 for k, v in samples.items()}
    x.grad = None
    return out


def cprofile(n: int = 20000, top: int = 25) -> str:
    import cProfile
    import io
    import pstats

    x, y = make_inputs()
    cf = build("aotc", "fwd_bwd", x, y)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        cf(x, y).backward()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    p.add_argument("--profile", action="store_true", help="break down aotc's fwd+bwd call path")
    args = p.parse_args(argv)
    print(f"overhead: {args.rounds} rounds x {args.iters} calls, interleaved", flush=True)
    results = run(iters=args.iters, rounds=args.rounds)
    extra: dict[str, object] = {}
    fb = results["fwd_bwd"]["median_us_per_call"]  # type: ignore[index]
    over = fb["aotc"] >= FWD_BWD_TARGET_US or fb["aotc"] > fb["aot_autograd"]
    if args.profile or over:
        bd = breakdown(iters=args.iters, rounds=max(5, args.rounds // 2))
        extra["aotc_breakdown_us"] = bd
        extra["aotc_knockout_us"] = knockout(iters=args.iters, rounds=max(5, args.rounds // 2))
    path = write_results(
        "overhead",
        results,
        goal=GOAL,
        workload="f(x, y) = (x * y).sum(), x: randn(4, requires_grad=True), y: randn(4)",
        method=(
            f"{args.rounds} rounds x {args.iters} calls, systems interleaved (order rotated), "
            "median of per-round mean us/call; AOTAutograd = aot_function with boxed no-op "
            "compilers"
        ),
        **extra,
    )
    print(table(results))
    if "aotc_breakdown_us" in extra:
        print("\naotc fwd+bwd breakdown (us/call, median of per-round means; pieces timed alone):")
        for k, v in extra["aotc_breakdown_us"].items():  # type: ignore[union-attr]
            print(f"  {v:8.2f}  {k}")
    if "aotc_knockout_us" in extra:
        print("\naotc whole-call us/call with one piece replaced by a precomputed result:")
        for mode, d in extra["aotc_knockout_us"].items():  # type: ignore[union-attr]
            base = d["baseline"]
            print(
                f"  {mode}: "
                + ", ".join(
                    f"{k} {v:.1f}" + ("" if k == "baseline" else f" ({v - base:+.1f})")
                    for k, v in d.items()
                )
            )
    if args.profile:
        print("\ncProfile of aotc fwd+bwd (tottime):")
        print(cprofile())
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
