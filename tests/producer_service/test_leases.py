"""LeaseQueue pops in deadline order whatever the push order (FIFO fast path + heap)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from producer_service.leases import LeaseQueue


@given(st.lists(st.floats(0, 1000, allow_nan=False), max_size=200), st.data())
def test_pops_come_out_sorted_like_a_heap(deadlines: list[float], data: st.DataObject) -> None:
    queue: LeaseQueue[str] = LeaseQueue()
    pushed: list[tuple[float, int, str]] = []
    popped: list[tuple[float, int, str]] = []
    for seq, deadline in enumerate(deadlines):
        queue.push(deadline, seq, f"id{seq}")
        pushed.append((deadline, seq, f"id{seq}"))
        if data.draw(st.booleans()) and len(queue):  # interleave pops with pushes
            head = queue.peek()
            item = queue.pop()
            assert item == head == min(set(pushed) - set(popped))
            popped.append(item)
    while len(queue):
        popped.append(queue.pop())
    assert sorted(popped) == sorted(pushed)
    assert queue.peek() is None and queue.pops == len(deadlines)


def test_in_order_pushes_use_the_fifo_and_retain_filters() -> None:
    queue: LeaseQueue[str] = LeaseQueue()
    for seq in range(5):
        queue.push(10.0 + seq, seq, f"id{seq}")
    queue.push(1.0, 99, "rearmed")  # out of order: goes to the heap, still comes out first
    assert queue.peek() == (1.0, 99, "rearmed")
    queue.retain(lambda item: item[1] % 2 == 0)
    assert [queue.pop()[1] for _ in range(len(queue))] == [0, 2, 4]
