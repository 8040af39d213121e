"""Outputs computed from other outputs, and independent outputs: one autograd node per segment.

Each test runs a program eagerly and through aotc (strict capture, the default Dynamo capture,
torch.compile's backend) on identical fresh random inputs, and compares what eager's node
boundaries decide: hooks and `.grad` of returned tensors other outputs are computed from,
`autograd.grad` with respect to such outputs, and separate backwards through independent outputs
without `retain_graph`. See Note [Segments] in passes/segments.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import aotc
from tests.triton_helpers import DEVICES

MODES = ("trace", "default", "torch_compile")


def compiled(fn: Any, mode: str) -> Any:
    torch._dynamo.reset()
    if mode == "trace":
        return aotc.compile(fn, capture="trace", cache=False)
    if mode == "default":
        return aotc.compile(fn, cache=False)
    return torch.compile(fn, backend="aotc")


def same(a: object, b: object) -> None:
    if a is None or b is None:
        assert a is None and b is None, (a, b)
        return
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def segments_of(fn: Any) -> int:
    """How many autograd nodes the (strict) entry creates per call."""
    (record,) = aotc.inspect(fn)
    return len(record.program.segments)


def cold_and_warm(script: str, cache_dir: Any, segments: str) -> tuple[list[str], list[str]]:
    """Runs `script` in two fresh processes sharing `cache_dir`; each prints `hit segments rest`
    last. Checks a miss then a hit, both with `segments` nodes; returns each run's fields."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, AOTC_CACHE_DIR=str(cache_dir), PYTHONPATH=root)
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
        ).stdout.split("\n")[-2]
        for _ in range(2)
    ]
    cold, warm = (r.split(" ", 2) for r in runs)
    assert cold[0] == "False" and warm[0] == "True", runs
    assert cold[1] == warm[1] == segments
    return cold, warm


def chained(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x * 2
    return y, y.sin()


@pytest.mark.parametrize("mode", MODES)
def test_hook_on_an_output_another_output_is_computed_from(mode: str) -> None:
    """The hook sees, and changes, the whole gradient at `y`: its own and the one from `z`."""
    fn = compiled(chained, mode)
    x = torch.randn(5)
    results = []
    for run in (chained, fn):
        xi = x.clone().requires_grad_()
        seen: list[torch.Tensor] = []
        y, z = run(xi)
        y.register_hook(lambda g: seen.append(g.clone()) or g * 10)
        (y.sum() + z.sum()).backward()
        results.append((xi.grad, seen[0]))
    (want, want_seen), (got, got_seen) = results
    same(got_seen, want_seen)
    same(got, want)
    if mode == "trace":
        assert segments_of(fn) == 2


@pytest.mark.parametrize("mode", MODES)
def test_retain_grad_and_autograd_grad_of_an_output(mode: str) -> None:
    fn = compiled(chained, mode)
    x = torch.randn(4)
    want: list[Any] = []
    got: list[Any] = []
    for run, into in ((chained, want), (fn, got)):
        xi = x.clone().requires_grad_()
        y, z = run(xi)
        y.retain_grad()
        (y * 3 + z).sum().backward(retain_graph=True)
        into.append(y.grad)
        into.append(torch.autograd.grad(z.sum(), y, retain_graph=True)[0])
        into.append(torch.autograd.grad(z.sum(), [y, xi], allow_unused=True))
        into.append(xi.grad)
    for a, b in zip(got, want):
        if isinstance(a, tuple):
            for u, v in zip(a, b):
                same(u, v)
        else:
            same(a, b)


class Classifier(torch.nn.Module):
    """Returns its features and the logits computed from them (Grad-CAM's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = F.relu(self.conv(x))
        return feats, self.head(feats.mean((2, 3)))


@pytest.mark.parametrize("mode", MODES)
def test_grad_cam_hook_on_returned_features(mode: str) -> None:
    torch.manual_seed(0)
    model = Classifier()
    fn = compiled(model, mode)
    x = torch.randn(2, 3, 6, 6)
    results = []
    for run in (model, fn):
        model.zero_grad(set_to_none=True)
        grads: list[torch.Tensor] = []
        feats, logits = run(x)
        feats.register_hook(grads.append)
        logits[0, logits[0].argmax()].backward()
        results.append((grads[0], model.conv.weight.grad, model.head.weight.grad))
    for a, b in zip(*results):
        same(a, b)


VIEWS = {
    "view": lambda h: h.view(h.shape),
    "flatten": lambda h: h.flatten(0),
    "transpose": lambda h: h.t(),
    "select": lambda h: h[0],
    "slice": lambda h: h[:, 1:],
    "chain": lambda h: h.t()[1:],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_view_output_other_outputs_are_computed_from(mode: str, view: str) -> None:
    """GPT-2 returns `hidden.view(shape)` and computes the logits from it: the view's hook sees
    (and rescales) the gradient from the logits too, and `.grad`/`autograd.grad` at it are
    eager's (Note [Views other outputs are computed from] in passes/segments.py)."""
    make = VIEWS[view]

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(x @ w)
        v = make(h)
        return v, (v * v.cos()).sum()

    fn = compiled(f, mode)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    results = []
    for run in (f, fn, fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        v, loss = run(xi, wi)
        assert v._is_view()
        seen: list[torch.Tensor] = []
        v.register_hook(lambda g: seen.append(g) or g * 3)
        v.retain_grad()
        (ag,) = torch.autograd.grad(loss, v, retain_graph=True)
        (loss + v.sum()).backward()
        results.append((ag, seen[-1], v.grad, xi.grad, wi.grad))
    for a, b in zip(results[0], results[2]):
        same(a, b)
    if mode == "trace":
        assert segments_of(fn) == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_view_of_an_input_other_outputs_are_computed_from(mode: str) -> None:
    """`flat = x.flatten(1)` returned next to a loss computed from it: the view is regenerated
    from the input before the node runs and handed to it, so its hook and `.grad` see the
    loss's gradient, and the hook's rescaling reaches `x.grad`."""

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.flatten(1)
        return flat, (flat @ w).tanh().sum()

    fn = compiled(f, mode)
    x, w = torch.randn(2, 3, 2), torch.randn(6, 2)
    results = []
    for run in (f, fn, fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        flat, loss = run(xi, wi)
        assert flat._base is xi
        flat.retain_grad()
        flat.register_hook(lambda g: g * 3)
        (loss + flat.sum()).backward()
        results.append((flat.grad, xi.grad, wi.grad))
    for a, b in zip(results[0], results[2]):
        same(a, b)
    if mode == "trace":
        assert segments_of(fn) == 1


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_a_view_of_a_returned_output_other_outputs_are_computed_from(mode: str) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = x.exp()
        v = y.view(-1)
        return y, v, v.sin().sum()

    fn = compiled(f, mode)
    x = torch.randn(2, 3)
    results = []
    for run in (f, fn):
        xi = x.clone().requires_grad_()
        y, v, s = run(xi)
        assert v._base is y
        y.retain_grad()
        v.retain_grad()
        v.register_hook(lambda g: g * 2)
        (s + y.sum()).backward()
        results.append((y.grad, v.grad, xi.grad))
    for a, b in zip(*results):
        same(a, b)


def test_a_view_of_a_returned_view_keeps_eager_gradients() -> None:
    """`v2 = v1[0]`, both returned, the loss computed from v2: the runtime regenerates each view
    from the base, not v2 from v1, so the call keeps one node; its gradients are still eager's."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = x.tanh()
        v1 = h.t()
        v2 = v1[0]
        return v1, v2, v2.exp().sum()

    fn = compiled(f, "trace")
    x = torch.randn(3, 2)
    results = []
    for run in (f, fn):
        xi = x.clone().requires_grad_()
        v1, v2, s = run(xi)
        (s + v1.sum() * 2).backward()
        results.append(xi.grad)
    same(results[1], results[0])


W4 = torch.randn(4, 4) * 0.5


def attention_probs(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Pre-LN attention returning its probabilities (HF output_attentions=True): the probs and
    the output are both computed from the hidden normalized input."""
    h = F.layer_norm(x, (4,), g)
    p = torch.softmax(h @ w @ h.t(), -1)
    y = x + p @ (h @ w)
    return p, y, y.pow(2).mean()


def shared_bias(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """T5: one bias, computed once and not returned, added in every layer."""
    bias = b.sum(0)
    f = torch.tanh(x @ w + bias)
    h2 = torch.tanh(f @ w + bias)
    return f, h2, h2.pow(2).mean()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("program", (attention_probs, shared_bias), ids=lambda p: p.__name__)
def test_a_boundary_at_a_value_the_call_does_not_return(mode: str, program: Any) -> None:
    """A hook rescaling the first output's gradient changes the parameters' gradients as in
    eager: the later segments' gradient reaches it through the hidden value's node (Note
    [Hidden segment boundaries] in passes/segments.py)."""
    fn = compiled(program, mode)
    x, w, third = torch.randn(5, 4), torch.randn(4, 4), torch.randn(3, 4) + 1
    if program is attention_probs:
        third = third[0]
    results = []
    for run in (program, fn, fn):
        wi, ti = w.clone().requires_grad_(), third.clone().requires_grad_()
        outs = run(x, wi, ti)
        first, loss = outs[0], outs[-1]
        seen: list[torch.Tensor] = []
        first.register_hook(lambda g: seen.append(g) or g * 3)
        first.retain_grad()
        loss.backward()
        results.append((seen[-1], first.grad, wi.grad, ti.grad))
    for a, b in zip(results[0], results[2]):
        same(a, b)
    if mode == "trace":
        assert segments_of(fn) == 3


def split_attention(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GPT-2's attention: query, key and value are one projection split in three; the
    probabilities (returned) come from query and key, the output from them and value, a view
    the call does not return."""
    q, k, v = (x @ w).split(4, dim=-1)
    p = torch.softmax(q @ k.transpose(-1, -2), -1)
    y = x[..., :4] + p @ v
    return p, y, y.pow(2).mean()


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_a_hidden_boundary_that_is_a_view(mode: str) -> None:
    fn = compiled(split_attention, mode)
    x, w = torch.randn(5, 4), torch.randn(4, 12)
    results = []
    for run in (split_attention, fn, fn):
        wi = w.clone().requires_grad_()
        p, _, loss = run(x, wi)
        p.retain_grad()
        p.register_hook(lambda g: g * 3)
        loss.backward()
        results.append((p.grad, wi.grad))
    for a, b in zip(results[0], results[2]):
        same(a, b)
    if mode == "trace":
        assert segments_of(fn) == 3


@pytest.mark.parametrize("program", (shared_bias, split_attention), ids=lambda p: p.__name__)
def test_segments_with_dynamic_sizes(program: Any) -> None:
    """Saved sizes (`dynamic=True`) go with the segment that reads them; a second size runs
    the same entry."""
    fn = aotc.compile(program, capture="trace", cache=False, dynamic=True)
    for n in (3, 6):
        x, w = torch.randn(n, 4), torch.randn(4, 12 if program is split_attention else 4)
        extra = (torch.randn(3, 4, requires_grad=True),) if program is shared_bias else ()
        results = []
        for run in (program, fn):
            wi = w.clone().requires_grad_()
            outs = run(x, wi, *extra)
            outs[0].register_hook(lambda g: g * 3)
            outs[-1].backward()
            results.append(wi.grad)
        same(results[1], results[0])
    (record,) = aotc.inspect(fn)
    assert len(record.program.segments) == 3
    if program is shared_bias:  # the bias's gradient expands to a saved size
        assert record.program.plan.autograd.num_saved_symints > 0


def test_a_hidden_boundary_from_the_disk_cache_and_export(tmp_path: Any) -> None:
    """The hidden value is a forward output of the stored graphs: a cache hit (a fresh process)
    and an exported artifact create the same nodes, with eager's gradients."""
    import textwrap

    script = textwrap.dedent(
        """
        import torch, aotc
        from tests.e2e.test_segments import shared_bias
        fn = aotc.compile(shared_bias, capture="trace")
        x, w = torch.linspace(-1, 1, 20).reshape(5, 4), torch.eye(4, requires_grad=True)
        f, _, loss = fn(x, w, torch.ones(3, 4))
        f.register_hook(lambda g: g * 2)
        loss.backward()
        (rec,) = aotc.inspect(fn)
        aotc.cache_flush()
        print(rec.is_cache_hit, len(rec.program.segments), w.grad.flatten().tolist())
        """
    )
    cold, warm = cold_and_warm(script, tmp_path / "cache", "3")

    def grads(run: Any) -> torch.Tensor:
        x, w = torch.linspace(-1, 1, 20).reshape(5, 4), torch.eye(4, requires_grad=True)
        f, _, loss = run(x, w, torch.ones(3, 4))
        f.register_hook(lambda g: g * 2)
        loss.backward()
        assert w.grad is not None
        return w.grad.flatten()

    want = grads(shared_bias)
    same(torch.tensor(eval(cold[2])), want)  # noqa: S307 - our own subprocess's list of floats
    same(torch.tensor(eval(warm[2])), want)  # noqa: S307
    path = aotc.export(
        shared_bias, torch.randn(5, 4), torch.randn(4, 4, requires_grad=True), torch.randn(3, 4),
        path=tmp_path / "art",
    )  # fmt: skip
    same(grads(aotc.load(path)), want)


class NormedClassifier(torch.nn.Module):
    """A BatchNorm in training mode writes its running statistics (under no_grad, in eager)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = F.relu(self.bn(self.conv(x)))
        return feats, self.head(feats.mean((2, 3)))


@pytest.mark.parametrize("mode", MODES)
def test_grad_cam_through_batch_norm_updates_running_stats(mode: str) -> None:
    """Writes eager records no history for keep the segments: the retained features' `.grad`
    is eager's whole gradient, and the buffers get eager's new values and versions."""
    torch.manual_seed(0)
    model = NormedClassifier()
    twin = NormedClassifier()
    twin.load_state_dict(model.state_dict())
    fn = compiled(twin, mode)
    results = []
    for run, m in ((model, model), (fn, twin)):
        torch.manual_seed(1)
        x = torch.randn(2, 3, 6, 6)
        before = m.bn.running_mean._version
        feats, logits = run(x)
        feats.retain_grad()
        logits[:, 0].sum().backward()
        results.append(
            (
                feats.grad,
                m.conv.weight.grad,
                m.bn.weight.grad,
                m.bn.running_mean.clone(),
                m.bn.running_var.clone(),
                m.bn.num_batches_tracked.clone(),
                torch.tensor(m.bn.running_mean._version - before),
            )
        )
    for a, b in zip(*results):
        same(a, b)
    if mode == "trace":
        assert segments_of(fn) == 2


def test_a_write_with_history_keeps_one_node() -> None:
    """An input written with autograd history: its epilogue's write is part of the node, so the
    call keeps one node."""

    def f(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = a.sum()
        a.mul_(2)
        return s, s.tanh()

    fn = compiled(f, "trace")
    x = torch.randn(3, requires_grad=True)
    results = []
    for run in (f, fn):
        a = x * 1.0
        s, t = run(a)
        (a.sum() + s + t).backward()
        results.append(x.grad.clone())
        x.grad = None
    same(results[1], results[0])
    assert segments_of(fn) == 0


def independent(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x @ w).sigmoid(), x * 2


@pytest.mark.parametrize("mode", MODES)
def test_separate_backwards_through_independent_outputs(mode: str) -> None:
    """Eager frees each node's saved values after its backward: the two outputs share none."""
    fn = compiled(independent, mode)
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    results = []
    for run in (independent, fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        a, b = run(xi, wi)
        a.sum().backward()
        first = xi.grad.clone()
        b.sum().backward()
        results.append((first, xi.grad, wi.grad))
    for a, b in zip(*results):
        same(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_runs_only_the_nodes_its_output_is_computed_from(mode: str) -> None:
    """`x0 = randn * 1.0` keeps its multiplication's node, which a backward frees; the first
    output is not computed from `x0`, so its backward must not run that node, or the later
    backward from `x0.abs()` raises (Note [Edges of a segment node] in runtime/segments.py)."""

    def f(a0: torch.Tensor, a1: torch.Tensor) -> tuple[torch.Tensor, ...]:
        v1 = a1[0] - a1[0]
        return torch.sigmoid(v1), v1[-1], a0.abs()

    fn = compiled(f, mode)
    results = []
    for run in (f, fn, fn):
        torch.manual_seed(0)
        x0 = torch.randn(4, 1, requires_grad=True)
        x1 = torch.randn(1, 3, requires_grad=True)
        outs = run(x0 * 1.0, x1)
        for o in outs:
            o.sum().backward()
        results.append((x0.grad, x1.grad))
    for a, b in zip(results[0], results[2]):
        same(a, b)


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_second_backward_through_a_shared_saved_value_raises_as_in_eager(mode: str) -> None:
    """Both outputs are computed from one node that saves its input: eager refuses the second
    backward, and so does aotc."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.exp()
        return h * 2, h * 3

    fn = compiled(f, mode)
    for run in (f, fn):
        a, b = run(torch.randn(3, requires_grad=True))
        a.sum().backward()
        with pytest.raises(RuntimeError, match="second time"):
            b.sum().backward()


def hidden_states(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h1 = torch.tanh(x @ w)
    h2 = torch.tanh(h1 @ w) + h1
    h3 = torch.tanh(h2 @ w) + h2
    return h1, h2, h3, (h3 * h3).mean()


@pytest.mark.parametrize("mode", MODES)
def test_retained_hidden_states(mode: str) -> None:
    """A chain of returned hidden states (`output_hidden_states=True`): each state's `.grad`
    holds the whole gradient of the loss."""
    fn = compiled(hidden_states, mode)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    results = []
    for run in (hidden_states, fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        *hs, loss = run(xi, wi)
        for h in hs:
            h.retain_grad()
        loss.backward()
        results.append([h.grad for h in hs] + [xi.grad, wi.grad])
    for a, b in zip(*results):
        same(a, b)
    if mode == "trace":
        assert segments_of(fn) == 4


@pytest.mark.parametrize("mode", MODES)
def test_only_some_outputs_get_gradients(mode: str) -> None:
    """None stays None: an input only an unused output depends on gets no gradient."""

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = x * w
        return y, y.cos(), w.sqrt()

    fn = compiled(f, mode)
    x, w = torch.randn(4), torch.rand(4) + 0.5
    for pick in ((0,), (1,), (2,), (0, 1), (1, 2)):
        results = []
        for run in (f, fn):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            outs = run(xi, wi)
            sum(outs[i].sum() for i in pick).backward()
            results.append((xi.grad, wi.grad))
        for a, b in zip(*results):
            same(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_double_backward_through_segments(mode: str) -> None:
    fn = compiled(chained, mode)
    x = torch.randn(4)
    results = []
    for run in (chained, fn):
        xi = x.clone().requires_grad_()
        y, z = run(xi)
        (g,) = torch.autograd.grad((y * y).sum() + z.sum(), xi, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), xi)
        results.append((g.detach(), gg))
    for a, b in zip(*results):
        same(a, b)


def test_a_hidden_boundary_keeps_one_node() -> None:
    """Two outputs computed from a hidden shared value: eager's boundary is a tensor the call
    does not return, so the call keeps one node (and its gradients are eager's)."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.exp()
        return h.sin(), h.cos()

    fn = compiled(f, "trace")
    x = torch.randn(3)
    results = []
    for run in (f, fn):
        xi = x.clone().requires_grad_()
        a, b = run(xi)
        (a.sum() + 2 * b.sum()).backward()
        results.append(xi.grad)
    same(results[1], results[0])
    assert segments_of(fn) == 0


def test_single_output_without_saved_values_runs_two_backwards() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    fn = compiled(f, "trace")
    results = []
    for run in (f, fn):
        x = torch.ones(2, 2, requires_grad=True)
        out = run(x)
        out[0].sum().backward()
        out[1].sum().backward()
        results.append(x.grad)
    same(results[1], results[0])


@pytest.mark.parametrize("mode", ("trace", "default"))
def test_dropout_in_segments(mode: str) -> None:
    """Random ops run once, in the one forward graph; the segment nodes share its draws."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.dropout(x * 2, 0.5, training=True)
        return y, (y * y).sum()

    fn = compiled(f, mode)
    x = torch.randn(16)
    results = []
    for run in (f, fn):
        torch.manual_seed(3)
        xi = x.clone().requires_grad_()
        y, s = run(xi)
        y.retain_grad()
        (s + y.sum()).backward()
        results.append((y.detach(), y.grad, xi.grad, torch.rand(1)))
    for a, b in zip(*results):
        same(a, b)


def test_segmented_entry_from_the_disk_cache(tmp_path: Any) -> None:
    """A cache hit runs the stored segments (same nodes, same gradients)."""
    import textwrap

    script = textwrap.dedent(
        """
        import sys, torch, aotc
        def f(x):
            y = x * 2
            return y, y.sin()
        fn = aotc.compile(f, capture="trace")
        x = torch.linspace(-1, 1, 5, requires_grad=True)
        y, z = fn(x)
        y.register_hook(lambda g: g * 10)
        (y.sum() + z.sum()).backward()
        (rec,) = aotc.inspect(fn)
        aotc.cache_flush()
        print(rec.is_cache_hit, len(rec.program.segments), x.grad.tolist())
        """
    )
    cold, warm = cold_and_warm(script, tmp_path, "2")
    x = torch.linspace(-1, 1, 5, requires_grad=True)
    y, z = chained(x)
    y.register_hook(lambda g: g * 10)
    (y.sum() + z.sum()).backward()
    want = torch.tensor(eval(cold[2]))  # noqa: S307 - our own subprocess's list of floats
    same(torch.tensor(eval(warm[2])), want)  # noqa: S307
    same(want, x.grad)


def test_exported_segments_load_and_match(tmp_path: Any) -> None:
    x = torch.randn(5, requires_grad=True)
    path = aotc.export(chained, x, path=tmp_path / "art")
    loaded = aotc.load(path)
    results = []
    for run in (chained, loaded):
        xi = x.detach().clone().requires_grad_()
        y, z = run(xi)
        y.register_hook(lambda g: g * 10)
        (y.sum() + z.sum()).backward()
        results.append(xi.grad)
    same(results[1], results[0])


@pytest.mark.parametrize("device", DEVICES)
def test_segment_backwards_run_generated_kernels(device: str, tmp_path: Any) -> None:
    """With the Triton backend each segment's backward is lowered to kernels of its own; a disk
    cache hit lowers them again from the stored decomposed graphs, and an export carries them."""

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = (x @ w).tanh()
        return y, (y * y).sin().sum()

    def run(fn: Any, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, s = fn(xi, wi)
        y.retain_grad()
        (s + 2 * y.sum()).backward()
        return [y.detach(), s.detach(), y.grad, xi.grad, wi.grad]

    x, w = torch.randn(4, 8, device=device), torch.randn(8, 8, device=device)
    want = run(f, x, w)
    options = dict(capture="trace", backend="triton", cache_dir=str(tmp_path / "cache"))
    cold = aotc.compile(f, **options)
    got = run(cold, x, w)
    (record,) = aotc.inspect(cold)
    assert len(record.program.segments) == 2
    assert all(seg.backward_kernels is not None for seg in record.program.segments)
    aotc.cache_flush()
    warm = aotc.compile(f, **options)
    hit = run(warm, x, w)
    assert aotc.inspect(warm)[0].is_cache_hit
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    loaded = aotc.load(aotc.export(f, xr, wr, path=tmp_path / "art", backend="triton"))
    exported = run(loaded, x, w)
    for results in (got, hit, exported):
        for a, b in zip(results, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_consumed_output_is_not_kept_alive() -> None:
    """The node that takes `logits` keeps only what its backward needs (and the graph args for a
    double backward): dropping `logits` frees it before the backward, as in eager."""
    import gc
    import weakref

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x @ w
        return logits, (logits * 2).sum()

    fn = compiled(f, "trace")
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    alive = []
    for run in (f, fn):
        logits, loss = run(x, w)
        ref = weakref.ref(logits)
        del logits
        gc.collect()
        alive.append(ref() is not None)
        loss.backward()
    assert alive == [False, False]
    assert segments_of(fn) == 2
