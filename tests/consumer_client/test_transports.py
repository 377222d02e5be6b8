"""Every transport end to end against a real producer: the bytes and their CRC32C, reason codes,
cancel from either side, a producer killed mid-transfer, tickets that are reused or forged,
TLS on the data connection, a lent buffer too small, the pool's invariants after each case.
The state machine is the same whatever moves the bytes, so each case checks the outcome the
gRPC stream would have given. Park by reference is also driven frame by frame, to show the
grouping of ChunkRefs and what a bad group leaves behind."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import MiB, running_producer, wait_for, wait_until
from prometheus_client import CollectorRegistry

from kvpark import (
    AsyncKVConsumer,
    AsyncKVParker,
    BufferTooSmallError,
    ConsumerMetrics,
    KVConsumer,
    KVParker,
    Reason,
    RequestRejectedError,
    State,
    Timeout,
    wire,
)
from kvpark.checksum import crc32c_of
from kvpark.client._tcp import RETRY_AFTER_S
from kvpark.pb import kvpark_pb2 as pb
from kvpark.shm import FETCH_ROLE, PARK_ROLE, SharedBuffer, ShmLender, split_call_id
from kvpark.tcp_frames import ACCEPTED, HEADER_BYTES, TICKET_BYTES, recv_header, recv_payload

CHUNK = MiB
SETTINGS: dict[str, Any] = {
    "data_listen": "127.0.0.1:0",
    "max_chunk_bytes": 4 * MiB,
    "pool_bytes": 128 * MiB,
}


@pytest.fixture
def shm_socket() -> Iterator[str]:
    # Unix socket paths are short (107 bytes): pytest's tmp_path can be too long.
    directory = tempfile.mkdtemp(prefix="kvpark-")
    yield os.path.join(directory, "shm.sock")
    shutil.rmtree(directory, ignore_errors=True)


def chunks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK, dtype=np.uint8) for _ in range(n)]


def joined(parts: list[np.ndarray]) -> bytes:
    return b"".join(p.tobytes() for p in parts)


def destination(consumer: KVConsumer, transport: str, n: int) -> Any:
    """Where `n` chunks land: a shared buffer for shared memory, a plain array otherwise."""
    if transport == "shm":
        return consumer.shared_buffer(n * CHUNK)
    return np.zeros(n * CHUNK, np.uint8)


async def in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


# ========================================================================= bytes, reasons
@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
async def test_every_transport_loads_the_bytes_and_reports_itself(
    transport: str, shm_socket: str
) -> None:
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        data = chunks(6, seed=1)

        def run() -> tuple[Any, Any, bytes]:
            with (
                KVParker(server.target, shm_socket=shm_socket) as parker,
                KVConsumer(server.target, transport=transport, shm_socket=shm_socket) as c,
            ):
                parked = parker.park("t", data)
                into = (
                    c.shared_buffer(6 * CHUNK)
                    if transport == "shm"
                    else np.zeros(6 * CHUNK, np.uint8)
                )
                return parked, c.load("t", num_chunks=6, into=into), into.tobytes()

        parked, loaded, landed = await in_thread(run)
        assert parked.ok and parked.transport == "shm"
        assert loaded.ok and loaded.transport == transport, loaded
        assert landed == joined(data) and loaded.chunk_sizes == (CHUNK,) * 6
        sent = server.metrics.registry.get_sample_value(
            "kvpark_sent_bytes_total", {"transport": transport}
        )
        assert sent == 6 * CHUNK, sent
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="confirmed")
        server.lot.check_invariants()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_out_of_band_transports_answer_the_same_reasons(
    transport: str, shm_socket: str
) -> None:
    """REAPED at once, WAIT_TIMEOUT after a stall, EPOCH_MISMATCH: the same answers in the
    same round trip, whatever transport was offered."""
    async with running_producer(
        **SETTINGS, shm_socket=shm_socket, unbound_store_timeout_s=0.3
    ) as server:

        def run() -> list[Any]:
            with (
                KVParker(server.target) as parker,
                KVConsumer(server.target, transport=transport, shm_socket=shm_socket) as c,
            ):
                assert parker.park("gone", chunks(1)).ok
                time_to_reap = time.monotonic() + 5
                while c.lookup(["gone"])[0].state != "TOMBSTONED":
                    assert time.monotonic() < time_to_reap
                    time.sleep(0.02)
                assert parker.park("half", {0: chunks(1)[0]}, total_chunks=2).ok
                into = (
                    c.shared_buffer(2 * CHUNK)
                    if transport == "shm"
                    else np.zeros(2 * CHUNK, np.uint8)
                )
                return [
                    c.load("gone", num_chunks=1, into=into),
                    c.load("half", num_chunks=2, into=into, wait_timeout_s=0.2),
                    c.load("half", num_chunks=2, into=into, expected_epoch=server.epoch ^ 1),
                ]

        reaped, stalled, mismatch = await in_thread(run)
        assert reaped.reason is Reason.REAPED and reaped.elapsed_s < 1
        assert stalled.reason is Reason.WAIT_TIMEOUT and stalled.chunks_loaded == 1
        assert stalled.transport == transport  # the first chunk came over it
        assert mismatch.reason is Reason.EPOCH_MISMATCH
        server.lot.check_invariants()


# ===================================================================================== cancel
@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_consumer_that_gives_up_mid_transfer_leaves_the_id_parked(
    transport: str, shm_socket: str
) -> None:
    """The client's timeout fires while the bytes flow (a fetch before the last chunk is
    parked): it cancels, the producer stops, and the id is PARKED again for a retry. Over
    shared memory the load returns only once no producer call can still copy into the
    caller's buffer."""
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:

        def run() -> tuple[Any, Any]:
            with (
                KVParker(server.target) as parker,
                KVConsumer(server.target, transport=transport, shm_socket=shm_socket) as c,
            ):
                data = chunks(4, seed=3)
                assert parker.park("c", {i: data[i] for i in range(3)}, total_chunks=4).ok
                into = (
                    c.shared_buffer(4 * CHUNK)
                    if transport == "shm"
                    else np.zeros(4 * CHUNK, np.uint8)
                )
                cut = c.load("c", num_chunks=4, into=into, timeout=0.5)
                if transport == "shm":
                    # Settled before the load returned: no producer call holds the lent
                    # buffer any more, so no late copy can land in it. The lend itself stays
                    # for the next load.
                    assert server.shm is not None and server.shm.held_lends == 0
                    assert server.shm.lend_count == 1
                assert parker.park("c", {3: data[3]}, total_chunks=4).ok
                return cut, c.load("c", num_chunks=4, into=into)

        cut, retried = await in_thread(run)
        assert cut.reason is Reason.TIMEOUT and cut.chunks_loaded == 3
        assert cut.transport == transport  # known from the first message, not only the last
        assert retried.ok and retried.transport == transport
        server.lot.check_invariants()


@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
async def test_on_chunk_sees_each_chunks_bytes_also_when_it_lands_in_pieces(
    transport: str, shm_socket: str
) -> None:
    """A paged destination (each chunk in two halves, as a layer's K and V): `on_chunk` gets
    the chunk's bytes whatever carried them, as for one buffer, and they stay its bytes after
    the client's next load (over shm that load reuses the staging buffer)."""
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        data, later = chunks(3, seed=7), chunks(3, seed=8)

        def paged(whole: Any) -> list[Any]:
            halves = [whole[i * CHUNK // 2 : (i + 1) * CHUNK // 2] for i in range(6)]
            return [halves[2 * i : 2 * i + 2] for i in range(3)]

        def run() -> tuple[list[Any], list[memoryview], Any]:
            seen: list[memoryview] = []
            with (
                KVParker(server.target) as parker,
                KVConsumer(server.target, transport=transport, shm_socket=shm_socket) as c,
            ):
                whole = destination(c, transport, 3)  # pieces of a shared buffer for shm
                assert parker.park("paged", data).ok and parker.park("later", later).ok
                loaded = [
                    c.load(
                        "paged",
                        num_chunks=3,
                        into=paged(whole),
                        on_chunk=lambda index, chunk_id, view: seen.append(view),
                    ),
                    c.load("later", num_chunks=3, into=paged(np.zeros(3 * CHUNK, np.uint8))),
                ]
            return loaded, seen, whole

        loaded, seen, whole = await in_thread(run)
    assert all(r.ok and r.transport == transport for r in loaded), loaded
    assert [bytes(view) for view in seen] == [d.tobytes() for d in data]
    assert bytes(whole) == joined(data)


@pytest.mark.parametrize("into", ["shared", "plain", "paged"])
async def test_shm_loads_chunks_over_the_clients_message_limit_into_any_destination(
    into: str, shm_socket: str
) -> None:
    """A client's max_chunk_bytes is the largest gRPC message it takes; shared memory moves no
    chunk in a message, so a producer's larger chunks load over it, into a shared buffer
    (in place) or through the staging buffer (a plain array, one destination per chunk)."""
    big = 2 * CHUNK
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        rng = np.random.default_rng(9)
        data = [rng.integers(0, 256, big, dtype=np.uint8) for _ in range(2)]

        def run() -> tuple[Any, Any]:
            with (
                KVParker(server.target) as parker,
                KVConsumer(
                    server.target, transport="shm", shm_socket=shm_socket, max_chunk_bytes=CHUNK
                ) as c,
            ):
                assert parker.park("big", data).ok
                whole = (
                    c.shared_buffer(2 * big) if into == "shared" else np.zeros(2 * big, np.uint8)
                )
                halves = [whole[i * CHUNK : (i + 1) * CHUNK] for i in range(4)]
                target = [halves[0:2], halves[2:4]] if into == "paged" else whole
                return c.load("big", num_chunks=2, into=target), whole

        loaded, whole = await in_thread(run)
    assert loaded.ok and loaded.transport == "shm", loaded
    assert bytes(whole) == joined(data)


@pytest.mark.parametrize("error", [OSError(28, "no space left"), TimeoutError("queue full")])
@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
async def test_what_on_chunk_raises_reaches_the_caller_on_every_transport(
    transport: str, error: Exception, shm_socket: str
) -> None:
    """The caller's own OSError or TimeoutError from `on_chunk` is raised to it as it was,
    whatever carries the bytes: not taken for a broken data connection or the load's
    timeout. The id keeps its bytes for the next load."""
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:

        def run() -> Any:
            def refuse_the_second(index: int, chunk_id: int, view: Any) -> None:
                if chunk_id == 1:
                    raise error

            with (
                KVParker(server.target) as parker,
                KVConsumer(server.target, transport=transport, shm_socket=shm_socket) as c,
            ):
                data = chunks(3, seed=5)
                assert parker.park("cb", data).ok
                with pytest.raises(type(error)) as raised:
                    c.load("cb", num_chunks=3, into=destination(c, transport, 3),
                           on_chunk=refuse_the_second, timeout=5)  # fmt: skip
                assert raised.value is error
                # The client cancelled its Fetch; the id is free again once the producer saw it.
                wait_for(
                    lambda: c.lookup(["cb"])[0].state != State.BOUND,
                    what="the cancelled Fetch to let the id go",
                )
                return c.load("cb", num_chunks=3, into=destination(c, transport, 3)), data

        again, data = await in_thread(run)
        assert again.ok and again.transport == transport, again
        assert again.data.tobytes() == joined(data)
        server.lot.check_invariants()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_a_load_cut_off_before_its_first_byte_names_the_transport_it_waited_on(
    transport: str, shm_socket: str
) -> None:
    """The first chunk is not parked yet when the client's timeout fires: no byte moved, and
    the result still says which path the load was on (metrics count failures per transport)."""
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:

        def run() -> Any:
            with (
                KVParker(server.target) as parker,
                KVConsumer(server.target, transport=transport, shm_socket=shm_socket) as c,
            ):
                assert parker.park("late-first", {1: chunks(2)[1]}, total_chunks=2).ok
                return c.load("late-first", num_chunks=2, into=destination(c, transport, 2),
                              timeout=0.5)  # fmt: skip

        cut = await in_thread(run)
        assert cut.reason is Reason.TIMEOUT and cut.chunks_loaded == 0, cut
        assert cut.transport == transport, cut
        server.lot.check_invariants()


async def test_an_async_shm_load_cut_off_returns_once_no_copy_can_land(shm_socket: str) -> None:
    """The async client settles a cut-off shm load as the blocking one does: by the time the
    load returns, no producer call holds the lent buffer."""
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        data = chunks(4, seed=6)

        def park_some() -> None:
            with KVParker(server.target) as parker:
                assert parker.park("a", {i: data[i] for i in range(3)}, total_chunks=4).ok

        await in_thread(park_some)
        async with AsyncKVConsumer(server.target, transport="shm", shm_socket=shm_socket) as c:
            into = c.shared_buffer(4 * CHUNK)
            cut = await c.load("a", num_chunks=4, into=into, timeout=0.5)
            assert server.shm is not None and server.shm.held_lends == 0
            assert cut.reason is Reason.TIMEOUT and cut.chunks_loaded == 3
            assert cut.transport == "shm" and into[: 3 * CHUNK].tobytes() == joined(data[:3])
        server.lot.check_invariants()


async def test_the_producer_ending_a_tcp_transfer_says_why_on_the_call() -> None:
    """The producer fails the transfer mid-way (shutdown): it closes the data connection and
    the TransferDone on the gRPC call gives the reason; the loaded prefix counts."""
    async with running_producer(**SETTINGS, shutdown_grace_s=0.2) as server:
        data = chunks(4, seed=4)

        def park_some() -> None:
            with KVParker(server.target) as parker:
                assert parker.park("s", {i: data[i] for i in range(2)}, total_chunks=4).ok

        await in_thread(park_some)
        consumer = KVConsumer(server.target, transport="tcp")
        loading = asyncio.ensure_future(
            in_thread(lambda: consumer.load("s", num_chunks=4, into=np.zeros(4 * CHUNK, np.uint8)))
        )
        await wait_until(lambda: server.lot.bound_count == 1, what="bound")
        await server.shutdown(grace_s=0.1)
        result = await loading
        consumer.close()
        assert result.reason is Reason.SHUTTING_DOWN and result.chunks_loaded == 2


@contextmanager
def cutting_proxy(upstream_port: int, pass_bytes: int, total_bytes: int) -> Iterator[int]:
    """A port in front of the producer's data port, as a middlebox that cuts connections: it
    forwards the consumer's ticket, passes `pass_bytes` of the producer's answer, then closes
    the consumer's side mid-frame and drains the rest of the `total_bytes` the producer sends,
    so the producer sends every frame and ends its Fetch OK while the consumer got only part
    of them. (A close, not a reset: a reset would also discard what the consumer's kernel
    already holds, so how many chunks it got would depend on timing.)"""
    listener = socket.create_server(("127.0.0.1", 0))

    def relay() -> None:
        consumer, _ = listener.accept()
        with socket.create_connection(("127.0.0.1", upstream_port)) as producer:
            consumer.settimeout(10)
            producer.settimeout(10)
            producer.sendall(consumer.recv(TICKET_BYTES, socket.MSG_WAITALL))
            passed = 0
            while passed < pass_bytes:
                piece = producer.recv(min(65536, pass_bytes - passed))
                consumer.sendall(piece)
                passed += len(piece)
            consumer.close()
            while passed < total_bytes:  # ... and the producer's last frames go nowhere
                passed += len(producer.recv(1 << 20))

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        thread.join(15)
        listener.close()


async def test_a_data_connection_cut_on_the_way_is_unavailable_and_the_id_loads_again() -> None:
    """The network (here a proxy) cuts the data connection after the producer has sent
    every frame: the producer ends the Fetch OK, the consumer got one chunk. That is the
    path failing, UNAVAILABLE with what broke, not a producer breaking the contract; the id
    keeps its bytes for the delivery grace, and the next load gets them all."""
    data = chunks(3, seed=12)
    async with running_producer(**SETTINGS) as server:
        assert server.data is not None
        # The ACCEPTED byte, three frames and the end frame.
        total = len(ACCEPTED) + 3 * (HEADER_BYTES + CHUNK) + HEADER_BYTES
        with cutting_proxy(server.data.port, CHUNK + 4096, total) as port:
            server.servicer.offer(data=server.data, data_address=f"127.0.0.1:{port}", shm=None)

            def run() -> Any:
                with KVParker(server.target) as parker:
                    assert parker.park("r", data).ok
                with KVConsumer(server.target, transport="tcp") as c:
                    return c.load("r", num_chunks=3, into=np.zeros(3 * CHUNK, np.uint8))

            broken = await in_thread(run)
        server.servicer.offer(
            data=server.data, data_address=f"127.0.0.1:{server.data.port}", shm=None
        )

        def again() -> Any:
            with KVConsumer(server.target, transport="tcp") as c:
                return c.load("r", num_chunks=3)

        retried = await in_thread(again)
        server.lot.check_invariants()
    assert broken.reason is Reason.UNAVAILABLE and broken.chunks_loaded == 1, broken
    assert "data connection broke after 1 of 3 chunks" in broken.detail, broken
    assert retried.ok and retried.transport == "tcp" and retried.data.tobytes() == joined(data)


_TCP_PRODUCER_KILLED = textwrap.dedent(
    """
    import sys, time, numpy as np
    from kvpark import KVParker
    with KVParker(sys.argv[1]) as parker:
        rng = np.random.default_rng(0)
        chunk = lambda: rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        assert parker.park("k", {i: chunk() for i in range(2)}, total_chunks=8).ok
    print("parked", flush=True)
    """
)


def test_a_producer_killed_mid_transfer_ends_the_load_within_two_seconds(
    producer_process: Any,
) -> None:
    """SIGKILL of the producer while a TCP load waits for more chunks: the load ends (the
    data connection and the call both break) within 2 s with what it had, and the caller
    falls back."""
    producer = producer_process(**{**SETTINGS, "data_listen": "127.0.0.1:0"})
    parked = subprocess.run(
        [sys.executable, "-c", _TCP_PRODUCER_KILLED, producer.target],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert parked.stdout.strip() == "parked", parked.stderr
    with KVConsumer(producer.target, transport="tcp", timeout=30) as consumer:
        killer = __import__("threading").Timer(0.5, producer.proc.send_signal, (signal.SIGKILL,))
        killer.start()
        started = time.monotonic()
        recomputed: list[int] = []
        report = consumer.load_or_recompute(
            "k", num_chunks=8, into=np.zeros(8 * MiB, np.uint8), recompute=recomputed.append
        )
        elapsed = time.monotonic() - started - 0.5
        killer.join()
    assert report.reason in (Reason.UNAVAILABLE, Reason.CANCELLED), report.result
    assert report.result.chunks_loaded == 2 and recomputed == [2]
    assert elapsed < 2.0, f"noticed {elapsed:.2f}s after the kill"


# ============================================================================= head of line
def _connect_and_read_nothing(port: int, ticket: bytes) -> socket.socket:
    """A data connection whose consumer presents its ticket and then reads nothing: its small
    receive window fills after a few frames, and the producer's writes to it stop."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: sets the window
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    sock.sendall(ticket)
    assert sock.recv(1) == ACCEPTED
    assert sock.recv(1, socket.MSG_PEEK)  # frames flow: a write to it has started
    return sock


def _read_frames(sock: socket.socket) -> list[tuple[int, int, bytes]]:
    """Every frame up to the producer's close, as (chunk_id, crc32c, payload)."""
    frames = []
    while (header := recv_header(sock)) is not None:
        chunk_id, crc32c, nbytes = header
        payload = bytearray(nbytes)
        recv_payload(sock, [memoryview(payload)], nbytes)
        frames.append((chunk_id, crc32c, bytes(payload)))
    return frames


async def test_consumers_that_stop_reading_hold_up_no_other_transfer(shm_socket: str) -> None:
    """More stalled TCP consumers than data threads: while their fetches wait on them (up to
    fetch_stall_timeout_s), another TCP fetch and an shm park run at once, well inside a load
    timeout far shorter than the stall bound. The stalled fetches keep their ids meanwhile."""
    from kvpark.pb import kvpark_pb2_grpc as pb_grpc

    settings = {**SETTINGS, "fetch_stall_timeout_s": 120.0, "data_threads": 2}
    async with running_producer(**settings, shm_socket=shm_socket) as server:
        big = chunks(24, seed=21)
        honest = chunks(4, seed=22)

        def park_all() -> None:
            with KVParker(server.target, transport="grpc") as parker:
                for kid in ("slow-0", "slow-1", "slow-2"):
                    assert parker.park(kid, big).ok
                assert parker.park("honest", honest).ok

        await in_thread(park_all)
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            calls, socks = [], []
            for kid in ("slow-0", "slow-1", "slow-2"):
                request = pb.FetchRequest(kv_request_id=kid, accept_transports=[pb.TRANSPORT_TCP])
                calls.append(stub.Fetch(request))
                offer = (await calls[-1].read()).data_offer
                socks.append(
                    await in_thread(_connect_and_read_nothing, server.data_port, offer.ticket)
                )

            def meanwhile() -> tuple[Any, Any, bytes]:
                with (
                    KVConsumer(server.target, transport="tcp", timeout=10) as consumer,
                    KVParker(server.target, transport="shm", shm_socket=shm_socket) as parker,
                ):
                    into = np.zeros(4 * CHUNK, np.uint8)
                    loaded = consumer.load("honest", num_chunks=4, into=into)
                    kv = parker.shared_buffer(4 * CHUNK)
                    kv[:] = np.frombuffer(joined(honest), np.uint8)
                    parked = parker.park(
                        "parked-meanwhile",
                        [kv[i * CHUNK : (i + 1) * CHUNK] for i in range(4)],
                        timeout=10,
                    )
                    return loaded, parked, into.tobytes()

            loaded, parked, landed = await in_thread(meanwhile)
            assert loaded.ok and loaded.transport == "tcp", loaded
            assert landed == joined(honest)
            assert parked.ok and parked.transport == "shm", parked
            assert server.lot.bound_count == 3  # the stalled fetches still hold their ids
            # One stalled consumer reads again: its transfer resumes where its writes paused,
            # every frame whole and in order, and the call ends OK.
            assert await in_thread(_read_frames, socks[0]) == [
                (i, crc32c_of(c), c.tobytes()) for i, c in enumerate(big)
            ]
            assert (await calls[0].read()).done.status == pb.STATUS_OK
            for call, sock in zip(calls[1:], socks[1:], strict=True):
                call.cancel()
                sock.close()
            await wait_until(lambda: server.lot.bound_count == 0, what="stalled fetches ended")
            socks[0].close()
        server.lot.check_invariants()


# ==================================================================================== tickets
async def test_a_forged_or_reused_ticket_is_refused_with_nothing_sent() -> None:
    async with running_producer(**SETTINGS) as server:
        port = server.data_port

        def attempt(ticket: bytes, enough: int = 1 << 62) -> bytes:
            """What the producer sends back for `ticket`, up to `enough` bytes or its close."""
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(ticket)
                sock.shutdown(socket.SHUT_WR)  # nothing more comes from this side
                got = b""
                while len(got) < enough and (chunk := sock.recv(65536)):
                    got += chunk
                return got

        assert await in_thread(attempt, os.urandom(TICKET_BYTES)) == b""  # forged
        assert await in_thread(attempt, b"short") == b""  # not even a ticket
        # A real ticket, used twice: the second connection gets nothing.
        data = chunks(2, seed=5)

        def park() -> None:
            with KVParker(server.target) as parker:
                assert parker.park("r", {0: data[0]}, total_chunks=2).ok

        await in_thread(park)
        import grpc

        from kvpark.pb import kvpark_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(server.target) as channel:
            request = pb.FetchRequest(kv_request_id="r", accept_transports=[pb.TRANSPORT_TCP])
            call = pb_grpc.KVProducerStub(channel).Fetch(request)
            offer = (await call.read()).data_offer
            first = await in_thread(attempt, offer.ticket, 1 + 16 + CHUNK)
            assert first[:1] == ACCEPTED and len(first) > CHUNK  # chunk 0's frame came
            assert await in_thread(attempt, offer.ticket) == b""  # reused
            call.cancel()
        assert server.data.refused == 3
        server.lot.check_invariants()


# ======================================================================================= TLS
async def test_the_data_connection_runs_tls_when_the_producer_does(tmp_path: Path) -> None:
    import grpc
    from tls_certs import make_certs

    certs = make_certs(tmp_path)
    async with running_producer(
        **SETTINGS,
        tls_cert_file=str(certs.server_cert),
        tls_key_file=str(certs.server_key),
    ) as server:
        data = chunks(3, seed=6)
        ca = certs.ca.read_bytes()
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        options = [("grpc.ssl_target_name_override", "localhost")]
        context = ssl.create_default_context(cadata=ca.decode())
        context.check_hostname = False  # the test certificate names localhost, we dial 127.0.0.1

        def run() -> tuple[Any, Any]:
            with KVParker(server.target, credentials=creds, channel_options=options) as parker:
                assert parker.park("tls", data).ok
            with KVConsumer(
                server.target, credentials=creds, channel_options=options, data_tls=context
            ) as c:
                loaded = c.load("tls", num_chunks=3, into=np.zeros(3 * CHUNK, np.uint8))
                return loaded, c.server_info()

        loaded, info = await in_thread(run)
        assert info.data_tls and loaded.ok and loaded.transport == "tcp"


async def test_without_data_tls_a_tls_producer_is_loaded_over_grpc_and_the_client_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Loads still work, over the slower gRPC stream; the client warns once that the producer's
    zero-copy TCP went unused for want of `data_tls`, and its metrics count the loads by the
    transport that carried them."""
    import grpc
    from tls_certs import make_certs

    certs = make_certs(tmp_path)
    registry = CollectorRegistry()
    async with running_producer(
        **SETTINGS, tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.server_key)
    ) as server:
        creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
        options = [("grpc.ssl_target_name_override", "localhost")]

        def run() -> list[Any]:
            with KVParker(server.target, credentials=creds, channel_options=options) as parker:
                assert parker.park("g", chunks(1)).ok and parker.park("h", chunks(1)).ok
            with KVConsumer(
                server.target, credentials=creds, channel_options=options,
                metrics=ConsumerMetrics(registry),
            ) as c:  # fmt: skip
                loaded = [c.load(kid, num_chunks=1) for kid in ("g", "h")]
                # The client reads ServerInfo in the background on first use, and warns then.
                wait_for(lambda: warned(), what="the data_tls warning")
                c.server_info()  # read again on request: no second warning
                return loaded

        def warned() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "no data_tls" in r.getMessage()]

        results = await in_thread(run)
    assert all(r.ok and r.transport == "grpc" for r in results)
    assert len(warned()) == 1 and warned()[0].levelname == "WARNING", caplog.records
    assert (
        registry.get_sample_value("kvpark_client_transport_loads_total", {"transport": "grpc"}) == 2
    )


@contextmanager
def dropping_port() -> Iterator[int]:
    """A loopback port where a connect hangs, as at a data port behind a firewall that drops
    it: a listener whose one-connection accept queue is already full, so the kernel drops
    every further SYN."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # fills the queue, never accepted
            yield port


def tcp_fallbacks(registry: CollectorRegistry) -> float:
    counted = registry.get_sample_value(
        "kvpark_client_transport_fallbacks_total", {"transport": "tcp"}
    )
    return counted or 0.0


async def test_a_data_port_that_drops_connects_costs_a_load_a_bounded_try() -> None:
    """A producer whose data port cannot be reached (it advertises one where connects hang)
    still serves every load over the gRPC stream within its timeout. A load that had little
    time to try (a quarter of 0.4 s) learns nothing about the path; the next one gives the
    connect a quarter of its 2 s and falls back well within them; after that failure the
    loads leave TCP alone. Before these bounds, one load spent its whole budget connecting
    and failed, and every later load did the same."""
    registry = CollectorRegistry()
    with dropping_port() as port:
        async with running_producer(**SETTINGS) as server:
            server.servicer.offer(data=server.data, data_address=f"127.0.0.1:{port}", shm=None)

            def run() -> list[Any]:
                with KVParker(server.target) as parker:
                    for i in range(4):
                        assert parker.park(f"d{i}", chunks(1, seed=i)).ok
                with KVConsumer(server.target, metrics=ConsumerMetrics(registry)) as c:
                    budgets = (0.4, 2, 2, 2)
                    return [c.load(f"d{i}", num_chunks=1, timeout=Timeout(budget))
                            for i, budget in enumerate(budgets)]  # fmt: skip

            results = await in_thread(run)
            server.lot.check_invariants()
    assert [(r.ok, r.transport) for r in results] == [(True, "grpc")] * 4, results
    # The first two loads tried the data connection; the second one's failure paused it.
    assert tcp_fallbacks(registry) == 2
    assert results[1].elapsed_s < 1.0, results[1]  # its attempt had 0.5 s, not its budget


async def test_a_data_port_that_drops_leaves_a_first_chunk_limit_time_for_grpc() -> None:
    """A load's first-chunk limit bounds its try of the data connection as its total does:
    a quarter of 0.8 s, not the connect's own 1 s, so the gRPC stream still brings the first
    chunk in time."""
    with dropping_port() as port:
        async with running_producer(**SETTINGS) as server:
            server.servicer.offer(data=server.data, data_address=f"127.0.0.1:{port}", shm=None)

            def run() -> Any:
                with KVParker(server.target) as parker:
                    assert parker.park("f", chunks(1, seed=9)).ok
                with KVConsumer(server.target) as c:
                    return c.load("f", num_chunks=1, timeout=Timeout(10, first_chunk_s=0.8))

            result = await in_thread(run)
            server.lot.check_invariants()
    assert (result.ok, result.transport) == (True, "grpc"), result


@pytest.fixture
def client_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """How far the client's clock is stepped past the real one ([seconds], 0 at first): the
    TCP pause is stepped over instead of waited out."""
    from kvpark.client import _core

    ahead = [0.0]
    monotonic = time.monotonic
    monkeypatch.setattr(
        _core, "time", type("Clock", (), {"monotonic": lambda: monotonic() + ahead[0]})
    )
    return ahead


async def test_after_a_pause_one_load_tries_tcp_again_and_a_working_path_is_used_by_all(
    client_clock: list[float],
) -> None:
    """After a failed data connection, TCP is left out for RETRY_AFTER_S (the client's clock
    is stepped here instead of waited on); then one load tries it, and once a connection is
    accepted every load uses TCP again."""
    registry = CollectorRegistry()
    with dropping_port() as port:
        async with running_producer(**SETTINGS) as server:
            working = f":{server.data_port}"
            data = server.data

            def run() -> list[str]:
                with KVParker(server.target) as parker:
                    for i in range(4):
                        assert parker.park(f"p{i}", chunks(1, seed=i)).ok
                with KVConsumer(server.target, metrics=ConsumerMetrics(registry)) as c:

                    def load(i: int) -> str:
                        result = c.load(f"p{i}", num_chunks=1, timeout=Timeout(2))
                        assert result.ok, result
                        return result.transport

                    server.servicer.offer(data=data, data_address=f"127.0.0.1:{port}", shm=None)
                    seen = [load(0)]  # fails over; TCP paused
                    server.servicer.offer(data=data, data_address=working, shm=None)
                    seen.append(load(1))  # within the pause: not tried
                    client_clock[0] += RETRY_AFTER_S
                    seen.append(load(2))  # the pause is over: this load tries, and gets in
                    seen.append(load(3))  # the path works: used again at once
                    return seen

            seen = await in_thread(run)
            server.lot.check_invariants()
    assert seen == ["grpc", "grpc", "tcp", "tcp"], seen
    assert tcp_fallbacks(registry) == 1


async def test_the_turn_after_the_pause_passes_on_only_when_no_data_offer_came(
    client_clock: list[float],
) -> None:
    """After the pause, the load whose turn it is to try TCP may never get to: its id was
    released, so the answer comes at once with no DataOffer. The next load then tries
    instead (here against the port that still drops connects, with too little time to blame
    the path: a second fallback). A load that did try keeps the pause whatever came of it, so
    the one after it leaves TCP alone, even now that the path works."""
    registry = CollectorRegistry()
    with dropping_port() as port:
        async with running_producer(**SETTINGS) as server:
            data = server.data

            def run() -> list[tuple[str, str | None]]:
                with KVParker(server.target) as parker:
                    for kid in ("q0", "q1", "q2", "gone"):
                        assert parker.park(kid, chunks(1)).ok
                    assert parker.release("gone").ok
                with KVConsumer(server.target, metrics=ConsumerMetrics(registry)) as c:

                    def load(kid: str, budget: float = 2) -> tuple[str, str | None]:
                        result = c.load(kid, num_chunks=1, timeout=Timeout(budget))
                        return result.transport, result.reason and result.reason.value

                    server.servicer.offer(data=data, data_address=f"127.0.0.1:{port}", shm=None)
                    seen = [load("q0")]  # fails over; TCP paused
                    client_clock[0] += RETRY_AFTER_S
                    seen.append(load("gone"))  # its turn to try: no DataOffer comes
                    # So this one tries, for a quarter of its 0.4 s: too short to blame the
                    # path, but it spent the time, so the pause stays.
                    seen.append(load("q1", 0.4))
                    server.servicer.offer(data=data, data_address=f":{server.data_port}", shm=None)
                    seen.append(load("q2"))  # within the new pause: not tried
                    return seen

            seen = await in_thread(run)
            server.lot.check_invariants()
    assert [seen[0], seen[1][1], seen[2], seen[3]] == [
        ("grpc", None),
        "RELEASED",
        ("grpc", None),
        ("grpc", None),
    ], seen
    assert tcp_fallbacks(registry) == 2  # q0 and q1 tried; "gone" never got to, q2 waits


# ======================================================================== shared memory
async def test_a_lent_buffer_too_small_is_a_clear_error_and_nothing_is_lost(
    shm_socket: str,
) -> None:
    """The producer refuses to copy a chunk past the lent range (before a byte of it moves),
    and the load ends with the same misuse error as on any transport: BufferTooSmallError.
    The id keeps its bytes: a load into a buffer of the right size gets all of them."""
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        data = chunks(3, seed=7)

        def run() -> tuple[BufferTooSmallError, Any]:
            with (
                KVParker(server.target) as parker,
                KVConsumer(server.target, shm_socket=shm_socket) as c,
            ):
                assert parker.park("small", data).ok
                small = c.shared_buffer(2 * CHUNK)
                with pytest.raises(BufferTooSmallError) as err:
                    c.load("small", num_chunks=3, into=small)
                right = c.shared_buffer(3 * CHUNK)
                return err.value, (c.load("small", num_chunks=3, into=right), right.tobytes())

        error, (retried, landed) = await in_thread(run)
        assert (error.needed, error.available) == (3 * CHUNK, 2 * CHUNK)
        assert retried.ok and retried.transport == "shm" and landed == joined(data)
        server.lot.check_invariants()


async def test_a_lend_the_producer_does_not_hold_falls_back_to_grpc(shm_socket: str) -> None:
    """A shared buffer lent to another producer process (here: a socket of a second
    producer) is refused before anything binds, and the load goes on over the gRPC stream."""
    other = shm_socket + ".other"
    async with (
        running_producer(**SETTINGS, shm_socket=shm_socket) as server,
        running_producer(**SETTINGS, shm_socket=other),
    ):

        def run() -> Any:
            with KVParker(server.target) as parker:
                assert parker.park("f", chunks(2, seed=8)).ok
            with KVConsumer(server.target, shm_socket=other) as c:
                return c.load("f", num_chunks=2, into=c.shared_buffer(2 * CHUNK))

        result = await in_thread(run)
        assert result.ok and result.transport in ("tcp", "grpc")
        server.lot.check_invariants()


async def test_an_shm_fetch_places_its_first_chunks_early_then_in_larger_batches(
    shm_socket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer copies a Fetch's first 4 MiB as a batch of their own, so the consumer
    gets its first chunks (and on_chunk runs) after a short copy; later batches grow fourfold
    up to 64 MiB, where the per-batch cost is noise. Seen in the ChunksPlaced messages the
    client receives: 100 chunks of 1 MiB are named 4, 16, 64, then the last 16."""
    from kvpark.client import _session

    placements: list[int] = []
    parse = _session.wire.parse_fetch_response

    def recording(raw: bytes) -> Any:
        message = parse(raw)
        if isinstance(message, pb.ChunksPlaced):
            placements.append(len(message.chunks))
        return message

    monkeypatch.setattr(_session.wire, "parse_fetch_response", recording)
    data = chunks(100, seed=13)
    settings = {**SETTINGS, "pool_bytes": 256 * MiB}  # a park may fill half the pool
    async with running_producer(**settings, shm_socket=shm_socket) as server:

        def run() -> tuple[Any, bytes]:
            with KVParker(server.target) as parker:
                assert parker.park("ramp", data).ok
            with KVConsumer(server.target, transport="shm") as c:
                into = c.shared_buffer(100 * CHUNK)
                return c.load("ramp", num_chunks=100, into=into), into.tobytes()

        loaded, landed = await in_thread(run)
        server.lot.check_invariants()
    assert loaded.ok and loaded.transport == "shm", loaded
    assert landed == joined(data)
    assert placements == [4, 16, 64, 16], placements


async def test_many_tiny_chunks_go_over_shm_in_placements_any_client_can_receive(
    shm_socket: str,
) -> None:
    """An id of 6,000 16-byte chunks (the pool holds one chunk per 256 KiB page, so it can
    hold that many) loaded over shared memory by a client that receives messages of at most
    64 KiB + 1 byte: the producer names them in ChunksPlaced messages of a bounded number of
    chunks, where one message naming all of them (~95 KB) would be refused by the client."""
    n, size = 6000, 16
    data = [np.full(size, i % 251, np.uint8) for i in range(n)]
    async with running_producer(  # the one batch holds 6,000 pages: most of the pool
        **{**SETTINGS, "pool_bytes": 1536 * MiB, "max_batch_share": 1.0}, shm_socket=shm_socket
    ) as server:

        def run() -> tuple[Any, bytes]:
            with KVParker(server.target) as parker:
                assert parker.park("tiny", data).ok
            with KVConsumer(server.target, transport="shm", max_chunk_bytes=1) as c:
                into = c.shared_buffer(n * size)
                return c.load("tiny", num_chunks=n, into=into), into.tobytes()

        loaded, landed = await in_thread(run)
        server.lot.check_invariants()
    assert loaded.ok and loaded.transport == "shm", loaded
    assert landed == joined(data)


async def test_a_load_whose_lend_the_producer_dropped_goes_on_over_grpc_and_is_counted(
    shm_socket: str,
) -> None:
    """The producer no longer holds the consumer's lent buffer (ended on its side, as after a
    restart): it refuses the Fetch before anything binds, the load goes on over the gRPC
    stream in the same call, and the client's metrics count one shm fallback."""
    registry = CollectorRegistry()
    data = chunks(2, seed=9)
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        shm = server.shm
        assert shm is not None

        def run() -> tuple[Any, bytes]:
            with (
                KVParker(server.target) as parker,
                KVConsumer(server.target, transport="shm", metrics=ConsumerMetrics(registry)) as c,
            ):
                into = c.shared_buffer(2 * CHUNK)
                assert parker.park("first", data).ok and parker.park("second", data).ok
                first = c.load("first", num_chunks=2, into=into)
                assert first.ok and first.transport == "shm", first
                found = c._core.shm.lend_of(into)  # the client still counts on this lend
                lent = shm.get(split_call_id(found[0])[0], FETCH_ROLE) if found else None
                assert lent is not None
                lent.end()  # thread-safe: the producer's lending thread ends lends too
                into[:] = 0
                second = c.load("second", num_chunks=2, into=into), into.tobytes()
                # The client forgot the dead lend: the next load lends the buffer anew.
                assert parker.park("third", data).ok
                third = c.load("third", num_chunks=2, into=into)
                assert third.ok and third.transport == "shm", third
                return second

        second, landed = await in_thread(run)
        server.lot.check_invariants()
    assert second.ok and second.transport == "grpc", second
    assert landed == joined(data)
    counted = registry.get_sample_value(
        "kvpark_client_transport_fallbacks_total", {"transport": "shm"}
    )
    assert counted == 1


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_an_shm_fetch_refused_for_its_request_is_not_taken_for_a_refused_lend(
    flavour: str, shm_socket: str
) -> None:
    """A shm Fetch refused INVALID_ARGUMENT for the request itself (a chunk id the id does not
    have) raises at once: only a refusal whose detail names the lend sends the load again over
    the gRPC stream, where this request would be refused the same way; no shm fallback is
    counted."""
    registry = CollectorRegistry()
    data = chunks(2, seed=4)
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        metrics = ConsumerMetrics(registry)
        with KVParker(server.target) as parker:
            assert (await in_thread(parker.park, "kv", data)).ok
        if flavour == "sync":

            def load() -> None:
                with KVConsumer(server.target, transport="shm", metrics=metrics) as consumer:
                    consumer.load("kv", chunk_ids=[5], into=consumer.shared_buffer(2 * CHUNK))

            with pytest.raises(RequestRejectedError, match="chunk_id 5"):
                await in_thread(load)
        else:
            async with AsyncKVConsumer(server.target, transport="shm", metrics=metrics) as c:
                with pytest.raises(RequestRejectedError, match="chunk_id 5"):
                    await c.load("kv", chunk_ids=[5], into=c.shared_buffer(2 * CHUNK))
        server.lot.check_invariants()
    counted = registry.get_sample_value(
        "kvpark_client_transport_fallbacks_total", {"transport": "shm"}
    )
    assert not counted, counted


async def test_a_placement_names_its_offset_from_the_start_of_the_fetched_range(
    shm_socket: str,
) -> None:
    """On the wire, as a client in another language sees it: a Fetch into a range that starts
    4 KiB into the lent buffer gets ChunksPlaced offsets counted from that range's start, and
    each chunk lies at shm_offset + offset in the buffer."""
    data = chunks(2, seed=11)
    start = 4096

    def run(target: str) -> tuple[list[Any], list[Any], bytes]:
        with KVParker(target) as parker:
            assert parker.park("placed", data).ok
        with ShmLender(shm_socket, None, 5.0) as lender, SharedBuffer(start + 2 * CHUNK) as buf:
            lender.connect()
            request = pb.FetchRequest(
                kv_request_id="placed", accept_transports=[pb.TRANSPORT_SHM],
                shm_lend_id=lender.lend(buf, FETCH_ROLE), shm_offset=start,
                shm_length=2 * CHUNK,
            )  # fmt: skip
            with grpc.insecure_channel(target) as channel:
                fetch = channel.unary_stream(
                    "/kvpark.v1.KVProducer/Fetch",
                    request_serializer=pb.FetchRequest.SerializeToString,
                    response_deserializer=pb.FetchResponse.FromString,
                )
                answers = list(fetch(request, timeout=10))
            placed = [p for a in answers if a.HasField("placed") for p in a.placed.chunks]
            return answers, placed, buf.array.tobytes()

    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        answers, placed, landed = await in_thread(run, server.target)
        server.lot.check_invariants()
    assert answers[-1].done.status == pb.STATUS_OK
    assert [(p.chunk_id, p.offset, p.nbytes) for p in placed] == [(0, 0, CHUNK), (1, CHUNK, CHUNK)]
    for p in placed:
        at = start + p.offset
        assert landed[at : at + p.nbytes] == data[p.chunk_id].tobytes()
        assert crc32c_of(landed[at : at + p.nbytes]) == p.crc32c


# ================================================================ Park by reference, in groups
async def test_shm_park_names_many_chunks_per_message_and_one_bad_crc_keeps_none(
    shm_socket: str,
) -> None:
    """A park of 100 small chunks by reference goes as a few ChunkRefs messages (64 per
    message at most), every byte kept; a ChunkRefs whose second group holds a wrong CRC32C,
    or an empty one, or one without a lent buffer, leaves nothing of the batch behind."""
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        with ShmLender(shm_socket, None, 5.0) as lender:
            lender.connect()
            buffer = SharedBuffer(100 * 4096)
            buffer.array[:] = np.random.default_rng(3).integers(0, 256, 100 * 4096, np.uint8)
            lend_id = lender.lend(buffer, PARK_ROLE)
            blocks = [buffer.array[i * 4096 : (i + 1) * 4096] for i in range(100)]

            def refs(first: int, n: int, bad: int | None = None) -> bytes:
                group = pb.ChunkRefs()
                for cid in range(first, first + n):
                    crc = crc32c_of(blocks[cid]) ^ (1 if cid == bad else 0)
                    group.refs.add(chunk_id=cid, crc32c=crc, offset=cid * 4096, nbytes=4096)
                return pb.ParkRequest(chunk_refs=group).SerializeToString()

            def park(kid: str, body: list[bytes], lend: str = lend_id) -> Any:
                header = pb.ParkHeader(kv_request_id=kid, total_chunks=100, shm_lend_id=lend)
                commit = wire.encode_park_commit(100, 100 * 4096)
                frames = [pb.ParkRequest(header=header).SerializeToString(), *body, commit]
                return stub(iter(frames))

            with grpc.insecure_channel(server.target) as channel:
                stub = channel.stream_unary(
                    "/kvpark.v1.KVProducer/Park",
                    request_serializer=None,
                    response_deserializer=pb.ParkResponse.FromString,
                )
                good = await in_thread(park, "grouped", [refs(0, 64), refs(64, 36)])
                bad = await in_thread(park, "bad-crc", [refs(0, 64), refs(64, 36, bad=70)])
                with pytest.raises(grpc.RpcError) as empty:
                    await in_thread(park, "empty", [refs(0, 64), pb.ParkRequest(
                        chunk_refs=pb.ChunkRefs()).SerializeToString()])  # fmt: skip
                with pytest.raises(grpc.RpcError) as unlent:
                    await in_thread(park, "unlent", [refs(0, 64)], "")
        assert good.status == pb.STATUS_OK and good.chunks_parked == 100, good
        assert bad.reason == pb.REASON_CHECKSUM_MISMATCH and "chunk 70" in bad.detail, bad
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert unlent.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shm_lend_id" in (unlent.value.details() or "")

        def load() -> Any:
            with KVConsumer(server.target) as consumer:
                return consumer.load("grouped", num_chunks=100)

        loaded = await in_thread(load)
        assert loaded.ok and loaded.data is not None
        assert loaded.data.tobytes() == buffer.array.tobytes()
        for status in server.lot.lookup(["bad-crc", "empty", "unlent"]):
            assert (status.chunks_parked, status.nbytes) == (0, 0), status
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="all freed")
        server.lot.check_invariants()


async def test_the_first_park_and_load_of_shared_buffers_go_over_shared_memory(
    shm_socket: str,
) -> None:
    """A client that made shared buffers learns the producer's epoch before its first lend
    (the socket is checked against it), so its very first park and load use them: no first
    call quietly over the gRPC stream."""
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:

        def run() -> tuple[Any, Any, bytes]:
            with KVParker(server.target) as parker, KVConsumer(server.target) as consumer:
                assert parker.info is None and consumer.info is None
                kv = parker.shared_buffer(3 * CHUNK)
                kv[:] = np.frombuffer(joined(chunks(3, seed=11)), np.uint8)
                parked = parker.park("first", [kv[i * CHUNK : (i + 1) * CHUNK] for i in range(3)])
                cache = consumer.shared_buffer(3 * CHUNK)
                loaded = consumer.load("first", num_chunks=3, into=cache)
                return parked, loaded, cache.tobytes()

        parked, loaded, landed = await in_thread(run)
        assert parked.ok and parked.transport == "shm", parked
        assert loaded.ok and loaded.transport == "shm", loaded
        assert landed == joined(chunks(3, seed=11))
        server.lot.check_invariants()


async def test_an_shm_park_cut_off_mid_copy_gives_every_page_and_the_lend_back(
    shm_socket: str,
) -> None:
    """A Park over shared memory whose deadline passes while copy jobs run: the handler waits
    for the threads still copying, then every slot they filled goes back to the pool and the
    lent buffer is no longer held, so the client can release it."""
    async with running_producer(
        **{**SETTINGS, "pool_bytes": 256 * MiB, "max_batch_share": 1.0}, shm_socket=shm_socket
    ) as server:

        def run() -> Any:
            with KVParker(server.target) as parker:
                kv = parker.shared_buffer(192 * MiB)
                kv[:] = 1
                pieces = [kv[i * CHUNK : (i + 1) * CHUNK] for i in range(192)]
                # A deadline inside the copies: shorter ones until one cuts the park off (a
                # fast machine may finish 192 MiB within the first), each success released.
                for n, timeout in enumerate((0.05, 0.02, 0.01, 0.005)):
                    result = parker.park(f"cut-{n}", pieces, timeout=timeout)
                    if not result.ok:
                        return result
                    assert parker.release(f"cut-{n}").ok
                return result

        cut = await in_thread(run)
        assert not cut.ok and cut.reason is Reason.TIMEOUT, cut
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="pages back")
        await wait_until(lambda: server.lot.statistics().pending_bytes == 0, what="no fills")
        assert server.shm is not None
        await wait_until(lambda: server.shm.lend_count == 0, what="the lend released")
        server.lot.check_invariants()


# ============================================================= streaming batches by reference
def kind_of(frame: bytes) -> str:
    """A Park message's kind; "shm header" for a header that names a lent buffer."""
    message = pb.ParkRequest.FromString(frame)
    kind = str(message.WhichOneof("kind"))
    return "shm header" if kind == "header" and message.header.shm_lend_id else kind


class ParkFrames(grpc.StreamUnaryClientInterceptor):  # type: ignore[misc]
    """The kinds of Park messages a sync parker sends."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        def recorded() -> Any:
            for frame in requests:
                self.kinds.append(kind_of(frame))
                yield frame

        return continuation(details, recorded())


class AsyncParkFrames(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    """The kinds of Park messages an async parker sends."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        async def recorded() -> Any:
            async for frame in requests:
                self.kinds.append(kind_of(frame))
                yield frame

        return await continuation(details, recorded())


def parker_for(flavour: str, target: str) -> tuple[Any, Any]:
    """A parker of the flavour, and the recorder of the Park messages it sends."""
    if flavour == "sync":
        frames: Any = ParkFrames()
        return KVParker(target, interceptors=[frames]), frames
    frames = AsyncParkFrames()
    return AsyncKVParker(target, interceptors=[frames]), frames


async def put_all(flavour: str, parker: Any, kid: str, pieces: list[Any]) -> Any:
    """Parks `pieces` through one streaming batch, sync (in a thread) or async."""
    if flavour == "async":
        async with parker.batch(kid, total_chunks=len(pieces)) as batch:
            for cid, piece in enumerate(pieces):
                assert await batch.put(cid, piece)
        return batch.result

    def run() -> Any:
        with parker.batch(kid, total_chunks=len(pieces)) as batch:
            for cid, piece in enumerate(pieces):
                assert batch.put(cid, piece)
        return batch.result

    return await in_thread(run)


def load_back(target: str, kid: str, n: int) -> bytes:
    into = np.zeros(n * CHUNK, np.uint8)
    with KVConsumer(target, transport="grpc") as consumer:
        loaded = consumer.load(kid, num_chunks=n, into=into)
        assert loaded.ok, loaded
    return into.tobytes()


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_streaming_batch_from_a_shared_buffer_goes_by_reference(
    flavour: str, shm_socket: str
) -> None:
    """Chunks put from a shared buffer go as ChunkRefs (the producer copies them from the
    buffer); a chunk from elsewhere goes inline in the same call."""
    data = chunks(4, seed=21)
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        parker, frames = parker_for(flavour, server.target)
        try:
            kv = parker.shared_buffer(3 * CHUNK)
            kv[:] = np.frombuffer(joined(data[:3]), np.uint8)
            pieces = [kv[i * CHUNK : (i + 1) * CHUNK] for i in range(3)] + [data[3]]
            result = await put_all(flavour, parker, "streamed", pieces)
        finally:
            await parker.aclose() if flavour == "async" else parker.close()
        assert result.ok and result.transport == "shm", result
        assert (result.chunks_parked, result.bytes_parked) == (4, 4 * CHUNK)
        # The references in one group (sent with the commit), the other chunk inline.
        assert frames.kinds == ["shm header", "chunk", "chunk_refs", "commit"]
        assert await in_thread(load_back, server.target, "streamed", 4) == joined(data)
        server.lot.check_invariants()


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_batch_whose_lend_the_producer_dropped_goes_inline_within_the_batch(
    flavour: str, shm_socket: str
) -> None:
    """The producer no longer holds the buffer the batch's header names (ended on its side,
    as after a restart): it refuses the header, and the batch sends every chunk put so far
    inline on a new call, then the rest, and commits: nothing is lost. The next batch lends
    the buffer anew and goes by reference again."""
    data = chunks(3, seed=22)
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        parker, frames = parker_for(flavour, server.target)
        try:
            kv = parker.shared_buffer(3 * CHUNK)
            kv[:] = np.frombuffer(joined(data), np.uint8)
            pieces = [kv[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
            first = await put_all(flavour, parker, "first", pieces)
            assert first.ok and first.transport == "shm", first
            found = parker._core.shm.lend_of(kv)  # the client still counts on this lend
            assert found is not None and server.shm is not None
            lent = server.shm.get(found[0], PARK_ROLE)
            assert lent is not None
            lent.end()
            frames.kinds.clear()
            result = await put_all(flavour, parker, "second", pieces)
            # The refused lend was forgotten: the next batch lends the buffer anew.
            third = await put_all(flavour, parker, "third", pieces)
            assert third.ok and third.transport == "shm", third
            assert frames.kinds[-3:] == ["shm header", "chunk_refs", "commit"], frames.kinds
            del frames.kinds[-3:]
        finally:
            await parker.aclose() if flavour == "async" else parker.close()
        assert result.ok and result.transport == "grpc", result
        assert (result.chunks_parked, result.bytes_parked) == (3, 3 * CHUNK)
        # The refused call began with a header naming the lend (and whatever followed before
        # the refusal came back, which the producer no longer read); the second call sent
        # every chunk inline.
        refused, inline = frames.kinds[:-5], frames.kinds[-5:]
        assert refused[0] == "shm header", frames.kinds
        assert set(refused[1:]) <= {"chunk_refs", "commit"}, frames.kinds
        assert inline == ["header", "chunk", "chunk", "chunk", "commit"], frames.kinds
        assert await in_thread(load_back, server.target, "second", 3) == joined(data)
        server.lot.check_invariants()


async def test_a_streaming_batch_sends_its_references_in_groups(shm_socket: str) -> None:
    """References go 64 to a message (the producer's cost is per message), the rest with the
    commit; every chunk is kept."""
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        parker, frames = parker_for("sync", server.target)
        with parker:
            kv = parker.shared_buffer(70 * 4096)
            kv[:] = np.random.default_rng(23).integers(0, 256, kv.size, dtype=np.uint8)
            pieces = [kv[i * 4096 : (i + 1) * 4096] for i in range(70)]
            result = await put_all("sync", parker, "grouped", pieces)
            expected = kv.tobytes()
        assert result.ok and result.chunks_parked == 70, result
        assert frames.kinds == ["shm header", "chunk_refs", "chunk_refs", "commit"]

        def load() -> bytes:
            into = np.zeros(70 * 4096, np.uint8)
            with KVConsumer(server.target, transport="grpc") as consumer:
                assert consumer.load("grouped", num_chunks=70, into=into).ok
            return into.tobytes()

        assert await in_thread(load) == expected
        server.lot.check_invariants()


# ============================================================ a lent range that runs out
SMALL_CHUNK = 256 * 1024


async def test_a_chunk_larger_than_its_own_destination_is_the_same_error_on_every_transport(
    shm_socket: str,
) -> None:
    """One destination per chunk, the second chunk a byte larger than its destination: over
    shared memory it overflows the staging range, and the error names that chunk's
    destination, with the counts the gRPC stream and TCP give."""
    data = [np.full(1000, 1, np.uint8), np.full(1001, 2, np.uint8)]

    def run(target: str) -> dict[str, tuple[Any, ...]]:
        seen = {}
        for transport in ("grpc", "tcp", "shm"):
            with KVConsumer(target, transport=transport, shm_socket=shm_socket, confirm=False) as c:
                pages = [np.zeros(1000, np.uint8), np.zeros(1000, np.uint8)]
                with pytest.raises(BufferTooSmallError) as err:
                    c.load("uneven", num_chunks=2, into=pages)
                e = err.value
                seen[transport] = (e.needed, e.available, e.chunks_loaded, e.bytes_loaded, str(e))
                assert bytes(pages[0]) == data[0].tobytes()
        return seen

    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        with KVParker(server.target) as parker:
            assert (await in_thread(parker.park, "uneven", data)).ok
        seen = await in_thread(run, server.target)
        server.lot.check_invariants()
    message = "chunk 1 is 1001 bytes; its destination holds 1000"
    assert seen["grpc"] == (1001, 1000, 1, 1000, message)
    assert seen["tcp"] == seen["grpc"] and seen["shm"] == seen["grpc"], seen


@pytest.mark.parametrize("client", ["sync", "async"])
@pytest.mark.parametrize("fitting", [20, 0], ids=["midway", "first chunk"])
async def test_a_lent_range_too_small_loads_what_fits_and_needs_what_grpc_says(
    client: str, fitting: int, shm_socket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """24 chunks of 256 KiB into a buffer with room for `fitting` of them and 100 bytes: over
    shared memory every chunk that fits lands (the producer places the fitting part of a batch,
    here the second), and the error is the one the gRPC stream gives into the same buffer,
    with the same counts and the bytes the load needs. A range too small even for the first
    chunk is not a lend the producer refused: no fallback to the gRPC stream."""
    rng = np.random.default_rng(29)
    data = [rng.integers(0, 256, SMALL_CHUNK, dtype=np.uint8) for _ in range(24)]
    room = fitting * SMALL_CHUNK + 100
    registry = CollectorRegistry()
    metrics = ConsumerMetrics(registry)

    def outcome(error: BufferTooSmallError, into: Any) -> tuple[Any, ...]:
        value = (error.chunks_loaded, error.bytes_loaded, error.needed, error.available)
        return value, into[: error.bytes_loaded].tobytes()

    def run_sync(target: str) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for transport in ("grpc", "shm"):
            with KVConsumer(
                target, transport=transport, shm_socket=shm_socket, metrics=metrics, confirm=False
            ) as c:
                into = c.shared_buffer(room)
                with pytest.raises(BufferTooSmallError) as err:
                    c.load("tight", num_chunks=24, into=into)
                seen[transport] = outcome(err.value, into)
                whole = c.shared_buffer(24 * SMALL_CHUNK)
                seen[f"{transport} retry"] = c.load("tight", num_chunks=24, into=whole), whole
        return seen

    async def run_async(target: str) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for transport in ("grpc", "shm"):
            async with AsyncKVConsumer(
                target, transport=transport, shm_socket=shm_socket, metrics=metrics, confirm=False
            ) as c:
                into = c.shared_buffer(room)
                with pytest.raises(BufferTooSmallError) as err:
                    await c.load("tight", num_chunks=24, into=into)
                seen[transport] = outcome(err.value, into)
                whole = c.shared_buffer(24 * SMALL_CHUNK)
                seen[f"{transport} retry"] = await c.load("tight", num_chunks=24, into=whole), whole
        return seen

    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        with KVParker(server.target) as parker:
            assert (await in_thread(parker.park, "tight", data)).ok
        with caplog.at_level(logging.INFO, logger="kvpark.client"):
            if client == "sync":
                seen = await in_thread(run_sync, server.target)
            else:
                seen = await run_async(server.target)
        server.lot.check_invariants()
        sent = server.metrics.registry.get_sample_value(
            "kvpark_sent_bytes_total", {"transport": "shm"}
        )
    fitted = (fitting, fitting * SMALL_CHUNK, (fitting + 1) * SMALL_CHUNK, room)
    assert seen["grpc"] == (fitted, joined(data[:fitting]))
    assert seen["shm"] == seen["grpc"]
    assert sent == (fitting + 24) * SMALL_CHUNK  # what fitted, then the whole retry
    shm_fallbacks = registry.get_sample_value(
        "kvpark_client_transport_fallbacks_total", {"transport": "shm"}
    )
    assert not shm_fallbacks
    assert not [r for r in caplog.records if "refused the lent buffer" in r.getMessage()]
    for transport in ("grpc", "shm"):  # the id kept its bytes
        retried, whole = seen[f"{transport} retry"]
        assert retried.ok and retried.transport == transport, retried
        assert whole.tobytes() == joined(data)


@pytest.mark.parametrize("fitting", [2, 0], ids=["midway", "first chunk"])
async def test_a_fetch_past_its_shm_range_places_what_fits_then_names_the_chunk(
    fitting: int, shm_socket: str
) -> None:
    """On the wire: the chunks that fit in the range are copied and named in ChunksPlaced, then
    the call ends OUT_OF_RANGE (never the INVALID_ARGUMENT of a lend the producer does not
    hold) naming the chunk that does not fit and its size; the id keeps its bytes."""
    data = chunks(3, seed=31)

    def run(target: str) -> tuple[list[Any], grpc.RpcError, bytes]:
        with KVParker(target) as parker:
            assert parker.park("past", data).ok
        with (
            ShmLender(shm_socket, None, 5.0) as lender,
            SharedBuffer(fitting * CHUNK + 100) as buf,
        ):
            lender.connect()
            request = pb.FetchRequest(
                kv_request_id="past", accept_transports=[pb.TRANSPORT_SHM],
                shm_lend_id=lender.lend(buf, FETCH_ROLE), shm_length=fitting * CHUNK + 100,
            )  # fmt: skip
            answers: list[Any] = []
            with grpc.insecure_channel(target) as channel:
                fetch = channel.unary_stream(
                    "/kvpark.v1.KVProducer/Fetch",
                    request_serializer=pb.FetchRequest.SerializeToString,
                    response_deserializer=pb.FetchResponse.FromString,
                )
                with pytest.raises(grpc.RpcError) as ended:
                    for answer in fetch(request, timeout=10):
                        answers.append(answer)
            return answers, ended.value, buf.array.tobytes()

    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        answers, ended, landed = await in_thread(run, server.target)
        parked = lambda: server.lot.lookup(["past"])[0].state == pb.STATE_PARKED  # noqa: E731
        await wait_until(parked, what="the id back where it was")
        server.lot.check_invariants()
    placed = [(p.chunk_id, p.offset, p.nbytes) for a in answers for p in a.placed.chunks]
    assert placed == [(i, i * CHUNK, CHUNK) for i in range(fitting)]
    assert landed[: fitting * CHUNK] == joined(data[:fitting])
    assert ended.code() == grpc.StatusCode.OUT_OF_RANGE
    assert (ended.details() or "").startswith(f"chunk {fitting} ({CHUNK} bytes) does not fit")
