"""Saved activation bytes, partitioner time and training step time: aotc vs AOTAutograd.

Each workload is compiled four ways: aotc with the min-cut plan (the default) and with the simple
plan (`partitioner="simple"`), and AOTAutograd (`aot_function` / `aot_module`, boxed no-op
compilers) with `partition_fn=` torch's `min_cut_rematerialization_partition` and
`default_partition`. One forward+backward triggers compilation.

Saved bytes are measured the same way for every system: the sum over the backward graph's
placeholders that are not tangents of numel * element_size of `node.meta["val"]` (non-tensors
count 0). For aotc that is `sum(s.nbytes for s in record.partition.saved)`; the script checks it
equals the placeholder sum of aotc's backward graph.

Saved bytes against eager's: what autograd keeps alive between forward and backward, measured at
run time the same way for eager, aotc and AOTAutograd: a `saved_tensors_hooks` pack hook sees
every saved tensor of one step; the figure is the sum of the distinct storages' bytes (a view
keeps its whole storage; a tensor saved twice counts once). aotc's saved bytes must not exceed
eager's. The report also gives aotc's partition of the same joint graph for the Triton executor
(`executor=Executor.TRITON`, where fused recomputation is free; see passes/recompute.py).

Partitioner time: aotc `record.partition.seconds`; torch: wall time around the partition_fn call
(wrapped). Median over `--reps` fresh compilations. Step time: `--procs` fresh processes (1 torch
thread each); in each, eager vs aotc (default options: the ATen backend on CPU) vs AOTAutograd
(min-cut, no-op compilers) run `loss = f(*inputs); loss.backward()` interleaved, and the process
reports the median of per-round means; reported: the median over processes of the times and of
the same-process ratios against eager. Gradients accumulate in .grad alike for every system.
An A/A control runs eager twice as two systems (`eager_again/eager`): the spread of that ratio
is the noise of the run the other ratios are read against.

A scaling case compiles a joint graph of >= 10,000 nodes (a long pointwise chain) and reports the
aotc partition time against a 2 s goal; over the goal it adds a cProfile top-15 of the partition.

Run from the repo root: .venv/bin/python bench/partition.py [--reps N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import pstats
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import (  # noqa: E402
    CausalSelfAttention,
    fmt_table,
    interleaved_rounds,
    median,
    noop_compiler,
    ratio,
    reset_state,
    write_results,
)
from torch._functorch.aot_autograd import aot_function, aot_module  # noqa: E402
from torch._functorch.partitioners import (  # noqa: E402
    default_partition,
    min_cut_rematerialization_partition,
)

import aotc  # noqa: E402
from aotc.passes.cleanup import cleanup  # noqa: E402
from aotc.passes.descriptors import SavedInput  # noqa: E402
from aotc.passes.ir import node_nbytes  # noqa: E402
from aotc.passes.partition import partition  # noqa: E402

# Note [Page faults in step times]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With glibc's default malloc, a step's large blocks come from the heap top, and the heap is
# trimmed whenever enough free memory gathers at its top; the next step then faults those pages
# in again (~1-2 us per 4 KiB page). How often that happens depends on where small allocations
# (tensor structs, autograd nodes) land between the large ones, which differs between eager
# (one autograd node per op) and aotc (one per program) even when the large allocations and
# frees come in exactly the same order (checked with an LD_PRELOAD malloc log on conv_net).
# Measured on conv_net: eager ~130-360 faults per step, aotc ~390-760; with PINNED_MALLOC both 0.
# The pinned run repeats the step times with PINNED_MALLOC, so the two effects (aotc's own
# per-step work and the allocator's layout luck) can be told apart.
PINNED_RUN = True

SCALING_GOAL_S = 2.0
SCALING_MIN_NODES = 10_000
# Heuristic: on this shared 2-core machine, repeated same-process step-time ratios of two
# identical systems spread by a few percent; a ratio within this band counts as "not slower".
STEP_NOISE = 1.05
GOAL = (
    "per workload, default options (ATen calls on CPU): saved bytes aotc <= eager's (hooks) and "
    f"step time aotc/eager <= {STEP_NOISE} (noise band); scaling case (joint graph >= "
    f"{SCALING_MIN_NODES} nodes): aotc partition < {SCALING_GOAL_S:g} s"
)
TORCH_PARTITIONERS: dict[str, Callable[..., Any]] = {
    "torch_min_cut": min_cut_rematerialization_partition,
    "torch_default": default_partition,
}


# --------------------------------------------------------------------------- workloads


def pointwise_chain(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()  # 1
    y = y.cos()  # 2
    y = y * 2.0  # 3
    y = y.exp()  # 4
    y = y.tanh()  # 5
    y = y + 1.0  # 6
    y = y.sigmoid()  # 7
    y = y - 0.5  # 8
    y = y.abs()  # 9
    y = y.sqrt()  # 10
    return y.sum()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


class LayerNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(128)
        self.fc1 = nn.Linear(128, 512)
        self.fc2 = nn.Linear(512, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln(x)))).sum()


class GPTBlock(nn.Module):
    """Pre-LN decoder block: x + attn(ln1(x)), then x + mlp(ln2(x)) with GELU."""

    def __init__(self, d_model: int, n_heads: int, seq: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, seq)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPTStack(nn.Module):
    def __init__(self, n_layers: int = 2, d_model: int = 64, n_heads: int = 4, seq: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, seq) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x).sum()


@dataclass
class Workload:
    """`fn` is a function or an nn.Module (train mode); `inputs()` builds fresh inputs."""

    name: str
    fn: Callable[..., torch.Tensor]
    inputs: Callable[[], tuple[Any, ...]]
    description: str


def _seeded(make: Callable[[], Any]) -> Callable[[], Any]:
    def build() -> Any:
        torch.manual_seed(0)
        return make()

    return build


def workloads() -> list[Workload]:
    torch.manual_seed(0)
    mlp, gpt, conv = LayerNormMLP(), GPTStack(), ConvNet()
    for m in (mlp, gpt, conv):
        m.train()
    return [
        Workload(
            "pointwise_chain",
            pointwise_chain,
            _seeded(lambda: (torch.randn(256, 256, requires_grad=True),)),
            "10 pointwise ops on float32[256,256], .sum()",
        ),
        Workload(
            "layernorm_gelu_mlp",
            mlp,
            _seeded(lambda: (torch.randn(64, 128, requires_grad=True),)),
            "x[64,128] -> LayerNorm(128) -> Linear(128,512) -> GELU -> Linear(512,128), .sum()",
        ),
        Workload(
            "softmax_cross_entropy",
            cross_entropy,
            _seeded(
                lambda: (torch.randn(64, 1000, requires_grad=True), torch.randint(0, 1000, (64,)))
            ),
            "F.cross_entropy(logits[64,1000], targets[64])",
        ),
        Workload(
            "gpt_stack",
            gpt,
            _seeded(lambda: (torch.randn(4, 32, 64, requires_grad=True),)),
            "2 pre-LN decoder blocks, d_model 64, 4 heads, seq 32, batch 4, .sum()",
        ),
        Workload(
            "conv_net",
            conv,
            _seeded(lambda: (torch.randn(8, 3, 32, 32, requires_grad=True),)),
            "Conv(3,16)-BN-ReLU-Conv(16,16)-ReLU-avgpool-Linear(16,10), x[8,3,32,32], train",
        ),
    ]


# --------------------------------------------------------------------------- compiling / measuring


def placeholder_saved(bw: fx.GraphModule, fw: fx.GraphModule | None = None) -> list[dict[str, Any]]:
    """Backward placeholders that are not tangents, with their bytes (0 for non-tensors).
    `fw`: the forward graph, to name the op that produced each saved value (torch keeps the
    joint node's name for the forward node and the backward placeholder)."""
    producers = (
        {}
        if fw is None
        else {n.name: "input" if n.op == "placeholder" else str(n.target) for n in fw.graph.nodes}
    )
    out = []
    for node in bw.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        val = node.meta.get("val")
        is_tensor = isinstance(val, torch.Tensor)
        out.append(
            {
                "name": node.name,
                "nbytes": int(val.numel()) * val.element_size() if is_tensor else 0,
                "shape": list(val.shape) if is_tensor else None,
                "dtype": str(val.dtype).removeprefix("torch.") if is_tensor else type(val).__name__,
                "producer": producers.get(node.name, "?"),
            }
        )
    return out


def _aotc_saved(record: Any) -> list[dict[str, Any]]:
    return [
        {
            "name": s.name,
            "nbytes": s.nbytes,
            "shape": list(s.shape) if s.shape is not None else None,
            "dtype": str(s.dtype).removeprefix("torch.") if s.dtype is not None else None,
            "producer": s.producer,
        }
        for s in record.partition.saved
    ]


def _clear_grads(wl: Workload, inputs: tuple[Any, ...]) -> None:
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None
    if isinstance(wl.fn, nn.Module):
        wl.fn.zero_grad(set_to_none=True)


def compile_aotc(wl: Workload, plan: str) -> dict[str, Any]:
    reset_state()
    gc.collect()
    inputs = wl.inputs()
    compiled = aotc.compile(wl.fn, partitioner=plan, capture="trace")
    compiled(*inputs).backward()
    _clear_grads(wl, inputs)
    record = aotc.inspect(compiled)[0]
    saved = _aotc_saved(record)
    # Cross-check against the backward graph: its placeholders that are saved values (aotc
    # names tangent placeholders argN_1 too, so go by the stage's input descriptors).
    bw = record.partition.backward
    saved_ph = [
        n
        for n, d in zip((n for n in bw.module.graph.nodes if n.op == "placeholder"), bw.inputs)
        if isinstance(d, SavedInput)
    ]
    from_placeholders = sum(node_nbytes(n) for n in saved_ph)
    nbytes = sum(s["nbytes"] for s in saved)
    assert nbytes == from_placeholders, (wl.name, nbytes, from_placeholders)
    return {
        "compiled": compiled,
        "saved_bytes": nbytes,
        "saved": saved,
        "partition_s": record.partition.seconds,
        "recomputed": len(record.partition.recomputed),
        "joint_nodes": len(record.joint.graph.nodes),
        "save_everything_bytes": record.partition.save_everything_bytes,
    }


def _capturing(partition_fn: Callable[..., Any], box: dict[str, Any]) -> Callable[..., Any]:
    def wrapped(joint_module: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        fw, bw = partition_fn(joint_module, joint_inputs, **kwargs)
        box.setdefault("seconds", []).append(time.perf_counter() - t0)
        box["fw"], box["bw"] = fw, bw
        box["joint_nodes"] = len(joint_module.graph.nodes)
        return fw, bw

    return wrapped


def make_aot(wl: Workload, partition_fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    if isinstance(wl.fn, nn.Module):
        return aot_module(wl.fn, noop_compiler, noop_compiler, partition_fn=partition_fn)
    fn = wl.fn

    def fresh(*args: Any) -> torch.Tensor:  # a new function object: no shared cache
        return fn(*args)

    return aot_function(fresh, noop_compiler, noop_compiler, partition_fn=partition_fn)


def compile_torch(wl: Workload, partition_fn: Callable[..., Any]) -> dict[str, Any]:
    reset_state()
    gc.collect()
    inputs = wl.inputs()
    box: dict[str, Any] = {}
    compiled = make_aot(wl, _capturing(partition_fn, box))
    compiled(*inputs).backward()
    _clear_grads(wl, inputs)
    if "bw" not in box:
        raise RuntimeError(f"{wl.name}: AOTAutograd did not call partition_fn")
    saved = placeholder_saved(box["bw"], box["fw"])
    return {
        "compiled": compiled,
        "saved_bytes": sum(s["nbytes"] for s in saved),
        "saved": saved,
        "partition_s": sum(box["seconds"]),
        "joint_nodes": box["joint_nodes"],
    }


def hooked_saved_bytes(wl: Workload, fn: Callable[..., torch.Tensor]) -> dict[str, int]:
    """Bytes autograd keeps alive for one step of `fn`, seen by a saved_tensors_hooks pack hook:
    the distinct storages of the saved tensors (a view counts its whole storage)."""
    storages: dict[int, int] = {}
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    inputs = wl.inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(*inputs)
    loss.backward()
    _clear_grads(wl, inputs)
    return {"bytes": sum(storages.values()), "storages": len(storages), "tensors": count}


def triton_partition_bytes(record: Any) -> int | None:
    """Saved bytes of aotc's partition of the same joint graph for the Triton executor (fused
    recomputation free), or None where this aotc has no executor-aware partition."""
    try:
        from aotc.passes.recompute import Executor
    except ImportError:
        return None
    return int(partition(record.partitioned_joint, executor=Executor.TRITON).saved_bytes)


def _grads_match(wl: Workload, compiled: Callable[..., torch.Tensor]) -> bool:
    """One step of `compiled` against eager: loss and every gradient allclose."""
    results = []
    for f in (wl.fn, compiled):
        state = copy.deepcopy(wl.fn.state_dict()) if isinstance(wl.fn, nn.Module) else None
        inputs = wl.inputs()
        loss = f(*inputs)
        loss.backward()
        grads = [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        if isinstance(wl.fn, nn.Module):
            grads += [p.grad for p in wl.fn.parameters()]
            wl.fn.load_state_dict(state)  # undo BN running-stat updates
        results.append((loss.detach(), [g.clone() for g in grads]))
        _clear_grads(wl, inputs)
    (l0, g0), (l1, g1) = results
    return bool(torch.allclose(l0, l1, rtol=1e-4, atol=1e-4)) and all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(g0, g1)
    )


def step_worker(name: str, rounds: int, target_round_s: float = 0.1) -> dict[str, float]:
    """In a fresh process: median per-round mean step time (ms) of eager, aotc and AOTAutograd
    (min-cut) on one workload, interleaved. `eager_again` runs eager a second time as its own
    system: eager_again/eager is the A/A control, the same-process noise of this run."""
    torch.set_num_threads(1)
    wl = next(w for w in workloads() if w.name == name)
    inputs = wl.inputs()
    systems: dict[str, Callable[..., torch.Tensor]] = {
        "eager": wl.fn,
        "eager_again": wl.fn,
        "aotc": aotc.compile(wl.fn, cache=False, capture="trace"),
        "aot_autograd": make_aot(wl, min_cut_rematerialization_partition),
    }

    def looper(f: Callable[..., torch.Tensor]) -> Callable[[int], None]:
        def run_n(n: int) -> None:
            for _ in range(n):
                f(*inputs).backward()

        return run_n

    runners = {n: looper(f) for n, f in systems.items()}
    for run_n in runners.values():
        run_n(3)
    per_call = max(
        median([_time(lambda: run_n(1)) for _ in range(5)]) for run_n in runners.values()
    )
    iters = max(1, min(2000, int(target_round_s / max(per_call, 1e-6))))
    samples = interleaved_rounds(
        runners, iters=iters, rounds=rounds, warmup_iters=max(1, iters // 4)
    )
    _clear_grads(wl, inputs)
    return {n: median(v) * 1e3 for n, v in samples.items()}


# glibc malloc settings that keep freed memory in the process (no heap trimming, no mmap of large
# blocks), as jemalloc/tcmalloc (which PyTorch recommends on CPU) behave: see `--pinned-malloc`.
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 26), "MALLOC_TRIM_THRESHOLD_": str(1 << 27)}


def step_times(
    wl: Workload, procs: int, rounds: int, env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """Step times over `procs` fresh processes: medians of times and of same-process ratios.
    `env_extra`: environment variables for the worker processes (the pinned-malloc run)."""
    import json
    import os
    import subprocess

    per_proc = []
    for _ in range(procs):
        cmd = [sys.executable, __file__, "--step-worker", wl.name, "--rounds", str(rounds)]
        env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{wl.name} step worker failed:\n{done.stderr[-4000:]}")
        per_proc.append(json.loads(done.stdout.strip().splitlines()[-1]))
    systems = list(per_proc[0])
    return {
        "median_ms": {s: median([pp[s] for pp in per_proc]) for s in systems},
        "ratio_vs_eager": {
            f"{s}/eager": median([pp[s] / pp["eager"] for pp in per_proc])
            for s in systems
            if s != "eager"
        },
        "per_process_ms": per_proc,
        "procs": procs,
        "rounds": rounds,
    }


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_workload(wl: Workload, reps: int, rounds: int, procs: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {
        k: [] for k in ("aotc_min_cut", "aotc_simple", *TORCH_PARTITIONERS)
    }
    for r in range(reps):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for system in order:
            if system == "aotc_min_cut":
                res = compile_aotc(wl, "min_cut")
            elif system == "aotc_simple":
                res = compile_aotc(wl, "simple")
            else:
                res = compile_torch(wl, TORCH_PARTITIONERS[system])
            runs[system].append(res)
    for system, rs in runs.items():
        if len({x["saved_bytes"] for x in rs}) != 1:
            raise AssertionError(f"{wl.name}/{system}: saved bytes differ between compilations")
    first = {s: rs[0] for s, rs in runs.items()}
    b = {s: first[s]["saved_bytes"] for s in runs}
    part_ms = {s: median([x["partition_s"] for x in rs]) * 1e3 for s, rs in runs.items()}
    aotc_fn = first["aotc_min_cut"]["compiled"]
    torch_fn = first["torch_min_cut"]["compiled"]
    hooked = {
        "eager": hooked_saved_bytes(wl, wl.fn),
        "aotc": hooked_saved_bytes(wl, aotc_fn),
        "aot_autograd": hooked_saved_bytes(wl, torch_fn),
    }
    record = aotc.inspect(aotc_fn)[0]
    steps = step_times(wl, procs, rounds)
    pinned = step_times(wl, procs, rounds, PINNED_MALLOC) if PINNED_RUN else None
    r = ratio(b["aotc_min_cut"], b["torch_min_cut"])
    return {
        "description": wl.description,
        "saved_bytes": b,
        "saved_count": {s: len(first[s]["saved"]) for s in runs},
        "ratio": {
            "aotc_min_cut/torch_min_cut": r,
            "aotc_simple/torch_default": ratio(b["aotc_simple"], b["torch_default"]),
        },
        "meets_goal": hooked["aotc"]["bytes"] <= hooked["eager"]["bytes"]
        and steps["ratio_vs_eager"]["aotc/eager"] <= STEP_NOISE,
        "saved_bytes_vs_eager": {
            "eager": hooked["eager"]["bytes"],
            "aotc": hooked["aotc"]["bytes"],
            "aot_autograd": hooked["aot_autograd"]["bytes"],
            "aotc/eager": ratio(hooked["aotc"]["bytes"], hooked["eager"]["bytes"]),
            "aot_autograd/eager": ratio(hooked["aot_autograd"]["bytes"], hooked["eager"]["bytes"]),
            "aotc_triton_partition": triton_partition_bytes(record),
            "detail": hooked,
        },
        "partition_median_ms": part_ms,
        "step_median_ms": steps["median_ms"],
        "step_ratio_vs_eager": steps["ratio_vs_eager"],
        "step_per_process_ms": steps["per_process_ms"],
        "step_procs": steps["procs"],
        "step_rounds": steps["rounds"],
        # the same steps with PINNED_MALLOC (None: not run); see Note [Page faults in step times]
        "step_pinned_malloc": None
        if pinned is None
        else {"median_ms": pinned["median_ms"], "ratio_vs_eager": pinned["ratio_vs_eager"]},
        "aotc_recompute_report": record.partition.format(),
        "aotc_recomputed_nodes": first["aotc_min_cut"]["recomputed"],
        "aotc_save_everything_bytes": first["aotc_min_cut"]["save_everything_bytes"],
        "joint_nodes": {
            "aotc": first["aotc_min_cut"]["joint_nodes"],
            "torch": first["torch_min_cut"]["joint_nodes"],
        },
        "grads_match_eager": {
            "aotc": _grads_match(wl, aotc_fn),
            "aot_autograd": _grads_match(wl, torch_fn),
        },
        "saved": {s: first[s]["saved"] for s in ("aotc_min_cut", "torch_min_cut")},
        "reps": reps,
    }


# --------------------------------------------------------------------------- scaling


def make_long_chain(n_ops: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A chain of n_ops pointwise ops (sin, cos * 0.5, tanh, + 0.1, sigmoid, ...) then .sum()."""
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = [
        torch.sin,
        lambda y: y * 0.5,
        torch.cos,
        torch.tanh,
        lambda y: y + 0.1,
        torch.sigmoid,
    ]

    def long_chain(x: torch.Tensor) -> torch.Tensor:
        y = x
        for i in range(n_ops):
            y = steps[i % len(steps)](y)
        return y.sum()

    return long_chain


def run_scaling(n_ops: int, with_torch: bool, reruns: int = 2) -> dict[str, Any]:
    fn = make_long_chain(n_ops)
    reset_state()
    gc.collect()
    x = torch.randn(16, requires_grad=True)
    compiled = aotc.compile(fn, capture="trace")
    t0 = time.perf_counter()
    compiled(x).backward()
    compile_s = time.perf_counter() - t0
    record = aotc.inspect(compiled)[0]
    nodes = len(record.joint.graph.nodes)
    # Median of the pipeline's own partition time and `reruns` more partitions of the same
    # cleaned joint graph (one sample is at the mercy of a shared machine).
    cleaned = cleanup(record.joint_graph)
    samples = [record.partition.seconds]
    for _ in range(reruns):
        samples.append(partition(cleaned).seconds)
    seconds = median(samples)
    out: dict[str, Any] = {
        "description": f"pointwise chain of {n_ops} ops on float32[16], .sum()",
        "pointwise_ops": n_ops,
        "joint_nodes": nodes,
        "aotc_partition_s": seconds,
        "aotc_partition_samples_s": samples,
        "aotc_stage_seconds": dict(record.stage_seconds),
        # The cleanup passes (DCE, CSE, no-op views) are their own stage of the driver.
        "aotc_cleanup_s": record.stage_seconds.get("cleanup", 0.0),
        "aotc_first_call_and_backward_s": compile_s,
        "aotc_saved_bytes": record.partition.saved_bytes,
        "meets_goal": nodes >= SCALING_MIN_NODES and seconds < SCALING_GOAL_S,
    }
    if seconds >= SCALING_GOAL_S:
        prof = cProfile.Profile()
        prof.enable()
        partition(cleaned)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(15)
        out["cprofile_top15"] = buf.getvalue()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        out["cprofile_top15_tottime"] = buf.getvalue()
    if with_torch:
        box: dict[str, Any] = {}
        aot = aot_function(
            make_long_chain(n_ops),
            noop_compiler,
            noop_compiler,
            partition_fn=_capturing(min_cut_rematerialization_partition, box),
        )
        x.grad = None
        aot(x).backward()
        out["torch_min_cut_partition_s"] = sum(box["seconds"])
        out["torch_joint_nodes"] = box["joint_nodes"]
        out["torch_min_cut_saved_bytes"] = sum(s["nbytes"] for s in placeholder_saved(box["bw"]))
    return out


# --------------------------------------------------------------------------- reporting


def table(results: dict[str, Any]) -> str:
    rows = []
    for name, r in results["workloads"].items():
        h, s, q = r["saved_bytes_vs_eager"], r["step_median_ms"], r["step_ratio_vs_eager"]
        rows.append(
            [
                name,
                h["eager"],
                h["aotc"],
                h["aot_autograd"],
                h["aotc_triton_partition"] if h["aotc_triton_partition"] is not None else "-",
                h["aotc/eager"],
                s["eager"],
                s["aotc"],
                s["aot_autograd"],
                q["aotc/eager"],
                q["aot_autograd/eager"],
                q.get("eager_again/eager", float("nan")),
                r["step_pinned_malloc"]["ratio_vs_eager"]["aotc/eager"]
                if r.get("step_pinned_malloc")
                else "-",
                "yes" if r["meets_goal"] else "NO",
            ]
        )
    text = fmt_table(
        [
            "workload",
            "saved eager B",
            "aotc B",
            "aot B",
            "aotc triton B",
            "aotc/eager B",
            "step eager ms",
            "aotc ms",
            "aot ms",
            "aotc/eager",
            "aot/eager",
            "A/A eager",
            "pinned aotc/eager",
            "goal",
        ],
        rows,
    )
    sc = results["scaling"]
    text += (
        f"\nscaling: {sc['joint_nodes']} joint nodes, aotc partition {sc['aotc_partition_s']:.3f} s"
        + (
            f" (torch min-cut {sc['torch_min_cut_partition_s']:.3f} s)"
            if "torch_min_cut_partition_s" in sc
            else ""
        )
        + f", goal < {SCALING_GOAL_S:g} s: {'yes' if sc['meets_goal'] else 'NO'}"
    )
    return text


def saved_listing(r: dict[str, Any]) -> str:
    lines = []
    for system in ("aotc_min_cut", "torch_min_cut"):
        lines.append(
            f"  {system}: {len(r['saved'][system])} values, "
            f"{sum(s['nbytes'] for s in r['saved'][system])} B"
        )
        for s in r["saved"][system]:
            lines.append(
                f"    {s['name']:28s} {s['dtype']}{s['shape']} {s['nbytes']} B from {s['producer']}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="compilations per system (partition time)")
    p.add_argument("--rounds", type=int, default=21, help="interleaved step-time rounds")
    p.add_argument("--procs", type=int, default=3, help="fresh processes for step times")
    p.add_argument("--out", default="partition", help="results file name under bench/results")
    p.add_argument("--step-worker", help=argparse.SUPPRESS)
    p.add_argument(
        "--scaling-ops",
        type=int,
        default=4300,
        help="pointwise ops in the scaling case (4300: ~10,000 joint nodes)",
    )
    p.add_argument(
        "--no-torch-scaling",
        action="store_true",
        help="skip AOTAutograd's min-cut on the scaling graph (~40 s; --quick skips it)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    p.add_argument(
        "--no-pinned-malloc",
        action="store_true",
        help="skip the step times with PINNED_MALLOC (Note [Page faults in step times])",
    )
    p.add_argument("--only", nargs="*", help="workload names to run (default: all)")
    args = p.parse_args(argv)
    if args.step_worker:
        import json

        print(json.dumps(step_worker(args.step_worker, max(3, args.rounds))))
        return {}
    global PINNED_RUN
    PINNED_RUN = not args.no_pinned_malloc
    reps, rounds = (3, 5) if args.quick else (max(1, args.reps), max(3, args.rounds))
    procs = 1 if args.quick else max(1, args.procs)
    print(
        f"partition: {reps} compilations per system, step times: {procs} processes x {rounds} "
        "rounds",
        flush=True,
    )
    per_workload: dict[str, Any] = {}
    for wl in workloads():
        if args.only and wl.name not in args.only:
            continue
        r = run_workload(wl, reps, rounds, procs)
        per_workload[wl.name] = r
        h, q = r["saved_bytes_vs_eager"], r["step_ratio_vs_eager"]
        print(
            f"  {wl.name:22s} saved B: eager {h['eager']:>9d}  aotc {h['aotc']:>9d}  "
            f"aot_autograd {h['aot_autograd']:>9d}; step vs eager: aotc {q['aotc/eager']:.3f}  "
            f"aot_autograd {q['aot_autograd/eager']:.3f}  (A/A eager {q['eager_again/eager']:.3f})",
            flush=True,
        )
        if not r["meets_goal"]:
            print(saved_listing(r), flush=True)
    scaling = run_scaling(
        args.scaling_ops,
        with_torch=not (args.no_torch_scaling or args.quick),
        reruns=1 if args.quick else 2,
    )
    print(
        f"  scaling: {scaling['joint_nodes']} joint nodes, aotc partition "
        f"{scaling['aotc_partition_s']:.3f} s",
        flush=True,
    )
    if "cprofile_top15" in scaling:
        print(scaling["cprofile_top15"], flush=True)
    results = {"workloads": per_workload, "scaling": scaling}
    results["all_goals_met"] = all(r["meets_goal"] for r in per_workload.values()) and bool(
        scaling["meets_goal"]
    )
    path = write_results(
        args.out,
        results,
        goal=GOAL,
        method=(
            "saved bytes = sum over backward-graph placeholders that are not tangents of "
            "numel*element_size(meta['val']), same for aotc and AOTAutograd (no-op compilers); "
            "saved bytes vs eager = distinct storages seen by a saved_tensors_hooks pack hook in "
            "one step, same for eager/aotc/AOTAutograd; partition time = median over reps of "
            "fresh compilations (aotc: record.partition.seconds; torch: wall time of the "
            "partition_fn call); step time = per fresh process (1 torch thread) the median of "
            "per-round means of fwd+bwd, eager/eager_again/aotc/aot_autograd(min-cut) "
            "interleaved (eager_again/eager: the A/A control, this run's same-process noise); "
            "reported the median over processes of times and of same-process ratios"
        ),
    )
    print(table(results))
    print(f"all goals met: {'yes' if results['all_goals_met'] else 'NO'}")
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
