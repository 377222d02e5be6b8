"""A minimal decode worker: how an inference engine uses the `kvpark` client library.

The router hands the decode worker each request with the KV handle the prefill's park returned
(`ParkResult.handle`, passed on as a dict or JSON): which producer holds the KV, the producer
epoch the prefill saw, and how many chunks. The worker:

1. queues the request and keeps its lease alive while it waits for a decode slot
   (`keep_alive`: one background loop per producer);
2. when the request is admitted, allocates its KV buffer (here a numpy array; in an engine,
   pinned host memory or a staging buffer) and calls `load_or_recompute` by handle into it
   (a `ConsumerPool` keeps one client per producer), so the KV either lands there or the
   engine recomputes exactly the chunks that are missing;
3. logs which path was taken and why, then decodes (not shown).

Run it against a producer that has the KV parked, or with `--self-test`, which first parks
synthetic KV itself (playing the prefill worker) for all but one request, so both the remote
and the recompute path show:

    python examples/decode_worker.py --target 127.0.0.1:50051 --self-test
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import sys
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvpark import ConsumerPool, KVHandle, KVParker, LoadReport, Timeout
from kvpark.alloc import tune_allocator
from kvpark.client import KeepAlive

log = logging.getLogger("decode_worker")


@dataclass(frozen=True)
class Request:
    """What the router tells the decode worker about a request's KV."""

    kv_request_id: str
    # The park's handle: where the KV is. A request never parked has one the router guessed
    # (the producer it would have used, at that producer's current epoch).
    handle: KVHandle
    chunk_bytes: int

    @property
    def num_chunks(self) -> int:
        return self.handle.num_chunks


def synthetic_chunk(kv_request_id: str, chunk_id: int, size: int) -> bytes:
    """Stand-in for a chunk of KV: deterministic, so recompute and checks agree."""
    seed = hashlib.blake2b(f"{kv_request_id}/{chunk_id}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(seed, "little")).bytes(size)


class DecodeWorker:
    def __init__(self, producers: ConsumerPool) -> None:
        self.producers = producers
        self.queue: deque[Request] = deque()
        self._keepalives: dict[str, KeepAlive] = {}  # producer target -> its lease loop

    def submit(self, request: Request) -> None:
        """A request arrives from the router: queue it and start renewing its lease."""
        self.queue.append(request)
        producer = request.handle.producer
        keepalive = self._keepalives.get(producer)
        if keepalive is None:
            keepalive = self._keepalives[producer] = self.producers.client(producer).keep_alive()
        keepalive.add(request.kv_request_id)

    def admit_next(self) -> tuple[Request, np.ndarray, LoadReport[int]]:
        """Takes the next request into a decode slot and gets its KV, one way or the other."""
        request = self.queue.popleft()
        self._keepalives[request.handle.producer].discard(request.kv_request_id)
        kv = np.empty(request.num_chunks * request.chunk_bytes, dtype=np.uint8)

        def recompute(first_missing: int) -> int:
            # The engine's local prefill, from the first chunk that did not arrive.
            for chunk_id in range(first_missing, request.num_chunks):
                start = chunk_id * request.chunk_bytes
                data = synthetic_chunk(request.kv_request_id, chunk_id, request.chunk_bytes)
                kv[start : start + request.chunk_bytes] = np.frombuffer(data, np.uint8)
            return request.num_chunks - first_missing

        report = self.producers.load_or_recompute(request.handle, into=kv, recompute=recompute)
        result = report.result
        log.info(
            "%s: %s%s, %d chunks loaded (%.1f MiB in %.3fs), %s chunks recomputed",
            request.kv_request_id,
            report.path,
            f" ({report.reason})" if report.reason else "",
            result.chunks_loaded,
            result.bytes / 2**20,
            result.elapsed_s,
            report.recompute_value or 0,
        )
        return request, kv, report

    def close(self) -> None:
        for keepalive in self._keepalives.values():
            keepalive.stop()


def park_synthetic(request: Request) -> KVHandle:
    """Plays the prefill worker: parks the request's synthetic KV; returns the park's handle."""
    chunks = [
        synthetic_chunk(request.kv_request_id, chunk_id, request.chunk_bytes)
        for chunk_id in range(request.num_chunks)
    ]
    with KVParker(request.handle.producer) as parker:
        result = parker.park(request.kv_request_id, chunks)
    if not result.ok:
        raise RuntimeError(f"park {request.kv_request_id}: {result.reason} {result.detail}")
    return result.handle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="producer host:port")
    parser.add_argument("--ids", nargs="*", default=["req-1", "req-2", "req-3"])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument(
        "--epoch", type=int, help="producer epoch the router saw (default: the producer's own)"
    )
    parser.add_argument(
        "--self-test", action="store_true", help="park synthetic KV for all ids but the last"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    tune_allocator()  # multi-MiB messages: keep them off fresh mmaps (docs/performance.md)

    # One client per producer, one timeout policy for all: 10 s total, 2 s to the first chunk.
    with ConsumerPool(timeout=Timeout(10, first_chunk_s=2)) as producers:
        epoch = args.epoch
        if epoch is None:
            epoch = producers.client(args.target).server_info().producer_epoch

        def guessed(kid: str) -> KVHandle:
            nbytes = args.chunks * args.chunk_bytes
            return KVHandle(kid, args.target, epoch, args.chunks, nbytes)

        requests = [Request(kid, guessed(kid), args.chunk_bytes) for kid in args.ids]
        if args.self_test:
            # All but the last are parked (the last is a miss); the router forwards each
            # park's handle as JSON, as it would between processes.
            requests[:-1] = [
                dataclasses.replace(r, handle=KVHandle.from_json(park_synthetic(r).to_json()))
                for r in requests[:-1]
            ]
        worker = DecodeWorker(producers)
        for request in requests:
            worker.submit(request)
        wrong = 0
        try:
            while worker.queue:
                request, kv, _ = worker.admit_next()
                for chunk_id in range(request.num_chunks):  # the demo's KV is checkable
                    start = chunk_id * request.chunk_bytes
                    want = synthetic_chunk(request.kv_request_id, chunk_id, request.chunk_bytes)
                    wrong += kv[start : start + request.chunk_bytes].tobytes() != want
        finally:
            worker.close()
    if wrong:
        log.error("%d chunks hold the wrong bytes", wrong)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
