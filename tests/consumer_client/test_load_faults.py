"""The client's loads when time, memory or the producer misbehave on an out-of-band path: the
first-chunk limit holds over TCP too (the DataOffer comes at once, the bytes need not), a
data connection that trickles bytes cannot stretch a load past its deadline, cancelling an
async TCP load ends it at once, async loads waiting on their data connections do not queue
the others, the staging buffer comes back after a load that raised, a shared buffer that
runs out midway raises BufferTooSmallError as on every transport, a consumer that stops
reading its shm Fetch is cut off like a gRPC one, a lend whose buffer its owner closed is
released, a restarted producer gets shared memory again, and a process out of file
descriptors loads and parks over the gRPC stream. Real producers throughout."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import textwrap
import threading
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import MiB, free_port, running_producer, wait_for, wait_until

from kvpark import AsyncKVConsumer, BufferTooSmallError, KVConsumer, KVParker, Reason, Timeout
from kvpark.client._buffers import IntoBuffer, destination_for
from kvpark.client._session import LoadSession, Step
from kvpark.client._tcp import Fallback, TcpReceiver
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.shm import FETCH_ROLE, SharedBuffer, ShmLender
from kvpark.tcp_frames import ACCEPTED, TICKET_BYTES, header

# A load that is never parked waits this long at the producer, far longer than any bound
# the tests below wait for: a load that ends sooner ended for the reason under test.
WAIT_S = 30.0
TCP_SETTINGS: dict[str, Any] = {"data_listen": "127.0.0.1:0", "max_fetch_wait_s": WAIT_S}
# Generous bounds on things that should happen at once; missing one is the failure shown.
PROMPTLY_S = 10.0


def pattern(n: int, nbytes: int = MiB) -> list[np.ndarray]:
    return [np.full(nbytes, i + 1, np.uint8) for i in range(n)]


def park(target: str, kid: str, chunks: list[np.ndarray]) -> bool:
    with KVParker(target, transport="grpc") as parker:
        return bool(parker.park(kid, chunks).ok)


async def test_the_first_chunk_limit_holds_over_tcp() -> None:
    async with running_producer(**TCP_SETTINGS) as server:

        def load() -> Any:
            with KVConsumer(server.target, transport="tcp") as consumer:
                return consumer.load(
                    "never", num_chunks=1, timeout=Timeout(2 * WAIT_S, first_chunk_s=0.3)
                )

        result = await asyncio.wait_for(asyncio.to_thread(load), PROMPTLY_S)
    assert result.reason is Reason.TIMEOUT and "first chunk" in result.detail, result


def read_ticket(conn: socket.socket) -> None:
    """What a data listener reads first: the consumer's ticket."""
    got = 0
    while got < TICKET_BYTES:
        got += len(conn.recv(TICKET_BYTES - got))


def one_chunk_tcp_session(destination: Any, timeout: Timeout) -> LoadSession:
    """A load of chunk 0 over TCP, for a receiver driven by hand (chunks up to 16 MiB)."""
    return LoadSession(
        kv_request_id="k",
        chunk_ids=(0,),
        destination=destination,
        timeout=timeout,
        expected_epoch=0,
        wait_timeout_s=0.0,
        on_chunk=None,
        max_chunk_bytes=16 << 20,
        accept=(pb.TRANSPORT_TCP,),
    )


def data_offer(port: int) -> pb.DataOffer:
    address = f"127.0.0.1:{port}"
    return pb.DataOffer(transport=pb.TRANSPORT_TCP, address=address, ticket=b"t" * TICKET_BYTES)


def test_a_trickling_data_connection_cannot_stretch_a_load_past_its_deadline() -> None:
    """A producer's data connection that sends a byte every 0.3 s would keep every single
    read within a 1 s socket timeout for the 300 s its 1000-byte chunk takes."""
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def trickle() -> None:
            conn, _ = listener.accept()
            with conn:
                read_ticket(conn)
                conn.sendall(ACCEPTED + header(0, 0, 1000))
                while not stop.wait(0.3):
                    try:
                        conn.sendall(b"x")
                    except OSError:
                        return

        producer = threading.Thread(target=trickle)
        producer.start()
        session = one_chunk_tcp_session(IntoBuffer(bytearray(1000)), Timeout(1.0))
        offer = data_offer(port)
        receiving = threading.Thread(
            target=TcpReceiver(offer, f"127.0.0.1:{port}", None).run, args=(session,)
        )
        try:
            receiving.start()
            receiving.join(PROMPTLY_S)
            assert not receiving.is_alive(), "the load outlived its deadline ten times over"
        finally:
            stop.set()
            producer.join()
            receiving.join()


def test_a_data_connection_cut_off_while_its_ticket_waits_is_no_verdict_on_the_path() -> None:
    """The load's call failed while its data connection waited for the ticket's answer, and
    the client cut the connection off (stop_reading): the load falls back, without counting
    that against the path or as the producer turning the load away."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        ticket_read = threading.Event()

        def never_answer() -> None:
            conn, _ = listener.accept()
            with conn:
                read_ticket(conn)
                ticket_read.set()
                conn.recv(1)  # until the client closes

        producer = threading.Thread(target=never_answer)
        producer.start()
        session = one_chunk_tcp_session(IntoBuffer(bytearray(1000)), Timeout(PROMPTLY_S))
        receiver = TcpReceiver(data_offer(port), f"127.0.0.1:{port}", None)
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                receiver.run(session)
            except Fallback as why:
                outcome["why"] = why

        receiving = threading.Thread(target=run)
        receiving.start()
        try:
            wait_for(ticket_read.is_set, what="the ticket presented")
            receiver.stop_reading()
            receiving.join(PROMPTLY_S)
            assert not receiving.is_alive()
        finally:
            producer.join(PROMPTLY_S)
    why = outcome["why"]
    assert not why.path_failed and not why.turned_away, why


@pytest.mark.parametrize("nbytes", [0, 1 << 62, (16 << 20) + 1])
def test_a_data_frame_of_a_size_no_chunk_has_is_a_protocol_error(nbytes: int) -> None:
    """A producer out of step (or not a producer) announcing an empty chunk, or one beyond
    the client's max_chunk_bytes: the load gives up PROTOCOL_ERROR before any buffer is sized
    by it (no MemoryError, no BufferTooSmallError blaming the caller, no empty chunk counted)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def announce() -> None:
            conn, _ = listener.accept()
            with conn:
                read_ticket(conn)
                conn.sendall(ACCEPTED + header(0, 0, nbytes))
                conn.recv(1)  # until the client closes

        producer = threading.Thread(target=announce)
        producer.start()
        # No `into`: the announced size would be allocated.
        session = one_chunk_tcp_session(destination_for(None), Timeout(PROMPTLY_S))
        offer = data_offer(port)
        try:
            step = TcpReceiver(offer, f"127.0.0.1:{port}", None).run(session)
        finally:
            producer.join(PROMPTLY_S)
    result = session.result(None)
    assert step is Step.ABANDON
    assert result.reason is Reason.PROTOCOL_ERROR and f"of {nbytes} bytes" in result.detail
    assert result.chunks_loaded == 0


async def test_cancelling_an_async_tcp_load_ends_it_at_once() -> None:
    async with running_producer(**TCP_SETTINGS) as server:
        assert server.data is not None
        async with AsyncKVConsumer(server.target, transport="tcp") as consumer:
            loading = asyncio.create_task(consumer.load("never", num_chunks=1, timeout=2 * WAIT_S))
            await wait_until(lambda: server.data.accepted == 1, what="the data connection")
            loading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(loading, PROMPTLY_S)


async def test_async_loads_waiting_on_data_connections_do_not_hold_up_others() -> None:
    async with running_producer(**TCP_SETTINGS) as server:
        assert server.data is not None
        async with AsyncKVConsumer(server.target, transport="tcp") as consumer:
            assert await asyncio.to_thread(park, server.target, "here", pattern(1))
            # More waiting loads than asyncio's default executor has threads on a small host.
            waiting = [
                asyncio.create_task(consumer.load(f"never-{i}", num_chunks=1, timeout=2 * WAIT_S))
                for i in range(12)
            ]
            try:
                await wait_until(lambda: server.data.accepted == 12, what="12 loads waiting")
                result = await asyncio.wait_for(consumer.load("here", num_chunks=1), PROMPTLY_S)
                assert result.ok and result.transport == "tcp", result
            finally:
                for task in waiting:
                    task.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)


async def test_the_staging_buffer_comes_back_after_a_load_that_raised(shm_socket: str) -> None:
    async with running_producer(shm_socket=shm_socket) as server:

        def run() -> Any:
            with KVParker(server.target) as parker, KVConsumer(
                server.target, transport="shm", shm_socket=shm_socket
            ) as consumer:  # fmt: skip
                for kid in ("a", "b"):
                    assert parker.park(kid, pattern(1, 4096)).ok
                with pytest.raises(BufferTooSmallError):
                    consumer.load("a", num_chunks=1, into=np.zeros(100, np.uint8))
                # Ordinary memory again: staged through shared memory, not the gRPC stream.
                return consumer.load("b", num_chunks=1, into=np.zeros(4096, np.uint8))

        result = await asyncio.to_thread(run)
    assert result.ok and result.transport == "shm", result


async def test_a_shared_buffer_that_runs_out_midway_raises_buffer_too_small(
    shm_socket: str,
) -> None:
    async with running_producer(shm_socket=shm_socket, pool_bytes=64 * MiB) as server:

        def run() -> None:
            with KVParker(server.target) as parker, KVConsumer(
                server.target, transport="shm", shm_socket=shm_socket
            ) as consumer:  # fmt: skip
                assert parker.park("six", pattern(6)).ok
                # The first batch (4 MiB) fits; the fifth and sixth chunks do not.
                with pytest.raises(BufferTooSmallError) as raised:
                    consumer.load("six", num_chunks=6, into=consumer.shared_buffer(5 * MiB))
                assert raised.value.available == 5 * MiB

        await asyncio.to_thread(run)
        assert server.lot.lookup(["six"])[0].state == pb.STATE_PARKED  # nothing lost


async def test_a_consumer_that_stops_reading_its_shm_fetch_is_cut_off(shm_socket: str) -> None:
    chunks = 240  # of 64 KiB: their ChunksPlaced messages outgrow a 1 KiB receive window
    # Each chunk takes a whole 256 KiB page: the one batch holds 60 MiB of the pool's 64.
    async with running_producer(
        pool_bytes=64 * MiB, max_batch_share=1.0, shm_socket=shm_socket, fetch_stall_timeout_s=0.5
    ) as server:
        assert await asyncio.to_thread(park, server.target, "s", pattern(chunks, 64 * 1024))
        landing = SharedBuffer(chunks * 64 * 1024)
        lender = ShmLender(shm_socket, None, 5.0)
        await asyncio.to_thread(lender.connect)
        lend_id = await asyncio.to_thread(lender.lend, landing, FETCH_ROLE)
        # A tiny receive window that does not grow: a consumer that never reads shuts it soon.
        options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]

        def state() -> pb.State:
            return server.lot.lookup(["s"])[0].state

        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            request = pb.FetchRequest(
                kv_request_id="s",
                accept_transports=[pb.TRANSPORT_SHM],
                shm_lend_id=lend_id,
                shm_length=landing.nbytes,
            )
            call = pb_grpc.KVProducerStub(channel).Fetch(request)  # never read
            try:
                await wait_until(lambda: state() == pb.STATE_BOUND, what="the Fetch bound")
                await wait_until(lambda: state() == pb.STATE_PARKED, what="the id back to PARKED")
            finally:
                call.cancel()
        lender.close()
        landing.close()


async def test_a_lend_whose_buffer_its_owner_closed_is_released(shm_socket: str) -> None:
    async with running_producer(pool_bytes=64 * MiB, shm_socket=shm_socket) as server:
        assert server.shm is not None

        def run() -> None:
            with KVConsumer(server.target, shm_socket=shm_socket) as consumer:
                with KVParker(server.target, shm_socket=shm_socket, transport="grpc") as parker:
                    for kid in ("a", "b"):
                        assert parker.park(kid, pattern(1)).ok
                    # The parker owns the buffer; the consumer lends it for its load.
                    result = consumer.load("a", num_chunks=1, into=parker.shared_buffer(MiB))
                    assert result.ok and result.transport == "shm", result
                # The parker closed its buffers; the consumer's next lend lets the old one go.
                result = consumer.load("b", num_chunks=1, into=consumer.shared_buffer(MiB))
                assert result.ok and result.transport == "shm", result
                wait_for(lambda: lends() == 1, what="only the consumer's own buffer lent")

        def lends() -> int:
            assert server.shm is not None
            return server.shm.lend_count

        await asyncio.to_thread(run)


async def test_a_restarted_producer_gets_shared_memory_again(shm_socket: str) -> None:
    listen = f"127.0.0.1:{free_port()}"
    consumer = KVConsumer(listen, shm_socket=shm_socket)
    landing = consumer.shared_buffer(2 * MiB)

    def park_and_load(kid: str) -> tuple[bool, str]:
        with KVParker(listen, transport="grpc") as parker:
            # Right after the restart grpc may still be backing off from the old connection
            # (channels to one address share it): park once the producer is reached.
            wait_for(lambda: parker.park(kid, pattern(2)).ok, what=f"{kid!r} parked")
        result = consumer.load(kid, num_chunks=2, into=landing)
        return result.ok, result.transport

    try:
        async with running_producer(listen=listen, pool_bytes=64 * MiB, shm_socket=shm_socket):
            assert await asyncio.to_thread(park_and_load, "before") == (True, "shm")
        async with running_producer(listen=listen, pool_bytes=64 * MiB, shm_socket=shm_socket):
            # The first load after the restart may find the old lend gone and fall back; the
            # ones after it lend anew.
            after = [await asyncio.to_thread(park_and_load, kid) for kid in ("b", "c", "d")]
    finally:
        consumer.close()
    assert after[-1] == (True, "shm"), after


# Run in a process of its own: it uses up its file descriptors. Each call that would need a new
# one for shared memory (a bigger staging buffer, a first connection to the shm socket) must go
# over the gRPC stream, which needs none, instead of raising.
OUT_OF_DESCRIPTORS = textwrap.dedent(
    """
    import json, os, resource, sys
    import numpy as np
    from kvpark import KVConsumer, KVParker

    target, sock = sys.argv[1:]
    small, big = np.full(8192, 1, np.uint8), np.full(65536, 2, np.uint8)
    results = {}
    with (
        KVParker(target, shm_socket=sock) as parker,
        KVConsumer(target, shm_socket=sock) as staged,
        KVConsumer(target, shm_socket=sock) as fresh,
    ):
        assert parker.park("warm", [small]).transport == "shm"
        assert staged.load("warm", into=np.empty(8192, np.uint8)).transport == "shm"
        fresh.server_info()
        shared = fresh.shared_buffer(65536)
        hog = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16,
                           resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        while True:
            try:
                hog.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        into = np.empty(65536, np.uint8)
        loaded = staged.load("big", into=into)  # needs a bigger staging buffer
        results["staged load"] = [loaded.ok, loaded.transport, bool((into == 2).all())]
        loaded = fresh.load("big2", into=shared)  # needs its first shm connection
        results["shared-buffer load"] = [loaded.ok, loaded.transport, bool((shared == 2).all())]
        parked = parker.park("parked", [big])  # needs a bigger staging buffer
        results["park"] = [parked.ok, parked.transport, True]
        for fd in hog:
            os.close(fd)
    print(json.dumps(results))
    """
)


async def test_out_of_descriptors_loads_and_parks_go_over_grpc(shm_socket: str) -> None:
    async with running_producer(shm_socket=shm_socket) as server:
        for kid in ("big", "big2"):
            assert await asyncio.to_thread(park, server.target, kid, [np.full(65536, 2, np.uint8)])
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", OUT_OF_DESCRIPTORS, server.target, shm_socket,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(child.communicate(), 60)
        assert child.returncode == 0, err.decode()[-2000:]
        server.lot.check_invariants()
    results = json.loads(out)
    assert results == {
        "staged load": [True, "grpc", True],
        "shared-buffer load": [True, "grpc", True],
        "park": [True, "grpc", True],
    }, results
