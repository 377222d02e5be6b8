"""What the compose demo's prefill and decode workers share: settings, ids and synthetic KV.

Both workers are configured from `DEMO_*` environment variables (never `KVPARK_*`: those are
the producer's, and the producer rejects any it does not know). Both derive the demo's request
ids from the producer's epoch, so the two containers agree on them without talking to each
other, and a re-run against a restarted producer uses fresh ids. The KV bytes are
decode_worker.py's synthetic KV, deterministic per id and chunk, so the decode worker can check
every byte it loaded and "recompute" a chunk by regenerating it.

    DEMO_TARGET          producer address (default producer:50051)
    DEMO_PARK_TOKEN      bearer token of the prefill side (Park)
    DEMO_FETCH_TOKEN     bearer token of the decode side (Fetch, KeepAlive, Lookup)
    DEMO_TLS_CA          PEM CA to verify the producer with: turns TLS on
    DEMO_TLS_CERT/_KEY   PEM client certificate and key (mTLS)
    DEMO_CHUNKS          chunks per request (default 16)
    DEMO_CHUNK_BYTES     bytes per chunk (default 1 MiB)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from decode_worker import synthetic_chunk

MiB = 1024 * 1024
# The three requests the demo walks through, in the order the table prints them.
NAMES = ("on-time", "late", "queued")


@dataclass(frozen=True)
class Settings:
    target: str
    park_token: str | None
    fetch_token: str | None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    chunks: int
    chunk_bytes: int

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ

        def opt(name: str) -> str | None:
            return env.get(name) or None

        return cls(
            target=env.get("DEMO_TARGET", "producer:50051"),
            park_token=opt("DEMO_PARK_TOKEN"),
            fetch_token=opt("DEMO_FETCH_TOKEN"),
            tls_ca=opt("DEMO_TLS_CA"),
            tls_cert=opt("DEMO_TLS_CERT"),
            tls_key=opt("DEMO_TLS_KEY"),
            chunks=int(env.get("DEMO_CHUNKS", "16")),
            chunk_bytes=int(env.get("DEMO_CHUNK_BYTES", str(MiB))),
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials when DEMO_TLS_CA is set (with a client cert: mTLS)."""
        if not self.tls_ca:
            return None

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.tls_ca),
            private_key=read(self.tls_key),
            certificate_chain=read(self.tls_cert),
        )

    @property
    def request_bytes(self) -> int:
        return self.chunks * self.chunk_bytes


def request_ids(epoch: int) -> dict[str, str]:
    """The demo's kv_request_ids for a producer epoch: {"on-time": "demo-<epoch>-on-time", ...}."""
    return {name: f"demo-{epoch:016x}-{name}" for name in NAMES}


def fill(into: memoryview | np.ndarray, kv_request_id: str, first: int, settings: Settings) -> int:
    """Regenerates ("recomputes") chunks first..N-1 into `into`, chunk k at k * chunk_bytes."""
    view = np.asarray(into, dtype=np.uint8).reshape(-1)
    size = settings.chunk_bytes
    for k in range(first, settings.chunks):
        view[k * size : (k + 1) * size] = np.frombuffer(
            synthetic_chunk(kv_request_id, k, size), np.uint8
        )
    return settings.chunks - first
