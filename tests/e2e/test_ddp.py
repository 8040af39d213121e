"""DistributedDataParallel and FSDP2 with aotc, 2 processes on CPU (gloo, `file://` init): the
parameters after several SGD steps equal eager DDP's (FSDP2's) on every rank.

Three ways for DDP: `aotc.compile(DDP(m))` (Dynamo splits the graph at DDP's buckets),
`DDP(aotc.compile(m))` and `torch.compile(DDP(m), backend="aotc")`. FSDP2 (`fully_shard`) runs
eagerly on CPU with gloo, so it is compared the same way; its per-module hooks run eagerly and the
modules' forwards are compiled between them."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
STEPS = 3

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")


class Block(nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        # Wide enough (~2 MB of parameters in all) for several 1 MB DDP buckets.
        self.a = nn.Linear(i, 2048)
        self.b = nn.Linear(2048, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(8, 64), Block(64, 64), Block(64, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _wrap(base: nn.Module, how: str) -> tuple[nn.Module, nn.Module]:
    """(the module to call, the module whose parameters the optimizer updates)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import aotc

    # 1 MB buckets (DDP's first bucket is 1 MB; Dynamo wants none larger): several all-reduces
    # per step, and several graphs in `aotc.compile(DDP(m))`.
    def ddp(m: nn.Module) -> nn.Module:
        return DDP(m, bucket_cap_mb=1)

    if how == "eager-ddp":
        return ddp(base), base
    if how == "aotc(DDP)":
        return aotc.compile(ddp(base)), base
    if how == "DDP(aotc)":
        return ddp(aotc.compile(base)), base
    if how == "torch.compile(DDP)":
        return torch.compile(ddp(base), backend="aotc"), base
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for block in base.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(base, mesh=mesh)
    if how == "eager-fsdp2":
        return base, base
    assert how == "aotc(FSDP2)", how
    return aotc.compile(base), base


ALL = ("eager-ddp", "aotc(DDP)", "DDP(aotc)", "torch.compile(DDP)", "eager-fsdp2", "aotc(FSDP2)")


def _train(rank: int, how: str) -> tuple[list[tuple[tuple[int, ...], bytes]], int]:
    import aotc

    torch.manual_seed(0)
    model, base = _wrap(Net(), how)
    opt = torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        torch.manual_seed(100 + step * WORLD + rank)  # each rank its own data
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    params = []  # as (shape, raw bytes): cheap to send back
    for p in base.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params.append((tuple(full.shape), full.detach().contiguous().numpy().tobytes()))
    graphs = len(aotc.inspect(model)) if isinstance(model, aotc.DynamoModule) else -1
    return params, graphs


def _worker(rank: int, init: str, queue: object) -> None:
    """One process per rank runs every variant in turn (one process group: spawning is the
    slow part), each from the same initial weights."""
    results: dict[str, object] = {}
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
        for how in ALL:
            torch._dynamo.reset()
            try:
                results[how] = _train(rank, how)
            except BaseException:  # noqa: BLE001 reported to the parent, per variant
                import traceback

                results[how] = traceback.format_exc()[-4000:]
            dist.barrier()
    finally:
        queue.put((rank, results))  # type: ignore[attr-defined]
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[int, object]]:
    import torch._dynamo  # noqa: F401 (the workers reset it between variants)

    ctx = mp.get_context("spawn")
    fd, path = tempfile.mkstemp(prefix="aotc-ddp-")
    os.close(fd)
    os.unlink(path)  # the file store creates it
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, f"file://{path}", queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: dict[str, dict[int, object]] = {how: {} for how in ALL}
    try:
        for _ in procs:
            rank, results = queue.get(timeout=900)
            for how, value in results.items():
                out[how][rank] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
        if os.path.exists(path):
            os.unlink(path)
    return out  # type: ignore[return-value]


def _get(runs: dict, how: str) -> dict:
    got = runs[how]
    for rank in range(WORLD):
        assert rank in got, f"{how}: rank {rank} reported nothing"
        assert not isinstance(got[rank], str), f"{how}, rank {rank}:\n{got[rank]}"
    return got


def _tensor(param: tuple[tuple[int, ...], bytes]) -> torch.Tensor:
    shape, raw = param
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)


def _assert_same(got: dict, want: dict, how: str) -> None:
    for rank in range(WORLD):
        for i, (g, w) in enumerate(zip(got[rank][0], want[rank][0])):
            torch.testing.assert_close(
                _tensor(g),
                _tensor(w),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, r=rank, i=i: f"{how}, rank {r}, parameter {i}: {m}",
            )
    # Ranks agree with each other (gradients were all-reduced every step).
    for a, b in zip(got[0][0], got[1][0]):
        torch.testing.assert_close(_tensor(a), _tensor(b), msg=f"{how}: ranks differ")


@pytest.mark.parametrize("how", ["aotc(DDP)", "DDP(aotc)", "torch.compile(DDP)"])
def test_ddp_matches_eager_ddp(runs, how):
    got = _get(runs, how)
    _assert_same(got, _get(runs, "eager-ddp"), how)
    if how == "aotc(DDP)":
        assert got[0][1] > 1  # Dynamo split the graph at DDP's buckets


def test_fsdp2_matches_eager_fsdp2(runs):
    got = _get(runs, "aotc(FSDP2)")
    _assert_same(got, _get(runs, "eager-fsdp2"), "aotc(FSDP2)")
    assert got[0][1] >= 1  # the blocks' forwards were compiled
