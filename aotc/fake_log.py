"""Fake tensors' error log, quiet for failures aotc reports itself.

Stage: `quiet_fake_tensor_errors()`, at `import aotc` (aotc/__init__.py); idempotent.
Ensures: a "failed while attempting to run meta for <op>" record of torch's fake tensor logger
is dropped when an aotc frame is on the stack; every other record, and every failure outside
aotc, is logged as before. The exception itself always propagates.

Note [Fake tensor error logs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A program that fails on fake tensors (`x @ w` with mismatched shapes) makes torch's fake tensor
module log the failure at ERROR level with its whole traceback, ~20 lines of torch frames,
before the error is raised. Under aotc that error is then reported with the user's line (strict
mode's metadata pass) or re-raised as eager raises it (the default mode), so the log is only
noise in front of it (the guide's rule: clear errors without pages of internal frames). A filter
on that logger drops exactly those records while an aotc call is on the stack: aotc's frames are
found by their files, and the walk runs only when such a record is emitted. Fake tensors used
by anything else in the process keep their log.
"""

from __future__ import annotations

import logging
import sys

from aotc.dynamo_skip import GENERATED_PREFIX, own_dirs

_MESSAGE = "failed while attempting to run meta"
_LOGGER = "torch._subclasses.fake_tensor"


class _UnderAotc(logging.Filter):
    dirs: tuple[str, ...] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_MESSAGE):
            return True
        if self.dirs is None:
            self.dirs = tuple(own_dirs())
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self.dirs) or name.startswith(GENERATED_PREFIX):
                return False
            frame = frame.f_back  # type: ignore[assignment]
        return True


def quiet_fake_tensor_errors() -> None:
    logger = logging.getLogger(_LOGGER)
    if not any(isinstance(f, _UnderAotc) for f in logger.filters):
        logger.addFilter(_UnderAotc())
