"""Shrink a failing fuzz program to a minimal one that still fails the same way.

`shrink(program, still_fails) -> Program`: greedy one-step reductions, repeated until none
applies: drop a statement, unwrap a `with` block (or drop one of its lines), drop an output (its
backward position with it), drop a backward position, stop writing into the outputs. A reduced
program is kept only if `still_fails(program)` holds (the same verdict on the same mode).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from tests.fuzz.generate import Program


def _reductions(p: Program) -> Iterator[Program]:
    for i in range(len(p.body)):
        yield dataclasses.replace(p, body=p.body[:i] + p.body[i + 1 :])
    for i, stmt in enumerate(p.body):
        if len(stmt) > 1:  # a with-block: its lines without the block, or one line fewer
            inner = [line.removeprefix("    ") for line in stmt[1:]]
            yield dataclasses.replace(
                p, body=[*p.body[:i], *[[x] for x in inner], *p.body[i + 1 :]]
            )
            for k in range(1, len(stmt)):
                if len(stmt) > 2:
                    yield dataclasses.replace(
                        p, body=[*p.body[:i], stmt[:k] + stmt[k + 1 :], *p.body[i + 1 :]]
                    )
    if len(p.outputs) > 1:
        for j in range(len(p.outputs)):
            backward = [b if b < j else b - 1 for b in p.backward if b != j]
            yield dataclasses.replace(
                p, outputs=p.outputs[:j] + p.outputs[j + 1 :], backward=backward
            )
    for b in p.backward:
        yield dataclasses.replace(p, backward=[x for x in p.backward if x != b])
    if p.write_outputs:
        yield dataclasses.replace(p, write_outputs=False)


def shrink(program: Program, still_fails: Callable[[Program], bool], budget: int = 200) -> Program:
    best = program
    tries = 0
    progress = True
    while progress and tries < budget:
        progress = False
        for candidate in _reductions(best):
            tries += 1
            if still_fails(candidate):
                best = candidate
                progress = True
                break
            if tries >= budget:
                break
    return best
