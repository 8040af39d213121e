"""Stage records are deterministic and read as documented (inline golden text)."""

from __future__ import annotations

import torch

import aotc


def step(x, buf):
    buf.add_(1)
    y = x.sin() * buf
    return y, y.view(-1), x.t()


def _compile_once():
    compiled = aotc.compile(step, capture="trace")  # the strict tracer's own graphs
    x = torch.randn(3, 4, requires_grad=True) * 1.0
    out = compiled(x, torch.randn(3, 4))
    out[0].sum().backward()
    return compiled.records[0]


def test_dumps_are_deterministic():
    first, second = _compile_once(), _compile_once()
    texts = [[t for name, t in r.stages if name != "07_compile_time.txt"] for r in (first, second)]
    assert texts[0] == texts[1]


def test_metadata_golden():
    record = _compile_once()
    assert record.meta.format() == (
        "# stage: metadata\n"
        "input  0: mutation=none requires_grad=True leaf=False\n"
        "input  1: mutation=data requires_grad=False leaf=True\n"
        "output 0: fresh requires_grad=True dtype=torch.float32\n"
        "output 1: alias_of_output base=user_out0 requires_grad=True dtype=torch.float32\n"
        "output 2: alias_of_input base=user_arg0 requires_grad=True dtype=torch.float32\n"
        "intermediate bases: 0\n"
        "user_arg1: version +1"
    )
    # buf's history is unchanged by add_(1) (nothing requires grad): replayed under no_grad
    assert record.epilogue.format().splitlines()[1:3] == [
        "mutation: copy graph_arg1 <- fwd_out2 (no_grad)",
        "version: user_arg1 +1",
    ]
