"""nn.Modules through aotc.compile: parameters and buffers as live graph inputs, train/eval,
training loops against eager, lifted closures and globals, recompiles."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import aotc
from tests.conftest import assert_matches_eager, assert_module_matches_eager


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


def test_batchnorm_train_updates_running_stats():
    compiled = assert_module_matches_eager(ConvBN, lambda: (torch.randn(4, 3, 7, 9),), steps=3)
    assert compiled.records[0].meta.inputs  # buffers were graph inputs
    mutated = [i for i in compiled.records[0].meta.inputs if i.mutation.has_data]
    assert len(mutated) == 3  # running_mean, running_var, num_batches_tracked


def test_eval_mode_switch_recompiles_and_matches():
    torch.manual_seed(0)
    model = ConvBN()
    ref = ConvBN()
    ref.load_state_dict(model.state_dict())
    compiled = aotc.compile(model)
    x = torch.randn(2, 3, 5, 5)
    compiled.train()
    ref.train()
    torch.testing.assert_close(compiled(x), ref(x))
    compiled.eval()
    ref.eval()
    assert not model.training
    torch.testing.assert_close(compiled(x), ref(x))
    assert len(compiled.records) == 2
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)


class TinyGPT(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


def test_gpt_block_training_loop():
    assert_module_matches_eager(TinyGPT, lambda: (torch.randn(3, 11, 32),), steps=3)


def test_module_shares_live_parameters():
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    compiled = aotc.compile(model)
    x = torch.randn(4, 5)
    compiled(x).sum().backward()
    assert model.weight.grad is not None  # gradients land on the original parameters
    with torch.no_grad():
        model.weight.mul_(2)  # an optimizer-style update outside
    torch.testing.assert_close(compiled(x), model(x))
    assert compiled.state_dict().keys() == model.state_dict().keys()
    assert [n for n, _ in compiled.named_parameters()] == ["weight", "bias"]
    assert compiled.in_features == 5
    model.weight = nn.Parameter(torch.randn(3, 5))  # rebinding is seen too
    torch.testing.assert_close(compiled(x), model(x))


def test_module_kwargs_and_dict_output():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *, scale=1.0, extra=None):
            h = self.lin(x) * scale
            return {"h": h, "pair": (h.sum(), extra)}

    torch.manual_seed(0)
    model = M()
    compiled = aotc.compile(model)
    x = torch.randn(2, 4)
    got = compiled(x, scale=2.0, extra=None)
    want = model(x, scale=2.0, extra=None)
    torch.testing.assert_close(got["h"], want["h"])
    assert got["pair"][1] is None


@dataclasses.dataclass
class ModelOutput:
    loss: torch.Tensor
    logits: torch.Tensor


def test_dataclass_model_output():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, y):
            logits = self.lin(x)
            return ModelOutput(loss=F.cross_entropy(logits, y), logits=logits)

    torch.manual_seed(0)
    model = M()
    compiled = aotc.compile(model)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    out = compiled(x, y)
    assert isinstance(out, ModelOutput)
    out.loss.backward()
    want = model(x, y)
    torch.testing.assert_close(out.loss, want.loss)


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor
    scale: float = 1.0
    steps: int = dataclasses.field(init=False, default=3)

    def __post_init__(self) -> None:
        self.scale = self.scale * 2  # rebuilt through the constructor, it would double again


@dataclasses.dataclass(frozen=True)
class _Config:
    act: str = "tanh"
    width: int = 2


@dataclasses.dataclass
class _Outer:
    batch: _Batch
    extra: list = dataclasses.field(default_factory=list)


@pytest.mark.parametrize("capture", ["trace", "dynamo"])
def test_dataclass_arguments_are_containers(capture):
    """Note [Dataclasses as pytree nodes]: a dataclass argument's tensors are inputs and its
    other attributes are keyed by value, including a field set after construction (init=False)
    and one `__post_init__` changed; outputs come back with the same attributes."""

    def f(outer, cfg):
        b = outer.batch
        h = getattr(torch, cfg.act)(b.x * b.scale) * b.steps + sum(t.sum() for t in outer.extra)
        loss = ((h - b.y) ** 2).sum() * cfg.width
        return _Batch(h, loss), loss

    compiled = aotc.compile(f, capture=capture)
    for scale, steps, cfg, extra in [
        (1.0, 3, _Config(), 1),
        (1.0, 5, _Config(), 1),
        (2.5, 5, _Config("sin", 3), 2),
    ]:
        x1 = torch.randn(4, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        y = torch.randn(4)
        extras = [torch.randn(2) for _ in range(extra)]
        b1, b2 = _Batch(x1, y, scale), _Batch(x2, y, scale)
        b1.steps = b2.steps = steps
        want_b, want = f(_Outer(b1, extras), cfg)
        got_b, got = compiled(_Outer(b2, extras), cfg)
        assert type(got_b) is _Batch
        assert (got_b.scale, got_b.steps) == (want_b.scale, want_b.steps)
        torch.testing.assert_close(got_b.x, want_b.x)
        torch.testing.assert_close(got, want)
        want.backward()
        got.backward()
        torch.testing.assert_close(x2.grad, x1.grad)


def test_plain_tensor_attribute_is_lifted():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = torch.tensor(2.0)  # not a buffer

        def forward(self, x):
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    model = M()
    compiled = aotc.compile(model)
    x = torch.randn(2, 3)
    torch.testing.assert_close(compiled(x), model(x))
    model.scale.fill_(5.0)  # later changes are seen, never baked in
    torch.testing.assert_close(compiled(x), model(x))


# ---------------------------------------------------------------- lifted closures and globals

GLOBAL_W = torch.randn(4, 4)


def uses_global(x):
    return x @ GLOBAL_W


def test_global_tensor_is_lifted_not_baked():
    global GLOBAL_W
    compiled = aotc.compile(uses_global)
    x = torch.randn(2, 4, requires_grad=True)
    torch.testing.assert_close(compiled(x), uses_global(x))
    GLOBAL_W.mul_(3)
    torch.testing.assert_close(compiled(x), uses_global(x))
    GLOBAL_W = torch.randn(4, 4)  # rebinding the name is seen
    torch.testing.assert_close(compiled(x), uses_global(x))


def test_closure_tensor_mutation_is_copied_back():
    counter = torch.zeros(())
    weight = torch.randn(3, requires_grad=True)

    def f(x):
        counter.add_(1)
        return x * weight

    compiled = aotc.compile(f)
    x = torch.randn(3)
    out = compiled(x)
    compiled(x)
    assert counter.item() == 2.0
    out.sum().backward()
    torch.testing.assert_close(weight.grad, x)


def test_closure_module_parameters_get_gradients():
    lin = nn.Linear(3, 2)

    def f(x):
        return lin(x).relu().sum()

    compiled = aotc.compile(f)
    compiled(torch.randn(4, 3)).backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None


def test_plain_object_attribute_is_lifted():
    class Holder:
        def __init__(self) -> None:
            self.t = torch.randn(3)

    holder = Holder()

    def f(x):
        return x * holder.t

    compiled = aotc.compile(f)
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), f(x))
    holder.t = torch.randn(3)  # rebinding the attribute is seen
    torch.testing.assert_close(compiled(x), f(x))


def helper():
    """A function object: aotc does not walk into functions' attributes."""


helper.table = torch.randn(3)  # a tensor hung on a function object: not walked


def test_unliftable_tensor_raises_clear_error():
    def f(x):
        return x * helper.table

    with pytest.raises(aotc.UnsupportedError, match="Pass it as an argument"):
        aotc.compile(f, capture="trace")(torch.randn(3))


# ---------------------------------------------------------------- recompiles


def test_new_shape_recompiles_and_matches():
    def f(x, w):
        return (x @ w).tanh()

    compiled = aotc.compile(f)
    for n in (3, 5, 3):
        assert_matches_eager(
            f,
            lambda n=n: (torch.randn(n, 4), torch.randn(4, 2, requires_grad=True)),
            compiled=compiled,
            runs=1,
        )
    assert len(compiled.records) == 2
    assert compiled.recompile_reasons


def test_recompile_warning_after_limit():
    compiled = aotc.compile(lambda x: x * 2, recompile_warn_limit=2, capture="trace")
    with pytest.warns(UserWarning, match="recompiled 2 times"):
        for n in range(1, 5):
            compiled(torch.randn(n))


def test_max_signatures_raises_guard_error():
    compiled = aotc.compile(
        lambda x: x + 1, max_signatures=2, recompile_warn_limit=100, capture="trace"
    )
    compiled(torch.randn(1))
    compiled(torch.randn(2))
    with pytest.raises(aotc.GuardError, match="max_signatures"):
        compiled(torch.randn(3))


def test_python_scalar_argument_is_guarded():
    def f(x, k):
        return x * k

    compiled = aotc.compile(f)
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x, 2), x * 2)
    torch.testing.assert_close(compiled(x, 3), x * 3)
    assert len(compiled.records) == 2


# ---------------------------------------------------------------- lifting through objects and optimizers


class MomentumSGD:
    """A plain-object optimizer: state in a dict keyed by the parameters."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        self.params = list(params)
        self.lr, self.momentum = lr, momentum
        self.state = {p: {"buf": torch.zeros_like(p)} for p in self.params}

    def step(self):
        with torch.no_grad():
            for p in self.params:
                buf = self.state[p]["buf"]
                buf.mul_(self.momentum).add_(p.grad)
                p.sub_(self.lr * buf)


def _train(model, opt_step, steps, data):
    losses = []
    for x, y in data[:steps]:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt_step()
        for p in model.parameters():
            p.grad = None
        losses.append(loss.detach())
    return losses


def test_plain_object_state_is_lifted_through_closure():
    import copy

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    opt, ref_opt = MomentumSGD(model.parameters()), MomentumSGD(ref.parameters())
    # MomentumSGD reads `p.grad` of a tensor reached through a plain object: lift it too.
    compiled_step = aotc.compile(lambda: opt.step())
    data = [(torch.randn(5, 4), torch.randn(5, 3)) for _ in range(4)]
    got = _train(model, compiled_step, 4, data)
    want = _train(ref, ref_opt.step, 4, data)
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["buf"], ref_opt.state[q]["buf"])


def test_torch_optim_sgd_step_is_lifted_and_matches_eager():
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    data = [(torch.randn(5, 4), torch.randn(5, 3)) for _ in range(5)]
    # The first step creates the momentum buffers (new state entries): run it eagerly.
    _train(model, opt.step, 1, data)
    _train(ref, ref_opt.step, 1, data)

    def step():
        opt.step()

    compiled_step = aotc.compile(step)
    got = _train(model, compiled_step, 4, data[1:])
    want = _train(ref, ref_opt.step, 4, data[1:])
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]
        )
    assert len(compiled_step.records) == 1  # one signature: steps 2..5 reuse it
    assert compiled_step.records[0].meta.inputs  # params, grads, buffers are graph inputs


def test_optimizer_first_step_creating_state_runs_eagerly_then_compiles():
    import copy

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    # Strict mode; the default mode: tests/e2e/test_capture_dynamo.py.
    compiled_step = aotc.compile(lambda: opt.step(), capture="trace")
    for _ in range(3):
        x = torch.randn(4, 3)
        model(x).sum().backward()
        ref(x).sum().backward()
        compiled_step()  # the first call creates the momentum buffers: it runs eagerly
        ref_opt.step()
        assert not any(isinstance(p, torch._subclasses.FakeTensor) for p in model.parameters())
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
            torch.testing.assert_close(
                opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]
            )
        opt.zero_grad()
        ref_opt.zero_grad()
    assert len(compiled_step.records) == 1  # compiled on the second call, reused on the third


def test_assigning_grad_inside_is_refused():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()

    def zero():
        opt.zero_grad(set_to_none=True)

    with pytest.raises(aotc.UnsupportedError, match="assigns .grad"):
        aotc.compile(zero, capture="trace")()  # the default mode runs it (test_capture_dynamo)
    assert model.weight.grad is not None


class TwoLayerLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1]), h  # c unused: its gradient is absent


@pytest.mark.parametrize("capture", ["trace", "dynamo"])
def test_lstm_trains_like_eager(capture):
    """Note [LSTM layers in a training trace]: the strict trace's backward needed a oneDNN
    workspace the traced layer never made (the input needs no gradient, the weights do)."""
    assert_module_matches_eager(TwoLayerLSTM, lambda: (torch.randn(3, 5, 4),), capture=capture)
    with torch.no_grad():  # an inference trace (keeps oneDNN's layer)
        model = TwoLayerLSTM()
        x = torch.randn(3, 5, 4)
        got = aotc.compile(model, capture=capture)(x)
        torch.testing.assert_close(got, model(x))


class CheckpointedBlocks(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.drop = nn.Dropout(p)
        self.b = nn.Linear(8, 4)

    def block(self, t):
        return self.b(self.drop(self.a(t).relu()))

    def forward(self, x):
        y = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(
            lambda t: self.block(t).tanh(), y, use_reentrant=False
        )


@pytest.mark.parametrize("capture", ["trace", "dynamo"])
def test_activation_checkpointing_trains_like_eager(capture):
    """Note [State during the traced backward]: the recomputation in the backward reads the
    module's parameters (strict mode read the real ones and refused)."""
    assert_module_matches_eager(
        CheckpointedBlocks, lambda: (torch.randn(5, 4, requires_grad=True),), capture=capture
    )


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_checkpointed_dropout_replays_eager(capture):
    """Note [Random ops the traced backward draws again]: eager's recomputation redraws the
    forward's dropout mask from a restored generator state; the compiled backward reuses the
    forward's draw (strict mode used to refuse it)."""
    assert_module_matches_eager(
        lambda: CheckpointedBlocks(0.25),
        lambda: (torch.randn(5, 4, requires_grad=True),),
        capture=capture,
    )


class DropoutEverywhere(nn.Module):
    """Draws before, inside (twice, with an in-place op on a cached value) and after two
    checkpointed regions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def region(self, lin, x, bias):
        scores = x @ lin.weight
        scores += bias  # an in-place op on a value selective checkpointing caches
        return F.dropout(scores.softmax(-1), 0.3) + torch.rand_like(x) * 0.1

    def forward(self, x, bias):
        x = F.dropout(x, 0.2)
        x = checkpoint(self.region, self.a, x, bias, use_reentrant=False)
        x = checkpoint(self.region, self.b, x, bias, use_reentrant=False)
        return F.dropout(x, 0.1)


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_random_draws_around_checkpointed_regions_match_eager(capture):
    """Outputs, gradients and the generator's state after the step all match eager's, over
    several steps (Note [Checkpoint caches under functionalization] for the in-place op)."""
    torch.manual_seed(0)
    model = DropoutEverywhere()
    twin = copy.deepcopy(model)
    compiled = aotc.compile(twin, capture=capture)
    for step in range(3):
        x, bias = torch.randn(4, 6, requires_grad=True), torch.randn(6)
        x2 = x.detach().clone().requires_grad_()
        torch.manual_seed(10 + step)
        want = model(x, bias)
        want.sum().backward()
        want_next = torch.rand(3)
        torch.manual_seed(10 + step)
        got = compiled(x2, bias)
        got.sum().backward()
        got_next = torch.rand(3)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_next, want_next, msg="generator state after the step")
        torch.testing.assert_close(x2.grad, x.grad)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
            p.grad = q.grad = None


def test_fork_rng_in_the_program_draws_the_same_numbers_again():
    """A draw after `fork_rng` restores the state repeats the draw made inside it, in eager;
    strict mode's graph reused a new draw (a silent difference before)."""

    def f(x):
        with torch.random.fork_rng():
            a = torch.rand(3)
        b = torch.rand(3)
        return x + a, b, torch.randn(2)

    compiled = aotc.compile(f, capture="trace")
    x = torch.randn(3)
    for seed in range(2):
        torch.manual_seed(seed)
        want = f(x)
        want_next = torch.rand(2)
        torch.manual_seed(seed)
        got = compiled(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.rand(2), want_next)


def test_checkpoint_without_preserved_rng_state_is_refused_in_strict_mode():
    """The recomputation draws new numbers in eager (`preserve_rng_state=False`) from the
    generator as the backward finds it; the compiled backward cannot follow that."""
    model = CheckpointedBlocks(0.25)

    def f(x):
        return checkpoint(model.block, x, use_reentrant=False, preserve_rng_state=False).sum()

    with pytest.raises(aotc.UnsupportedError, match="random op .*generator state"):
        aotc.compile(f, capture="trace")(torch.randn(5, 4, requires_grad=True))


def test_attention_without_dropout_in_a_checkpoint_is_not_a_random_draw():
    """`scaled_dot_product_attention` is tagged random; with dropout_p=0 it draws nothing, so
    recomputing it in the backward (Llama with gradient checkpointing) is not refused."""

    def block(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).relu()

    def f(q):
        return checkpoint(block, q, use_reentrant=False).sum()

    q = torch.randn(2, 2, 5, 8, requires_grad=True)
    q2 = q.detach().clone().requires_grad_()
    f(q).backward()
    aotc.compile(f, capture="trace")(q2).backward()
    torch.testing.assert_close(q2.grad, q.grad)


def _region(x, w, bias):
    scores = x @ w
    scores += bias
    return F.dropout(scores.softmax(-1), 0.3)


def _two_regions(x, bias, wa, wb):
    x = checkpoint(_region, x, wa, bias, use_reentrant=False)
    return checkpoint(_region, x, wb, bias, use_reentrant=False)


def test_checkpointed_regions_of_a_graph_run_eagerly_keep_eager_rng():
    """Note [Checkpointed regions of a graph run eagerly]: Dynamo's checkpoint operator run as
    is turns `preserve_rng_state` off (torch.compile(backend="eager") gets other gradients);
    the graph aotc runs eagerly after a refusal uses eager's checkpoint."""
    from aotc.eagergraph import eager_graph

    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm

    x, bias = torch.randn(4, 6), torch.randn(6)
    wa, wb = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(_two_regions, backend=grab, fullgraph=True)(x, bias, wa, wb)
    (gm,) = graphs
    hop = torch.ops.higher_order.tag_activation_checkpoint
    assert sum(n.target is hop for n in gm.graph.nodes) == 2
    run = eager_graph(gm)
    assert not any(n.target is hop for n in run.graph.nodes)
    torch.manual_seed(3)
    want = _two_regions(x, bias, wa, wb)
    want_grads = torch.autograd.grad(want.sum(), [wa, wb])
    torch.manual_seed(3)
    given = {"x": x, "bias": bias, "wa": wa, "wb": wb}
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]  # e.g. L_wa_
    (got,) = run(*(given[name[2:-1]] for name in names))
    got_grads = torch.autograd.grad(got.sum(), [wa, wb])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grads, want_grads)


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_deepcopy_and_save_of_a_compiled_module(capture):
    import copy
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    compiled = aotc.compile(model, capture=capture)
    x = torch.randn(5, 4)
    compiled(x)
    ema = copy.deepcopy(compiled)  # the usual EMA copy of a training model
    assert type(ema) is type(compiled)
    assert all(p is not q for p, q in zip(ema.parameters(), model.parameters()))
    torch.testing.assert_close(ema(x), model(x))
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)  # the copy's state is its own
    assert not torch.allclose(ema(x), model(x))
    buf = io.BytesIO()
    torch.save(compiled, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), model(x))
    loaded(x).sum().backward()
    assert all(p.grad is not None for p in loaded.parameters())


class _Reversible(torch.autograd.Function):
    """A reversible layer's pattern: the backward recomputes and calls .backward() itself,
    accumulating into the layer's parameters."""

    @staticmethod
    def forward(ctx, x, lin):
        ctx.lin = lin
        ctx.save_for_backward(x)
        with torch.no_grad():
            return lin(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            ctx.lin(x).backward(grad)
        return x.grad, None


def test_a_backward_inside_the_backward_is_refused_in_strict_mode_with_the_reason():
    lin = nn.Linear(3, 3)

    def reentrant(x):
        return checkpoint(lin, x, use_reentrant=True).sum()

    def reversible(x):
        return _Reversible.apply(x, lin).sum()

    for fn in (reentrant, reversible):
        x = torch.randn(2, 3, requires_grad=True)
        with pytest.raises(aotc.UnsupportedError, match="runs autograd inside a backward") as e:
            aotc.compile(fn, capture="trace")(x).backward()
        assert "<string>" not in str(e.value)  # not make_fx's generated wrapper as the line
        want = fn(x)  # the default mode runs them as eager does
        want.backward()
        want_grad, x.grad = x.grad, None
        want_w, lin.weight.grad = lin.weight.grad, None
        torch._dynamo.reset()
        aotc.compile(fn)(x).backward()
        torch.testing.assert_close(x.grad, want_grad)
        torch.testing.assert_close(lin.weight.grad, want_w)
        lin.weight.grad = lin.bias.grad = None


class _GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):  # type: ignore[no-untyped-def]
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g.neg() * ctx.alpha, None


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g * 3


class _TwoViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x[0], x[1]  # views recorded as a multi-output node's

    @staticmethod
    def backward(ctx, a, b):  # type: ignore[no-untyped-def]
        return torch.stack([a * 2, b * 3])


class _NonDifferentiableView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        v = x.view(-1)
        ctx.mark_non_differentiable(v)
        return v, x * 2

    @staticmethod
    def backward(ctx, gv, g):  # type: ignore[no-untyped-def]
        return g * 2


def _grl_of_input(x):
    return _GradReverse.apply(x, 0.5)


def _two_views_of_input(x):
    return _TwoViews.apply(x)


def _non_differentiable_view(x):
    v, y = _NonDifferentiableView.apply(x)
    return v.detach(), y


def _identity_of_input(x):
    return _Identity.apply(x), x.sin()


def _grl_of_returned_intermediate(x, w):
    f = x @ w
    return f, _GradReverse.apply(f, 0.25)


def _view_of_grl_output(x):
    return _GradReverse.apply(x, 0.5)[1:]  # a select's node, the Function's creation record


def _grl_of_hidden_intermediate(x, w):
    return _GradReverse.apply((x @ w).tanh(), 2.0)


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
@pytest.mark.parametrize(
    "fn",
    [
        _grl_of_input,
        _identity_of_input,
        _grl_of_returned_intermediate,
        _view_of_grl_output,
        _two_views_of_input,
        _non_differentiable_view,
    ],
)
def test_views_a_custom_function_returns_keep_its_backward(fn, capture):
    """Note [Views a custom Function returns]: a gradient reversal layer's output is a view of
    its input whose gradient goes through the Function's backward. aotc regenerated it as a plain
    view, and the reversal was lost (wrong gradients, silently); now the view shares the base's
    storage as in eager and its gradient goes through the compiled backward."""
    import inspect

    n = len(inspect.signature(fn).parameters)

    def make():
        return (torch.randn(2, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True))[:n]

    assert_matches_eager(fn, make, capture=capture)


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_view_a_custom_function_returns_of_a_hidden_intermediate(capture):
    """The base is an intermediate the call does not return: the output is the graph's own
    tensor (its `_base` is not eager's), with the Function's gradient."""
    compiled = aotc.compile(_grl_of_hidden_intermediate, capture=capture)
    for _ in range(2):
        x1, w1 = torch.randn(2, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
        x2, w2 = x1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
        want, got = _grl_of_hidden_intermediate(x1, w1), compiled(x2, w2)
        torch.testing.assert_close(got, want)
        (want * torch.arange(3.0)).sum().backward()
        (got * torch.arange(3.0)).sum().backward()
        torch.testing.assert_close(x2.grad, x1.grad)
        torch.testing.assert_close(w2.grad, w1.grad)


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_view_a_custom_function_returns_refuses_in_place_writes_as_in_eager(capture):
    compiled = aotc.compile(_grl_of_input, capture=capture)
    x = torch.randn(3, requires_grad=True)
    y = compiled(x)
    assert y._base is x and y.data_ptr() == x.data_ptr()
    (y * torch.arange(3.0)).sum().backward()
    torch.testing.assert_close(x.grad, -0.5 * torch.arange(3.0))
    with pytest.raises(RuntimeError, match="custom Function"):
        y.add_(1)
    with torch.no_grad():
        x.mul_(2)
    torch.testing.assert_close(y.detach(), x.detach())


@pytest.mark.parametrize("capture", ["dynamo", "trace"])
def test_view_a_custom_function_marks_non_differentiable(capture):
    """Eager's non-differentiable view of an input requires grad yet has no node: not a view to
    make again with the Function's gradient (its trace failed when it was taken for one)."""
    compiled = aotc.compile(_NonDifferentiableView.apply, capture=capture)
    x1 = torch.randn(2, 3, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    (v1, y1), (v2, y2) = _NonDifferentiableView.apply(x1), compiled(x2)
    torch.testing.assert_close(v2, v1)
    assert (v2.requires_grad, v2.grad_fn is None) == (v1.requires_grad, v1.grad_fn is None)
    y1.sum().backward()
    y2.sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad)
