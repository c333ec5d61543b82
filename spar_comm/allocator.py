"""Keep freed memory in the process: a training step on the CPU stops page-faulting.

A PyTorch step on the CPU allocates its gradients and activations afresh and
frees them again, megabytes at a time. glibc's malloc serves large blocks
from new mappings and hands freed ones back to the kernel, so every step
faults those pages in again, and the kernel zeroes each one: a
10.5M-parameter MLP's SGD step faulted 8,912 pages (35 MB). Blocks of up to
``MMAP_THRESHOLD`` served from the heap, and a heap trimmed only past
``TRIM_THRESHOLD`` free at its top, brought that to 26 pages a step, and
the steps of a 17.3M-parameter MLP to 0.8x their time
(docs/results/peers.md).

It changes the whole process's malloc, which a library must not do behind
its user's back: the drivers call ``retain_freed_memory()`` at start, and
your own script may. glibc's own ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` set the same before the process starts.
"""
from __future__ import annotations

import ctypes

#: glibc's largest mmap threshold (half its 64 MiB heap): a block up to this size comes from the heap.
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top kept before returning any of it to the kernel.
TRIM_THRESHOLD = 1 << 30
#: mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def retain_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks for reuse; whether it took effect
    (False where the C library is not glibc). Call it once, at start."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    mmap = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trim = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mmap and trim)
