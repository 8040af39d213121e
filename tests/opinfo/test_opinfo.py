"""OpInfo sweep: every op in torch's own OpInfo database that supports autograd, compiled by aotc
and compared against eager (outputs, gradients, mutations, aliasing) on float32 CPU samples.

Run with `python -m pytest -m opinfo tests/opinfo` (the default run deselects `-m opinfo`; the op
database is then not even imported, so the default run pays nothing for this file).

One test per OpInfo (name + variant). Each test takes the first `MAX_SAMPLES` samples of
`op.sample_inputs("cpu", torch.float32, requires_grad=True)` and hands each one to
`assert_matches_eager`, which compiles `op(input, *args, **kwargs)` with
`aotc.compile(fn, check_invariants=True)`, runs it and eager on fresh clones of the sample, and
backpropagates the same random cotangent through both. As in torch's own gradient tests, the
sample's `output_process_fn_grad` is applied to the op's output inside the compiled function (it
makes e.g. eigenvector gradients well defined).

Tables below, each keyed by the test id:
  TOLERANCES   per-op (rtol, atol) overrides of the default 1e-4/1e-4 (outputs and gradients).
  UNSUPPORTED  ops aotc must refuse with `aotc.UnsupportedError` (by design, e.g. data-dependent
               output shapes): every sample matches eager or raises it, and at least one raises.
  SKIPS        ops whose comparison with eager is meaningless (random outputs that do not match
               eager under the same seed). Ops without float32 CPU support skip automatically.
  XFAILS       genuine expected failures, `xfail(strict=True)` so they flag when fixed. Every
               reason is categorised: "aotc bug", "unsupported by design" or
               "test harness limitation".
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import aotc
import tests.conftest as harness
from tests.conftest import assert_matches_eager

pytestmark = pytest.mark.opinfo

DTYPE = torch.float32
DEVICE = "cpu"
MAX_SAMPLES = 3
DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-4

# ------------------------------------------------------------------------------------- tables

# test id -> (rtol, atol), for outputs and gradients alike. Empty today: every op that runs
# matches eager within the default 1e-4/1e-4 (the traced graph calls the same ATen kernels).
TOLERANCES: dict[str, tuple[float, float]] = {}

# test id -> why aotc refuses it. Each sample must either match eager or raise
# `aotc.UnsupportedError`, and at least one sample must raise it. Empty: the default capture
# runs every op with data-dependent shapes or values (Dynamo leaves the value-dependent part to
# eager): narrow with a tensor start, index_put with a boolean mask, index_fill with a 0-dim
# index, view_as_complex, masked_select, combinations, cov, corrcoef, tensor_split,
# gaussian_nll_loss, ctc_loss, linalg.lstsq and the sparse CSR ops match eager. (Strict mode
# refuses the data-dependent ones by design.)
_DATA_DEPENDENT = "unsupported by design: data-dependent output shape or control flow"
UNSUPPORTED: dict[str, str] = {}

# test id -> reason to skip. Empty today: ops with random outputs (dropout variants, bernoulli,
# normal, rrelu, fractional_max_pool, ...) run, because `_same_seed` below keeps torch's
# `wrapper_set_seed` from reseeding at trace time and aotc then matches eager's random stream
# under the same seed. Ops without float32 CPU support are skipped automatically.
SKIPS: dict[str, str] = {}

# test id -> reason for xfail(strict=True). Category first: "aotc bug", "unsupported by design"
# or "test harness limitation".
# (unsafe_split/unsafe_chunk were here until issue #13: their outputs now match eager's.)
XFAILS: dict[str, str] = {
    # The third sample changes the shapes: Dynamo recompiles with symbolic sizes, where the
    # traced `matmul` of a 1-D and a 2-D tensor is Python's decomposition, ending in a view
    # (`squeeze`); eager's C++ kernel returns no view. Values and gradients match; only
    # `out._is_view()` differs (the same under AOTAutograd).
    "matmul": "aotc bug: 1-D @ 2-D under symbolic sizes returns a view where eager does not",
    "__rmatmul__": "aotc bug: 1-D @ 2-D under symbolic sizes returns a view where eager does not",
}


# ------------------------------------------------------------------------------ parametrization


def op_id(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _opinfo_selected(config: pytest.Config) -> bool:
    """Whether the `-m` expression selects tests marked `opinfo` (only then is op_db imported)."""
    expr = config.getoption("markexpr", default="") or ""
    if not expr:
        return True
    try:
        from _pytest.mark.expression import Expression

        return Expression.compile(expr).evaluate(lambda name, **kw: name == "opinfo")
    except Exception:  # an internal API of pytest: when in doubt, collect the sweep
        return True


def load_ops() -> list[Any]:
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as e:  # torch's test utilities need `expecttest`
        raise RuntimeError(
            f"the OpInfo sweep needs torch's internal test utilities ({e}); "
            "`pip install expecttest`"
        ) from e
    return [op for op in op_db if op.supports_autograd]


def _params(ops: list[Any]) -> list[Any]:
    params = []
    for op in ops:
        name = op_id(op)
        marks = []
        if name in SKIPS:
            marks.append(pytest.mark.skip(reason=SKIPS[name]))
        elif DTYPE not in op.supported_dtypes(DEVICE):
            marks.append(
                pytest.mark.skip(
                    reason="not applicable: the OpInfo declares no float32 CPU support"
                )
            )
        elif name in XFAILS:
            marks.append(pytest.mark.xfail(strict=True, reason=XFAILS[name]))
        params.append(pytest.param(op, id=name, marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "op" in metafunc.fixturenames:
        ops = load_ops() if _opinfo_selected(metafunc.config) else []
        metafunc.parametrize("op", _params(ops))


# ------------------------------------------------------------------------------------ helpers


def fresh_args(sample: Any) -> tuple:
    """Fresh clones of a sample's tensors, as `(input, *args, kwargs)` for `assert_matches_eager`
    (its last element, a dict, becomes the keyword arguments). A tensor that appears several
    times in the sample is cloned once, so aliasing between arguments is kept."""
    memo: dict[int, torch.Tensor] = {}

    def clone(x: torch.Tensor) -> torch.Tensor:
        if id(x) not in memo:
            base = x._base
            if base is not None and base.is_contiguous() and base.storage_offset() == 0:
                # A view into a larger base (e.g. as_strided.partial_views): clone the base and
                # take the same view of it, so the storage beyond the view is there too.
                new_base = base.detach().clone().requires_grad_(base.requires_grad)
                memo[id(x)] = new_base.as_strided(x.shape, x.stride(), x.storage_offset())
            else:
                memo[id(x)] = x.detach().clone().requires_grad_(x.requires_grad)
        return memo[id(x)]

    def tree(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return clone(x)
        if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            items = [tree(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        if isinstance(x, dict):
            return {k: tree(v) for k, v in x.items()}
        return x

    return (tree(sample.input), *tree(tuple(sample.args)), tree(dict(sample.kwargs)))


def make_fn(op: Any, sample: Any):
    process = sample.output_process_fn_grad

    def fn(*args: Any, **kwargs: Any) -> Any:
        return process(op(*args, **kwargs))

    fn.__name__ = op_id(op).replace(".", "_")
    return fn


def samples(op: Any) -> list[Any]:
    torch.manual_seed(0)
    return list(itertools.islice(op.sample_inputs(DEVICE, DTYPE, requires_grad=True), MAX_SAMPLES))


def _loosened(rtol: float, atol: float):
    """`assert_matches_eager` compares gradients at a fixed 1e-5: widen every comparison to at
    least this op's tolerance."""
    strict = harness._assert_tensor_equal

    def check(got, want, what, r, a):
        strict(got, want, what, max(r, rtol), max(a, atol))

    return check


# -------------------------------------------------------------------------------------- test


def _same_seed(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for torch's `wrapper_set_seed`, which reseeds the global generator inside the
    op's callable: aotc runs that Python call once, at trace time, so the compiled graph would not
    reseed. `assert_matches_eager` already seeds both sides identically before each call."""
    return op(*args, **kwargs)


def test_opinfo(op: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    name = op_id(op)
    rtol, atol = TOLERANCES.get(name, (DEFAULT_RTOL, DEFAULT_ATOL))
    monkeypatch.setattr(harness, "_assert_tensor_equal", _loosened(rtol, atol))
    monkeypatch.setattr(
        "torch.testing._internal.common_methods_invocations.wrapper_set_seed", _same_seed
    )
    todo = samples(op)
    assert todo, f"{name}: no float32 CPU samples"
    refused = 0
    for i, sample in enumerate(todo):
        fn = make_fn(op, sample)
        make = lambda s=sample: fresh_args(s)  # noqa: E731
        try:
            assert_matches_eager(fn, make, rtol=rtol, atol=atol)
        except aotc.UnsupportedError as e:
            if name not in UNSUPPORTED:
                raise AssertionError(
                    f"{name} sample {i} ({sample.summary()}): aotc refused it: {e}"
                ) from e
            refused += 1
        except Exception as e:
            raise AssertionError(
                f"{name} sample {i} ({sample.summary()}): {type(e).__name__}: {e}"
            ) from e
    if name in UNSUPPORTED:
        assert refused, (
            f"{name}: listed in UNSUPPORTED ({UNSUPPORTED[name]}) but aotc compiled "
            f"all {len(todo)} samples: remove it from the table"
        )
