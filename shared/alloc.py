"""Process-wide glibc allocator tuning for processes that send or receive multi-MiB messages
(the producer, decode workers, the benchmark).

gRPC hands every received message to Python as a new `bytes` of the chunk's size. With glibc's
defaults, allocations above 128 KiB are fresh `mmap`s that page-fault on first touch and are
unmapped on free, so every chunk pays the page faults again: performance-notes.md measured the
fix at 1.4-2.9x on gRPC streams. Raising M_MMAP_THRESHOLD keeps those buffers on the heap and
raising M_TRIM_THRESHOLD keeps the heap from being handed back after each one.

A library must not change process-wide settings on import, so this is an explicit call at a
process's start-up (`kvpark-producer`, the `kvpark` CLI and the example worker make it).
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's own maximum for this threshold
TRIM_THRESHOLD_BYTES = 2 * 1024 * 1024 * 1024
# gRPC's threads would each get an arena that keeps its own peak of multi-MiB messages (the trim
# threshold above keeps them on purpose); two arenas bound that plateau (docs/performance.md).
ARENA_MAX = 2


def tune_allocator() -> bool:
    """Keeps multi-MiB buffers on the glibc heap. True if applied; False where there is no
    glibc (musl, macOS), in which case nothing changes."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    ok_trim = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    ok_arena = mallopt(_M_ARENA_MAX, ARENA_MAX)
    return bool(ok_mmap and ok_trim and ok_arena)
