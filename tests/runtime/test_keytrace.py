"""The meta key trace (Note [Meta key trace] in aotc/keytrace.py): it writes the same text as the
fake-tensor trace on real programs, an entry is stored under a meta key only when the two agree,
inputs it does not model use the fake tracer, and a hit defers the joint graphs."""

from __future__ import annotations

import os

import pytest
import torch

import aotc
from aotc import keytrace, persist, structured
from aotc.options import CompileOptions
from tests.conftest import Double, assert_matches_eager, assert_module_matches_eager
from tests.e2e import models


def program_of(fn):
    def program(user_leaves):
        import torch.utils._pytree as pytree

        return pytree.tree_flatten(fn(*user_leaves))

    return program


def module_program(module, n_inputs):
    state = [*module.named_parameters(), *module.named_buffers()]

    def fn(*leaves):
        params = dict(zip([n for n, _ in state], leaves[n_inputs:]))
        return torch.func.functional_call(module, params, leaves[:n_inputs])

    return fn, [t for _, t in state]


def both_texts(fn, *args):
    leaves = list(args)
    program = program_of(fn)
    meta = keytrace.trace_text(program, leaves, torch.is_grad_enabled(), "meta")
    fake = keytrace.trace_text(program, leaves, torch.is_grad_enabled(), "fake")
    return meta, fake


def _inplace(x, y):
    y.add_(1)
    return x.sin() * y, y.view(-1)


def _factories(x):
    return (
        x
        + torch.ones(x.shape, device=x.device)
        + torch.tensor([1.0, 2.0, 3.0])
        + torch.arange(3)
        + torch.zeros_like(x).fill_(2)
    )


def _scalar_tensor(x):
    return x * torch.tensor(2.0), x.new_zeros(2)


def _queries(x):
    # Branches on properties the text records for every result.
    y = x.t() if x.is_contiguous() else x
    z = y.contiguous() if not y.is_contiguous() else y * 2
    return z.to(torch.float64) if z.dtype == torch.float32 else z, z.shape[0] * 2


PROGRAMS = {
    "inplace": (_inplace, lambda: (torch.randn(3, requires_grad=True), torch.randn(3))),
    "factories": (_factories, lambda: (torch.randn(2, 3),)),
    "scalar_tensor": (_scalar_tensor, lambda: (torch.randn(4, 3),)),
    "queries": (_queries, lambda: (torch.randn(4, 3, requires_grad=True),)),
    "reductions": (
        lambda x: (x.softmax(-1), x.var(0), x.amax(1, keepdim=True).expand(4, 3)),
        lambda: (torch.randn(4, 3, requires_grad=True),),
    ),
    "int_and_bool": (
        lambda x, i: ((x > 0) & (i % 2 == 0)[:, None], i.cumsum(0), x[i.clamp(0, 3)]),
        lambda: (torch.randn(4, 3), torch.arange(4)),
    ),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_meta_and_fake_texts_agree_on_programs(name):
    fn, make = PROGRAMS[name]
    args = make()
    assert keytrace.meta_eligible(list(args))
    meta, fake = both_texts(fn, *args)
    assert meta == fake
    assert meta.count("\n") > 2


MODELS = {
    "gpt": (models.GPT, models.gpt_batch),
    "bert": (models.BERT, models.bert_batch),
    "llama": (models.LlamaBlock, models.llama_batch),
    "conv": (models.ConvNet, models.conv_batch),
    "lstm": (models.LSTMLoop, models.lstm_batch),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_meta_and_fake_texts_agree_on_models(name):
    make_model, batch = MODELS[name]
    torch.manual_seed(0)
    model = make_model()
    inputs = batch()
    fn, params = module_program(model, len(inputs))
    meta, fake = both_texts(fn, *inputs, *params)
    assert meta == fake


def test_results_carry_device_and_geometry():
    meta, _ = both_texts(lambda x: x.t().contiguous(), torch.randn(2, 3))
    assert "float32[3, 2]/(1, 3)+0@cpu = aten.t.default" in meta
    assert "float32[3, 2]/(2, 1)+0@cpu = aten.clone.default" in meta


def test_storage_reads_are_unkeyable_by_meta_and_fake():
    def peeks(x):
        return x + x.untyped_storage().nbytes()

    with pytest.raises(Exception):  # noqa: B017 the meta tracer refuses; which error is torch's
        keytrace.trace_text(program_of(peeks), [torch.randn(3)], True, "meta")
    opts = CompileOptions.from_env(cache_dir="/unused")
    key = persist.cache_key(program_of(peeks), [torch.randn(3)], ["x"], opts, True)
    assert key.tracer in ("fake", "")


@pytest.mark.parametrize(
    "args",
    [
        lambda: (torch.randn(4, 3)[1:].t(),),  # a view
        lambda: (torch.randn(4, 3, requires_grad=True) * 1,),  # a non-leaf requiring grad
        lambda: (torch.randn(3, dtype=torch.complex64).conj(),),
    ],
    ids=["view", "non_leaf", "conj"],
)
def test_inputs_the_wrapper_does_not_model_use_the_fake_tracer(args, tmp_path):
    leaves = list(args())
    assert not keytrace.meta_eligible(leaves)
    opts = CompileOptions.from_env(cache_dir=str(tmp_path))
    key = persist.cache_key(program_of(lambda x: x * 2), leaves, ["x"], opts, True)
    assert key.key is not None and key.tracer == "fake"
    assert persist.verify_key(key, program_of(lambda x: x * 2), leaves, True) is None


def test_duplicate_inputs_use_the_fake_tracer():
    x = torch.randn(3)
    assert not keytrace.meta_eligible([x, x])
    assert keytrace.meta_eligible([x, x.clone()])


def test_meta_and_fake_keys_never_meet():
    x = torch.randn(3, 4)
    opts = CompileOptions.from_env(cache_dir="/unused")
    program = program_of(lambda x: x.sin())
    meta_key = persist.cache_key(program, [x], ["x"], opts, True)
    assert meta_key.tracer == "meta"
    fake_trace = keytrace.trace_text(program, [x], True, "fake")
    assert fake_trace == meta_key.trace  # same text, but the key hashes the tracer's name too
    assert "tracer meta" not in fake_trace


def test_disagreeing_meta_trace_redirects_to_the_fake_key(tmp_path, monkeypatch, caplog):
    """A meta trace that differs from the fake one (simulated: one result's strides are written
    wrong) is never trusted. The first compile of a family never stored traces no key (Note [Keys
    of programs never stored]) and stores under the meta key of its fake text, which this
    program's meta trace never writes; so the second compile traces, misses and sends the entry
    to the fake key, with a redirect under the meta key, and the third hits after one extra
    (fake) key trace."""
    d = str(tmp_path)
    real_record = keytrace._MetaRecorder.record

    def wrong(self, func, text, out):
        real_record(self, func, text, out)
        if "aten.mm" in text:
            self.lines[-1] = self.lines[-1].replace("/(", "/(7, ", 1)

    monkeypatch.setattr(keytrace._MetaRecorder, "record", wrong)
    args = lambda: (torch.randn(5, 4, requires_grad=True), torch.randn(4, 3))
    fn = lambda a, b: (a @ b).relu()

    def bodies():
        aotc.cache_flush()
        return [
            persist.store.read_entry(d, n.removesuffix(".json"))
            for n in sorted(os.listdir(d))
            if n.endswith(".json")
        ]

    # Strict mode: a Dynamo graph is keyed by its own text (Note [Graph key]), not traced.
    with caplog.at_level("INFO", logger="aotc.cache"):
        first = assert_matches_eager(fn, args, cache_dir=d, capture="trace")
    assert "meta and fake key traces differ" not in caplog.text
    assert len(bodies()) == 1
    with caplog.at_level("INFO", logger="aotc.cache"):
        second = assert_matches_eager(fn, args, cache_dir=d, capture="trace")
    assert "meta and fake key traces differ" in caplog.text
    stored = bodies()
    assert len(stored) == 3
    assert {"redirect": "fake"} in stored
    assert sum("graphs" in b for b in stored) == 2
    third = assert_matches_eager(fn, args, cache_dir=d, capture="trace")
    assert "cache_load" not in aotc.inspect(first)[0].stage_seconds
    assert "cache_load" not in aotc.inspect(second)[0].stage_seconds
    assert "cache_load" in aotc.inspect(third)[0].stage_seconds


def test_meta_key_hit_matches_eager_and_defers_joint_graphs(tmp_path, monkeypatch):
    d = str(tmp_path)
    # A structured trace (TORCH_TRACE, or a handler another test left) reads the joint graph.
    monkeypatch.setattr(structured, "is_tracing", lambda: False)
    make = lambda: models.GPTBlock(32, 4, 0.0)
    inputs = lambda: (torch.randn(2, 8, 32),)
    cold = assert_module_matches_eager(make, inputs, steps=2, cache_dir=d)
    warm = assert_module_matches_eager(make, inputs, steps=2, cache_dir=d)
    cold_rec, warm_rec = aotc.inspect(cold)[0], aotc.inspect(warm)[0]
    assert "cache_load" in warm_rec.stage_seconds and "trace" not in warm_rec.stage_seconds
    # Deferred until read; then the same graphs as the cold compile's.
    assert not warm_rec.inspection.decoded and cold_rec.inspection.decoded
    assert warm_rec.joint.code == cold_rec.joint.code
    assert warm_rec.partitioned_joint.module.code == cold_rec.partitioned_joint.module.code
    assert warm_rec.joint_graph.format("joint") == cold_rec.joint_graph.format("joint")


def _spy_verification(monkeypatch):
    """Record, per verification, the compile's observed fake text, a standalone fake trace and a
    standalone meta trace of the same program, and the key's text; count the key traces the
    compile itself runs."""
    seen: list[tuple[str | None, str, str, str]] = []
    standalone = {"fake": 0, "meta": 0}
    real_trace, real_verify = keytrace.trace_text, persist.verify_key

    def trace_text(program, leaves, grad_enabled, tracer, facts=None):
        standalone[tracer] = standalone.get(tracer, 0) + 1
        return real_trace(program, leaves, grad_enabled, tracer, facts)

    def verify_key(key, program, leaves, grad_enabled, fake_text=None):
        fake = real_trace(program, leaves, grad_enabled, "fake")
        meta = real_trace(program, leaves, grad_enabled, "meta")
        seen.append((fake_text, fake, meta, key.trace))
        return real_verify(key, program, leaves, grad_enabled, fake_text)

    monkeypatch.setattr(keytrace, "trace_text", trace_text)
    monkeypatch.setattr(persist, "verify_key", verify_key)
    return seen, standalone


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_cold_compile_verifies_on_its_own_fake_run(name, tmp_path, monkeypatch):
    """Note [Verifying on the compile's own run]: the metadata pass's fake run writes exactly the
    standalone fake (and meta) trace's text. So a cold compile of a family never stored runs no
    key trace at all (Note [Keys of programs never stored]) and stores under the meta key of
    that text, and the next compile, which traces the meta key, hits."""
    fn, make = PROGRAMS[name]
    seen, standalone = _spy_verification(monkeypatch)
    cold = assert_matches_eager(fn, make, cache_dir=str(tmp_path), runs=1, capture="trace")
    assert len(seen) == 1
    observed, fake, meta, key_text = seen[0]
    assert observed is not None and observed == fake == meta == key_text
    assert standalone == {"fake": 0, "meta": 0}
    warm = assert_matches_eager(fn, make, cache_dir=str(tmp_path), runs=1, capture="trace")
    assert standalone == {"fake": 0, "meta": 1}
    assert "cache_load" not in aotc.inspect(cold)[0].stage_seconds
    assert "cache_load" in aotc.inspect(warm)[0].stage_seconds


@pytest.mark.parametrize("name", ["gpt", "conv"])
def test_cold_compile_verifies_models_on_its_own_fake_run(name, tmp_path, monkeypatch):
    make_model, batch = MODELS[name]
    seen, standalone = _spy_verification(monkeypatch)
    torch.manual_seed(0)
    model = aotc.compile(make_model(), cache_dir=str(tmp_path), capture="trace")
    model(*batch()).float().sum().backward()
    ((observed, fake, meta, key_text),) = seen
    assert observed is not None and observed == fake == meta == key_text
    assert standalone == {"fake": 0, "meta": 0}


def test_observer_leaves_functional_and_symbolic_runs_alone():
    x = torch.randn(3, requires_grad=True)
    observer = keytrace.FakeRunObserver([x])
    calls = []

    def program(user_leaves):
        calls.append(type(user_leaves[0]).__name__)
        return [user_leaves[0] * 2], None

    observed = observer.observe(program)
    observed([x])  # a real tensor: not a fake run
    assert observer.text is None and "no plain fake" in observer.reason
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        observed([fake])
        observed([mode.from_tensor(x)])  # only the first plain fake run is recorded
    assert observer.text is not None and "aten.mul.Tensor" in observer.text
    assert observer.text.count("aten.mul.Tensor") == 1
    assert len(calls) == 3


def _count_key_traces(monkeypatch):
    counts = {"fake": 0, "meta": 0}
    real = keytrace.trace_text

    def trace_text(program, leaves, grad_enabled, tracer, facts=None):
        counts[tracer] += 1
        return real(program, leaves, grad_enabled, tracer, facts)

    monkeypatch.setattr(keytrace, "trace_text", trace_text)
    return counts


def _entries(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".json"))


def _families(d):
    folder = os.path.join(d, "families")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _hit(compiled):
    return "cache_load" in aotc.inspect(compiled)[0].stage_seconds


_ARGS = lambda: (torch.randn(5, 4, requires_grad=True), torch.randn(4, 3))


def test_cold_compile_of_a_family_never_stored_traces_no_key(tmp_path, monkeypatch):
    """Note [Keys of programs never stored]: the first compile runs no key trace, stores under
    the meta key of its own fake run and marks the family; a compile in this process hits
    before the deferred store ran, and one in a new process (the family read from disk) hits
    after one meta key trace."""
    d = str(tmp_path)
    counts = _count_key_traces(monkeypatch)
    fn = lambda a, b: (a @ b).tanh() * 2
    cold = assert_matches_eager(fn, _ARGS, cache_dir=d, capture="trace")
    assert counts == {"fake": 0, "meta": 0} and not _hit(cold)
    same_process = assert_matches_eager(fn, _ARGS, cache_dir=d, capture="trace")
    assert _hit(same_process) and counts == {"fake": 0, "meta": 1}
    aotc.cache_flush()
    assert len(_entries(d)) == 1 and len(_families(d)) == 1
    monkeypatch.setattr(persist, "_FAMILIES", set())  # as a new process starts
    new_process = assert_matches_eager(fn, _ARGS, cache_dir=d, capture="trace")
    assert _hit(new_process) and counts == {"fake": 0, "meta": 2}


def test_a_marked_family_traces_the_key_of_another_program(tmp_path, monkeypatch):
    """Two programs of one input signature share a family: the second compile traces its key,
    misses (its ops differ), compiles and stores its own entry; each then hits its own."""
    d = str(tmp_path)
    counts = _count_key_traces(monkeypatch)
    first = lambda a, b: (a @ b).tanh()
    second = lambda a, b: (a @ b).sigmoid()
    assert not _hit(assert_matches_eager(first, _ARGS, cache_dir=d, capture="trace"))
    assert counts["meta"] == 0
    assert not _hit(assert_matches_eager(second, _ARGS, cache_dir=d, capture="trace"))
    assert counts["meta"] == 1
    aotc.cache_flush()
    assert len(_entries(d)) == 2 and len(_families(d)) == 1
    assert _hit(assert_matches_eager(first, _ARGS, cache_dir=d, capture="trace"))
    assert _hit(assert_matches_eager(second, _ARGS, cache_dir=d, capture="trace"))


def test_unkeyable_program_of_a_family_never_stored_is_not_stored(tmp_path, monkeypatch):
    """A deferred key whose fake run the key text cannot hold (a custom Function) is not
    stored, as a traced key would not have been, and marks no family."""

    d = str(tmp_path)
    counts = _count_key_traces(monkeypatch)
    fn = lambda a, b: Double.apply(a @ b).sum()
    assert_matches_eager(fn, _ARGS, cache_dir=d, capture="trace")
    aotc.cache_flush()
    assert counts == {"fake": 0, "meta": 0}
    assert _entries(d) == [] and _families(d) == []


def test_deferred_key_without_an_observed_run_is_traced_after_compiling(tmp_path, monkeypatch):
    """Where the compile made no plain fake run the observer could write, the skipped key trace
    runs after compiling and is verified as a traced key is; the next compile hits."""
    d = str(tmp_path)
    monkeypatch.setattr(keytrace.FakeRunObserver, "observe", lambda self, program: program)
    counts = _count_key_traces(monkeypatch)
    fn = lambda a, b: (a @ b).relu() - 1
    assert not _hit(assert_matches_eager(fn, _ARGS, cache_dir=d, capture="trace"))
    assert counts == {"fake": 1, "meta": 1}
    aotc.cache_flush()
    assert len(_entries(d)) == 1 and len(_families(d)) == 1
    assert _hit(assert_matches_eager(fn, _ARGS, cache_dir=d, capture="trace"))
