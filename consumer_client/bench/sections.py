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

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from .._models import State
from .._result import Reason
from .._sync import KVConsumer
from ..parker import KVParker
from . import payload
from .processes import cpu_seconds, spent
from .rawtcp import RawTcp

T = TypeVar("T")
LATENCY_CALL_S = 10.0  # each latency try's deadline: a hung producer fails the section
LATENCY_MAX_S = 120.0  # and all of them together stop after this
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

    kind: str  # raw_tcp, park, fetch, lookup, late_fetch
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

    def compare(self, got: payload.U8, expected: payload.U8, what: str) -> None:
        if (where := payload.first_difference(got, expected)) >= 0:
            raise Check(f"{what}: byte {where} differs from what was sent")
        self.verified_bytes += len(got)

    def timed(self, row: Row, call: Callable[[], T]) -> T:
        other, this = cpu_seconds(self.producer_pid), time.process_time()
        started = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - started
        row.add(seconds, time.process_time() - this, spent(other, cpu_seconds(self.producer_pid)))
        return result


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
            rows = {t: (Row("park", t, chunk), Row("fetch", t, chunk)) for t in p.transports}
            run.rows += [raw, *(row for pair in rows.values() for row in pair)]
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
    park_row: Row, fetch_row: Row,
) -> None:  # fmt: skip
    parker, consumer = run.clients[transport]
    size, timeout = len(expected), run.plan.call_timeout_s
    view = memoryview(expected)  # type: ignore[arg-type]
    pieces = [view[i : i + chunk] for i in range(0, size, chunk)]
    n = len(pieces)
    parked = run.timed(park_row, lambda: parker.park(kid, pieces, timeout=timeout))
    if not (parked.ok and (parked.chunks_parked, parked.bytes_parked) == (n, size)):
        raise Check(f"park of {kid!r} ({n} chunks, {size} bytes) answered {parked}")
    dest.fill(0)
    loaded = run.timed(
        fetch_row,
        lambda: consumer.load(kid, num_chunks=n, into=dest, timeout=timeout, confirm=False),
    )
    if not (loaded.ok and (loaded.chunks_loaded, loaded.bytes) == (n, size)):
        raise Check(f"load of {kid!r} ({n} chunks, {size} bytes) answered {loaded}")
    if (parked.transport, loaded.transport) != (transport, transport):
        raise Check(f"{kid!r} went by {parked.transport}/{loaded.transport}, not {transport}")
    run.compare(dest, expected, f"fetch of {kid!r}")
    if not (confirmed := consumer.confirm(loaded)).ok:
        raise Check(f"confirming the delivery of {kid!r} answered {confirmed}")


def latency(run: Run) -> None:
    for transport in run.plan.transports:
        parker, consumer = run.clients[transport]
        kid = f"{run.tag}-{transport}-late"
        parked = parker.park(kid, [payload.pattern(4096)], timeout=LATENCY_CALL_S)
        released = parker.release(kid, timeout=LATENCY_CALL_S)
        if not (parked.ok and released.ok):
            raise Check(f"park, then release, of {kid!r} answered {parked}, {released}")

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
