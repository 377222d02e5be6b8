"""Timer deadlines (leases and delivery graces) in the order the reaper needs them: earliest
first, O(1) in the usual case.

Almost every lease is armed as `now + unbound_store_timeout_s` with a monotonic `now`, so
deadlines mostly arrive in order. Those go to a FIFO (`deque`): push and pop are O(1) and touch
one cache line. Only the out-of-order ones (a cancelled Fetch re-arming an old deadline, a
KeepAlive or intent giving one id a shorter lease than later ids, a delivery grace shorter than
the leases ahead of it) go to a heap. The earliest item is the smaller of the two heads, so a
reaper pass costs O(expired) for in-order leases and O(expired · log n) at worst, never
O(parked). On this machine the heap alone made a pass that
expires 1k of 100k ids spend most of its time in `heappop` cache misses.

Items are `(deadline, seq, owner)`; the queue never decides whether an item is still current —
the lot does (`Lot._timer_item_live`) and discards stale ones as it pops them.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class LeaseQueue(Generic[T]):
    def __init__(self) -> None:
        self._in_order: deque[tuple[float, int, T]] = deque()  # nondecreasing deadlines
        self._heap: list[tuple[float, int, T]] = []  # everything that arrived out of order
        # Items popped so far: the work reaper passes did, which must grow with what expired,
        # never with what is parked.
        self.pops = 0

    def __len__(self) -> int:
        return len(self._in_order) + len(self._heap)

    def __iter__(self) -> Iterator[tuple[float, int, T]]:
        yield from self._in_order
        yield from self._heap

    def push(self, deadline: float, seq: int, owner: T) -> None:
        item = (deadline, seq, owner)
        if not self._in_order or deadline >= self._in_order[-1][0]:
            self._in_order.append(item)
        else:
            heapq.heappush(self._heap, item)

    def peek(self) -> tuple[float, int, T] | None:
        """The earliest item, or None when empty."""
        fifo, heap = self._in_order, self._heap
        if fifo and (not heap or fifo[0][:2] <= heap[0][:2]):
            return fifo[0]
        return heap[0] if heap else None

    def pop(self) -> tuple[float, int, T]:
        """Removes and returns the earliest item (the queue must not be empty)."""
        self.pops += 1
        fifo, heap = self._in_order, self._heap
        if fifo and (not heap or fifo[0][:2] <= heap[0][:2]):
            return fifo.popleft()
        return heapq.heappop(heap)

    def pop_due(self, now: float) -> list[tuple[float, int, T]]:
        """Removes and returns every item whose deadline is at or before `now`, earliest first:
        what a peek/pop loop would return, in one call per reaper pass."""
        fifo, heap = self._in_order, self._heap
        due: list[tuple[float, int, T]] = []
        # While the heap head is due, the earliest item of the two is too: `pop` picks it.
        while heap and heap[0][0] <= now:
            due.append(self.pop())
        # Nothing left in the heap is due, so the rest of the due items are a FIFO prefix.
        merged = len(due)
        while fifo and fifo[0][0] <= now:
            due.append(fifo.popleft())
        self.pops += len(due) - merged
        return due

    def retain(self, keep: Callable[[tuple[float, int, T]], bool]) -> None:
        """Drops every item `keep` rejects (compaction when stale items pile up)."""
        self._in_order = deque(item for item in self._in_order if keep(item))
        self._heap = [item for item in self._heap if keep(item)]
        heapq.heapify(self._heap)
