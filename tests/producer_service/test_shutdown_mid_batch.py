"""Shutdown (docs/protocol.md, step 4) when the grace ends in the middle of a batch: a Fetch
whose consumer reads slowly still gets its TransferDone with SHUTTING_DOWN, not the call
cancelled by the server's stop. The producer stops the batch short: over gRPC after the
message being written, over TCP at once, ending the data connection mid-frame. The
TransferDone counts the chunks that reached the consumer whole; the pool ends empty and
consistent; a producer stopped by SIGTERM this way logs no traceback and exits 0.

Each consumer reads a little, pauses until the grace is over, then reads on: a real
producer (in-process, or a process for the signal), real gRPC calls, real sockets."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Awaitable, Callable

import grpc
import pytest
from conftest import (
    MiB,
    ProducerProcess,
    channel_options,
    park,
    running_producer,
    stub_for,
    wait_until,
)

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer.server import ProducerServer
from kvpark.producer.transports import FIRST_BATCH_BYTES
from kvpark.tcp_frames import ACCEPTED, FrameError, recv_exactly, recv_header

GRACE_S = 0.2
SETTINGS = {
    "shutdown_grace_s": GRACE_S,
    # Far beyond the test: a consumer that pauses is slow, not stalled.
    "fetch_stall_timeout_s": 30,
    "data_listen": "127.0.0.1:0",
    "pool_bytes": 64 * MiB,
}
# gRPC: chunks of a quarter of the call's 64 KiB window, so that a Fetch's first batch
# (FIRST_BATCH_BYTES) is many chunks and a consumer that pauses holds the Fetch inside it.
GRPC_CHUNK = 256 * 1024
GRPC_DATA = {i: bytes([i]) * GRPC_CHUNK for i in range(2 * FIRST_BATCH_BYTES // GRPC_CHUNK)}
# After its pause the gRPC consumer takes this many messages, then pauses again: more than can
# be on the way (the message being written, and what the window let through before it), far
# fewer than the batch holds.
GRPC_TAKES = 4
# TCP: a batch is the whole id, far more than the sockets' buffers hold.
TCP_DATA = {i: bytes([i]) * MiB for i in range(32)}

Stop = Callable[[], Awaitable[None]]


async def grpc_fetch_across_the_grace(
    target: str, kid: str, stop: Stop
) -> tuple[list[pb.Chunk], pb.TransferDone]:
    """Fetches `kid` as messages of the call: reads one chunk, pauses over `stop` (which
    returns once the grace is over), then finds the TransferDone within GRPC_TAKES messages.
    Returns the chunks read and the TransferDone."""
    # Without BDP probing the call's window stays at 64 KiB: what the consumer does not read
    # stays with the producer, whose write waits.
    options = [*channel_options(), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        call = pb_grpc.KVProducerStub(channel).Fetch(pb.FetchRequest(kv_request_id=kid))
        got = [(await call.read()).chunk]  # bound and streaming
        await stop()
        for _ in range(GRPC_TAKES):
            message = await call.read()
            assert message is not grpc.aio.EOF
            if message.HasField("done"):
                assert await call.read() is grpc.aio.EOF
                assert await call.code() == grpc.StatusCode.OK
                return got, message.done
            got.append(message.chunk)
        raise AssertionError(f"{GRPC_TAKES} more chunks after the grace, and no TransferDone")


def read_frames(sock: socket.socket, data: dict[int, bytes]) -> int:
    """Reads whole frames, checking each one's bytes, until the connection ends; returns how
    many came whole (a frame cut short by the end is not counted)."""
    whole = 0
    try:
        while (header := recv_header(sock)) is not None:
            chunk_id, _, nbytes = header
            payload = bytearray(nbytes)
            recv_exactly(sock, memoryview(payload))
            assert (chunk_id, payload) == (whole, data[whole])
            whole += 1
    except (FrameError, ConnectionError):
        pass
    return whole


async def tcp_fetch_across_the_grace(
    target: str, data_port: int, kid: str, stop: Stop
) -> tuple[int, pb.TransferDone]:
    """Fetches `kid` over a data connection with a small receive buffer: reads nothing from it
    until `stop` returns (the grace is over), by then reads its TransferDone from the call,
    then the frames that came whole. Returns how many did, and the TransferDone."""
    async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
        stub = pb_grpc.KVProducerStub(channel)
        call = stub.Fetch(pb.FetchRequest(kv_request_id=kid, accept_transports=[pb.TRANSPORT_TCP]))
        offer = (await call.read()).data_offer
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            await asyncio.to_thread(sock.connect, ("127.0.0.1", data_port))
            sock.sendall(offer.ticket)
            assert await asyncio.to_thread(sock.recv, 1) == ACCEPTED
            await asyncio.to_thread(sock.recv, 1, socket.MSG_PEEK)  # the frames have started
            await stop()
            message = await call.read()
            assert message.HasField("done"), message
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            return await asyncio.to_thread(read_frames, sock, TCP_DATA), message.done


def assert_cut_short(done: pb.TransferDone, chunks: int, chunk_bytes: int, of: int) -> None:
    """The Fetch ended SHUTTING_DOWN part of the way through, counting the `chunks` that came."""
    assert (done.status, done.reason) == (pb.STATUS_FAILED, pb.REASON_SHUTTING_DOWN)
    assert 0 < chunks < of, f"{chunks} of {of} chunks came"
    assert (done.chunks_sent, done.bytes_sent) == (chunks, chunks * chunk_bytes)


# ===================================================================== in-process producer
def ended_by_the_grace(server: ProducerServer, kid: str) -> bool:
    (state,) = server.lot.lookup([kid])
    return bool(state.state == pb.STATE_TOMBSTONED and state.reason == pb.REASON_SHUTTING_DOWN)


def shutdown_of(server: ProducerServer, kid: str, started: list[asyncio.Task[None]]) -> Stop:
    """Starts the server's shutdown (into `started`); returns once its grace ended `kid`."""

    async def stop() -> None:
        started.append(asyncio.create_task(server.shutdown()))
        await wait_until(lambda: ended_by_the_grace(server, kid), what="the grace to end")

    return stop


async def test_a_grpc_fetch_in_the_middle_of_a_batch_gets_its_transfer_done() -> None:
    async with running_producer(**SETTINGS) as server:
        async with stub_for(server) as stub:
            assert (
                await park(stub, "slow", GRPC_DATA, total=len(GRPC_DATA))
            ).status == pb.STATUS_OK
        shutdown: list[asyncio.Task[None]] = []
        got, done = await grpc_fetch_across_the_grace(
            server.target, "slow", shutdown_of(server, "slow", shutdown)
        )
        assert [c.chunk_id for c in got] == list(range(len(got)))
        assert all(c.data == GRPC_DATA[c.chunk_id] for c in got)
        # Cut short inside the first batch, not at its end.
        assert_cut_short(done, len(got), GRPC_CHUNK, of=FIRST_BATCH_BYTES // GRPC_CHUNK)
        await asyncio.wait_for(shutdown[0], 10)
        assert ended_by_the_grace(server, "slow")
        assert server.pool.statistics().used_bytes == 0
        server.lot.check_invariants()


async def test_a_tcp_fetch_in_the_middle_of_a_batch_gets_its_transfer_done() -> None:
    async with running_producer(**SETTINGS) as server:
        async with stub_for(server) as stub:
            assert (await park(stub, "slow", TCP_DATA, total=len(TCP_DATA))).status == pb.STATUS_OK
        assert server.data_port
        shutdown: list[asyncio.Task[None]] = []
        whole, done = await tcp_fetch_across_the_grace(
            server.target, server.data_port, "slow", shutdown_of(server, "slow", shutdown)
        )
        assert_cut_short(done, whole, MiB, of=len(TCP_DATA))
        await asyncio.wait_for(shutdown[0], 10)
        assert ended_by_the_grace(server, "slow")
        assert server.pool.statistics().used_bytes == 0
        server.lot.check_invariants()


# ======================================================================= producer process
def sigterm_to(producer: ProducerProcess) -> Stop:
    """SIGTERM; returns once the producer says its grace is over."""

    async def stop() -> None:
        producer.proc.send_signal(signal.SIGTERM)
        await wait_until(
            lambda: any("shutting down" in line for line in producer.log),
            what="the grace to end",
        )

    return stop


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
async def test_sigterm_in_the_middle_of_a_batch_sends_the_transfer_done_and_exits_0(
    producer_process: Callable[..., ProducerProcess], transport: str
) -> None:
    producer = producer_process(**SETTINGS)
    data = GRPC_DATA if transport == "grpc" else TCP_DATA
    async with grpc.aio.insecure_channel(producer.target, options=channel_options()) as ch:
        stub = pb_grpc.KVProducerStub(ch)
        assert (await park(stub, "slow", data, total=len(data))).status == pb.STATUS_OK
        info = await stub.GetServerInfo(pb.GetServerInfoRequest())
    if transport == "grpc":
        got, done = await grpc_fetch_across_the_grace(producer.target, "slow", sigterm_to(producer))
        assert_cut_short(done, len(got), GRPC_CHUNK, of=FIRST_BATCH_BYTES // GRPC_CHUNK)
    else:
        data_port = int(info.data_address.rpartition(":")[2])
        whole, done = await tcp_fetch_across_the_grace(
            producer.target, data_port, "slow", sigterm_to(producer)
        )
        assert_cut_short(done, whole, MiB, of=len(TCP_DATA))
    assert await asyncio.to_thread(producer.proc.wait, 10) == 0
    log = producer.output()
    # A call the server's stop cancels would leave grpc's CancelledError traceback here.
    assert "Traceback" not in log and "undrained_fetches=1" in log, log
