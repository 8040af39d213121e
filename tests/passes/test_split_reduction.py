"""Large sums with few results split in two (passes.split_reduction), row epilogues joining
their reduction (Note [Epilogues join their reduction]), sums over rows generated as column
reductions (`KernelSource.outer`), and warm compiles (runtime.precompile): structure on graphs,
results against eager through Triton's interpreter (and CUDA under `gpu`)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import aotc
from aotc.passes.split_reduction import split_reductions
from aotc.runtime.kernels import cuda_configs
from tests.conftest import assert_matches_eager
from tests.triton_helpers import DEVICES, assert_closer

aten = torch.ops.aten


def _sums(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target in (aten.sum.dim_IntList, aten.sum.default)]


def _fake_graph(fn, *shapes: tuple[int, ...], dtype: torch.dtype = torch.float32):
    return make_fx(fn, tracing_mode="fake")(*[torch.empty(s, dtype=dtype) for s in shapes])


def test_sum_over_many_rows_is_split_in_two() -> None:
    gm = _fake_graph(lambda g: aten.sum.dim_IntList(g, [0]), (16384, 64))
    out = split_reductions(gm)
    assert out is not gm and len(_sums(gm)) == 1  # the input graph is not changed
    first, second = _sums(out)
    partial = first.meta["val"]
    assert partial.shape[-1] == 64 and partial.numel() >= 64 * 4
    assert second.meta["val"].shape == (64,)
    x = torch.randn(16384, 64)
    torch.testing.assert_close(out(x)[0] if isinstance(out(x), tuple) else out(x), x.sum(0))


def test_half_sums_accumulate_partials_in_float32() -> None:
    gm = _fake_graph(lambda g: g.sum(), (1 << 16,), dtype=torch.bfloat16)
    out = split_reductions(gm)
    first, _ = _sums(out)
    assert first.meta["val"].dtype == torch.float32
    result = [n for n in out.graph.nodes if n.op == "output"][0].args[0]
    vals = [a.meta["val"] for a in (result if isinstance(result, (list, tuple)) else [result])]
    assert vals[0].dtype == torch.bfloat16 and vals[0].shape == ()


@pytest.mark.parametrize(
    "shape,dims",
    [
        ((64, 64), [0]),  # too few elements reduced
        ((8, 8), None),
        ((16384, 4096), [1]),  # softmax's row sums: one row per program is plenty of programs
        ((5, 4099), [1]),  # few rows, but no power of two divides the row
    ],
)
def test_small_wide_or_indivisible_sums_are_kept_whole(
    shape: tuple[int, ...], dims: list[int] | None
) -> None:
    fn = (lambda g: g.sum()) if dims is None else (lambda g: aten.sum.dim_IntList(g, dims))
    gm = _fake_graph(fn, shape)
    assert split_reductions(gm) is gm


def test_few_long_rows_are_split() -> None:
    gm = _fake_graph(lambda g: aten.sum.dim_IntList(g, [1]), (4, 1 << 16))
    first, second = _sums(split_reductions(gm))
    assert first.meta["val"].shape[0] == 4 and first.meta["val"].numel() >= 1024
    assert second.meta["val"].shape == (4,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case",
    ["rows", "all", "keepdim", "two_dims", "inner_few_rows", "mean"],
)
def test_split_sums_match_eager(device: str, case: str) -> None:
    fns = {
        "rows": (lambda x: (x * x).sum(0), (8192, 3)),
        "all": (lambda x: x.sin().sum(), (1 << 15,)),
        "keepdim": (lambda x: x.sum(0, keepdim=True) * 2, (4096, 5)),
        "two_dims": (lambda x: (x + 1).sum([0, 1]), (4, 2048, 3)),
        "inner_few_rows": (lambda x: x.exp().sum(-1), (2, 8192)),
        "mean": (lambda x: x.mean(0), (8192, 2)),
    }
    fn, shape = fns[case]
    # thousands of float32 additions in another order: absolute error ~1e-5 where terms cancel
    compiled = assert_matches_eager(
        fn,
        lambda: torch.randn(*shape, device=device, requires_grad=True),
        backend="triton",
        rtol=1e-5,
        atol=1e-4,
        grad_tol=(1e-5, 1e-4),
    )
    # the forward's sum alone is two reduction kernels: the partial sums and their total
    assert sum(1 for k in _kernels(compiled) if k.reduction) >= 2


@pytest.mark.parametrize("device", DEVICES)
def test_split_bf16_sum_is_as_close_as_eager(device: str) -> None:
    x = torch.randn(8192, 4, device=device, dtype=torch.bfloat16, requires_grad=True)
    assert_closer(lambda t: (t * 3).sum(0), [x])


def _kernels(compiled) -> list:
    return [k for rec in aotc.inspect(compiled) for k in rec.kernels]


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_input_grad_is_stored_by_the_row_kernel(device: str) -> None:
    rows, cols = 4096, 16
    compiled = assert_matches_eager(
        lambda x, w, b: F.layer_norm(x, (cols,), w, b),
        lambda: (
            torch.randn(rows, cols, device=device, requires_grad=True),
            torch.randn(cols, device=device, requires_grad=True),
            torch.randn(cols, device=device, requires_grad=True),
        ),
        backend="triton",
        rtol=1e-5,
        atol=1e-4,
        grad_tol=(1e-5, 1e-4),
    )
    kernels = _kernels(compiled)
    # forward, then the backward's row kernel (per-row sums and the input gradient), then the
    # weight and bias gradients' partial sums over row blocks and their total
    assert len(kernels) == 4
    for k in kernels:
        full = [o for o in k.outputs if o.startswith(("add", "mul", "div"))]
        if k.reduction and not k.outer:
            assert k.xnumel == rows, k.source
        if k.outer:
            assert not full, f"{k.name} stores a full-size tensor in column order"
    column = [k for k in kernels if k.outer]
    assert len(column) >= 1
    assert all(cfg[0] >= 16 for k in column for cfg in cuda_configs(k.for_cuda))


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gradient_is_a_column_reduction(device: str) -> None:
    compiled = assert_matches_eager(
        lambda x, w, b: F.linear(x, w, b).relu(),
        lambda: (
            torch.randn(2048, 8, device=device),
            torch.randn(4, 8, device=device, requires_grad=True),
            torch.randn(4, device=device, requires_grad=True),
        ),
        backend="triton",
    )
    assert any(k.outer for k in _kernels(compiled))


def test_warm_compile_lands_in_the_named_triton_cache(tmp_path) -> None:
    pytest.importorskip("triton")
    from aotc.runtime.cuda_check import _Pool
    from aotc.runtime.precompile import warm_request

    compiled = aotc.compile(lambda x: (x * 2).sin().sum(0), backend="triton")
    compiled(torch.randn(64, 128))
    (kernel,) = [k.for_cuda for k in _kernels(compiled)]
    pool = _Pool(1, 0, cache_dir=str(tmp_path))
    try:
        assert pool.submit({"ping": True}).result(timeout=120).get("ok")  # precompile.start
        request = warm_request(kernel, 90, cuda_configs(kernel)[0])
        answer = pool.submit(request).result(timeout=300)
    finally:
        pool.close()
    assert answer.get("ok") and answer.get("launcher") in (True, False), answer
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert any(f.endswith(".cubin") for f in files), files


def test_warm_pool_starts_once_and_is_ready() -> None:
    pytest.importorskip("triton")
    from aotc.runtime import precompile

    precompile.shutdown()
    try:
        precompile.start()
        pool = precompile._STATE["pool"]
        precompile.start()  # a no-op once started
        assert precompile._STATE["pool"] is pool
        assert warm_ready(pool)
        assert precompile.warm([], "cpu") == 0  # only CUDA kernels are warmed
    finally:
        precompile.shutdown()
    assert "pool" not in precompile._STATE


def warm_ready(pool) -> bool:
    """Every worker answers a ping (it has imported Triton's compiler)."""
    return all(pool.submit({"ping": True}).result(timeout=120).get("ok") for _ in pool.threads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_compiles_are_cache_hits_on_cuda() -> None:
    """The backward's first launches find every warmed configuration's binary in Triton's cache
    (the worker's compile had the cache key the launch computes)."""
    from aotc.runtime import kernels as K
    from aotc.runtime.precompile import triton_cache_dir, wait

    def entries() -> int:  # compiled kernels (launcher stubs are C builds, not counted)
        return sum(f.endswith(".cubin") for _, _, fs in os.walk(triton_cache_dir()) for f in fs)

    x = torch.randn(3001, 77, device="cuda", requires_grad=True)
    f = aotc.compile(lambda t: torch.softmax(t * 1.25, -1).sum(0), backend="triton")
    out = f(x)  # compiles both graphs (warm compiles start) and runs the forward's kernels
    pending = list(K.WARMING.values())
    assert pending, "no warm compiles for the backward's kernels"
    wait(pending)
    before = entries()
    out.sum().backward()
    torch.testing.assert_close(out, torch.softmax(x.detach() * 1.25, -1).sum(0))
    assert entries() == before, "a first launch compiled again: warm compiles missed the cache"
