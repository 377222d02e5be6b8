"""The blocking client runs a load on the caller's own thread. grpc's sync API would otherwise
start a thread to drive the channel for each streaming call that begins while no other is
open: one thread start per load for a worker that loads one id at a time, paid in CPU and, on
a busy machine, in waiting for that thread to be scheduled. Checked against a real producer
process by counting every `threading.Thread.start` made while loads run."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from conftest import ProducerProcess

from kvpark.client import KVConsumer, KVParker, Reason


def test_loads_in_a_row_start_no_thread(
    producer_process: Callable[..., ProducerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = producer_process()
    chunk = np.arange(4096, dtype=np.uint8)
    with KVParker(producer.target, transport="grpc") as parker, KVConsumer(
        producer.target, transport="grpc", confirm=False
    ) as consumer:  # fmt: skip
        for kid in ("warm-up", "a", "b", "late"):
            assert parker.park(kid, [chunk], timeout=10).ok
        assert parker.release("late", timeout=10).ok
        # The first load reads ServerInfo in the background: a thread, once per client.
        assert consumer.load("warm-up", num_chunks=1, timeout=10).ok
        consumer.server_info(timeout=10)
        started: list[str] = []
        real_start = threading.Thread.start

        def counted(thread: threading.Thread) -> None:
            started.append(thread.name)
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", counted)
        loaded = [consumer.load(kid, num_chunks=1, timeout=10) for kid in ("a", "b")]
        late = consumer.load("late", num_chunks=1, timeout=10)
        monkeypatch.undo()
        assert [r.ok for r in loaded] == [True, True] and late.reason is Reason.RELEASED, late
        assert all(bytes(r.data) == chunk.tobytes() for r in loaded)
        assert started == [], started
