"""A one-shot prefill side that the compose tests run inside a container (service `same-host`).

    python parker.py KV_REQUEST_ID [KV_REQUEST_ID ...] --chunks N --chunk-bytes B
                     [--transport auto|grpc|shm]

Connects to DEMO_TARGET with DEMO_PARK_TOKEN, fills one `shared_buffer` of N x B random bytes
(chunk c = bytes [cB, (c+1)B)) and parks those same chunks under every id, as views of that
buffer: where the producer's shm socket can be reached the parker lends it the buffer and each
park names the chunks by offset (ParkResult.transport "shm"), else they go inline over gRPC.
Reports on stdout, one JSON object per line:

    {"event": "parked", "kv_request_id": ..., "ok": ..., "transport": ..., "sha256": ...}

`sha256` is that of the N x B bytes, for loaders to compare with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

from kvpark import KVParker, Timeout


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("kv_request_ids", nargs="+")
    parser.add_argument("--chunks", type=int, required=True)
    parser.add_argument("--chunk-bytes", type=int, required=True)
    parser.add_argument("--transport", default="auto", choices=("auto", "grpc", "shm"))
    args = parser.parse_args()

    target = os.environ.get("DEMO_TARGET", "producer:50051")
    token = os.environ.get("DEMO_PARK_TOKEN") or None
    size = args.chunk_bytes
    with KVParker(target, token=token, timeout=Timeout(total_s=30), transport=args.transport) as p:
        info = p.server_info()  # also tells the parker where the producer's shm socket is
        memory = p.shared_buffer(args.chunks * size)
        memory[:] = memoryview(os.urandom(len(memory)))
        digest = hashlib.sha256(memory).hexdigest()
        chunks = [memory[c * size : (c + 1) * size] for c in range(args.chunks)]
        for kid in args.kv_request_ids:
            result = p.park(kid, chunks)
            emit(
                "parked",
                kv_request_id=kid,
                ok=result.ok,
                reason=str(result.reason) if result.reason else None,
                transport=result.transport,
                transports=list(result.transports),
                chunks_parked=result.chunks_parked,
                bytes_parked=result.bytes_parked,
                producer=result.producer,
                epoch=info.producer_epoch,
                sha256=digest,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
