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
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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
        self._lock = threading.Lock()
        self._queued = 0  # submitted jobs no thread has started yet

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Starts `fn(*args)` on a data thread; `wait` for it."""

        def job() -> T:
            with self._lock:
                self._queued -= 1
            return fn(*args)

        with self._lock:
            self._queued += 1
        try:
            future = self._pool.submit(job)
        except BaseException:  # closed: the job never runs
            with self._lock:
                self._queued -= 1
            raise
        future.add_done_callback(self._cancelled_before_start)
        return future

    def _cancelled_before_start(self, future: Future[Any]) -> None:
        if future.cancelled():  # `wait` took it back before a thread started it
            with self._lock:
                self._queued -= 1

    def waiting(self) -> int:
        """Jobs waiting for a thread (any thread): a long job gives way when this is above 0."""
        with self._lock:
            return self._queued

    async def run(
        self, fn: Callable[..., T], *args: Any, interrupt: Callable[[], None] | None = None
    ) -> T:
        """`fn(*args)` on a data thread, waited for as `wait` does."""
        return await wait(self.submit(fn, *args), interrupt=interrupt)

    def close(self) -> None:
        """No more work; threads still running finish what they were given."""
        self._pool.shutdown(wait=False)


async def wait(job: Future[T], *, interrupt: Callable[[], None] | None = None) -> T:
    """The job's result. A cancel of the caller cannot stop a thread that is copying into or
    out of memory the caller owns (pool pages, a lent buffer, a socket), so the caller keeps
    waiting until the thread is done, after `interrupt()` (which should make it finish soon,
    e.g. shut its socket down), and only then re-raises the cancel: nothing the job uses is
    freed, unmapped or closed under it."""
    outcome = asyncio.wrap_future(job)
    cancelled = False
    while not outcome.done():
        try:
            await asyncio.shield(outcome)
        except asyncio.CancelledError:
            # A job no thread has started touches nothing: take it back, leave at once
            # (only for callers that can be interrupted, i.e. that own no partial state).
            if interrupt is not None and job.cancel():
                raise
            if not cancelled and interrupt is not None:
                interrupt()
            cancelled = True
        except Exception:
            break  # the job failed: its result below raises that
    if cancelled:
        outcome.exception()  # the cancel wins; a failure the interrupt caused is expected
        raise asyncio.CancelledError
    return outcome.result()
