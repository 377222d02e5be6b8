"""The benchmark's clients: a raw Park uploader, and loaders for Fetch.

Park: raw `ParkRequest` frames built by `kvpark.wire` (byte-identical to the generated stubs)
on a method registered with an identity serializer, one declared batch (`batch_bytes`,
`total_chunks`) per id, ended by its `ParkCommit`. Not `KVParker`, on purpose: the chunks' CRCs
are computed before the clock starts (the prefill side has them as it produces the chunks), so
the timed upload is the transport's alone; `kvpark bench` times `KVParker.park` itself.

Fetch: `ConsumerLoader` is the product — `KVConsumer.load(..., into=<numpy array>)`.
`RawLoader` is a minimal stand-in with the same shape (frames parsed by `kvpark.wire`, CRC32C
checked, one copy into the caller's array), kept for `--loader raw`. Both confirm each
delivery after the timed load, so the producer frees the id before the next park needs room.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np

import kvpark.client
from kvpark import wire
from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc

from .data import U8
from .env import MiB, channel_options

_SERVICE = "/kvpark.v1.KVProducer/"
# Room for the largest chunk plus framing, on every channel the benchmark opens.
MAX_MESSAGE_BYTES = 64 * MiB
# Load timeout of every benchmark load; below the producer's tombstone_retention_s
# (docs/protocol.md), so a late answer is never an UNKNOWN_ID.
LOAD_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Loaded:
    ok: bool
    reason: str
    chunks: int
    nbytes: int
    seconds: float


class Loader(Protocol):
    name: str

    def load(self, kid: str, num_chunks: int, into: U8, timeout: float) -> Loaded: ...

    def close(self) -> None: ...


def open_channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=channel_options(MAX_MESSAGE_BYTES))


class Parker:
    """Uploads one id's chunks in one declared Park batch over raw frames."""

    def __init__(self, target: str) -> None:
        self._channel = open_channel(target)
        self._park = self._channel.stream_unary(
            _SERVICE + "Park",
            request_serializer=None,  # frames are already bytes
            response_deserializer=pb.ParkResponse.FromString,
        )
        # The unary calls need no special framing: the generated stub already declares them.
        self._stub = pb_grpc.KVProducerStub(self._channel)

    def park(
        self,
        kid: str,
        payload: U8,
        chunk_bytes: int,
        crcs: Sequence[int],
        timeout: float = 120.0,
    ) -> pb.ParkResponse:
        """Parks `payload` as ceil(len/chunk_bytes) chunks; `crcs` are their CRC32Cs."""
        view = memoryview(payload)  # type: ignore[arg-type]
        total = len(crcs)

        def frames() -> Iterator[bytes]:
            yield wire.encode_park_header(kid, total_chunks=total, batch_bytes=len(payload))
            for i in range(total):
                yield wire.encode_park_chunk(
                    i, crcs[i], (view[i * chunk_bytes : (i + 1) * chunk_bytes],)
                )
            yield wire.encode_park_commit(total, len(payload))  # nothing is kept without it

        reply: pb.ParkResponse = self._park(frames(), timeout=timeout)
        return reply

    def lookup(self, kids: Sequence[str]) -> list[pb.IdState]:
        reply: pb.LookupResponse = self._stub.Lookup(
            pb.LookupRequest(kv_request_ids=list(kids)), timeout=30
        )
        return list(reply.states)

    def release(self, kid: str) -> pb.ReleaseResponse:
        reply: pb.ReleaseResponse = self._stub.Release(
            pb.ReleaseRequest(kv_request_id=kid), timeout=30
        )
        return reply

    def keep_alive(self, kids: Sequence[str], extend_s: float) -> list[pb.IdState]:
        reply: pb.KeepAliveResponse = self._stub.KeepAlive(
            pb.KeepAliveRequest(kv_request_ids=list(kids), extend_s=extend_s), timeout=30
        )
        return list(reply.states)

    def server_info(self) -> pb.ServerInfo:
        info: pb.ServerInfo = self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
        return info

    def close(self) -> None:
        self._channel.close()


class RawLoader:
    """Stand-in for consumer_client: same placement rule (back to back in request order)."""

    name = "internal raw client"

    def __init__(self, target: str) -> None:
        self._channel = open_channel(target)
        self._fetch = self._channel.unary_stream(
            _SERVICE + "Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=None,  # raw frames, parsed by kvpark.wire
        )
        self._stub = pb_grpc.KVProducerStub(self._channel)

    def load(self, kid: str, num_chunks: int, into: U8, timeout: float) -> Loaded:
        started = time.perf_counter()
        view = memoryview(into)  # type: ignore[arg-type]
        pos = 0
        count = 0
        request = pb.FetchRequest(kv_request_id=kid, chunk_ids=range(num_chunks))
        for raw in self._fetch(request, timeout=timeout):
            message = wire.parse_fetch_response(raw)
            if isinstance(message, wire.ChunkView):
                data = message.data
                if message.chunk_id != count or crc32c_of(data) != message.crc32c:
                    return Loaded(False, "CHECKSUM_MISMATCH", count, pos, 0.0)
                view[pos : pos + len(data)] = data
                pos += len(data)
                count += 1
            elif isinstance(message, pb.TransferDone):
                ok = message.status == pb.STATUS_OK and count == num_chunks
                reason = "" if ok else pb.FailureReason.Name(message.reason)
                seconds = time.perf_counter() - started
                if ok:  # the id stays DELIVERED, holding its pages, until this confirmation
                    release = pb.ReleaseRequest(kv_request_id=kid, delivery_id=message.delivery_id)
                    ok = self._stub.Release(release, timeout=30).status == pb.STATUS_OK
                return Loaded(ok, reason, count, pos, seconds)
        return Loaded(False, "PROTOCOL_ERROR", count, pos, time.perf_counter() - started)

    def close(self) -> None:
        self._channel.close()


class ConsumerLoader:
    """The product: `consumer_client.KVConsumer.load(..., into=<numpy array>)`."""

    name = "consumer_client.KVConsumer"

    def __init__(self, target: str, client: Any = None) -> None:

        self._owned = client is None
        self._client: Any = client or kvpark.client.KVConsumer(
            target,
            timeout=LOAD_TIMEOUT_S,
            transport="grpc",  # what the lab's figures compare
        )
        self._client.server_info()  # first contact now, not inside the first timed load

    def load(self, kid: str, num_chunks: int, into: U8, timeout: float) -> Loaded:
        started = time.perf_counter()
        result = self._client.load(
            kid, num_chunks=num_chunks, into=into, timeout=timeout, confirm=False
        )
        seconds = time.perf_counter() - started
        # Confirmed here, untimed, rather than in the client's background: the next park of
        # a run that fills the pool needs this id's pages back first.
        confirmed = bool(result.ok) and bool(self._client.confirm(result).ok)
        return Loaded(
            confirmed,
            "" if result.ok else f"{result.reason}: {result.detail}",
            int(result.chunks_loaded),
            int(result.bytes),
            seconds,
        )

    def close(self) -> None:
        if self._owned:
            self._client.close()


class AsyncConsumerBatch:
    """Many loads at once on one `consumer_client.AsyncKVConsumer` (one channel), in one
    event loop: how an asyncio decode worker would load a batch of requests."""

    name = "consumer_client.AsyncKVConsumer"

    def __init__(self, target: str) -> None:
        self._target = target

    def load_all(
        self, kids: Sequence[str], num_chunks: Sequence[int], intos: Sequence[U8], timeout: float
    ) -> tuple[list[Loaded], float]:
        """Loads every id concurrently; returns the results and the wall time of the batch."""
        return asyncio.run(self._load_all(kids, num_chunks, intos, timeout))

    async def _load_all(
        self, kids: Sequence[str], num_chunks: Sequence[int], intos: Sequence[U8], timeout: float
    ) -> tuple[list[Loaded], float]:

        async with kvpark.client.AsyncKVConsumer(
            self._target, timeout=LOAD_TIMEOUT_S, transport="grpc"
        ) as client:
            await client.server_info()

            loaded: list[Any] = [None] * len(kids)

            async def one(i: int) -> Loaded:
                began = time.perf_counter()
                r = loaded[i] = await client.load(
                    kids[i], num_chunks=num_chunks[i], into=intos[i], timeout=timeout,
                    confirm=False,
                )  # fmt: skip
                return Loaded(
                    bool(r.ok),
                    "" if r.ok else f"{r.reason}: {r.detail}",
                    int(r.chunks_loaded),
                    int(r.bytes),
                    time.perf_counter() - began,
                )

            started = time.perf_counter()
            results = await asyncio.gather(*(one(i) for i in range(len(kids))))
            seconds = time.perf_counter() - started
            # Confirmed after the clock stops: the pool needs these pages for the next round.
            for i, r in enumerate(loaded):
                if r.ok and not (await client.confirm(r)).ok:
                    results[i] = Loaded(False, "confirmation refused", 0, 0, 0.0)
            return list(results), seconds


def make_loader(target: str, prefer_raw: bool = False) -> Loader:
    return RawLoader(target) if prefer_raw else ConsumerLoader(target)


def zeroed(nbytes: int) -> U8:
    """A preallocated destination with its pages touched (as an engine's KV buffer is)."""
    out = np.empty(nbytes, dtype=np.uint8)
    out.fill(0)  # touch every page now, not during the timed load
    return out
