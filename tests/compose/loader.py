"""A one-shot decode side that the compose tests run inside a container (service `loader`).

    python loader.py KV_REQUEST_ID --chunks N --buffer-bytes B [--timeout S] [--expected-epoch E]

Connects to DEMO_TARGET with DEMO_FETCH_TOKEN, then runs one `load_or_recompute` and reports on
stdout, one JSON object per line, each with `t` (wall clock, the host's too):

    {"event": "ready", ...}                    connected (ServerInfo read), about to load
    {"event": "chunk", "index": i, ...}        chunk i verified and placed
    {"event": "result", "reason": ..., ...}    the outcome, `sha256` of the loaded bytes

Recompute only records the first missing chunk; the tests check it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

from kvpark.client import KVConsumer, Timeout


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("kv_request_id")
    parser.add_argument("--chunks", type=int, required=True)
    parser.add_argument("--buffer-bytes", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--expected-epoch", type=int, default=0)
    args = parser.parse_args()

    target = os.environ.get("DEMO_TARGET", "producer:50051")
    token = os.environ.get("DEMO_FETCH_TOKEN") or None
    buf = np.zeros(args.buffer_bytes, dtype=np.uint8)
    recomputed: list[int] = []
    with KVConsumer(target, token=token, timeout=Timeout(total_s=args.timeout)) as kv:
        info = kv.server_info()
        emit("ready", epoch=info.producer_epoch)
        report = kv.load_or_recompute(
            args.kv_request_id,
            num_chunks=args.chunks,
            into=buf,
            expected_epoch=args.expected_epoch,
            recompute=recomputed.append,
            on_chunk=lambda index, chunk_id, _view: emit("chunk", index=index, chunk_id=chunk_id),
        )
    result = report.result
    emit(
        "result",
        ok=result.ok,
        reason=str(result.reason) if result.reason else None,
        path=str(report.path),
        recomputed_from=report.recomputed_from,
        recompute_calls=recomputed,
        chunks_loaded=result.chunks_loaded,
        bytes=result.bytes,
        elapsed_s=result.elapsed_s,
        sha256=hashlib.sha256(buf[: result.bytes].tobytes()).hexdigest(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
