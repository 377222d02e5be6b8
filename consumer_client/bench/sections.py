"""What `kvpark bench` measures. Transfer: per chunk size and repetition, back to back so they
share the machine's moment, raw TCP moves a window of the pattern (rawtcp.py), then for each
transport `KVParker.park` parks the same window as one batch (CRC32C per chunk, computed within
the timed call) and `KVConsumer.load` loads it into a preallocated numpy array (every chunk's
CRC checked); every byte is then compared, and the delivery confirmed, untimed, so the next
park finds the pool free. Latency: an id is parked and released, so the producer keeps only its
tombstone; a Fetch of it is a late fetch, turned away in-band (RELEASED) by the same check that
turns away a fetch of a reaped id. Tries alternate a unary Lookup (one round trip, the
reference) and a late load, with nothing else running.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np

from kvpark.producer.data_threads import lower_priority

from .._models import State
from .._result import Reason
from .._sync import KVConsumer
from ..parker import KVParker
from . import payload
from .late_fetcher import Prober, ProberArgs
from .processes import cpu_seconds, spent
from .rawtcp import RawTcp
from .transports import TRANSPORTS

T = TypeVar("T")
LATENCY_CALL_S = 10.0  # each latency try's deadline: a hung producer fails the section
LATENCY_MAX_S = 120.0  # and all of them together stop after this
STREAMS = 16  # loads at once in the concurrent section
Clients = dict[str, tuple[KVParker, KVConsumer]]  # transport -> its clients


class Check(Exception):
    """A byte, a CRC or an outcome was not what it had to be: the run exits 1."""


@dataclass(frozen=True)
class Plan:
    size: int
    chunks: tuple[int, ...]
    reps: int
    latency_tries: int
    transports: tuple[str, ...]
    quick: bool

    @property
    def call_timeout_s(self) -> float:
        return 30.0 + self.size / 20e6  # one park or load: bounded, yet never tight


@dataclass
class Row:
    """One figure's samples: seconds per repetition (or try), and CPU seconds of this process
    and of the other end (None where it is not ours to read)."""

    # raw_tcp, park, fetch, fetch_concurrent(_probed), lookup, late_fetch, late_fetch_busy
    kind: str
    transport: str | None
    chunk_bytes: int = 0
    seconds: list[float] = field(default_factory=list)
    cpu: list[tuple[float, float | None]] = field(default_factory=list)

    def add(self, seconds: float, this_cpu: float, other_cpu: float | None) -> None:
        self.seconds.append(seconds)
        self.cpu.append((this_cpu, other_cpu))


@dataclass
class Run:
    plan: Plan
    clients: Clients
    producer_pid: int | None  # our own producer's; None for --target
    progress: Callable[[str], None]
    rows: list[Row] = field(default_factory=list)
    verified_bytes: int = 0
    tag: str = field(default_factory=lambda: f"kvpark-bench-{uuid.uuid4().hex[:8]}")
    # The producer, and what the late-fetch prober needs to reach it (late_fetcher.py).
    target: str = ""
    prober_args: ProberArgs = field(default_factory=ProberArgs)
    # transport -> (the parker's, the consumer's) shared buffer, made on first use.
    shared: dict[str, tuple[payload.U8, payload.U8]] = field(default_factory=dict)

    def compare(self, got: payload.U8, expected: payload.U8, what: str) -> None:
        if (where := payload.first_difference(got, expected)) >= 0:
            raise Check(f"{what}: byte {where} differs from what was sent")
        self.verified_bytes += len(got)

    def buffers(
        self, transport: str, source: payload.U8, dest: payload.U8
    ) -> tuple[payload.U8, payload.U8]:
        """Where a transport parks from and loads into: for shm, the clients' shared buffers
        (the source copied into the parker's, untimed); otherwise `source` and `dest`."""
        if not TRANSPORTS[transport].shared:
            return source, dest
        if transport not in self.shared:
            parker, consumer = self.clients[transport]
            size = self.plan.size
            self.shared[transport] = parker.shared_buffer(size), consumer.shared_buffer(size)
        staged, landing = self.shared[transport]
        staged[: len(source)] = source
        return staged[: len(source)], landing[: len(dest)]

    def timed(self, row: Row | None, call: Callable[[], T]) -> T:
        """`call()`, its seconds and CPU added to `row` (untimed without one)."""
        if row is None:
            return call()
        other, this = cpu_seconds(self.producer_pid), time.process_time()
        started = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - started
        row.add(seconds, time.process_time() - this, spent(other, cpu_seconds(self.producer_pid)))
        return result


def warm_up(run: Run) -> None:
    """One small park and load per transport before anything is timed, as in a worker that
    has been serving: channels connected, the producer's epoch known to both clients (a
    shared buffer is lent only to the producer whose epoch the client knows), buffers lent."""
    for transport in run.plan.transports:
        parker, consumer = run.clients[transport]
        parker.server_info(timeout=LATENCY_CALL_S)
        consumer.server_info(timeout=LATENCY_CALL_S)
        source, dest = run.buffers(transport, payload.pattern(4096), np.empty(4096, np.uint8))
        _park_and_fetch(run, transport, f"{run.tag}-{transport}-warm-up", source, 4096, dest)


def transfer(run: Run) -> None:
    p = run.plan
    pattern_bytes = payload.source_bytes(p.size, len(p.chunks) * p.reps)
    run.progress(f"building the {p.size / 1e6:g} MB pattern here and in the raw TCP peer")
    tcp = RawTcp(pattern_bytes)
    try:
        source = payload.pattern(pattern_bytes)
        dest = np.empty(p.size, dtype=np.uint8)
        for ci, chunk in enumerate(p.chunks):
            raw = Row("raw_tcp", None, chunk)
            rows = {
                t: (Row("park", t, chunk) if TRANSPORTS[t].parks else None, Row("fetch", t, chunk))
                for t in p.transports
            }
            run.rows += [raw, *(row for pair in rows.values() for row in pair if row)]
            for rep in range(p.reps):
                index = ci * p.reps + rep
                expected = payload.window(source, index, p.size)
                label = f"{chunk / 2**20:g} MiB chunks, repetition {rep + 1}/{p.reps}"
                run.progress(f"transfer, {label}: raw TCP")
                dest.fill(0)  # touched, and nothing left of the previous transfer
                this = time.process_time()
                seconds, peer_cpu = tcp.transfer(index * payload.SHIFT, dest, chunk)
                raw.add(seconds, time.process_time() - this, peer_cpu)
                run.compare(dest, expected, f"raw TCP, {label}")
                for transport, (park_row, fetch_row) in rows.items():
                    run.progress(f"transfer, {label}: park and fetch, {transport}")
                    kid = f"{run.tag}-{transport}-{chunk}-{rep}"
                    _park_and_fetch(run, transport, kid, expected, chunk, dest, park_row,
                                    fetch_row)  # fmt: skip
    finally:
        tcp.close()


def _park_and_fetch(
    run: Run, transport: str, kid: str, expected: payload.U8, chunk: int, dest: payload.U8,
    park_row: Row | None = None, fetch_row: Row | None = None,
) -> None:  # fmt: skip
    """Parks `expected` and loads it back, timed into the rows given; checks the transport
    each took, every byte, and confirms the delivery untimed."""
    parker, consumer = run.clients[transport]
    size, timeout = len(expected), run.plan.call_timeout_s
    source, dest = run.buffers(transport, expected, dest)
    pieces = _pieces(source, chunk)
    n = len(pieces)
    parked = run.timed(park_row, partial(parker.park, kid, pieces, timeout=timeout))
    if not (parked.ok and (parked.chunks_parked, parked.bytes_parked) == (n, size)):
        raise Check(f"park of {kid!r} ({n} chunks, {size} bytes) answered {parked}")
    dest.fill(0)
    load = partial(consumer.load, kid, num_chunks=n, into=dest, timeout=timeout, confirm=False)
    loaded = run.timed(fetch_row, load)
    if not (loaded.ok and (loaded.chunks_loaded, loaded.bytes) == (n, size)):
        raise Check(f"load of {kid!r} ({n} chunks, {size} bytes) answered {loaded}")
    want = (transport if TRANSPORTS[transport].parks else "grpc", transport)
    if (parked.transport, loaded.transport) != want:
        raise Check(f"{kid!r} went by {parked.transport}/{loaded.transport}, not {want}")
    run.compare(dest, expected, f"fetch of {kid!r}")
    if not (confirmed := consumer.confirm(loaded)).ok:
        raise Check(f"confirming the delivery of {kid!r} answered {confirmed}")


def _pieces(source: payload.U8, chunk: int) -> list[memoryview]:
    view = memoryview(source)  # type: ignore[arg-type]
    return [view[i : i + chunk] for i in range(0, len(source), chunk)]


def concurrent(run: Run) -> None:
    """STREAMS loads at once, each of 1/STREAMS of a transfer, into their own slice of one
    destination, against one load of the whole transfer: the aggregate seconds. Each
    repetition runs the one load and then the STREAMS loads back to back, so that their ratio
    is paired (the machine's speed drifts between sections more than concurrency costs), and
    the STREAMS loads twice. Once alone: the throughput figure, measured as the one load was,
    with nothing else running. Once while another process sends late fetches back to back
    (late_fetcher.py), only while the loads run: what a turned-away decode worker waits while
    the producer is busy; that prober is a closed loop that takes a share of the two cores of
    its own, so the aggregate measured with it is reported too but is not the throughput
    figure. The loading threads run at a lower CPU priority (nice +10) than the prober: on this
    one host they stand for decode workers on other hosts, whose cores the producer does not
    share, so the late fetch measures the producer's answer rather than a fight for cores."""
    p = run.plan
    chunk = p.chunks[0]
    part = p.size // STREAMS // chunk * chunk  # whole chunks per stream, the rest to the last
    if part == 0:
        run.progress(f"concurrent loads: left out, --size is under {STREAMS} chunks")
        return
    source = payload.pattern(p.size)
    spans = [(i * part, (i + 1) * part if i < STREAMS - 1 else p.size) for i in range(STREAMS)]
    with _loading_threads() as pool:
        _raw_concurrent_rows(run, pool, source, spans)
        for transport in p.transports:
            _concurrent_rows(run, transport, pool, source, spans)


def _raw_concurrent_rows(
    run: Run, pool: ThreadPoolExecutor, source: payload.U8, spans: list[tuple[int, int]]
) -> None:
    """The machine's own cost of STREAMS transfers at once, the reference for the loads':
    raw TCP (rawtcp.py) moves the same spans over STREAMS connections, received by the
    loads' threads, each repetition paired with one raw transfer of them all just before."""
    chunk = run.plan.chunks[0]
    one = Row("raw_tcp_one", None, chunk)
    at_once = Row("raw_tcp_concurrent", None, chunk)
    run.rows += [one, at_once]
    dest = np.empty(run.plan.size, dtype=np.uint8)
    tcp = RawTcp(run.plan.size, connections=STREAMS)
    try:
        for rep in range(run.plan.reps):
            what = f"{STREAMS} raw TCP transfers at once, repetition {rep + 1}/{run.plan.reps}"
            run.progress(f"{what}: one transfer of them all")
            for row, windows, threads in (
                (one, [(0, dest)], None),
                (at_once, [(start, dest[start:end]) for start, end in spans], pool),
            ):
                dest.fill(0)
                this = time.process_time()
                seconds, peer_cpu = tcp.transfer_at_once(windows, chunk, threads)
                row.add(seconds, time.process_time() - this, peer_cpu)
                run.compare(dest, source, what)
    finally:
        tcp.close()


def _concurrent_rows(
    run: Run, transport: str, pool: ThreadPoolExecutor, source: payload.U8,
    spans: list[tuple[int, int]],
) -> None:  # fmt: skip
    """One transport's rows of the concurrent section, its loads run by `pool`'s threads."""
    p, chunk = run.plan, run.plan.chunks[0]
    prober = Prober(run.target, _released(run, transport, "busy-late"), run.prober_args)
    one = Row("fetch_one", transport, chunk)
    alone = Row("fetch_concurrent", transport, chunk)
    probed = Row("fetch_concurrent_probed", transport, chunk)
    late_row = Row("late_fetch_busy", transport)
    run.rows += [one, alone, probed, late_row]
    staged, dest = run.buffers(transport, source, np.empty(p.size, dtype=np.uint8))
    try:
        for rep in range(p.reps):
            what = f"{STREAMS} concurrent loads, {transport}, repetition {rep + 1}/{p.reps}"
            run.progress(f"{what}: one load of them all")
            _park_and_fetch(run, transport, f"{run.tag}-{transport}-one-{rep}", source,
                            chunk, dest, fetch_row=one)  # fmt: skip
            run.progress(what)
            _concurrent_loads(run, transport, pool, f"c{rep}", spans, staged, dest, alone)
            run.progress(f"{what}, with late fetches")
            _concurrent_loads(run, transport, pool, f"p{rep}", spans, staged, dest, probed,
                              probe=(prober, late_row))  # fmt: skip
    finally:
        prober.close()


def _loading_threads() -> ThreadPoolExecutor:
    """STREAMS threads at the loaders' priority, all started before anything is timed: a
    decode worker loads from threads it already has, and starting sixteen threads inside the
    timed loads (each `start` waits for its thread to run) would count as the loads' cost."""
    pool = ThreadPoolExecutor(STREAMS, initializer=lower_priority)
    started = threading.Barrier(STREAMS + 1)
    try:
        for _ in range(STREAMS):
            pool.submit(started.wait, LATENCY_CALL_S)
        started.wait(LATENCY_CALL_S)
    except BaseException:
        started.abort()  # the threads that wait give up at once
        pool.shutdown()
        raise
    return pool


def _concurrent_loads(
    run: Run, transport: str, pool: ThreadPoolExecutor, tag: str,
    spans: list[tuple[int, int]], staged: payload.U8, dest: payload.U8, row: Row,
    probe: tuple[Prober, Row] | None = None,
) -> None:  # fmt: skip
    """Parks STREAMS ids (untimed), loads them all at once (timed into `row`), checks every
    byte and confirms the deliveries. With a probe, its prober sends late fetches (their
    seconds into its row) while the loads run, and only then: the parks before them go over
    the gRPC stream for the tcp row, and a late fetch meanwhile would measure that path."""
    parker, consumer = run.clients[transport]
    chunk = run.plan.chunks[0]
    kids = [f"{run.tag}-{transport}-{tag}-{i}" for i in range(STREAMS)]
    for kid, (start, end) in zip(kids, spans, strict=True):
        parked = parker.park(
            kid, _pieces(staged[start:end], chunk), timeout=run.plan.call_timeout_s
        )
        if not parked.ok:
            raise Check(f"park of {kid!r} answered {parked}")
    dest.fill(0)
    if probe is not None:
        probe[0].go()
    try:
        results = run.timed(row, partial(_load_all, run, transport, pool, kids, spans, dest))
    finally:
        if probe is not None:
            for seconds in probe[0].stop():
                probe[1].add(seconds, 0.0, None)
    for kid, result in zip(kids, results, strict=True):
        if not result.ok or result.transport != transport:
            raise Check(f"concurrent load of {kid!r} answered {result}")
    run.compare(dest, staged[: len(dest)], f"{STREAMS} concurrent loads, {transport}")
    for kid, result in zip(kids, results, strict=True):
        if not (confirmed := consumer.confirm(result)).ok:
            raise Check(f"confirming the delivery of {kid!r} answered {confirmed}")


def _load_all(
    run: Run, transport: str, pool: ThreadPoolExecutor, kids: list[str],
    spans: list[tuple[int, int]], dest: payload.U8,
) -> list[Any]:  # fmt: skip
    consumer = run.clients[transport][1]
    timeout = run.plan.call_timeout_s

    def load(kid: str, span: tuple[int, int]) -> Any:
        into = dest[span[0] : span[1]]
        return consumer.load(kid, into=into, timeout=timeout, confirm=False)

    loads = [pool.submit(load, kid, span) for kid, span in zip(kids, spans, strict=True)]
    return [f.result() for f in loads]


def _released(run: Run, transport: str, name: str) -> str:
    """An id parked and released: the producer keeps only its tombstone."""
    parker = run.clients[transport][0]
    kid = f"{run.tag}-{transport}-{name}"
    parked = parker.park(kid, [payload.pattern(4096)], timeout=LATENCY_CALL_S)
    released = parker.release(kid, timeout=LATENCY_CALL_S)
    if not (parked.ok and released.ok):
        raise Check(f"park, then release, of {kid!r} answered {parked}, {released}")
    return kid


def latency(run: Run) -> None:
    for transport in run.plan.transports:
        consumer = run.clients[transport][1]
        kid = _released(run, transport, "late")

        def lookup(kid: str = kid, consumer: KVConsumer = consumer) -> None:
            [state] = consumer.lookup([kid], timeout=LATENCY_CALL_S)
            if (state.state, state.reason) != (State.TOMBSTONED, Reason.RELEASED):
                raise Check(f"Lookup of the released {kid!r} answered {state}")

        def late_fetch(kid: str = kid, consumer: KVConsumer = consumer) -> None:
            result = consumer.load(kid, num_chunks=1, timeout=LATENCY_CALL_S)
            if result.ok or result.reason is not Reason.RELEASED or result.chunks_loaded:
                raise Check(f"late fetch of the released {kid!r} answered {result}")

        for _ in range(5):  # connection and first-call set-up are not tries
            lookup()
            late_fetch()
        rows = Row("lookup", transport), Row("late_fetch", transport)
        run.rows += rows
        run.progress(f"latency, {transport}: {run.plan.latency_tries:,} Lookups and late fetches")
        ends = time.monotonic() + LATENCY_MAX_S
        for _ in range(run.plan.latency_tries):
            run.timed(rows[0], lookup)
            run.timed(rows[1], late_fetch)
            if time.monotonic() > ends:
                run.progress(f"latency, {transport}: stopped after {LATENCY_MAX_S:g} s")
                break
