"""aotc's graphs in torch's structured trace (`TORCH_TRACE=dir`, read by tlparse).

Not a stage: `trace_record(record)` emits, for one compiled signature, the joint, forward and
backward graphs (`graph_dump` records named `aotc_joint_graph`, `aotc_forward_graph`,
`aotc_backward_graph`), the partition report (`artifact` `aotc_partition`), the compile times
(`artifact` `aotc_compile_time`) and each generated Triton kernel (`artifact`
`aotc_kernel_<name>`); `trace_failure` a failed compile (`artifact` `aotc_compile_error`), as the same text the dump folder holds. Under `torch.compile` they carry
the compile id of the Dynamo frame they belong to, so tlparse lists them next to Dynamo's graphs
for that frame. Nothing is formatted unless a structured-trace handler other than the `aotc`
command's own (aotc/dynamo_log.py) is attached.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aotc.pipeline import CompiledRecord, FailedCompile


def is_tracing() -> bool:
    from torch._logging._internal import trace_log

    if not trace_log.handlers:
        return False
    # A DynamoLog handler exists only once aotc.dynamo_log is imported: no import on a hit.
    dynamo_log = sys.modules.get("aotc.dynamo_log")
    if dynamo_log is None:
        return True
    return any(not isinstance(h, dynamo_log.DynamoLog) for h in trace_log.handlers)


def trace_record(record: CompiledRecord) -> None:
    if not is_tracing():
        return
    from torch._logging import trace_structured

    from aotc.pipeline import compile_time_text

    names = record.graph_arg_names

    def graph(name: str, text: Callable[[], str]) -> None:
        trace_structured(
            "graph_dump",
            metadata_fn=lambda: {"name": name, "type": "aotc"},
            payload_fn=text,
            expect_trace_id=False,
        )

    def artifact(name: str, text: Callable[[], str]) -> None:
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": name, "encoding": "string"},
            payload_fn=text,
            expect_trace_id=False,
        )

    graph("aotc_joint_graph", lambda: record.joint_graph.format("joint", names))
    part = record.partition
    if part is not None:
        stages = dict(record.stages)
        graph("aotc_forward_graph", lambda: stages["04_forward.py"])
        graph("aotc_backward_graph", lambda: stages["05_backward.py"])
        artifact("aotc_partition", lambda: part.format(names))
    else:
        graph("aotc_inference_graph", lambda: record.forward.code)
    artifact("aotc_compile_time", lambda: compile_time_text(record))
    for kernel in record.kernels:
        artifact(f"aotc_kernel_{kernel.name}", lambda k=kernel: k.source)  # type: ignore[misc]


def trace_failure(failure: FailedCompile) -> None:
    """A failed compilation as `artifact` `aotc_compile_error`."""
    if not is_tracing():
        return
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "aotc_compile_error", "encoding": "string"},
        payload_fn=lambda: (
            f"{failure.name} ({failure.source})\n{failure.signature}\n"
            f"{failure.error_type}: {failure.error}"
        ),
        expect_trace_id=False,
    )
