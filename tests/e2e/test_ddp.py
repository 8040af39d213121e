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
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
STEPS = 3

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")


class Block(nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.a = nn.Linear(i, 16)
        self.b = nn.Linear(16, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(8, 16), Block(16, 16), Block(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _wrap(base: nn.Module, how: str) -> tuple[nn.Module, nn.Module]:
    """(the module to call, the module whose parameters the optimizer updates)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import aotc

    # Small buckets: several all-reduces per step, and several graphs in `aotc.compile(DDP(m))`.
    def ddp(m: nn.Module) -> nn.Module:
        return DDP(m, bucket_cap_mb=0.002)

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


def _worker(rank: int, init: str, how: str, queue: object) -> None:
    try:
        import aotc

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
        torch.manual_seed(0)
        model, base = _wrap(Net(), how)
        opt = torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            torch.manual_seed(100 + step * WORLD + rank)  # each rank its own data
            x, y = torch.randn(6, 8), torch.randn(6, 4)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        params = []
        for p in base.parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            params.append(full.detach().tolist())
        graphs = len(aotc.inspect(model)) if isinstance(model, aotc.DynamoModule) else -1
        queue.put((rank, params, graphs, None))  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001 reported to the parent
        import traceback

        queue.put((rank, None, 0, traceback.format_exc()[-4000:]))  # type: ignore[attr-defined]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(how: str) -> dict[int, tuple[list[list[float]], int]]:
    ctx = mp.get_context("spawn")
    fd, path = tempfile.mkstemp(prefix="aotc-ddp-")
    os.close(fd)
    os.unlink(path)  # the file store creates it
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, f"file://{path}", how, queue)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            rank, params, graphs, error = queue.get(timeout=600)
            assert error is None, f"{how}, rank {rank}:\n{error}"
            out[rank] = (params, graphs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
        if os.path.exists(path):
            os.unlink(path)
    return out


_REFERENCE: dict[str, dict[int, tuple[list[list[float]], int]]] = {}


def _reference(kind: str) -> dict[int, tuple[list[list[float]], int]]:
    if kind not in _REFERENCE:
        _REFERENCE[kind] = _run(kind)
    return _REFERENCE[kind]


def _assert_same(got: dict, want: dict, how: str) -> None:
    for rank in range(WORLD):
        for i, (g, w) in enumerate(zip(got[rank][0], want[rank][0])):
            torch.testing.assert_close(
                torch.tensor(g),
                torch.tensor(w),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, r=rank, i=i: f"{how}, rank {r}, parameter {i}: {m}",
            )
    # Ranks agree with each other (gradients were all-reduced every step).
    for a, b in zip(got[0][0], got[1][0]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), msg=f"{how}: ranks differ")


@pytest.mark.parametrize("how", ["aotc(DDP)", "DDP(aotc)", "torch.compile(DDP)"])
def test_ddp_matches_eager_ddp(how):
    got = _run(how)
    _assert_same(got, _reference("eager-ddp"), how)
    if how == "aotc(DDP)":
        assert got[0][1] > 1  # Dynamo split the graph at DDP's buckets


def test_fsdp2_matches_eager_fsdp2():
    got = _run("aotc(FSDP2)")
    _assert_same(got, _reference("eager-fsdp2"), "aotc(FSDP2)")
    assert got[0][1] >= 1  # the blocks' forwards were compiled
