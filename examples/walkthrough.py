"""Walk through every stage of one compilation, printed in pipeline order.

    .venv/bin/python examples/walkthrough.py                 # from the repo root
    .venv/bin/python examples/walkthrough.py --dump DIR      # also write the stages under DIR

`step` mutates its input `buf` in place and returns an output together with a view of it, so the
record shows every piece aotc has: the input mutation in the metadata, the functional joint graph
(the mutation becomes a plain `add` whose result is an extra output), the forward/backward
partition, and the epilogue that copies the new value back into `buf` and rebuilds the view.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import aotc  # noqa: E402


def step(x: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    buf.add_(1)
    y = x.sin() * buf
    return y, y.view(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", metavar="DIR", help="write every compiled stage under DIR")
    args = parser.parse_args()

    compiled = aotc.compile(step, dump_dir=args.dump)

    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    buf = torch.zeros(3, 4)
    x_ref, buf_ref = x.detach().clone().requires_grad_(), buf.clone()

    y, flat = compiled(x, buf)
    y_ref, flat_ref = step(x_ref, buf_ref)
    flat.sum().backward()
    flat_ref.sum().backward()

    # Same outputs, same mutation of buf, same view relationship, same gradient as eager.
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(buf, buf_ref)
    assert flat._base is y, "the second output is a view of the first, as in eager"
    torch.testing.assert_close(x.grad, x_ref.grad)

    (record,) = aotc.inspect(compiled)
    print(record.format())
    print("outputs, buf mutation, view aliasing and x.grad match eager")
    if args.dump:
        print(
            f"the same stages were written under {args.dump}/: "
            f"{', '.join(sorted(os.listdir(args.dump)))}"
        )


if __name__ == "__main__":
    main()
