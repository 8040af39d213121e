"""Roles of graph placeholders and outputs. Roles come from these, never from node names."""

from __future__ import annotations

from dataclasses import dataclass

from aotc.runtime.schema import FwdOut, GraphArg


@dataclass(frozen=True, slots=True)
class PrimalInput:
    arg: GraphArg


@dataclass(frozen=True, slots=True)
class TangentInput:
    out: FwdOut  # the differentiable forward output this is the cotangent of


@dataclass(frozen=True, slots=True)
class SavedInput:
    name: str  # a value the forward saved for the backward


@dataclass(frozen=True, slots=True)
class FwdOutput:
    out: FwdOut


@dataclass(frozen=True, slots=True)
class GradOutput:
    arg: GraphArg  # gradient of this primal (None in the graph when statically zero)


@dataclass(frozen=True, slots=True)
class SavedOutput:
    name: str


InputDesc = PrimalInput | TangentInput | SavedInput
OutputDesc = FwdOutput | GradOutput | SavedOutput


def describe(desc: InputDesc | OutputDesc) -> str:
    match desc:
        case PrimalInput(arg=arg):
            return f"primal graph_arg{arg}"
        case TangentInput(out=out):
            return f"tangent of fwd_out{out}"
        case SavedInput(name=name) | SavedOutput(name=name):
            return f"saved {name}"
        case FwdOutput(out=out):
            return f"fwd_out{out}"
        case GradOutput(arg=arg):
            return f"grad of graph_arg{arg}"
