"""The blocking client runs a load on the caller's own thread. grpc's sync API would otherwise
start a thread to drive the channel for each streaming call that begins while no other is
open: one thread start per load for a worker that loads one id at a time, paid in CPU and, on
a busy machine, in waiting for that thread to be scheduled. Checked against a real producer
process by counting every `threading.Thread.start` made while loads run."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import numpy as np
import pytest
from conftest import ProducerProcess
from grpc.experimental import ChannelOptions

from kvpark.client import KVConsumer, KVParker, Reason, Timeout


@pytest.mark.parametrize(
    ("timeout", "own_thread"),
    [(10.0, True), (Timeout(total_s=10, first_chunk_s=5), True), (10.0, False)],
    ids=["total", "first-chunk-too", "opted-out"],
)
def test_loads_in_a_row_start_no_thread(
    producer_process: Callable[..., ProducerProcess],
    monkeypatch: pytest.MonkeyPatch,
    timeout: float | Timeout,
    own_thread: bool,
) -> None:
    """With a first-chunk timeout too, whose watchdogs share one thread per client. A caller
    that sets the channel option to 0 gets grpc's thread per load back."""
    producer = producer_process()
    chunk = np.arange(4096, dtype=np.uint8)
    options = [] if own_thread else [(ChannelOptions.SingleThreadedUnaryStream, 0)]
    with KVParker(producer.target, transport="grpc") as parker, KVConsumer(
        producer.target, transport="grpc", confirm=False, channel_options=options
    ) as consumer:  # fmt: skip
        for kid in ("warm-up", "a", "b", "late"):
            assert parker.park(kid, [chunk], timeout=10).ok
        assert parker.release("late", timeout=10).ok
        # The first load reads ServerInfo in the background and starts the first-chunk
        # watchdogs' thread: threads once per client.
        assert consumer.load("warm-up", num_chunks=1, timeout=timeout).ok
        consumer.server_info(timeout=10)
        started: list[str] = []
        real_start = threading.Thread.start

        def counted(thread: threading.Thread) -> None:
            started.append(thread.name)
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", counted)
        loaded = [consumer.load(kid, num_chunks=1, timeout=timeout) for kid in ("a", "b")]
        late = consumer.load("late", num_chunks=1, timeout=timeout)
        monkeypatch.undo()
        assert [r.ok for r in loaded] == [True, True] and late.reason is Reason.RELEASED, late
        assert all(bytes(r.data) == chunk.tobytes() for r in loaded)
        assert (started == []) is own_thread, started


def test_loads_cut_off_mid_stream_leave_nothing_of_their_calls_behind(
    producer_process: Callable[..., ProducerProcess],
) -> None:
    """A load the client cuts off (here its on_chunk raises after the first chunk) cancels
    its call. Read on the caller's thread, a cancelled call keeps grpc's native state until
    its remaining events are read; the client reads them, so hundreds of cut-off loads leave
    no objects behind (without that, five per load)."""
    producer = producer_process()
    chunk = np.arange(4096, dtype=np.uint8)

    class Stop(Exception):
        pass

    def stop(index: int, chunk_id: int, landed: memoryview) -> None:
        raise Stop

    with KVParker(producer.target, transport="grpc") as parker, KVConsumer(
        producer.target, transport="grpc", confirm=False
    ) as consumer:  # fmt: skip
        assert parker.park("two", [chunk, chunk], timeout=10).ok

        def cut_off() -> None:
            with pytest.raises(Stop):
                consumer.load("two", num_chunks=2, on_chunk=stop, timeout=10)

        for _ in range(50):  # warm-up: caches, the channel, the ServerInfo read
            cut_off()
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(300):
            cut_off()
        gc.collect()
        assert len(gc.get_objects()) - before < 100
        assert consumer.load("two", num_chunks=2, timeout=10).ok  # the id is still whole
