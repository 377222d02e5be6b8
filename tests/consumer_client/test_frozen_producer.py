"""A producer that stops answering while a load reads its TCP data connection (SIGSTOP: its
sockets stay open and silent, as with a frozen process; a host gone dark looks the same to
the call). The load must end as one over the gRPC stream does, UNAVAILABLE once the channel's
keepalive gives up on the call (a ping every 2 s, 2 s to answer), not at its own deadline, and
not never when it has none. And a load whose call is watched for a while (the blocking client
reads it on a thread of its own past a second) still ends whole when the bytes come late."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
from conftest import MiB, ProducerProcess, wait_for
from consumer_support import no_thread_starts, park_sync, payload

from kvpark import AsyncKVConsumer, KVConsumer, Reason

Start = Callable[..., ProducerProcess]

# Far longer than keepalive takes to give up (and below the producer's tombstone retention):
# a load that ends sooner did not wait it out.
LOAD_TIMEOUT_S = 45.0
# How long the test waits for the load to end once the producer froze: keepalive gives up
# within about 4 s (plus the blocking client's second before it watches the call).
NOTICED_WITHIN_S = 20.0


def _load_in_thread(
    consumer_kind: str, target: str, timeout: float | None, first_landed: threading.Event
) -> tuple[threading.Thread, dict[str, Any]]:
    """A TCP load of "half" (2 chunks) on a thread of its own, by the blocking or the asyncio
    client; `first_landed` is set once chunk 0 is in."""
    outcome: dict[str, Any] = {}

    def on_chunk(*_: Any) -> None:
        first_landed.set()

    def run() -> None:
        if consumer_kind == "sync":
            with KVConsumer(target, transport="tcp", timeout=timeout) as consumer:
                outcome["result"] = consumer.load("half", num_chunks=2, on_chunk=on_chunk)
        else:

            async def load() -> Any:
                async with AsyncKVConsumer(target, transport="tcp", timeout=timeout) as consumer:
                    return await consumer.load("half", num_chunks=2, on_chunk=on_chunk)

            outcome["result"] = asyncio.run(load())

    loader = threading.Thread(target=run, daemon=True)
    loader.start()
    return loader, outcome


@pytest.mark.parametrize("timeout", [LOAD_TIMEOUT_S, None], ids=["bounded", "unbounded"])
@pytest.mark.parametrize("consumer_kind", ["sync", "async"])
@pytest.mark.filterwarnings("ignore::kvpark.client.TimeoutConfigWarning")
def test_a_frozen_producer_ends_a_tcp_load_as_it_ends_a_stream(
    producer_process: Start, consumer_kind: str, timeout: float | None
) -> None:
    """Chunk 0 of 2 is parked: the load reads it over TCP and waits on its data connection
    for chunk 1. The producer then freezes."""
    producer = producer_process(data_listen="127.0.0.1:0")
    park_sync(producer.target, "half", {0: bytes(MiB)}, total=2)
    first_landed = threading.Event()
    loader, outcome = _load_in_thread(consumer_kind, producer.target, timeout, first_landed)
    try:
        wait_for(first_landed.is_set, what="chunk 0 over the data connection")
        os.kill(producer.proc.pid, signal.SIGSTOP)
        loader.join(NOTICED_WITHIN_S)
        assert not loader.is_alive(), "the load went on reading from a producer that froze"
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
        loader.join()
    result = outcome["result"]
    assert result.reason is Reason.UNAVAILABLE, result
    assert result.transport == "tcp" and result.chunks_loaded == 1, result


@pytest.mark.parametrize("watch_thread", ["starts", "cannot start"])
def test_a_long_read_whose_call_is_watched_still_ends_whole(
    producer_process: Start, watch_thread: str
) -> None:
    """Chunk 1 is parked only once the blocking client watches the call (a thread reads it
    while the caller's thread reads the data connection): the TransferDone that thread reads
    is the load's, which ends ok with every byte and is confirmed. Where no thread can be
    started (a pids limit), the load goes on unwatched, as well."""
    producer = producer_process(data_listen="127.0.0.1:0")
    chunks = payload(2, MiB, seed=7)
    park_sync(producer.target, "half", {0: chunks[0]}, total=2)
    first_landed = threading.Event()
    refusing = (
        no_thread_starts("kvpark-call-watch")
        if watch_thread == "cannot start"
        else contextlib.nullcontext(threading.Event())
    )
    with (
        refusing as refused,
        KVConsumer(producer.target, transport="tcp", timeout=LOAD_TIMEOUT_S) as consumer,
    ):
        outcome: dict[str, Any] = {}

        def load() -> None:
            on_chunk = lambda *_: first_landed.set()  # noqa: E731
            outcome["result"] = consumer.load(
                "half", num_chunks=2, on_chunk=on_chunk, confirm=False
            )

        loader = threading.Thread(target=load)
        loader.start()
        wait_for(first_landed.is_set, what="chunk 0 over the data connection")
        wait_for(
            lambda: (
                refused.is_set()
                or any(t.name == "kvpark-call-watch" for t in threading.enumerate())
            ),
            what="the call watched",
        )
        park_sync(producer.target, "half", {1: chunks[1]}, total=2)
        loader.join(NOTICED_WITHIN_S)
        assert not loader.is_alive(), "the load did not end after its last chunk came"
        result = outcome["result"]
        assert result.ok and result.transport == "tcp", result
        assert result.data is not None and result.data.tobytes() == chunks[0] + chunks[1]
        assert consumer.confirm(result).ok
    assert not any(t.name == "kvpark-call-watch" for t in threading.enumerate())
