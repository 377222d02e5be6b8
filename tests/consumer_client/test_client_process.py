"""Against `python -m kvpark.producer` subprocesses, where a process must die, restart or
get a signal: a producer SIGKILLed mid-stream, a restarted producer answering an old epoch,
a decode worker interrupted by Ctrl-C mid-load, and one that must not crash on close."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import conftest
import numpy as np
import pytest
from conftest import MiB, ProducerProcess, free_port, wait_for
from consumer_support import park_sync, payload

from kvpark.client import AsyncKVConsumer, KVConsumer, LoadPath, Reason, TransportError

Start = Callable[..., ProducerProcess]


def test_producer_killed_mid_stream_ends_the_load_fast_and_recomputes_the_rest(
    producer_process: Start,
) -> None:
    """Chunks 0-3 of 8 are parked; the stream delivers them and waits for chunk 4. SIGKILL:
    the load ends within a second or two with a transport reason, and `load_or_recompute`
    calls recompute(k) with k = the chunks already loaded (verified, in `into`)."""
    producer = producer_process(max_fetch_wait_s=60)
    chunks = payload(4, 1 * MiB, seed=7)
    assert park_sync(producer.target, "victim", chunks, total=8).chunks_parked == 4
    into = np.zeros(8 * MiB + 64, np.uint8)
    landed: list[int] = []
    recomputed: list[int] = []
    outcome: dict[str, Any] = {}

    def worker() -> None:
        with KVConsumer(producer.target, timeout=30) as client:
            outcome["report"] = client.load_or_recompute(
                "victim",
                num_chunks=8,
                into=into,
                on_chunk=lambda index, cid, data: landed.append(cid),
                recompute=recomputed.append,
            )
            outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=worker)
    thread.start()
    wait_for(lambda: len(landed) == 4, what="the parked chunks to land")
    producer.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the load must end when the producer dies"
    report = outcome["report"]
    assert outcome["ended"] - killed < 2.0, "ended within a second or two of the kill"
    assert report.result.reason is Reason.UNAVAILABLE
    assert report.path is LoadPath.PARTIAL
    assert report.result.chunks_loaded == 4 and recomputed == [4]
    assert report.recomputed_from == 4
    n = sum(len(c) for c in chunks.values())
    assert into[:n].tobytes() == b"".join(chunks[i] for i in range(4))


async def test_async_load_ends_fast_when_the_producer_is_killed(producer_process: Start) -> None:
    producer = producer_process(max_fetch_wait_s=60)
    park_sync(producer.target, "victim", payload(1, 1000), total=2)
    landed = asyncio.Event()
    async with AsyncKVConsumer(producer.target) as client:
        task = asyncio.create_task(
            client.load("victim", num_chunks=2, on_chunk=lambda *_: landed.set())
        )
        await asyncio.wait_for(landed.wait(), 10)
        producer.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        result = await asyncio.wait_for(task, 10)
        assert time.monotonic() - killed < 2.0
        assert result.reason is Reason.UNAVAILABLE and result.chunks_loaded == 1
        # The next contact fails fast too, as a value for loads and an exception for RPCs.
        assert (await client.load("victim", num_chunks=1)).reason is Reason.UNAVAILABLE
        try:
            await client.lookup(["victim"])
        except TransportError:
            pass
        else:
            raise AssertionError("lookup on a dead producer must raise TransportError")


def test_restarted_producer_answers_epoch_mismatch_at_once(
    producer_process: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both processes must listen on the same port. conftest.start_producer_process computes its
    # target from the port it draws (a `listen` override is not reflected in `.target`), so
    # the ports it draws are pinned instead: (grpc, metrics) for each start.
    port = free_port()
    drawn = iter([port, free_port(), port, free_port()])
    monkeypatch.setattr(conftest, "free_port", lambda: next(drawn))
    first = producer_process()
    with KVConsumer(first.target) as client:
        old_epoch = client.server_info().producer_epoch
        reply = park_sync(first.target, "kv-1", payload(2, 1000), total=2)
        assert reply.producer_epoch == old_epoch
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
        second = producer_process()
        assert second.target == first.target
        # Same client, same channel: it reconnects to the new process by itself.
        result = client.load("kv-1", num_chunks=2, expected_epoch=old_epoch)
        assert result.reason is Reason.EPOCH_MISMATCH, result
        assert result.elapsed_s < 1.0, "answered at once"
        assert result.path is LoadPath.RECOMPUTE
        assert result.producer_epoch not in (0, old_epoch)  # the new process answered
        new_epoch = client.server_info().producer_epoch  # re-read after the mismatch
        assert new_epoch not in (0, old_epoch)
        # The id itself died with the old process.
        assert client.lookup(["kv-1"])[0].state == "UNKNOWN"
        assert second.proc.poll() is None, "the new producer is still up"


# The decode worker of the Ctrl-C test: loads `argv[2]` over the gRPC stream on its main
# thread, says when the parked chunks have landed, and after the KeyboardInterrupt loads them
# again on the same client.
_INTERRUPTED_WORKER = """
import sys
from kvpark.client import KVConsumer

target, kid, parked = sys.argv[1], sys.argv[2], int(sys.argv[3])
landed = []

def on_chunk(index, chunk_id, data):
    landed.append(chunk_id)
    if len(landed) == parked:
        print("landed", flush=True)

with KVConsumer(target, timeout=30, transport="grpc") as client:
    try:
        client.load(kid, num_chunks=parked + 1, on_chunk=on_chunk)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    again = client.load(kid, num_chunks=parked, timeout=10, confirm=False)
    print("again", again.ok, again.chunks_loaded, flush=True)
"""


def test_ctrl_c_in_a_load_leaves_the_client_usable(producer_process: Start) -> None:
    """Ctrl-C while a load on the main thread waits for its next chunk: the KeyboardInterrupt
    reaches the caller at once, and the same client loads the id again. The signal lands
    inside grpc's own reading of the call; draining that call afterwards used to block the
    worker for ever."""
    producer = producer_process(max_fetch_wait_s=60)
    park_sync(producer.target, "ctrl-c", payload(4, 64 * 1024), total=5)
    worker = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_WORKER, producer.target, "ctrl-c", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "landed"
        worker.send_signal(signal.SIGINT)
        output, _ = worker.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        raise AssertionError(f"the worker hung after Ctrl-C: {worker.communicate()[0]}") from None
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, output
    assert output.split("\n")[:2] == ["interrupted", "again True 4"], output


# The decode worker of the close test: its interceptor holds the first Release (the load's
# background confirmation) until the client is closed, as an auth refresh or a retry's back-off
# would; the confirmation then goes on into a closed channel.
_HELD_CONFIRM_WORKER = """
import sys, threading
import grpc
from kvpark.client import KVConsumer

target, kid = sys.argv[1], sys.argv[2]
entered, go_on = threading.Event(), threading.Event()

class HoldFirstRelease(grpc.UnaryUnaryClientInterceptor):
    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/Release") and not entered.is_set():
            entered.set()
            go_on.wait(30)
        return continuation(details, request)

client = KVConsumer(target, timeout=30, interceptors=[HoldFirstRelease()])
print("loaded", client.load(kid, num_chunks=1).ok, flush=True)
assert entered.wait(30)
client.close()
go_on.set()
for thread in threading.enumerate():
    if thread.name.startswith("kvpark-confirm"):
        thread.join(30)
print("closed", client.lookup is not None, flush=True)
"""


def test_a_confirmation_held_in_an_interceptor_past_close_does_not_crash(
    producer_process: Start,
) -> None:
    """A client with an interceptor is closed while its background confirmation is still in
    the interceptor; the confirmation then meets a closed channel and is dropped. grpc builds
    each intercepted call on the channel anew, and building one on a closed channel crashed
    the whole worker with a segmentation fault."""
    producer = producer_process()
    park_sync(producer.target, "held", payload(1, 1000))
    worker = subprocess.run(
        [sys.executable, "-c", _HELD_CONFIRM_WORKER, producer.target, "held"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert worker.stdout.split("\n")[:2] == ["loaded True", "closed True"], worker.stdout


@pytest.mark.filterwarnings("ignore::kvpark.client.TimeoutConfigWarning")
def test_close_ends_a_load_reading_a_silent_data_connection_at_once(
    producer_process: Start,
) -> None:
    """Chunk 0 of 2 is parked: the load reads it over TCP and waits on its data connection
    for chunk 1. The producer then stops (SIGSTOP: its sockets stay open, nothing answers),
    and close() must end the load CANCELLED, not leave it reading until its 60 s timeout."""
    producer = producer_process(data_listen="127.0.0.1:0")
    park_sync(producer.target, "half", {0: bytes(MiB)}, total=2)
    consumer = KVConsumer(producer.target, transport="tcp", timeout=60)
    first_landed = threading.Event()
    outcome: dict[str, Any] = {}

    def load() -> None:
        on_chunk = lambda *_: first_landed.set()  # noqa: E731
        outcome["result"] = consumer.load("half", num_chunks=2, on_chunk=on_chunk)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        wait_for(first_landed.is_set, what="chunk 0 over the data connection")
        producer.proc.send_signal(signal.SIGSTOP)
        consumer.close()
        loader.join(timeout=10)
        assert not loader.is_alive(), "the load went on reading after close()"
    finally:
        producer.proc.send_signal(signal.SIGCONT)
        consumer.close()
        loader.join()
    result = outcome["result"]
    assert result.reason is Reason.CANCELLED, result
    assert result.transport == "tcp" and result.chunks_loaded == 1, result
