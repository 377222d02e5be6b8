"""Gives the heap a burst grew back to the OS once the producer has gone quiet.

The allocator is tuned to keep freed multi-MiB buffers (`kvpark.alloc`: a 2 GiB trim threshold),
because handing them back and faulting them in again costs more than the copy they hold while
data moves. The price is that a burst — 16 concurrent 4 MiB streams — leaves the producer
100-200 MiB above `pool_bytes` for the rest of its life, on a host whose memory was sized for
the pool (docs/performance.md). `IdleHeapTrim` releases that heap once no data has moved and
nothing is bound for `after_s`: one `malloc_trim` (~15 ms) per quiet period, so the next burst
pays its page faults once, not per message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from kvpark.alloc import release_free_heap

# Long enough that the gaps inside a burst (between one request's park and its fetch, between
# requests of a busy prefill worker) do not trim; short enough that a quiet producer is back
# near `pool_bytes` within seconds.
IDLE_TRIM_AFTER_S = 2.0
_NOT_SEEN = object()


class IdleHeapTrim:
    def __init__(
        self,
        after_s: float = IDLE_TRIM_AFTER_S,
        trim: Callable[[], object] = release_free_heap,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._after_s = after_s
        self._trim = trim
        self._clock = clock
        self._activity: Hashable = _NOT_SEEN
        self._quiet_since = clock()
        self._armed = False

    def due(self, activity: Hashable, busy: bool) -> bool:
        """Called periodically with a value that changes whenever data moves (`activity`) and
        whether anything is in progress; True when the heap should be trimmed now. Once per
        quiet period: the next activity re-arms it."""
        now = self._clock()
        if self._activity is _NOT_SEEN:
            # The first look is the baseline: a process that has moved nothing has no burst
            # heap to give back.
            self._activity = activity
            return False
        if busy or activity != self._activity:
            self._activity = activity
            self._quiet_since = now
            self._armed = True
            return False
        if self._armed and now - self._quiet_since >= self._after_s:
            self._armed = False
            return True
        return False

    def trim(self) -> None:
        self._trim()
