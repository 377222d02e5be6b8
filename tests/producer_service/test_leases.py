"""LeaseQueue pops in deadline order whatever the push order (FIFO fast path + heap)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpark.producer.leases import LeaseQueue


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
    # Iteration shows the layout, FIFO first, then the heap: only the out-of-order push is in
    # the heap (a queue that heaped everything would list 99 first).
    assert [seq for _, seq, _ in queue] == [0, 1, 2, 3, 4, 99]
    assert queue.peek() == (1.0, 99, "rearmed")
    queue.retain(lambda item: item[1] % 2 == 0)
    assert [queue.pop()[1] for _ in range(len(queue))] == [0, 2, 4]


@given(st.lists(st.sampled_from([1.0, 2.0, 2.5, 3.0, 7.0]), max_size=60), st.data())
def test_pop_due_takes_what_peek_and_pop_would_and_nothing_later(
    deadlines: list[float], data: st.DataObject
) -> None:
    """Two queues fed the same pushes (ties included, so FIFO and heap heads compare on seq):
    `pop_due(now)` returns exactly the items a peek/pop loop would, in the same order."""
    batched: LeaseQueue[str] = LeaseQueue()
    stepped: LeaseQueue[str] = LeaseQueue()
    for seq, deadline in enumerate(deadlines):
        for queue in (batched, stepped):
            queue.push(deadline, seq, f"id{seq}")
        if data.draw(st.booleans()):
            now = data.draw(st.sampled_from([0.0, 2.0, 2.5, 5.0]))
            expected = []
            while (head := stepped.peek()) is not None and head[0] <= now:
                expected.append(stepped.pop())
            assert batched.pop_due(now) == expected
            assert batched.pops == stepped.pops
            assert list(batched) == list(stepped)
    assert batched.pop_due(float("inf")) == [stepped.pop() for _ in range(len(stepped))]
    assert len(batched) == 0 and batched.pops == len(deadlines)


def test_pop_due_merges_the_heap_into_the_fifo_order() -> None:
    queue: LeaseQueue[str] = LeaseQueue()
    for seq, deadline in enumerate([10.0, 20.0, 30.0]):
        queue.push(deadline, seq, f"id{seq}")
    queue.push(15.0, 3, "rearmed")  # out of order: heap
    queue.push(5.0, 4, "early")  # out of order: heap
    assert [owner for _, _, owner in queue.pop_due(20.0)] == ["early", "id0", "rearmed", "id1"]
    assert queue.pop_due(29.0) == [] and queue.pops == 4
    assert queue.peek() == (30.0, 2, "id2")
