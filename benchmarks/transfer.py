"""Bulk transfer: raw TCP vs bare gRPC vs Park vs Fetch of one 580 MB request, and 16 Fetch
streams at once.

Single stream — for each repetition and each chunk size, four steps back to back, so the
four figures share the machine's conditions of the moment (this 2-core machine is noisy):

1. raw TCP: the window moved between two processes (`rawtcp`), the practical limit;
2. bare gRPC: the same window streamed by a minimal grpcio server process as `chunk`-byte
   messages into a preallocated numpy array (`grpcfloor`), the transport's own limit;
3. park: the same window uploaded as one declared Park batch of `chunk`-byte chunks, timed
   from the call to the `ParkResponse`; chunk CRC32Cs are computed before the clock starts
   (the prefill side had them as it produced the chunks);
4. fetch: the id loaded with the loader (consumer_client) into a preallocated numpy array,
   CRCs verified by the loader, then every byte compared with the window.

Each repetition and chunk size uses a different window of the pattern, so bytes left over
from an earlier transfer (a stale pool slot, the previous load in the same array) fail the
comparison.

Concurrency — each round parks 16 ids of `per_stream` bytes, then loads all 16 at once
(aggregate = total bytes / wall time from the first request to the last byte), and, in the same
round, parks and loads one id of the same total size as a single stream, the reference of the
ratio. While the 16 streams run, the prober process sends late Fetches.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import data
from .clients import LOAD_TIMEOUT_S, Loaded, Loader, Parker, zeroed
from .env import cpu_seconds
from .grpcfloor import FloorClient, FloorServer
from .rawtcp import RawTcpPair
from .report import VerificationError

Progress = Callable[[str], None]
KEEP_S = 120.0


@dataclass
class SingleStreamSamples:
    """Seconds per repetition, by chunk size; `cpu` holds, per step ("raw", "floor", "park",
    "fetch") and repetition, the CPU seconds the two processes spent on it: (this process, the
    other one) — receiver and sender for raw TCP, client and server for the bare gRPC stream,
    client and producer for park and fetch."""

    raw: dict[int, list[float]] = field(default_factory=dict)
    floor: dict[int, list[float]] = field(default_factory=dict)
    park: dict[int, list[float]] = field(default_factory=dict)
    fetch: dict[int, list[float]] = field(default_factory=dict)
    cpu: dict[str, dict[int, list[tuple[float, float]]]] = field(
        default_factory=lambda: {"raw": {}, "floor": {}, "park": {}, "fetch": {}}
    )
    bytes_verified: int = 0


class CpuPair:
    """CPU seconds this process and one other spend between `start()` and `stop()`; the
    last interval is kept in `last`."""

    def __init__(self, other_pid: int) -> None:
        self._pids = (os.getpid(), other_pid)
        self._start = (0.0, 0.0)
        self.last = (0.0, 0.0)

    def start(self) -> None:
        self._start = (cpu_seconds(self._pids[0]), cpu_seconds(self._pids[1]))

    def stop(self) -> tuple[float, float]:
        self.last = (
            cpu_seconds(self._pids[0]) - self._start[0],
            cpu_seconds(self._pids[1]) - self._start[1],
        )
        return self.last


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def park_checked(
    parker: Parker, kid: str, payload: data.U8, chunk: int, cpu: CpuPair | None = None
) -> tuple[float, int]:
    """Parks `payload`; returns (seconds, chunks). A refused park is a failed run. `cpu`
    measures the upload alone."""
    crcs = data.chunk_crcs(payload, chunk)
    # The data producer's lease is short (late-fetch probes need ids that are reaped soon);
    # a KeepAlive before the park records an intent (docs/protocol.md, KeepAlive), so the lease
    # the commit starts lasts KEEP_S and a busy machine does not reap the id before its fetch.
    # Not timed.
    parker.keep_alive([kid], KEEP_S)
    if cpu is not None:
        cpu.start()
    started = time.perf_counter()
    reply = parker.park(kid, payload, chunk, crcs)
    seconds = time.perf_counter() - started
    if cpu is not None:
        cpu.stop()
    if reply.status != 1 or reply.chunks_parked != len(crcs):
        raise VerificationError(
            f"park of {kid!r} ({len(payload)} bytes, {chunk}-byte chunks) answered "
            f"status={reply.status} reason={reply.reason} chunks_parked={reply.chunks_parked}, "
            f"expected {len(crcs)}: {reply.detail}"
        )
    return seconds, len(crcs)


def check_loaded(kid: str, result: Loaded, chunks: int, dest: data.U8, payload: data.U8) -> None:
    if not result.ok or result.chunks != chunks or result.nbytes != len(payload):
        raise VerificationError(
            f"load of {kid!r}: ok={result.ok} reason={result.reason} chunks={result.chunks}/"
            f"{chunks} bytes={result.nbytes}/{len(payload)}"
        )
    data.check_same(dest[: len(payload)], payload, f"load of {kid!r}")


def floor_checked(
    floor: FloorClient, window_no: int, chunk: int, dest: data.U8, payload: data.U8, cpu: CpuPair
) -> float:
    """Streams window `window_no` (`payload`) from the bare gRPC server into `dest` in
    `chunk`-byte messages; returns the seconds, every byte verified. The server cuts the
    messages before the clock starts; `cpu` measures the stream alone."""
    request, messages = floor.prepare(window_no, len(payload), chunk)
    dest.fill(0)
    cpu.start()
    result = floor.load(request, messages, dest, LOAD_TIMEOUT_S)
    cpu.stop()
    check_loaded(f"bare gRPC {request}", result, messages, dest, payload)
    return result.seconds


def single_stream(
    producer_pid: int,
    parker: Parker,
    loader: Loader,
    source: data.U8,
    nbytes: int,
    chunk_sizes: Sequence[int],
    reps: int,
    progress: Progress,
) -> SingleStreamSamples:
    out = SingleStreamSamples()
    with contextlib.ExitStack() as helpers:
        # The floor's server builds its pattern while the raw-TCP peer builds its own.
        floor_server = FloorServer(len(source))
        helpers.callback(floor_server.close)
        tcp = RawTcpPair(source, nbytes)
        helpers.callback(tcp.close)
        floor = FloorClient(floor_server.ready(), max(chunk_sizes))
        helpers.callback(floor.close)
        dest = zeroed(nbytes)
        tag = _tag()
        tcp_cpu, floor_cpu = CpuPair(tcp.peer_pid), CpuPair(floor_server.pid)
        grpc_cpu = CpuPair(producer_pid)
        for rep in range(reps):
            for ci, chunk in enumerate(chunk_sizes):
                window_no = rep * len(chunk_sizes) + ci
                label = f"{chunk >> 20} MiB chunks, repetition {rep + 1}/{reps}"
                progress(f"transfer {label}: raw TCP")
                out.raw.setdefault(chunk, []).append(tcp.once(window_no, chunk, tcp_cpu))
                out.cpu["raw"].setdefault(chunk, []).append(tcp_cpu.last)
                payload = data.window(source, window_no, nbytes)
                progress(f"transfer {label}: bare gRPC stream")
                floor_s = floor_checked(floor, window_no, chunk, dest, payload, floor_cpu)
                out.floor.setdefault(chunk, []).append(floor_s)
                out.cpu["floor"].setdefault(chunk, []).append(floor_cpu.last)
                kid = f"bench-{tag}-{chunk >> 20}m-{rep}"
                progress(f"transfer {label}: park")
                park_s, chunks = park_checked(parker, kid, payload, chunk, grpc_cpu)
                out.park.setdefault(chunk, []).append(park_s)
                out.cpu["park"].setdefault(chunk, []).append(grpc_cpu.last)
                progress(f"transfer {label}: fetch")
                dest.fill(0)
                grpc_cpu.start()
                result = loader.load(kid, chunks, dest, LOAD_TIMEOUT_S)
                out.cpu["fetch"].setdefault(chunk, []).append(grpc_cpu.stop())
                check_loaded(kid, result, chunks, dest, payload)
                out.fetch.setdefault(chunk, []).append(result.seconds)
                # raw TCP, bare gRPC, park (its bytes verified by the fetch), fetch
                out.bytes_verified += 4 * nbytes
    return out


@dataclass
class ConcurrencySamples:
    aggregate: list[float] = field(default_factory=list)  # seconds for streams*per_stream bytes
    single: list[float] = field(default_factory=list)  # seconds for the same bytes, one stream
    loaded_rejections: list[float] = field(default_factory=list)
    bytes_verified: int = 0


class LoadProbe:
    """Starts/stops the prober's late fetches around a phase (see prober.py)."""

    def __init__(self, start: Callable[[], None], stop: Callable[[], list[float]]) -> None:
        self.start = start
        self.stop = stop


# Loads every id at once: (ids, chunk counts, destinations) -> (results, wall seconds).
BatchLoad = Callable[[Sequence[str], Sequence[int], Sequence[data.U8]], tuple[list[Loaded], float]]


def threaded_batch(
    loader: Loader, streams: int, timeout: float = LOAD_TIMEOUT_S
) -> tuple[BatchLoad, Callable[[], None]]:
    """`streams` threads sharing one sync client (one channel): a threaded decode worker.
    Every load has `timeout` as its deadline, which bounds a batch."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=streams)

    def run(
        kids: Sequence[str], counts: Sequence[int], dests: Sequence[data.U8]
    ) -> tuple[list[Loaded], float]:
        started = time.perf_counter()
        futures = [
            pool.submit(loader.load, kid, n, dest, timeout)
            for kid, n, dest in zip(kids, counts, dests, strict=True)
        ]
        results = [f.result() for f in futures]
        return results, time.perf_counter() - started

    return run, lambda: pool.shutdown(wait=True)


def concurrency(
    parker: Parker,
    batch_load: BatchLoad,
    single: Loader,
    source: data.U8,
    streams: int,
    per_stream: int,
    chunk: int,
    rounds: int,
    probe: LoadProbe,
    progress: Progress,
) -> ConcurrencySamples:
    out = ConcurrencySamples()
    total = streams * per_stream
    dests = [zeroed(per_stream) for _ in range(streams)]
    single_dest = zeroed(total)
    tag = _tag()
    for rnd in range(rounds):
        label = f"{streams} streams, round {rnd + 1}/{rounds}"
        progress(f"concurrency {label}: park {streams} x {per_stream / 1e6:.0f} MB")
        kids = [f"bench-{tag}-c{rnd}-{s}" for s in range(streams)]
        payloads = []
        counts = []
        for s, kid in enumerate(kids):
            offset = s * per_stream + rnd * data.REP_SHIFT
            payload = source[offset : offset + per_stream]
            payloads.append(payload)
            counts.append(park_checked(parker, kid, payload, chunk)[1])
        for d in dests:
            d.fill(0)
        progress(f"concurrency {label}: fetch {streams} streams at once")
        probe.start()
        try:
            results, seconds = batch_load(kids, counts, dests)
        finally:
            out.loaded_rejections += probe.stop()
        out.aggregate.append(seconds)
        for s in range(streams):
            check_loaded(kids[s], results[s], counts[s], dests[s], payloads[s])
        out.bytes_verified += total
        progress(f"concurrency {label}: single-stream reference")
        offset = (rnd + 1) * data.REP_SHIFT + 1
        payload = source[offset : offset + total]
        kid = f"bench-{tag}-c{rnd}-single"
        _, n = park_checked(parker, kid, payload, chunk)
        single_dest.fill(0)
        result = single.load(kid, n, single_dest, LOAD_TIMEOUT_S)
        check_loaded(kid, result, n, single_dest, payload)
        out.single.append(result.seconds)
        out.bytes_verified += total
    return out
