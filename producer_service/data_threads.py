"""The threads that move bulk bytes: TCP sends from the pool and shared-memory copies.

They run beside the event loop, which answers every control call: a late Fetch turned away, a
Lookup, a KeepAlive, the next Park header. Two things keep those answers fast while hundreds of
MB move. The pool is small (`data_threads`, 2 by default): bulk bytes go no faster with more
threads than cores, and each extra runnable thread is one more the event loop may wait behind
for a core. And each thread runs at a lower CPU priority (nice +10 from the process's), so
when the event loop's thread wakes up the kernel runs it first. Measured with 16 TCP fetches at
once on 2 cores (docs/performance.md): with asyncio's default executor (6 threads at the
loop's priority) a late fetch meanwhile took 27-31 ms at p99 and the 580 MB 0.94 s; with 2
threads at +10, 9-17 ms and 0.33 s.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
NICE_INCREMENT = 10
_NICEST = 19


def lower_priority() -> None:
    """Lowers the calling thread's CPU priority by NICE_INCREMENT (the first thing each data
    thread does). Where thread priorities cannot be set (not Linux, or not allowed), the
    thread keeps its priority and only the small pool helps."""
    try:
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(_NICEST, nice + NICE_INCREMENT))
    except (AttributeError, OSError):
        pass


class DataThreads:
    def __init__(self, count: int) -> None:
        self._pool = ThreadPoolExecutor(
            count, thread_name_prefix="kvpark-data", initializer=lower_priority
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a data thread. Cancelling the caller does not stop the thread: a
        caller that hands out memory to `fn` waits for it before taking the memory back."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        """No more work; threads still running finish what they were given."""
        self._pool.shutdown(wait=False)
