"""What the compose demo's prefill and decode workers share: settings, the model, the prompts
and the request ids.

Both workers run the same reference model (examples/reference_model.py, seeded weights) on the
same prompts (seeded token ids), as a router would hand one request to both sides. Both derive
the demo's request ids from the producer's epoch, so the two containers agree on them without
talking to each other, and a re-run against a restarted producer uses fresh ids.

Both workers are configured from `DEMO_*` environment variables (never `KVPARK_*`: those are
the producer's, and the producer rejects any it does not know):

    DEMO_TARGET          producer address (default producer:50051)
    DEMO_PARK_TOKEN      bearer token of the prefill side (Park)
    DEMO_FETCH_TOKEN     bearer token of the decode side (Fetch, KeepAlive, Lookup)
    DEMO_TLS_CA          PEM CA to verify the producer with: turns TLS on (the gRPC channel
                         and, with the same files, the decode side's TCP data connection)
    DEMO_TLS_CERT/_KEY   PEM client certificate and key (mTLS)
    DEMO_GENERATE        tokens each request decodes greedily (default 16)
    DEMO_TRANSPORT       the clients' `transport=`: auto (default), grpc, tcp or shm
    DEMO_SHM_SOCKET      the producer's shm socket as this container sees it (default: the
                         path the producer advertises in ServerInfo)
    DEMO_EXPECT_TRANSPORT  when set, the transport every park (prefill worker) or every load
                         that moved bytes (decode worker) must have taken; another one makes
                         the worker exit 1 (the compose demo: parks over shm, loads over tcp)
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
from reference_model import ReferenceModel

from kvpark import ProducerInfo, fingerprint

# The requests the demo walks through, in the order the table prints them, and the length of
# each one's prompt (64-token chunks: most end in a partial chunk).
PROMPT_TOKENS = {"on-time": 480, "partial": 500, "late": 256, "queued": 350}
NAMES = tuple(PROMPT_TOKENS)
MODEL_SEED = 0
PROMPT_SEED = 2024


@dataclass(frozen=True)
class Settings:
    target: str
    park_token: str | None
    fetch_token: str | None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    generate: int
    transport: str = "auto"
    shm_socket: str | None = None
    expect_transport: str | None = None

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
            generate=int(env.get("DEMO_GENERATE", "16")),
            transport=env.get("DEMO_TRANSPORT") or "auto",
            shm_socket=opt("DEMO_SHM_SOCKET"),
            expect_transport=opt("DEMO_EXPECT_TRANSPORT"),
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

    def data_tls(self) -> ssl.SSLContext | None:
        """The TCP data connection's TLS, from the same files as the channel's: the producer
        serves its data port with its gRPC certificate and, with mTLS, requires the client
        certificate there too. Without it a TLS producer's data port is not used (gRPC
        credentials cannot be reused for a plain socket) and loads go over the gRPC stream."""
        if not self.tls_ca:
            return None
        context = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context


def demo_model() -> ReferenceModel:
    """The model both workers run: same seed, same weights, so the same KV for a prompt."""
    return ReferenceModel(seed=MODEL_SEED)


def kv_fingerprint(model: ReferenceModel, tokens: npt.NDArray[np.int64]) -> bytes:
    """What both workers name a prompt's KV by: the model (its weights' seed and its sizes) and
    the prompt's tokens. The producer hands the KV only to a load that names the same, so a
    decode worker running another model, or another prompt under the same id, recomputes
    instead of decoding from KV that is not its own (docs/protocol.md, Fingerprints)."""
    return fingerprint("kvpark-reference-model", tokens, f"seed={MODEL_SEED}", repr(model.config))


def prompt(name: str, vocab_size: int) -> npt.NDArray[np.int64]:
    """The token ids of request `name`'s prompt (seeded, so both workers draw the same)."""
    rng = np.random.default_rng([PROMPT_SEED, NAMES.index(name)])
    return rng.integers(0, vocab_size, PROMPT_TOKENS[name], dtype=np.int64)


def partial_prefix(num_chunks: int) -> int:
    """How many chunks of the `partial` request the prefill worker commits: the first half."""
    return num_chunks // 2


def request_ids(epoch: int) -> dict[str, str]:
    """The demo's kv_request_ids for a producer epoch: {"on-time": "demo-<epoch>-on-time", ...}."""
    return {name: f"demo-{epoch:016x}-{name}" for name in NAMES}


def offered_transports(info: ProducerInfo) -> str:
    """The transports a producer offers, best first, as its ServerInfo tells them."""
    offered = [f"shm {info.shm_socket}"] if info.shm_socket else []
    if info.data_address:
        offered.append(f"tcp {info.data_address}{' (TLS)' if info.data_tls else ''}")
    return ", ".join([*offered, "grpc"])
