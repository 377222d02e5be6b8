"""Bounds: no client can hold what others need. Each hostile pattern runs against a producer
process while an honest client works beside it; the test measures the honest client's latency
and the producer's resident memory, and checks that the hostile part is bounded as
docs/protocol.md ("Limits") states and that nothing honest is lost.

Hostile clients here hold valid tokens' worth of access (the producer runs open on loopback):
authentication keeps strangers out, these bounds keep a broken or malicious peer from
starving the rest.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import psutil
import pytest
from conftest import (
    ChildLimits,
    MiB,
    ProducerProcess,
    park_requests,
    start_producer_process,
    wait_for,
)

from kvpark import KVConsumer, KVParker, TransportError
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer import servicer
from kvpark.shm import SharedBuffer, ShmLender, ShmRefused

IDLE_S = 1.0  # park_idle_timeout_s and fetch_stall_timeout_s of the producers below
SETTINGS: dict[str, Any] = {
    "pool_bytes": 256 * MiB,
    "max_chunk_bytes": 4 * MiB,
    "park_idle_timeout_s": IDLE_S,
    "fetch_stall_timeout_s": IDLE_S,
}


def rss(producer: ProducerProcess) -> int:
    return int(psutil.Process(producer.proc.pid).memory_info().rss)


def lookup_p50_ms(client: KVConsumer, n: int = 30) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        client.lookup(["probe"])
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def chunks(n: int, size: int, tag: int) -> list[bytes]:
    return [bytes([tag + i]) * size for i in range(n)]


# ============================================================================ zero window
def test_readers_that_never_drain_lose_their_ids_and_hold_bounded_memory(
    producer_process: Any,
) -> None:
    """16 Fetches whose readers never read (HTTP/2 window shut, PINGs still answered): after
    fetch_stall_timeout_s every id is PARKED again with a fresh lease and loads in full for an
    honest consumer; meanwhile the producer holds at most two chunks per stalled stream."""
    producer = producer_process(**SETTINGS)
    streams, chunk = 16, 4 * MiB
    with KVParker(producer.target) as parker:
        for i in range(streams):
            assert parker.park(f"z{i}", chunks(2, chunk, i)).ok
    with KVConsumer(producer.target) as honest:
        idle_ms = lookup_p50_ms(honest)
        before = rss(producer)
        options = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.http2.bdp_probe", 0)]
        with grpc.insecure_channel(producer.target, options=options) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            stalled = [stub.Fetch(pb.FetchRequest(kv_request_id=f"z{i}")) for i in range(streams)]
            ids = [f"z{i}" for i in range(streams)]
            # Bound first: before its Fetch binds, an id is PARKED with its first lease.
            wait_for(
                lambda: all(s.state == "BOUND" for s in honest.lookup(ids)),
                timeout=10,
                what="every stalled Fetch bound",
            )
            wait_for(
                lambda: all(
                    s.state == "PARKED" for s in honest.lookup([f"z{i}" for i in range(16)])
                ),
                timeout=10 + IDLE_S,
                what="every stalled id back to PARKED",
            )
            during_ms = lookup_p50_ms(honest)
            held = rss(producer) - before
            states = honest.lookup([f"z{i}" for i in range(streams)])
            assert all(s.lease_remaining_s > 50 for s in states)  # a fresh lease
            for i in range(4):
                loaded = honest.load(f"z{i}", num_chunks=2)
                assert loaded.ok and loaded.data is not None
                assert loaded.data.tobytes() == b"".join(chunks(2, chunk, i))
            for call in stalled:
                call.cancel()
    print(
        f"\nzero-window: RSS +{held / MiB:.0f} MiB, lookup p50 {idle_ms:.2f} -> {during_ms:.2f} ms"
    )
    assert held <= streams * 2 * chunk + 64 * MiB, f"held {held / MiB:.0f} MiB"
    assert during_ms < idle_ms + 5


# ============================================================================ reservations
def _silent_park(target: str, kid: str, batch_bytes: int, stop: threading.Event) -> Any:
    """A Park that sends its header (reserving `batch_bytes`) and then nothing."""

    def requests() -> Iterator[pb.ParkRequest]:
        yield from park_requests(kid, {}, total=1, batch_bytes=batch_bytes, commit=False)
        stop.wait(30)

    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.KVProducerStub(channel).Park.future(requests(), timeout=30)


def test_a_reservation_then_silence_delays_honest_parks_by_the_idle_bound_at_most(
    producer_process: Any,
) -> None:
    """A header for the whole pool is refused at once (max_batch_share); one for the largest
    share it may take, then silence, holds those pages for park_idle_timeout_s and no longer:
    an honest park that needs them succeeds as soon as they are back."""
    producer = producer_process(**SETTINGS)
    stop = threading.Event()
    try:
        whole_channel, whole = _silent_park(producer.target, "hog-all", 256 * MiB, stop)
        assert whole.result(timeout=10).reason == pb.REASON_TOO_LARGE
        whole_channel.close()
        channel, hog = _silent_park(producer.target, "hog", 128 * MiB, stop)
        with KVParker(producer.target, timeout=10) as parker, KVConsumer(producer.target) as c:
            wait_for(lambda: c.server_info(refresh=True).pool_free_bytes <= 128 * MiB)
            with KVParker(producer.target) as filler:  # the other half, honestly
                assert filler.park("filler", chunks(31, 4 * MiB, 0)).ok
            started = time.monotonic()
            honest = parker.park("honest", chunks(8, 4 * MiB, 1))  # needs the hog's pages
            waited = time.monotonic() - started
        assert honest.ok and honest.attempts > 1, honest
        assert waited < IDLE_S + 1.5, f"honest park waited {waited:.2f}s"
        assert hog.result(timeout=10).reason == pb.REASON_NOT_COMMITTED
        channel.close()
    finally:
        stop.set()


def test_a_trickle_with_keepalive_holds_no_more_than_its_share(producer_process: Any) -> None:
    """A batch that reserves its share and then sends one tiny chunk per 0.4 s (under the idle
    bound) while its id is kept alive: KeepAlive never renews an uncommitted batch, the trickle
    holds at most max_batch_share of the pool, and honest parks of the rest succeed at once;
    none of the trickle ever becomes visible, and its pages return once it stops."""
    producer = producer_process(**SETTINGS)
    stop = threading.Event()

    def trickle() -> Iterator[pb.ParkRequest]:
        yield from park_requests("trickle", {}, batch_bytes=128 * MiB, commit=False)
        cid = 0
        while not stop.wait(0.4):
            yield pb.ParkRequest(chunk=pb.Chunk(chunk_id=cid, data=b"t"))
            cid += 1

    with grpc.insecure_channel(producer.target) as channel:
        call = pb_grpc.KVProducerStub(channel).Park.future(trickle(), timeout=60)
        with KVConsumer(producer.target) as consumer, KVParker(producer.target) as parker:
            wait_for(lambda: consumer.server_info(refresh=True).pool_free_bytes <= 128 * MiB)
            for _ in range(4):  # several idle bounds long, renewing intent all the while
                consumer.extend_leases(["trickle"], 60)
                started = time.monotonic()
                ok = parker.park(f"honest-{_}", chunks(4, 4 * MiB, _))
                assert ok.ok and time.monotonic() - started < 1.0
                assert consumer.lookup(["trickle"])[0].state == "UNKNOWN"
                time.sleep(IDLE_S / 2)
            stop.set()
            assert call.result(timeout=10).reason == pb.REASON_NOT_COMMITTED
            wait_for(
                lambda: (
                    consumer.server_info(refresh=True).pool_free_bytes == 256 * MiB - 4 * 16 * MiB
                ),
                what="the trickle's pages back",
            )


# ============================================================================ silent calls
def test_park_streams_that_never_send_a_header_are_answered_within_the_idle_bound(
    producer_process: Any,
) -> None:
    producer = producer_process(**SETTINGS)
    stop = threading.Event()

    def nothing() -> Iterator[pb.ParkRequest]:
        stop.wait(30)
        yield from ()

    with grpc.insecure_channel(producer.target) as channel, KVConsumer(producer.target) as c:
        idle_ms = lookup_p50_ms(c)
        stub = pb_grpc.KVProducerStub(channel)
        started = time.monotonic()
        calls = [stub.Park.future(nothing(), timeout=30) for _ in range(200)]
        during_ms = lookup_p50_ms(c)
        replies = [call.result(timeout=10 + IDLE_S) for call in calls]
        elapsed = time.monotonic() - started
        stop.set()
    assert {r.reason for r in replies} == {pb.REASON_NOT_COMMITTED}
    assert elapsed < IDLE_S + 3, f"200 headerless streams took {elapsed:.2f}s to be answered"
    assert during_ms < idle_ms + 5


def test_silent_connections_are_dropped_within_the_handshake_timeout(producer_process: Any) -> None:
    """More raw TCP connections than max_connections, none of which ever speaks HTTP/2: the
    producer holds at most max_connections of them, drops them after its handshake timeout
    (5 s), and an honest client retrying its call is served within that bound, not the minute
    it took before."""
    producer = producer_process(**SETTINGS, max_connections=100)
    process = psutil.Process(producer.proc.pid)
    baseline = process.num_fds()
    host, port = producer.target.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port))) for _ in range(150)]
    try:
        with KVConsumer(producer.target, timeout=2) as honest:
            started = time.monotonic()
            while True:
                try:
                    assert honest.lookup(["x"])[0].state == "UNKNOWN"
                    break
                except TransportError:
                    # the handshake timeout, plus the client's reconnect backoff (2 s at most)
                    assert time.monotonic() - started < 5 + 2 + 2, "locked out past the bound"
                    time.sleep(0.1)
            served = time.monotonic() - started
            assert process.num_fds() <= baseline + 100 + 10  # capped at max_connections
            wait_for(
                lambda: process.num_fds() <= baseline + 5,
                timeout=15,
                what="silent connections closed by the handshake timeout",
            )
    finally:
        for conn in silent:
            conn.close()
    print(f"\nsilent connections: honest call served after {served:.2f}s")


# ============================================================================ big id lists
def test_a_lookup_of_the_most_ids_is_served_and_a_longer_one_refused(producer_process: Any) -> None:
    producer = producer_process(**SETTINGS)
    ids = [f"id-{i:06d}" for i in range(servicer.MAX_IDS_PER_CALL + 1)]
    with grpc.insecure_channel(producer.target) as channel:
        stub = pb_grpc.KVProducerStub(channel)
        most = stub.Lookup(pb.LookupRequest(kv_request_ids=ids[:-1]), timeout=10)
        assert [s.kv_request_id for s in most.states] == ids[:-1]
        assert {s.state for s in most.states} == {pb.STATE_UNKNOWN}
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(pb.LookupRequest(kv_request_ids=ids), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(servicer.MAX_IDS_PER_CALL) in (err.value.details() or "")


async def test_a_long_id_list_lets_other_calls_run_between_its_slices() -> None:
    """A Lookup or KeepAlive of many ids (~10 us of the event loop each) checks and serves
    them in slices and yields the loop before each next one: an honest call waiting behind it
    is delayed by one slice, not by the whole list."""
    ids = [f"id-{i:06d}" for i in range(servicer.MAX_IDS_PER_CALL)]
    turns = 0

    async def another_call() -> None:  # one step each time the event loop gets to it
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(another_call())
    await asyncio.sleep(0)
    try:
        before_check = turns
        assert await servicer._valid_ids(None, ids) == ids  # valid ids never need the context
        slices = len(ids) // servicer.IDS_PER_SLICE
        assert turns - before_check >= slices - 1
        served = [(len(part), turns) async for part in servicer._in_slices(ids)]
    finally:
        other.cancel()
    assert [n for n, _ in served] == [servicer.IDS_PER_SLICE] * slices
    assert all(later > earlier for (_, earlier), (_, later) in itertools.pairwise(served))


# ======================================================================= fields per message
def test_a_park_message_of_a_million_empty_fields_is_refused_and_others_are_served(
    producer_process: Any,
) -> None:
    """A valid batch whose header message also carries a million empty unknown fields (2 MB):
    protobuf would skip them, one by one; the producer stops counting at its field budget,
    refuses the batch, keeps nothing, and serves the next call."""
    producer = producer_process(**SETTINGS)
    requests = park_requests("wide", {0: b"kv"}, total=1)
    padded = requests[0].SerializeToString() + b"\x32\x00" * 1_000_000
    raw = [padded, *(r.SerializeToString() for r in requests[1:])]
    with grpc.insecure_channel(producer.target) as channel:
        raw_park = channel.stream_unary(
            "/kvpark.v1.KVProducer/Park", response_deserializer=pb.ParkResponse.FromString
        )
        with pytest.raises(grpc.RpcError) as err:
            raw_park(iter(raw), timeout=30)
        stub = pb_grpc.KVProducerStub(channel)
        state = stub.Lookup(pb.LookupRequest(kv_request_ids=["wide"]), timeout=10).states[0]
        honest = stub.Park(iter(park_requests("honest", {0: b"kv"}, total=1)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fields in one message" in (err.value.details() or "")
    assert state.state == pb.STATE_UNKNOWN
    assert honest.status == pb.STATUS_OK


# ============================================================================== dead peers
_WAITING_CONSUMER = textwrap.dedent(
    """
    import sys
    from kvpark import KVConsumer
    with KVConsumer(sys.argv[1], timeout=None) as consumer:
        print("binding", flush=True)
        consumer.load("never-parked", num_chunks=1, wait_timeout_s=120)
    """
)


def test_a_frozen_peer_is_noticed_within_seconds(producer_process: Any) -> None:
    """A consumer whose process stops (SIGSTOP: its TCP stays up, nothing answers pings) while
    its Fetch waits is noticed by the producer's keepalive within ~10 s, not a minute: the
    call is cancelled and the waiting id forgotten."""
    producer = producer_process(**SETTINGS, max_fetch_wait_s=120)
    consumer = subprocess.Popen(
        [sys.executable, "-c", _WAITING_CONSUMER, producer.target], stdout=subprocess.PIPE
    )
    try:
        assert consumer.stdout is not None and consumer.stdout.readline().strip() == b"binding"
        with KVConsumer(producer.target) as observer:
            wait_for(lambda: observer.lookup(["never-parked"])[0].state == "BOUND")
            os.kill(consumer.pid, signal.SIGSTOP)
            started = time.monotonic()
            wait_for(
                lambda: observer.lookup(["never-parked"])[0].state == "UNKNOWN",
                timeout=30,
                what="the frozen consumer's fetch to be dropped",
            )
            noticed = time.monotonic() - started
        assert noticed < 15, f"noticed after {noticed:.1f}s"
    finally:
        os.kill(consumer.pid, signal.SIGKILL)
        consumer.wait(10)
        if consumer.stdout is not None:
            consumer.stdout.close()


# ================================================================== file-descriptor budget
def test_a_descriptor_limit_below_max_connections_is_a_config_error(tmp_path: Any) -> None:
    args = [sys.executable, "-m", "kvpark.producer", "--listen", "127.0.0.1:0",
            "--metrics-listen", "", "--pool-bytes", "16MiB", "--max-chunk-bytes", "1MiB",
            "--max-connections", "1000"]  # fmt: skip
    run = subprocess.run(
        ChildLimits(nofile=256).wrap(args), capture_output=True, text=True, timeout=60,
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "max_connections" in run.stderr and "256" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_the_descriptor_budget_counts_the_data_listener_and_the_shm_socket(tmp_path: Any) -> None:
    """Kept data connections, TCP Fetches in flight and lent buffers each hold a descriptor:
    a limit that max_connections alone fits is still a config error once the data listener
    and the shm socket are on, and the message names each part with its count."""
    args = [sys.executable, "-m", "kvpark.producer", "--listen", "127.0.0.1:0",
            "--metrics-listen", "", "--pool-bytes", "16MiB", "--max-chunk-bytes", "1MiB",
            "--max-connections", "100", "--max-concurrent-rpcs", "100",
            "--data-listen", "127.0.0.1:0", "--shm-socket", str(tmp_path / "shm.sock")]  # fmt: skip
    run = subprocess.run(
        ChildLimits(nofile=1500).wrap(args), capture_output=True, text=True, timeout=60,
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    # 64 handshakes, 1,024 kept connections, the listener's own 4 and 100 calls in flight; the
    # shm socket's own 4, 256 connections with a lend's descriptor each, the 4 its thread takes
    # in only to close them and (the limit leaving no more) 256 lends.
    for part in ("max_connections 164", "data_listen 1192", "shm_socket 776", "is 1500"):
        assert part in run.stderr, (part, run.stderr)
    assert len(run.stderr.strip().splitlines()) == 1


def test_a_tight_descriptor_limit_gets_fewer_shm_lends_not_a_refusal_to_start(
    tmp_path: Any,
) -> None:
    """A hard limit of 4,096 (common outside containers) is below what the defaults with both
    transports on would need with 4,096 lends. The producer takes as many lends as the limit
    leaves room for, says so, and serves every transport."""

    producer = start_producer_process(
        tmp_path, limits=ChildLimits(nofile=4096), data_listen="127.0.0.1:0",
        shm_socket=str(tmp_path / "shm.sock"),
    )  # fmt: skip
    try:
        socket_path = str(tmp_path / "shm.sock")
        with (
            KVParker(producer.target) as parker,
            KVConsumer(producer.target, transport="tcp") as over_tcp,
            KVConsumer(producer.target, transport="shm", shm_socket=socket_path) as over_shm,
        ):
            for kid in ("t", "s"):
                assert parker.park(kid, [bytes(range(256)) * 16]).ok
            loaded = over_tcp.load("t", num_chunks=1)
            into = over_shm.shared_buffer(4096)
            lent = over_shm.load("s", num_chunks=1, into=into)
            made = _lends_until_refused(socket_path)  # besides the one `into` holds
        assert (loaded.ok, loaded.transport, lent.ok, lent.transport) == (
            True, "tcp", True, "shm"
        ), (loaded, lent)  # fmt: skip
    finally:
        producer.proc.terminate()
        output = producer.output()
    # 4,096 less 1,064 (1,000 connections and the margin), 17 (the metrics endpoint and its
    # connections), 2,092 (the data listener and 1,000 calls in flight) and 520 (the shm
    # socket's own, its connections and a lend's descriptor for each)
    assert "the shm socket takes 403 lends at once, not 4096" in output, output
    assert made == 402, made


def _lends_until_refused(socket_path: str) -> int:
    """Lends small buffers (a new one each time: the producer maps a buffer once; 64 lends per
    connection, the most) until the producer refuses for its total; how many it took."""
    made = 0
    lenders: list[ShmLender] = []
    try:
        while True:
            if made % 64 == 0:
                lenders.append(ShmLender(socket_path, None, 5.0))
                lenders[-1].connect()
            # Closed once lent: the producer's mapping keeps the memfd, and this process
            # holds no descriptor per lend.
            with SharedBuffer(4096) as buffer:
                try:
                    lenders[-1].lend(buffer, "fetch")
                except ShmRefused as refused:
                    assert "lends, the most it takes" in str(refused), refused
                    return made
            made += 1
    finally:
        for lender in lenders:
            lender.close()
