"""Demo prefill worker: parks synthetic KV for the demo's requests on the producer.

It shows how a prefill worker in any language parks KV: with nothing but the stubs generated
from `protos/kvpark/v1/kvpark.proto`. One `Park` call per request is a client stream: a
`ParkHeader` (id, total chunks, and the batch's size so the pool reserves it before any data is
sent), then one `Chunk` per piece of KV with its CRC32C, then the producer's `ParkResponse`.
The call carries the prefill role's token as `authorization: Bearer <token>` metadata.

(Python producers that park at high rates can skip protobuf's payload copies with
`kvpark.wire.encode_park_chunk`, as the benchmarks do; the bytes on the wire are the same.)

A prefill worker is a long-running service, so after parking this one waits until it is
stopped (SIGTERM/SIGINT) and exits 0. `DEMO_EXIT_AFTER_PARK=true` makes it exit right away
instead (one-shot runs in tests). Settings: see demo_common.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import grpc
from decode_worker import synthetic_chunk
from demo_common import Settings, request_ids

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc

CONNECT_TIMEOUT_S = 30.0
PARK_TIMEOUT_S = 30.0


def park_requests(kv_request_id: str, settings: Settings) -> Iterator[pb.ParkRequest]:
    header = pb.ParkHeader(
        kv_request_id=kv_request_id,
        total_chunks=settings.chunks,
        batch_bytes=settings.request_bytes,
    )
    yield pb.ParkRequest(header=header)
    for chunk_id in range(settings.chunks):
        data = synthetic_chunk(kv_request_id, chunk_id, settings.chunk_bytes)
        yield pb.ParkRequest(chunk=pb.Chunk(chunk_id=chunk_id, data=data, crc32c=crc32c_of(data)))


def main() -> int:
    settings = Settings.from_env()
    stop = threading.Event()
    # PID 1 in a container gets no default signal handling: without these, `docker stop`
    # would wait out its grace period and then SIGKILL.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    creds = settings.credentials()
    options = [("grpc.max_send_message_length", settings.chunk_bytes + 65536)]
    channel = (
        grpc.secure_channel(settings.target, creds, options)
        if creds is not None
        else grpc.insecure_channel(settings.target, options)
    )
    metadata = (
        (("authorization", f"Bearer {settings.park_token}"),) if settings.park_token else None
    )
    with channel:
        stub = kvpark_pb2_grpc.KVProducerStub(channel)
        # wait_for_ready: compose starts us once the producer is healthy, but a restart may race.
        info = stub.GetServerInfo(
            pb.GetServerInfoRequest(),
            timeout=CONNECT_TIMEOUT_S,
            wait_for_ready=True,
            metadata=metadata,
        )
        print(
            f"prefill-worker: producer {settings.target} epoch {info.producer_epoch:016x}, "
            f"lease {info.unbound_store_timeout_s:g}s",
            flush=True,
        )
        for name, kid in request_ids(info.producer_epoch).items():
            started = time.perf_counter()
            reply = stub.Park(
                park_requests(kid, settings), timeout=PARK_TIMEOUT_S, metadata=metadata
            )
            took = time.perf_counter() - started
            if reply.status != pb.STATUS_OK:
                reason = pb.FailureReason.Name(reply.reason)
                print(f"prefill-worker: park {kid} failed: {reason} {reply.detail}", flush=True)
                return 1
            print(
                f"prefill-worker: parked {name:8s} {kid}: {reply.chunks_parked} chunks, "
                f"{settings.request_bytes} bytes in {took * 1000:.0f} ms "
                f"(lease {reply.lease_remaining_s:.1f}s)",
                flush=True,
            )
    if os.environ.get("DEMO_EXIT_AFTER_PARK", "").lower() in ("1", "true", "yes"):
        return 0
    print("prefill-worker: done parking; idle until stopped", flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
