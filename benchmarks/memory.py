"""Producer memory: RSS with the pool full, and RSS growth while 100k ids cycle through it.

Pool full: ids of 64 MiB (16 chunks of 4 MiB) are parked until the pool cannot take another
chunk, their leases extended with KeepAlive so none is reaped before the reading; the producer's
RSS is read from /proc, then every id is released.

Churn: ids cycle through the three ways an id ends — parked then fetched (bytes verified, the
delivery confirmed), parked then released, parked then left for the reaper — a third each,
`workers` at a time, on a producer of their own whose lease (1 s) and tombstone retention
(2 s) are short, so the run sees every id end and its tombstone pruned. RSS is read when the
producer is quiescent (every id ended and its tombstone pruned) after a warm-up, and again,
quiescent, after the measured ids: the difference is what the producer kept. Growth that
retention holds by design (tombstones within `tombstone_retention_s`) is deliberately not
counted; the peak during the churn is reported beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kvpark import wire
from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb

from . import data
from .clients import MAX_MESSAGE_BYTES, Parker
from .env import MiB, ProducerProcess, channel_options
from .report import VerificationError

Progress = Callable[[str], None]
_SERVICE = "/kvpark.v1.KVProducer/"


@dataclass
class PoolFullResult:
    rss_bytes: int
    stored_bytes: int
    pool_bytes: int
    ids: int


def pool_full(
    producer: ProducerProcess, parker: Parker, source: data.U8, progress: Progress
) -> PoolFullResult:
    chunk = 4 * MiB
    per_id = 16 * chunk
    tag = uuid.uuid4().hex[:8]
    kids: list[str] = []
    stored = 0
    try:
        while True:
            free = int(parker.server_info().pool_free_bytes)
            nbytes = min(per_id, free // chunk * chunk)
            if nbytes <= 0:
                break
            progress(
                f"memory: filling the pool, {stored / MiB:.0f} MiB parked, "
                f"{free / MiB:.0f} MiB free"
            )
            offset = (len(kids) * per_id) % (len(source) - per_id)
            payload = source[offset : offset + nbytes]
            kid = f"bench-{tag}-full-{len(kids)}"
            reply = parker.park(kid, payload, chunk, data.chunk_crcs(payload, chunk))
            if reply.status != pb.STATUS_OK:
                raise VerificationError(
                    f"pool fill: park of {kid!r} refused ({reply.reason}) with "
                    f"{free} bytes free: {reply.detail}"
                )
            kids.append(kid)
            stored += nbytes
            parker.keep_alive([kid], 120.0)
        rss = producer.rss()
        info = parker.server_info()
        stored_now = int(info.pool_bytes - info.pool_free_bytes)
        return PoolFullResult(rss, stored_now, int(info.pool_bytes), len(kids))
    finally:
        progress("memory: releasing the pool")
        for kid in kids:
            parker.release(kid)


# ---------------------------------------------------------------------------------- churn
@dataclass
class ChurnResult:
    ids: int
    warmup_ids: int
    rss_before: int
    rss_after: int
    rss_peak: int
    seconds: float
    fetched: int = 0
    released: int = 0
    left_to_reap: int = 0
    rss_samples: list[tuple[float, int]] = field(default_factory=list)


class _Churn:
    """Async client for the churn: raw frames for Park and Fetch, generated messages else."""

    def __init__(self, channel: grpc.aio.Channel, payload_bytes: int, source: data.U8) -> None:
        self._park = channel.stream_unary(
            _SERVICE + "Park",
            request_serializer=None,
            response_deserializer=pb.ParkResponse.FromString,
        )
        self._fetch = channel.unary_stream(
            _SERVICE + "Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=None,
        )
        self._release = channel.unary_unary(
            _SERVICE + "Release",
            request_serializer=pb.ReleaseRequest.SerializeToString,
            response_deserializer=pb.ReleaseResponse.FromString,
        )
        self._lookup = channel.unary_unary(
            _SERVICE + "Lookup",
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString,
        )
        self._bytes = payload_bytes
        self._source = source
        self._view = memoryview(source)  # type: ignore[arg-type]
        self.fetched = self.released = self.left = 0

    def payload(self, i: int) -> memoryview:
        offset = (i * 7919) % (len(self._source) - self._bytes)
        return self._view[offset : offset + self._bytes]

    async def cycle(self, kid: str, i: int) -> None:
        payload = self.payload(i)
        frames = [
            wire.encode_park_header(kid, total_chunks=1, batch_bytes=len(payload)),
            wire.encode_park_chunk(0, crc32c_of(payload), (payload,)),
            wire.encode_park_commit(1, len(payload)),
        ]
        reply = await self._park(iter(frames), timeout=30)
        if reply.status != pb.STATUS_OK:
            raise VerificationError(
                f"churn: park of {kid!r} refused: {reply.reason} {reply.detail}"
            )
        kind = i % 3
        if kind == 0:
            got = b""
            done: pb.TransferDone | None = None
            async for raw in self._fetch(pb.FetchRequest(kv_request_id=kid), timeout=30):
                message = wire.parse_fetch_response(raw)
                if isinstance(message, wire.ChunkView):
                    if crc32c_of(message.data) != message.crc32c:
                        raise VerificationError(f"churn: {kid!r} chunk CRC mismatch")
                    got += bytes(message.data)
                elif isinstance(message, pb.TransferDone):
                    done = message
            if done is None or done.status != pb.STATUS_OK or got != bytes(payload):
                raise VerificationError(f"churn: fetch of {kid!r} got wrong bytes or {done}")
            # The id stays DELIVERED, its pages held, until the delivery is confirmed.
            confirm = pb.ReleaseRequest(kv_request_id=kid, delivery_id=done.delivery_id)
            confirmed = await self._release(confirm, timeout=30)
            if confirmed.status != pb.STATUS_OK:
                raise VerificationError(f"churn: confirming {kid!r} answered {confirmed}")
            self.fetched += 1
        elif kind == 1:
            released = await self._release(pb.ReleaseRequest(kv_request_id=kid), timeout=30)
            if released.status != pb.STATUS_OK:
                raise VerificationError(f"churn: release of {kid!r} answered {released}")
            self.released += 1
        else:
            self.left += 1  # the reaper ends it

    async def states(self, kids: list[str]) -> list[pb.IdState]:
        reply = await self._lookup(pb.LookupRequest(kv_request_ids=kids), timeout=30)
        return list(reply.states)


async def _run_ids(
    client: _Churn,
    tag: str,
    first: int,
    count: int,
    workers: int,
    pending_cap: int,
    lease_s: float,
    progress: Progress,
    what: str,
) -> None:
    """Cycles ids first..first+count-1 with `workers` in flight. Ids left for the reaper hold
    pool pages for about a lease: at most `pending_cap` of them are outstanding."""
    next_id = first
    end = first + count
    reap_times: list[float] = []  # when each outstanding left-to-reap id was parked
    last_report = 0.0

    async def worker() -> None:
        nonlocal next_id, last_report
        while next_id < end:
            i = next_id
            next_id += 1
            if i % 3 == 2:
                while True:
                    now = time.monotonic()
                    while reap_times and reap_times[0] < now - lease_s - 1.0:
                        reap_times.pop(0)
                    if len(reap_times) < pending_cap:
                        break
                    await asyncio.sleep(0.05)
                reap_times.append(time.monotonic())
            await client.cycle(f"bench-{tag}-{i}", i)
            now = time.monotonic()
            if now - last_report > 1.0:
                last_report = now
                progress(f"memory churn ({what}): {i - first + 1:,}/{count:,} ids")

    await asyncio.gather(*(worker() for _ in range(workers)))


async def _quiescent(client: _Churn, kids: list[str], timeout_s: float) -> None:
    """Waits until every id in `kids` is forgotten (ended and its tombstone pruned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = await client.states(kids)
        if all(s.state == pb.STATE_UNKNOWN for s in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"churn: ids not pruned after {timeout_s}s: "
                f"{[pb.State.Name(s.state) for s in states]}"
            )
        await asyncio.sleep(0.1)


def churn(
    producer: ProducerProcess,
    ids: int,
    warmup: int,
    source: data.U8,
    progress: Progress,
    workers: int = 16,
    payload_bytes: int = 4096,
) -> ChurnResult:
    return asyncio.run(_churn(producer, ids, warmup, source, progress, workers, payload_bytes))


async def _churn(
    producer: ProducerProcess,
    ids: int,
    warmup: int,
    source: data.U8,
    progress: Progress,
    workers: int,
    payload_bytes: int,
) -> ChurnResult:
    settings = producer.settings
    pages = settings.pool_bytes // (256 * 1024)
    pending_cap = max(16, pages // 2)
    lease = settings.unbound_store_timeout_s
    settle_s = lease + settings.tombstone_retention_s + 4 * settings.reap_interval_s + 10.0
    tag = uuid.uuid4().hex[:8]
    samples: list[tuple[float, int]] = []
    async with grpc.aio.insecure_channel(
        producer.target, options=channel_options(MAX_MESSAGE_BYTES)
    ) as channel:
        client = _Churn(channel, payload_bytes, source)
        await _run_ids(client, tag, 0, warmup, workers, pending_cap, lease, progress, "warm-up")
        progress("memory churn: waiting for the warm-up ids to be pruned")
        await _quiescent(
            client, [f"bench-{tag}-{i}" for i in range(max(0, warmup - 6), warmup)], settle_s
        )
        rss_before = producer.rss()
        started = time.monotonic()
        stop = asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - started, producer.rss()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)

        sampler = asyncio.create_task(sample())
        try:
            await _run_ids(
                client, tag, warmup, ids, workers, pending_cap, lease, progress, "measured"
            )
        finally:
            stop.set()
            await sampler
        seconds = time.monotonic() - started
        progress("memory churn: waiting for the last ids to be reaped and pruned")
        last = [f"bench-{tag}-{i}" for i in range(warmup + ids - 6, warmup + ids)]
        await _quiescent(client, last, settle_s)
        rss_after = producer.rss()
        return ChurnResult(
            ids=ids,
            warmup_ids=warmup,
            rss_before=rss_before,
            rss_after=rss_after,
            rss_peak=max([rss_before, rss_after] + [r for _, r in samples]),
            seconds=seconds,
            fetched=client.fetched,
            released=client.released,
            left_to_reap=client.left,
            rss_samples=samples,
        )
