"""Strict mode's own costs: the state guard checked on every call, and recording while compiling.

Workloads: a GPT block module (bench/common.py's attention + MLP) and a two-layer Hugging Face
GPT-2 built from a small config (tied embeddings; skipped without transformers).
  compile   first call + first backward, cold (no disk cache): strict mode as shipped vs strict
            mode with the recorder switched off (no recorded loads, no state guard: what aotc did
            before #12). Their difference is what recording costs a cold compile.
  per call  fwd+bwd of the compiled module: strict vs the same entry with its state guard removed
            vs eager; plus the guard check alone and its number of items.
Systems are interleaved inside every repetition; reported: medians.

Run from the repo root: .venv/bin/python bench/strict.py [--reps N] [--iters N] [--rounds R]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from common import (  # noqa: E402
    CausalSelfAttention,
    fmt_table,
    interleaved_rounds,
    median,
    ratio,
    write_results,
)

import aotc  # noqa: E402
import aotc.api  # noqa: E402
import aotc.recording  # noqa: E402

GOAL = (
    "the state guard costs a few microseconds per call at most for small programs; recording "
    "adds a small fraction to a cold compile"
)


class Block(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, 16)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return (x + self.mlp(self.ln2(x))).square().mean()


class GPT2Loss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        logging.getLogger("transformers").setLevel(logging.ERROR)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def workloads() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor]]]]:
    out = {"gpt_block": (Block, lambda: (torch.randn(4, 16, 64),))}
    try:
        import transformers  # noqa: F401

        out["hf_gpt2_2layer"] = (GPT2Loss, lambda: (torch.randint(0, 128, (2, 16)),))
    except ImportError:
        pass
    return out


@contextlib.contextmanager
def _nothing(*args: object, **kwargs: object) -> Iterator[None]:
    yield


@contextlib.contextmanager
def recorder_off() -> Iterator[None]:
    """Strict mode as before #12: nothing recorded, no state guard (diagnostics only)."""
    rec = aotc.recording.Recorder
    saved = [(rec, "run", rec.run), (rec, "track", rec.track)]
    saved += [
        (aotc.api, n, getattr(aotc.api, n)) for n in ("build_state_guard", "warn_side_effects")
    ]
    rec.run = _nothing  # type: ignore[method-assign,assignment]
    rec.track = lambda self, *a, **k: None  # type: ignore[method-assign]
    aotc.api.build_state_guard = lambda *a, **k: None  # type: ignore[attr-defined]
    aotc.api.warn_side_effects = lambda *a, **k: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def compile_times(reps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, (make, batch) in workloads().items():
        times: dict[str, list[float]] = {"strict": [], "strict_unrecorded": []}
        for r in range(reps):
            order = list(times) if r % 2 == 0 else list(times)[::-1]
            for system in order:
                torch.manual_seed(0)
                model = make()
                args = batch()
                compiled = aotc.compile(model, capture="trace", cache=False)
                with recorder_off() if system == "strict_unrecorded" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    compiled(*args).backward()
                    times[system].append(time.perf_counter() - t0)
        med = {s: median(v) for s, v in times.items()}
        out[name] = {
            "strict_s": med["strict"],
            "strict_unrecorded_s": med["strict_unrecorded"],
            "recording_share": ratio(med["strict"] - med["strict_unrecorded"], med["strict"]),
        }
        print(f"  compile {name}: {out[name]}", flush=True)
    return out


def per_call(iters: int, rounds: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, (make, batch) in workloads().items():
        torch.manual_seed(0)
        eager = make()
        model = copy.deepcopy(eager)
        compiled = aotc.compile(model, capture="trace", cache=False)
        args = batch()
        compiled(*args).backward()
        ((_, link),) = compiled._compiled._dispatch._heads.items()
        guard = link.state
        items = len(link.guard.items)

        def loop(fn: Callable[[], object]) -> Callable[[int], None]:
            def run_n(n: int) -> None:
                for _ in range(n):
                    fn()

            return run_n

        def unguarded(n: int) -> None:
            link.state = None
            try:
                for _ in range(n):
                    compiled(*args).backward()
            finally:
                link.state = guard

        systems = {
            "eager": loop(lambda: eager(*args).backward()),
            "strict": loop(lambda: compiled(*args).backward()),
            "strict_unguarded": unguarded,
            "guard_check": loop(guard),
        }
        samples = interleaved_rounds(systems, iters=iters, rounds=rounds, warmup_iters=5)
        med = {s: median(v) * 1e6 for s, v in samples.items()}
        out[name] = {
            "guard_items": items,
            "guard_check_us": med["guard_check"],
            "fwd_bwd_us": {s: med[s] for s in ("eager", "strict", "strict_unguarded")},
            "strict/eager": ratio(med["strict"], med["eager"]),
            "guard_share_of_call": ratio(med["guard_check"], med["strict"]),
        }
        print(f"  per call {name}: {out[name]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="cold compiles per system and workload")
    p.add_argument("--iters", type=int, default=50, help="calls per round")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    results = {"compile": compile_times(args.reps), "per_call": per_call(args.iters, args.rounds)}
    path = write_results(
        "strict",
        results,
        goal=GOAL,
        method=(
            f"compile: median of {args.reps} cold compiles (first call + backward) per system, "
            f"interleaved; per call: {args.rounds} rounds x {args.iters} calls, interleaved, "
            "median of per-round means"
        ),
    )
    rows = [
        [n, r["strict_s"], r["strict_unrecorded_s"], r["recording_share"]]
        for n, r in results["compile"].items()
    ]
    print(fmt_table(["compile (s)", "strict", "unrecorded", "recording share"], rows))
    rows = [
        [n, r["guard_items"], r["guard_check_us"], r["fwd_bwd_us"]["strict"],
         r["fwd_bwd_us"]["strict_unguarded"], r["fwd_bwd_us"]["eager"], r["strict/eager"]]
        for n, r in results["per_call"].items()
    ]  # fmt: skip
    print(
        fmt_table(
            ["per call (us)", "items", "guard", "strict", "unguarded", "eager", "strict/eager"],
            rows,
        )
    )
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
