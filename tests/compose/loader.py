"""A one-shot decode side that the compose tests run inside a container (service `loader`).

    python loader.py KV_REQUEST_ID --chunks N --buffer-bytes B [--timeout S] [--expected-epoch E]
                     [--transport auto|grpc|tcp|shm] [--shared] [--data-tls-without-cert]

Connects to DEMO_TARGET with DEMO_FETCH_TOKEN, then runs one `load_or_recompute` and reports on
stdout, one JSON object per line, each with `t` (wall clock, the host's too):

    {"event": "ready", ...}                    connected (ServerInfo read), about to load
    {"event": "chunk", "index": i, ...}        chunk i verified and placed
    {"event": "result", "reason": ..., ...}    the outcome, `sha256` of the loaded bytes and
                                               the `transport` that carried them

`--shared` loads into the client's `shared_buffer` (lent to the producer over its shm socket
when this container can reach it) instead of a private numpy array.

With DEMO_TLS_CA (and DEMO_TLS_CERT / DEMO_TLS_KEY for mTLS) the channel speaks TLS, and the
TCP data connection too, with the same files; `--data-tls-without-cert` leaves the client
certificate off the data connection only (the producer must refuse it there).

Recompute only records the first missing chunk; the tests check it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvpark.client import KVConsumer, Timeout


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def tls_settings(with_cert_on_data: bool) -> tuple[Any, ssl.SSLContext | None]:
    """The channel's credentials and the data connection's TLS from DEMO_TLS_*, or None."""
    ca, cert, key = (os.environ.get(f"DEMO_TLS_{n}") or None for n in ("CA", "CERT", "KEY"))
    if ca is None:
        return None, None
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )
    data_tls = ssl.create_default_context(cafile=ca)
    if cert and with_cert_on_data:
        data_tls.load_cert_chain(cert, key)
    return credentials, data_tls


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("kv_request_id")
    parser.add_argument("--chunks", type=int, required=True)
    parser.add_argument("--buffer-bytes", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--expected-epoch", type=int, default=0)
    parser.add_argument("--transport", default="auto", choices=("auto", "grpc", "tcp", "shm"))
    parser.add_argument("--shared", action="store_true")
    parser.add_argument("--data-tls-without-cert", action="store_true")
    args = parser.parse_args()

    target = os.environ.get("DEMO_TARGET", "producer:50051")
    token = os.environ.get("DEMO_FETCH_TOKEN") or None
    credentials, data_tls = tls_settings(not args.data_tls_without_cert)
    recomputed: list[int] = []
    with KVConsumer(
        target,
        token=token,
        timeout=Timeout(total_s=args.timeout),
        credentials=credentials,
        transport=args.transport,
        data_tls=data_tls,
    ) as kv:
        info = kv.server_info()
        buf = (
            kv.shared_buffer(args.buffer_bytes)
            if args.shared
            else np.zeros(args.buffer_bytes, dtype=np.uint8)
        )
        emit(
            "ready",
            epoch=info.producer_epoch,
            data_address=info.data_address,
            data_tls=info.data_tls,
            shm_socket=info.shm_socket,
        )
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
        transport=result.transport,
        sha256=hashlib.sha256(buf[: result.bytes].tobytes()).hexdigest(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
