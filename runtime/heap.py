"""Heap: settle glibc's malloc thresholds once per process, before CPU programs run.

`settle()` is called when a compiled program for CPU tensors is assembled (aotc/pipeline.py). On
Linux with glibc it allocates one block of `SETTLE_BYTES` with `malloc` and frees it right away:
no page is touched. It does nothing on other C libraries, when `AOTC_SETTLE_HEAP=0`, and after its
first call.

Note [Settled heap thresholds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
glibc serves a request of at least `mmap_threshold` bytes (128 KiB at start) with its own `mmap`,
and shrinks the heap (`brk`) whenever the free memory at its top reaches `trim_threshold`
(128 KiB at start). Both thresholds are dynamic: freeing an mmapped block of S bytes, where
S <= 32 MiB, raises them to S and 2S. A training step whose blocks are a few MiB therefore
sits in one of two steady states, depending on where earlier small allocations happened to
land. In the first, the heap keeps its top across steps. In the second, the last frees of a
step leave more than `trim_threshold` free at the top, the heap is trimmed, and the next step
grows it again, faulting in every page it touches.

Which state a process lands in depends only on the placement of small allocations (tensor
structs, autograd nodes, Python objects over 512 bytes). Measured on bench/partition.py's
conv_net (1 thread, 2-core machine), eager and aotc in one process, same rounds:
- Trimming state: eager ~300-570 faults and 7.4-8.8 ms per step; aotc ~1350 faults and
  10.6-12.8 ms (its small allocations differ: one autograd node where eager has one per op).
  Eager alone lands there too in some processes (17.6 ms a step under strace).
- After one freed 30 MiB block: 0 faults for both, eager 5.6-6.9 ms, aotc 5.8-7.4 ms.

Any program that frees one tensor of 30 MiB (a 2.6M-parameter layer's gradient, a batch of
images) reaches the settled thresholds on its own. `settle` puts every process there from its
first compiled CPU program, so step time no longer depends on that placement luck.

What it changes, for the whole process (eager code included):
- Blocks under 30 MiB come from the heap instead of `mmap` (where glibc would put them anyway
  after such a free).
- Up to 60 MiB of freed memory may stay at the heap top instead of going back to the system.

Thresholds the user set (`mallopt`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
`MALLOC_TOP_PAD_`) turn glibc's dynamic thresholds off, and then this free changes nothing.
Another malloc (jemalloc, tcmalloc through `LD_PRELOAD`) just serves and frees one block.
`AOTC_SETTLE_HEAP=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

# glibc's dynamic thresholds follow freed mmapped blocks of at most 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX
# on 64-bit); the block's chunk adds a header and rounds up to a page, so stay a little under.
SETTLE_BYTES = 30 << 20

_settled = False


def enabled() -> bool:
    return os.environ.get("AOTC_SETTLE_HEAP", "1") != "0"


def is_glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def settle() -> bool:
    """Raise glibc's dynamic malloc thresholds to their settled values, once per process (Note
    [Settled heap thresholds]). True when this call freed the settling block."""
    global _settled
    if _settled:
        return False
    _settled = True
    if not enabled() or not is_glibc():
        return False
    try:
        libc = ctypes.CDLL(None)
        malloc, free = libc.malloc, libc.free
    except (OSError, AttributeError):
        return False
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t]
    free.restype = None
    free.argtypes = [ctypes.c_void_p]
    block = malloc(SETTLE_BYTES)
    if not block:
        return False
    free(block)
    return True
