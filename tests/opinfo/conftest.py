"""Prints one summary line for the OpInfo sweep at the end of a run that executed it:

opinfo sweep: N passed, M xfailed, K skipped, F failed of T ops
"""

from __future__ import annotations

from typing import Any

SWEEP_FILE = "test_opinfo.py::"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    outcome: dict[str, str] = {}  # nodeid -> worst outcome over setup/call/teardown
    order = ("passed", "xfailed", "skipped", "xpassed", "failed", "error")
    for key, reports in terminalreporter.stats.items():
        if key not in order:
            continue
        for report in reports:
            nodeid = getattr(report, "nodeid", "")
            if SWEEP_FILE not in nodeid:
                continue
            prev = outcome.get(nodeid)
            if prev is None or order.index(key) > order.index(prev):
                outcome[nodeid] = key
    if not outcome:
        return
    count = {k: sum(1 for v in outcome.values() if v == k) for k in order}
    failed = count["failed"] + count["error"] + count["xpassed"]
    terminalreporter.write_line(
        f"opinfo sweep: {count['passed']} passed, {count['xfailed']} xfailed, "
        f"{count['skipped']} skipped, {failed} failed of {len(outcome)} ops"
    )
