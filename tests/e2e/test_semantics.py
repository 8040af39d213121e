"""Differential tests against eager for every category of the core pipeline: plain functions,
pytrees, input mutations, aliased outputs, duplicate and aliased inputs, grad mode, inference."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_matches_eager


def leaf(*shape: int, rg: bool = True) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=rg)


def nonleaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True) * 1.0


# ---------------------------------------------------------------- plain functions and pytrees


def test_pointwise_chain():
    def f(x, y):
        return ((x * y).sin() + y.exp()).tanh() * 2

    assert_matches_eager(f, lambda: (leaf(11, 7), leaf(11, 7)))


def test_mlp():
    def mlp(w1, w2, x):
        return (x @ w1).relu() @ w2

    assert_matches_eager(mlp, lambda: (leaf(31, 16), leaf(16, 5), torch.randn(23, 31)))


def test_pytree_inputs_and_outputs():
    def f(inputs, scale, flag, missing):
        a, b = inputs["a"], inputs["pair"][1]
        out = a * scale + b
        return {"out": out, "both": (out.sum(), a.mean()), "flag": flag, "none": missing, "n": 3}

    assert_matches_eager(
        f, lambda: ({"a": leaf(4, 3), "pair": [leaf(3), leaf(4, 3)]}, 2.5, True, None)
    )


def test_kwargs():
    def f(x, *, alpha=1.0, bias=None):
        return x * alpha + bias

    assert_matches_eager(f, lambda: (leaf(5), {"alpha": 3.0, "bias": leaf(5)}))


def test_non_contiguous_and_broadcast_inputs():
    def f(x, y):
        return x * y + x.t().sum(0, keepdim=True).t()

    assert_matches_eager(f, lambda: (leaf(9, 6).t(), leaf(1, 9)))


def test_integer_and_bool_outputs():
    def f(x):
        return x.argmax(-1), x > 0, x.sum()

    assert_matches_eager(f, lambda: (leaf(6, 5),))


def test_output_not_requiring_grad_and_detach():
    def f(x, y):
        return x.detach() * 2, x * y, y + 1

    assert_matches_eager(f, lambda: (leaf(4), leaf(4, rg=False)))


# ---------------------------------------------------------------- input mutations


def test_data_mutation_of_input_not_requiring_grad():
    def f(x, buf):
        buf.add_(x.detach())
        return x * buf

    assert_matches_eager(f, lambda: (leaf(5, 3), torch.randn(5, 3)))


def test_data_mutation_of_nonleaf_requiring_grad():
    def f(x, y):
        x.mul_(y)
        return x.sin()

    assert_matches_eager(f, lambda: (nonleaf(4, 4), leaf(4, 4)))


def test_mutation_makes_input_require_grad():
    def f(x, w):
        x.mul_(w)
        return x.sum()

    assert_matches_eager(f, lambda: (torch.randn(6), leaf(6)))


def test_mutation_under_no_grad_of_leaf():
    def f(w, g):
        out = (w * 2).sum()
        with torch.no_grad():
            w.sub_(0.1 * g)
        return out

    assert_matches_eager(f, lambda: (leaf(7), torch.randn(7)))


def test_metadata_mutation():
    def f(x):
        x.t_()
        return x * 2

    assert_matches_eager(f, lambda: (nonleaf(3, 5),))


def test_data_and_metadata_mutation():
    def f(x, y):
        x.t_()
        x.add_(y)
        return x.sum()

    assert_matches_eager(f, lambda: (torch.randn(3, 4), leaf(4, 3)))


def test_mutation_of_view_of_input():
    def f(x, y):
        x[1].mul_(y)
        x[:, 0].add_(1)
        return x * 1

    assert_matches_eager(f, lambda: (nonleaf(3, 4), leaf(4)))


def test_mutated_input_returned():
    def f(x):
        x.add_(1)
        return x

    assert_matches_eager(f, lambda: (torch.randn(5),))
    assert_matches_eager(f, lambda: (nonleaf(5),))


def test_mutation_of_strided_input_then_view_returned():
    def f(x):
        x.add_(1)
        return x[0], x.sum()

    assert_matches_eager(f, lambda: (torch.randn(4, 6)[:, ::2],))


def test_leaf_mutation_errors_like_eager():
    def f(x):
        x.add_(1)
        return x

    with pytest.raises(RuntimeError, match="leaf Variable"):
        f(leaf(3))
    import aotc

    with pytest.raises(RuntimeError, match="leaf Variable"):
        aotc.compile(f)(leaf(3))


# ---------------------------------------------------------------- outputs that alias


def test_output_aliases_input():
    def f(x):
        return x.t(), x.view(-1)[2:], x * 2

    assert_matches_eager(f, lambda: (leaf(3, 4),))


def test_output_is_input():
    def f(x, y):
        return x, y * 2

    assert_matches_eager(f, lambda: (leaf(3), leaf(3)))


def test_output_aliases_intermediate():
    def f(x):
        y = x * 2
        return y.view(-1), y.t()

    assert_matches_eager(f, lambda: (leaf(3, 4),))


def test_output_aliases_another_output():
    def f(x):
        y = x.exp()
        return y, y[0], y

    assert_matches_eager(f, lambda: (leaf(3, 4),))


def test_aliased_output_can_be_mutated():
    def f(x):
        y = x * 2
        return y.view(-1)

    import aotc

    torch.manual_seed(0)
    x = leaf(2, 3)
    xe = x.detach().clone().requires_grad_()
    out = aotc.compile(f)(x)
    out_e = f(xe)
    out.mul_(3)
    out_e.mul_(3)
    out.sum().backward()
    out_e.sum().backward()
    torch.testing.assert_close(x.grad, xe.grad)


def test_view_of_input_under_no_grad():
    def f(x):
        with torch.no_grad():
            v = x.view(-1)
        return v, x * 2

    # eager's v requires grad but has no grad_fn, so backward through it fails in eager too
    assert_matches_eager(f, lambda: (leaf(2, 3),), backward=False)


# ---------------------------------------------------------------- duplicate and aliased inputs


def test_duplicate_inputs():
    def f(a, b):
        return a * b + a

    compiled = assert_matches_eager(f, lambda: (lambda x: (x, x))(leaf(5)))
    record = compiled.records[0]
    assert len(record.convention.graph_sources) == 1


def test_duplicate_input_mutated():
    def f(a, b):
        a.add_(1)
        return b * 2

    assert_matches_eager(f, lambda: (lambda x: (x, x))(torch.randn(5)))


def test_synthetic_base_view_of_input():
    def f(x, x_view):
        x.mul_(2)
        return x_view + 1

    def make():
        x = nonleaf(4, 3)
        return x, x.view(-1)

    compiled = assert_matches_eager(f, make)
    assert compiled.records[0].convention.synthetic_bases


def test_synthetic_base_two_slices():
    def f(a, b):
        a.add_(b * 2)
        return a * b

    def make():
        base = leaf(2, 5)
        buf = base * 1
        return buf[0], buf[1]

    assert_matches_eager(f, make)


def test_aliased_inputs_without_mutation_stay_separate():
    def f(a, b):
        return a * b

    def make():
        base = leaf(2, 5)
        return base[0], base[1]

    compiled = assert_matches_eager(f, make)
    assert not compiled.records[0].convention.synthetic_bases


# ---------------------------------------------------------------- grad mode and inference


def test_no_grad_block_inside():
    def f(x, y):
        with torch.no_grad():
            s = x * y
        return s + x, (x * s).sum()

    assert_matches_eager(f, lambda: (leaf(4), leaf(4)))


def test_inference_under_outer_no_grad():
    def f(x, w):
        return (x @ w).relu()

    import aotc

    compiled = aotc.compile(f)
    x, w = torch.randn(3, 4), leaf(4, 2)
    with torch.no_grad():
        out = compiled(x, w)
    assert not out.requires_grad
    torch.testing.assert_close(out, f(x, w).detach())
    assert compiled.records[0].backward is None and not compiled.records[0].training


def test_inference_without_inputs_requiring_grad():
    def f(x, buf):
        buf.add_(1)
        return x.sin(), buf.view(-1)

    compiled = assert_matches_eager(f, lambda: (torch.randn(3), torch.randn(2, 2)))
    assert not compiled.records[0].training


def test_enable_grad_inside_no_grad_call():
    def f(x):
        return x * 2

    import aotc

    compiled = aotc.compile(f)
    x = leaf(3)
    with torch.no_grad():
        a = compiled(x)
    b = compiled(x)
    assert not a.requires_grad and b.requires_grad
    assert len(compiled.records) == 2


# ---------------------------------------------------------------- randomness


def test_dropout_matches_eager_rng():
    def f(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 2

    assert_matches_eager(f, lambda: (leaf(64, 9),))


def test_rand_like_consumes_rng_like_eager():
    def f(x):
        return x * torch.rand_like(x) + torch.randn(3)

    assert_matches_eager(f, lambda: (leaf(3),))


# ---------------------------------------------------------------- regressions found by the OpInfo sweep


def test_conjugate_view_outputs_keep_the_conj_bit():
    def f(z, x):
        return z.conj(), torch.fft.ifft(x)

    assert_matches_eager(
        f, lambda: (torch.randn(3, dtype=torch.complex64), torch.randn(8)), backward=False
    )


def test_output_requires_grad_even_when_no_input_gets_a_gradient():
    def f(x):
        return torch.linalg.vector_norm(x, 0)

    assert_matches_eager(f, lambda: (leaf(10),))


def test_slice_argument_is_a_guarded_constant():
    def f(x, s):
        return x[s] * 2

    assert_matches_eager(f, lambda: (leaf(6), slice(1, 5)))


def test_fresh_output_made_by_in_place_view_op_is_not_a_view():
    def f(x):
        y = x * 2
        y.unsqueeze_(0)
        return y

    compiled = assert_matches_eager(f, lambda: (leaf(5),))
    x = leaf(5)
    out = compiled(x)
    out.mul_(3)  # eager allows mutating it; a view out of an autograd node would refuse
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 6.0))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning")
def test_sparse_input_raises_unsupported():
    import aotc

    dense = torch.randn(5, 3)
    with pytest.raises(aotc.UnsupportedError, match="sparse_csr"):
        aotc.compile(lambda a, b: a @ b, capture="trace")(torch.randn(5, 5).to_sparse_csr(), dense)
