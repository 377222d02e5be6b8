"""Every client call ends within its own deadline, and the one timeout rule holds.

The adversary is a frozen producer: it accepts TCP connections and never answers (no HTTP/2
settings, no status), the failure a client exists to survive. Against it, concurrent loads with
different timeouts each end within their own timeout plus a small margin, sync and async: no
call waits behind another's first contact. Then one test per row of the timeout rule (README,
"Timeouts"): the client's timeout applies to loads and unary calls alike, a call's timeout
overrides it, USE_CLIENT_DEFAULT means the client's, None means no limit, a number means that
many seconds in all. Last, a Lookup or KeepAlive of more ids than one request carries: its
requests share the call's one timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import MiB, park, running_producer, stub_for, wait_until

from kvpark import (
    AsyncKVConsumer,
    AsyncKVParker,
    KVConsumer,
    KVParker,
    Reason,
    Timeout,
    TransportError,
    UsageError,
)
from kvpark.client import USE_CLIENT_DEFAULT, ClientClosedError

# What a call may take beyond its own timeout: scheduling on a busy 2-core machine.
MARGIN_S = 0.6
TIMEOUTS_S = [0.2, 0.4, 0.6, 0.8, 1.0, 1.3, 1.6, 2.0]


class FrozenProducer:
    """Accepts connections and holds them open without reading or writing a byte."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._held.append(conn)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        for conn in self._held:
            conn.close()
        self._listener.close()


@pytest.fixture
def frozen() -> Iterator[FrozenProducer]:
    producer = FrozenProducer()
    yield producer
    producer.close()


def assert_within(elapsed: float, timeout: float) -> None:
    assert elapsed <= timeout + MARGIN_S, f"took {elapsed:.3f}s against its own {timeout}s"


# ============================================================ concurrent calls, one each
def test_concurrent_sync_loads_each_end_within_their_own_timeout(frozen: FrozenProducer) -> None:
    results: dict[float, tuple[Any, float]] = {}
    with KVConsumer(frozen.target) as client:

        def one(timeout: float) -> None:
            started = time.monotonic()
            result = client.load("x", num_chunks=1, timeout=timeout)
            results[timeout] = (result, time.monotonic() - started)

        threads = [threading.Thread(target=one, args=(t,)) for t in TIMEOUTS_S]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert sorted(results) == TIMEOUTS_S
    for timeout, (result, elapsed) in results.items():
        assert result.reason is Reason.TIMEOUT
        assert_within(elapsed, timeout)


async def test_concurrent_async_loads_each_end_within_their_own_timeout(
    frozen: FrozenProducer,
) -> None:
    async with AsyncKVConsumer(frozen.target) as client:

        async def one(timeout: float) -> tuple[Any, float]:
            started = time.monotonic()
            result = await client.load("x", num_chunks=1, timeout=timeout)
            return result, time.monotonic() - started

        outcomes = await asyncio.gather(*(one(t) for t in TIMEOUTS_S))
    for timeout, (result, elapsed) in zip(TIMEOUTS_S, outcomes, strict=True):
        assert result.reason is Reason.TIMEOUT
        assert_within(elapsed, timeout)


def test_keep_alive_rounds_end_within_their_interval(frozen: FrozenProducer) -> None:
    """Against a producer that never answers, each KeepAlive round fails at its own deadline
    (never longer than the interval), and stopping the loop returns promptly."""
    with KVConsumer(frozen.target) as client:
        keepalive = client.keep_alive(["a"], interval_s=0.3)
        deadline = time.monotonic() + 10
        while keepalive.statistics().errors < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keepalive.statistics().errors >= 3  # rounds keep coming, each bounded
        started = time.monotonic()
        keepalive.stop()
        assert_within(time.monotonic() - started, 0.3)


def test_a_parker_call_ends_within_its_own_timeout(frozen: FrozenProducer) -> None:
    with KVParker(frozen.target) as parker:
        started = time.monotonic()
        result = parker.park("x", [b"kv"], timeout=0.3)
        assert result.reason is Reason.TIMEOUT
        assert_within(time.monotonic() - started, 0.3)


# ======================================================================= the timeout rule
def test_rule_the_clients_timeout_applies_to_loads_and_unary_calls(
    frozen: FrozenProducer,
) -> None:
    with KVConsumer(frozen.target, timeout=0.3) as client:
        started = time.monotonic()
        assert client.load("x", num_chunks=1).reason is Reason.TIMEOUT
        assert_within(time.monotonic() - started, 0.3)
        started = time.monotonic()
        with pytest.raises(TransportError):
            client.lookup(["x"])
        assert_within(time.monotonic() - started, 0.3)


def test_rule_a_calls_timeout_overrides_the_clients(frozen: FrozenProducer) -> None:
    with KVConsumer(frozen.target, timeout=30) as client:
        started = time.monotonic()
        assert client.load("x", num_chunks=1, timeout=0.3).reason is Reason.TIMEOUT
        assert_within(time.monotonic() - started, 0.3)
        started = time.monotonic()
        with pytest.raises(TransportError):
            client.extend_leases(["x"], timeout=Timeout(0.3))
        assert_within(time.monotonic() - started, 0.3)


def test_rule_use_client_default_means_the_clients_timeout(frozen: FrozenProducer) -> None:
    with KVConsumer(frozen.target, timeout=Timeout(0.3)) as client:
        started = time.monotonic()
        result = client.load("x", num_chunks=1, timeout=USE_CLIENT_DEFAULT)
        assert result.reason is Reason.TIMEOUT
        assert_within(time.monotonic() - started, 0.3)
        with pytest.raises(TransportError):
            client.server_info(timeout=USE_CLIENT_DEFAULT)


def test_rule_none_means_no_limit_for_a_call(frozen: FrozenProducer) -> None:
    """`timeout=None` on a call lifts the client's 0.2 s: the call is still waiting well past
    it, and only closing the client ends it."""
    client = KVConsumer(frozen.target, timeout=0.2)
    outcome: list[BaseException] = []

    def unbounded() -> None:
        try:
            client.lookup(["x"], timeout=None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=unbounded)
    thread.start()
    thread.join(1.0)
    assert thread.is_alive() and not outcome, "a call with timeout=None must not time out"
    client.close()
    thread.join(10)
    assert isinstance(outcome[0], ClientClosedError)


# An unbounded client is warned, rightly, that its loads outlast the producer's tombstones.
@pytest.mark.filterwarnings("ignore::kvpark.client.TimeoutConfigWarning")
async def test_rule_none_means_no_limit_for_a_client() -> None:
    """A client made with `timeout=None` puts no deadline on a load: a fetch before park that
    the producer serves after 0.6 s succeeds, where a 0.3 s client would give up."""
    async with running_producer() as server, stub_for(server) as stub:
        async with AsyncKVConsumer(server.target, timeout=None) as unbounded:
            assert unbounded.timeout.total_s is None
            loading = asyncio.ensure_future(unbounded.load("later", num_chunks=1))
            await asyncio.sleep(0.6)
            # Still waiting twice as long as the bounded client below may: no deadline applied.
            # (The load's own clock starts after its ServerInfo round trip, so its elapsed_s
            # is not a reliable measure of this wait.)
            assert not loading.done()
            await park(stub, "later", {0: b"kv"}, total=1)
            assert (await loading).ok
        async with AsyncKVConsumer(server.target, timeout=0.3) as bounded:
            assert (await bounded.load("never", num_chunks=1)).reason is Reason.TIMEOUT


def test_rule_a_number_means_that_many_seconds_in_all(frozen: FrozenProducer) -> None:
    with KVConsumer(frozen.target, timeout=0.25) as client:
        assert client.timeout == Timeout(total_s=0.25)
        started = time.monotonic()
        assert client.load("x", num_chunks=1).reason is Reason.TIMEOUT
        assert_within(time.monotonic() - started, 0.25)


@pytest.mark.parametrize(
    ("timeout", "limit_s"),
    [
        (1.0, 1.0),
        (Timeout(4.0, first_chunk_s=0.5), 0.5),
        # The size-scaled budget of a 1 MiB load: 0.3 s + 1/1024 s.
        (Timeout(4.0, base_s=0.3, per_gib_s=1.0), 0.3 + 1 / 1024),
    ],
)
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_the_epoch_read_before_a_first_lend_is_inside_the_loads_own_limits(
    frozen: FrozenProducer, timeout: Timeout | float, limit_s: float, flavour: str
) -> None:
    """A load that would lend a shared buffer first reads the producer's epoch; that read
    counts against the load's own limits (the first chunk's, its size-scaled budget, else the
    total) and in its elapsed time: it is not extra time on top of them."""
    into = np.zeros(MiB, np.uint8)
    started = time.monotonic()
    if flavour == "sync":
        with KVConsumer(frozen.target, transport="shm") as client:
            result = client.load("x", num_chunks=1, into=into, timeout=timeout)
    else:

        async def load() -> Any:
            async with AsyncKVConsumer(frozen.target, transport="shm") as client:
                return await client.load("x", num_chunks=1, into=into, timeout=timeout)

        result = asyncio.run(load())
    elapsed = time.monotonic() - started
    assert result.reason is Reason.TIMEOUT
    assert_within(elapsed, limit_s)
    assert result.elapsed_s >= limit_s - 0.05, result  # the read counted in the load's time


def test_a_silent_shm_socket_costs_a_load_a_share_of_its_own_timeout() -> None:
    """A load into a shared buffer lends it over the shm socket first. A socket whose producer
    side never answers (a frozen lending thread) gets a share of the load's own timeout (a
    quarter: 0.25 s of 1 s), not a handshake timeout of its own on top, and that wait counts
    in the load's time: the load then goes on over the gRPC stream and ends within its
    timeout, with the bytes."""
    directory = tempfile.mkdtemp(prefix="kvpark-")  # Unix socket paths are short (107 bytes)
    path = os.path.join(directory, "frozen.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(path)
        silent.listen(8)  # connections queue; nothing ever reads or answers them

        async def scenario() -> Any:
            async with running_producer() as server:

                def run() -> tuple[Any, float]:
                    with KVParker(server.target) as parker:
                        assert parker.park("s", [bytes(range(256)) * 16]).ok
                    with KVConsumer(server.target, shm_socket=path) as client:
                        client.server_info()  # the epoch is known: the lend is what waits
                        into = client.shared_buffer(4096)
                        started = time.monotonic()
                        result = client.load("s", num_chunks=1, into=into, timeout=1.0)
                        return result, time.monotonic() - started

                return await asyncio.to_thread(run)

        result, elapsed = asyncio.run(scenario())
    shutil.rmtree(directory, ignore_errors=True)
    assert result.ok and result.transport == "grpc", result
    assert result.elapsed_s >= 0.25, result  # the lend's wait counts in the load's own time
    assert_within(elapsed, 1.0)


@contextlib.contextmanager
def silent_shm_socket() -> Iterator[socket.socket]:
    """An shm socket whose producer side never answers (a frozen lending thread):
    connections queue on it and nothing ever reads them."""
    directory = tempfile.mkdtemp(prefix="kvpark-")  # Unix socket paths are short (107 bytes)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.bind(os.path.join(directory, "frozen.sock"))
            silent.listen(8)
            yield silent
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def timed_against_a_silent_shm_socket(
    prepared: Callable[[KVParker], Callable[[], Any]],
) -> tuple[Any, float]:
    """Runs what `prepared(parker)` returns, for a parker whose producer's shm socket never
    answers (the epoch is already known, so a lend is what waits): its result and seconds."""
    with silent_shm_socket() as silent:

        async def scenario() -> tuple[Any, float]:
            async with running_producer() as server:

                def run() -> tuple[Any, float]:
                    with KVParker(server.target, shm_socket=silent.getsockname()) as parker:
                        parker.server_info()
                        action = prepared(parker)
                        started = time.monotonic()
                        return action(), time.monotonic() - started

                return await asyncio.to_thread(run)

        return asyncio.run(scenario())


@pytest.mark.parametrize("buffers", [1, 8])
def test_a_silent_shm_socket_costs_a_park_a_share_of_its_own_timeout(buffers: int) -> None:
    """A park from shared buffers lends them over the shm socket first. A socket that never
    answers gets a quarter of the park's own timeout for all of its lends together (each
    lend waiting a quarter of 0.8 s, short of what marks the socket down, eight took twice
    the timeout), not a handshake timeout of its own on top: the park then goes over the
    gRPC stream and ends within its timeout, parked."""

    def parking(parker: KVParker) -> Callable[[], Any]:
        sources = [parker.shared_buffer(4096) for _ in range(buffers)]
        for source in sources:
            source[:] = 7
        return lambda: parker.park("s", sources, timeout=0.8)

    result, elapsed = timed_against_a_silent_shm_socket(parking)
    assert result.ok and result.transport == "grpc", result
    assert_within(elapsed, 0.8)


async def test_an_async_park_waits_for_a_silent_shm_socket_off_the_event_loop() -> None:
    """While an async park's lend waits on a silent shm socket, the event loop goes on
    running other tasks (this test's own polling sees the lend waiting, with the park not
    done), and the park still ends parked, over the gRPC stream, within its timeout."""
    with silent_shm_socket() as silent:
        async with running_producer() as server:
            async with AsyncKVParker(server.target, shm_socket=silent.getsockname()) as parker:
                await parker.server_info()
                source = parker.shared_buffer(4096)
                source[:] = 7
                started = time.monotonic()
                park = asyncio.create_task(parker.park("s", [source], timeout=1.0))
                await wait_until(
                    lambda: select.select([silent], [], [], 0)[0], what="the lend to wait"
                )
                assert not park.done()
                result = await park
                elapsed = time.monotonic() - started
    assert result.ok and result.transport == "grpc", result
    assert_within(elapsed, 1.0)


def shared_chunks(parker: Any, buffers: int) -> list[Any]:
    """Two 4 KiB chunks in `buffers` shared buffers of the parker (one, or one each)."""
    if buffers == 1:
        source = parker.shared_buffer(2 * 4096)
        source[:] = 7
        return [source[:4096], source[4096:]]
    pieces = [parker.shared_buffer(4096) for _ in range(buffers)]
    for piece in pieces:
        piece[:] = 7
    return pieces


@pytest.mark.parametrize("buffers", [1, 2])
def test_a_silent_shm_socket_costs_a_streaming_batch_a_share_of_its_own_timeout(
    buffers: int,
) -> None:
    """A streaming batch from shared buffers lends one over the shm socket: when it starts
    with one shared buffer, at its first chunk with several. A socket that never answers
    gets a share of what is left of the batch's own timeout for each lend, not a handshake
    timeout of its own on top: the batch goes over the gRPC stream and commits within its
    timeout."""

    def streaming(parker: KVParker) -> Callable[[], Any]:
        pieces = shared_chunks(parker, buffers)

        def stream() -> Any:
            with parker.batch("s", total_chunks=2, timeout=1.0) as batch:
                for chunk_id, piece in enumerate(pieces):
                    assert batch.put(chunk_id, piece)
            return batch.result

        return stream

    result, elapsed = timed_against_a_silent_shm_socket(streaming)
    assert result is not None and result.ok and result.transport == "grpc", result
    assert result.chunks_parked == 2, result
    assert_within(elapsed, 1.0)


@pytest.mark.parametrize("buffers", [1, 2])
async def test_an_async_streaming_batch_waits_for_a_silent_shm_socket_off_the_event_loop(
    buffers: int,
) -> None:
    """While an async streaming batch's lend waits on a silent shm socket (when the batch
    starts with one shared buffer, at its first chunk with several), the event loop goes on
    running other tasks (this test's own polling sees the lend waiting, with the batch not
    done), and the batch still commits, over the gRPC stream, within its timeout."""
    with silent_shm_socket() as silent:
        async with running_producer() as server:
            async with AsyncKVParker(server.target, shm_socket=silent.getsockname()) as parker:
                await parker.server_info()
                pieces = shared_chunks(parker, buffers)

                async def stream() -> Any:
                    async with parker.batch("s", total_chunks=2, timeout=1.0) as batch:
                        for chunk_id, piece in enumerate(pieces):
                            assert await batch.put(chunk_id, piece)
                    return batch.result

                started = time.monotonic()
                streaming = asyncio.create_task(stream())
                await wait_until(
                    lambda: select.select([silent], [], [], 0)[0], what="the lend to wait"
                )
                assert not streaming.done()
                result = await streaming
                elapsed = time.monotonic() - started
    assert result is not None and result.ok and result.transport == "grpc", result
    assert result.chunks_parked == 2, result
    assert_within(elapsed, 1.0)


# ============================================================ one timeout, many requests
IDS_PER_REQUEST = 1000  # the producer's cap on ids per Lookup or KeepAlive
DELAY_S = 0.4


def of_ids(details: Any) -> bool:
    """A Lookup or KeepAlive, not the client's own background ServerInfo."""
    method = details.method
    method = method.decode() if isinstance(method, bytes) else method
    return method.endswith(("/Lookup", "/KeepAlive"))


class DelayedUnary(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Holds each unary call DELAY_S before it leaves, as a slow producer would, and records
    the deadline each Lookup or KeepAlive was given."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        time.sleep(DELAY_S)
        if of_ids(details):
            self.timeouts.append(details.timeout)
        return continuation(details, request)


class AioDelayedUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self) -> None:
        self.timeouts: list[float] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        await asyncio.sleep(DELAY_S)
        if of_ids(details):
            self.timeouts.append(details.timeout)
        return await continuation(details, request)


def assert_shared(timeouts: list[float], timeout: float) -> None:
    """Each request got what was left of the one timeout, not the whole of it again."""
    assert timeouts, "no request left"
    for n, given in enumerate(timeouts):
        assert given <= timeout - n * DELAY_S + 0.05, f"request {n} was given {given:.3f}s"


@pytest.mark.parametrize("method", ["lookup", "extend_leases"])
async def test_a_call_of_many_ids_ends_within_its_one_timeout(method: str) -> None:
    """4000 ids take four requests; with each held 0.4 s, a 1 s timeout runs out before the
    last one. The call raises DEADLINE_EXCEEDED within its timeout, each request given only
    what was left of it."""
    ids = [f"id-{i}" for i in range(4 * IDS_PER_REQUEST)]
    async with running_producer() as server:

        def run() -> tuple[BaseException | None, float, list[float]]:
            delayed = DelayedUnary()
            with KVConsumer(server.target, interceptors=[delayed]) as client:
                started = time.monotonic()
                try:
                    getattr(client, method)(ids, timeout=1.0)
                except TransportError as exc:
                    return exc, time.monotonic() - started, delayed.timeouts
                return None, time.monotonic() - started, delayed.timeouts

        raised, elapsed, timeouts = await asyncio.to_thread(run)
        delayed = AioDelayedUnary()
        async with AsyncKVConsumer(server.target, interceptors=[delayed]) as client:
            started = time.monotonic()
            with pytest.raises(TransportError, match="DEADLINE_EXCEEDED") as aio_raised:
                await getattr(client, method)(ids, timeout=1.0)
            aio_elapsed = time.monotonic() - started
    assert raised is not None and "DEADLINE_EXCEEDED" in str(raised), raised
    assert aio_raised.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    for spent, given in ((elapsed, timeouts), (aio_elapsed, delayed.timeouts)):
        assert_within(spent, 1.0)
        assert_shared(given, 1.0)


async def test_a_lookup_of_many_ids_answers_each_in_order() -> None:
    """Ids beyond one request's cap are split over several; the answer keeps the caller's
    order, each id's own state at its place."""
    ids = [f"id-{i}" for i in range(2 * IDS_PER_REQUEST + 500)]
    parked_at = [3, IDS_PER_REQUEST + 7, 2 * IDS_PER_REQUEST + 499]
    async with running_producer() as server:
        async with stub_for(server) as stub:
            for i in parked_at:
                await park(stub, ids[i], {0: b"kv"})
        async with AsyncKVConsumer(server.target) as client:
            states = await client.lookup(ids)
        with KVConsumer(server.target) as sync_client:
            sync_states = await asyncio.to_thread(sync_client.lookup, ids)
    for answer in (states, sync_states):
        assert [s.kv_request_id for s in answer] == ids
        assert [i for i, s in enumerate(answer) if s.state == "PARKED"] == parked_at


MISUSE: list[dict[str, Any]] = [
    {"kv_request_id": ""},
    {"kv_request_id": "x", "num_chunks": 0},
    {"kv_request_id": "x", "wait_timeout_s": -1},
    {"kv_request_id": "x", "expected_epoch": -1},
]


@pytest.mark.parametrize("kwargs", MISUSE)
async def test_load_misuse_is_raised_before_the_producer_is_asked_anything(
    frozen: FrozenProducer, kwargs: dict[str, Any]
) -> None:
    """A client that lends shared memory reads its producer's ServerInfo before its first
    load; misuse is still raised at once, not after that read waited out the timeout."""
    with KVConsumer(frozen.target, transport="shm", timeout=3) as client:
        started = time.monotonic()
        with pytest.raises(UsageError):
            await asyncio.to_thread(client.load, **kwargs)
        with pytest.raises(UsageError):
            await asyncio.to_thread(lambda: client.load_or_recompute(**kwargs, recompute=print))
        assert time.monotonic() - started < 1.0
    async with AsyncKVConsumer(frozen.target, transport="shm", timeout=3) as aclient:
        started = time.monotonic()
        with pytest.raises(UsageError):
            await aclient.load(**kwargs)
        with pytest.raises(UsageError):
            await aclient.load_or_recompute(**kwargs, recompute=print)
        assert time.monotonic() - started < 1.0
