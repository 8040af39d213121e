"""The disk cache and exported artifacts hold one record (`CompiledProgram`), built by one
assembly; the driver's stage runner; the cache key's text of enum options."""

from __future__ import annotations

import enum
import os

import pytest
import torch

import aotc
from aotc import cachekey, persist
from aotc.options import Backend, CompileOptions
from aotc.passes.ir import StageGraph
from aotc.runtime import cache as store
from aotc.runtime.artifact import CompiledProgram, read_artifact
from aotc.runtime.errors import GraphInvariantError
from aotc.stages import Stage, StageRunner
from tests.conftest import assert_matches_eager


def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).tanh().sum(-1)


def args() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 5), torch.randn(5, 3, requires_grad=True)


def _entry(d: str) -> persist.CacheHit:
    aotc.cache_flush()
    (name,) = [n for n in os.listdir(d) if n.endswith(".json")]
    key = name.removesuffix(".json")
    body = store.read_entry(d, key)
    assert body is not None
    hit = persist.decode_hit(persist.StoredEntry(key, body), CompileOptions(cache_dir=d))
    assert hit is not None
    return hit


def test_cache_entry_and_artifact_hold_the_same_program(tmp_path):
    d, out = str(tmp_path / "cache"), str(tmp_path / "artifact")
    compiled = assert_matches_eager(step, args, cache_dir=d, capture="trace")
    hit = _entry(d)
    assert isinstance(hit.program, CompiledProgram)
    assert not hit.inspection.decoded  # only inspection reads it
    record = aotc.inspect(compiled)[0]
    assert record.program.forward.code == hit.program.forward.code
    assert hit.program.backward is not None and record.program.backward is not None
    assert record.program.backward.code == hit.program.backward.code
    assert hit.program.plan.autograd == record.program.plan.autograd
    # Export writes the same record (a cold compile of its own: cache off).
    aotc.export(step, *args(), path=out)
    artifact, _ = read_artifact(out)
    assert isinstance(artifact.program, CompiledProgram)
    assert artifact.program.forward.code == hit.program.forward.code
    assert artifact.program.plan.epilogue == hit.program.plan.epilogue
    # And the loaded artifact, the hit and the cold compile agree with eager.
    loaded = aotc.load(out)
    warm = aotc.compile(step, cache_dir=d, capture="trace")
    x, w = args()
    w2 = w.detach().clone().requires_grad_()
    w3 = w.detach().clone().requires_grad_()
    want = step(x, w)
    want.sum().backward()
    for fn, weight in ((loaded, w2), (warm, w3)):
        got = fn(x, weight)
        torch.testing.assert_close(got, want.detach())
        got.sum().backward()
        torch.testing.assert_close(weight.grad, w.grad)
    assert "cache_load" in aotc.inspect(warm)[0].stage_seconds


def test_record_is_complete_at_construction(tmp_path):
    compiled = aotc.compile(step, cache=False, capture="trace")
    compiled(*args())
    record = aotc.inspect(compiled)[0]
    with pytest.raises(AttributeError):
        record.name = "other"  # type: ignore[misc]
    assert record.training and record.joint is record.joint_graph.module
    assert record.forward is record.program.forward


def test_driver_stages_are_timed_in_order():
    compiled = aotc.compile(step, cache=False, capture="trace", backend="aten")
    compiled(*args())
    names = list(aotc.inspect(compiled)[0].stage_seconds)
    assert names == ["metadata", "trace", "cleanup", "partition", "epilogue", "assemble"]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "0", reason="needs Triton's interpreter on CPU"
)
def test_triton_substages_are_driver_stages():
    pytest.importorskip("triton")
    compiled = aotc.compile(step, cache=False, capture="trace", backend="triton")
    compiled(*args())
    record = aotc.inspect(compiled)[0]
    if not record.kernels:
        pytest.skip("no Triton kernels generated here")
    names = list(record.stage_seconds)
    for stage in ("decompose", "lower", "fuse", "generate"):
        assert stage in names
    assert names.index("epilogue") < names.index("decompose") < names.index("assemble")


def test_stage_runner_times_merges_and_lints():
    runner = StageRunner(check_invariants=True)
    assert runner.run(Stage.TRACE, lambda a, b: a + b, 2, 3) == 5
    runner.labeled(Stage.LOWER, "forward", lambda: None)
    runner.labeled(Stage.LOWER, "backward", lambda: None)
    assert list(runner.seconds) == ["trace", "lower"]
    assert [r.label for r in runner.runs] == ["", "forward", "backward"]
    runner.run(Stage.CACHE_LOAD, lambda: None)
    runner.merge(Stage.CACHE_LOAD, into=Stage.CACHE_KEY)
    assert "cache_load" not in runner.seconds and "cache_key" in runner.seconds

    broken = StageGraph(torch.fx.GraphModule(torch.nn.Module(), _one_input_graph()), (), ())
    with pytest.raises(GraphInvariantError):
        runner.run(Stage.TRACE, lambda: broken)
    StageRunner(check_invariants=False).run(Stage.TRACE, lambda: broken)  # not linted


def _one_input_graph() -> torch.fx.Graph:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((x,))
    return graph


def test_key_writes_enum_options_by_value():
    class Renamed(enum.Enum):
        TRITON = "triton"

    assert cachekey._option_text(Backend.TRITON) == "Backend:'triton'"
    assert cachekey._option_text(Renamed.TRITON) == "Renamed:'triton'"
    text = cachekey._options_text(CompileOptions(cache_dir="/unused", backend="triton"))
    assert "backend=Backend:'triton'" in text and "<" not in text
