"""Process-wide glibc allocator tuning for processes that send or receive multi-MiB messages
(the producer, decode workers, the benchmark).

gRPC hands every received message to Python as a new `bytes` of the chunk's size. With glibc's
defaults, allocations above 128 KiB are fresh `mmap`s that page-fault on first touch and are
unmapped on free, so every chunk pays the page faults again. Raising M_MMAP_THRESHOLD keeps
those buffers on the heap and raising M_TRIM_THRESHOLD keeps the heap from being handed back
after each one.

A library must not change process-wide settings on import, so this is an explicit call at a
process's start-up (`kvpark-producer`, the `kvpark` CLI and the example worker make it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's own maximum for this threshold
TRIM_THRESHOLD_BYTES = 2 * 1024 * 1024 * 1024
# gRPC's threads would each get an arena that keeps its own peak of multi-MiB messages (the trim
# threshold above keeps them on purpose); two arenas bound that plateau (docs/performance.md).
ARENA_MAX = 2


def _libc_function(name: str) -> Any:
    """A glibc function by name, or None where there is no glibc (musl, macOS)."""
    path = ctypes.util.find_library("c")
    if not path:
        return None
    try:
        return getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None


def tune_allocator() -> bool:
    """Keeps multi-MiB buffers on the glibc heap. True if applied; False where there is no
    glibc (musl, macOS), in which case nothing changes."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    ok_mmap = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    ok_trim = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    ok_arena = mallopt(_M_ARENA_MAX, ARENA_MAX)
    return bool(ok_mmap and ok_trim and ok_arena)


def release_free_heap() -> bool:
    """Hands freed heap back to the OS (`malloc_trim(0)`): the counterpart of the high trim
    threshold above, for a process that has gone idle after a burst. True if glibc released
    something; False where it had nothing to give back, or there is no glibc."""
    malloc_trim = _libc_function("malloc_trim")
    return bool(malloc_trim(0)) if malloc_trim is not None else False
