"""The transports `kvpark bench` measures: one entry here each, one row pair (park, fetch) in
the table each. An entry names the keyword arguments its `KVParker` and its `KVConsumer` get
(`transport=`), so a row never measures what the clients' "auto" would pick instead; every
result says which transport carried it, and the run checks that against the row. The clients
also speak "tcp" (fetch only: its park would be the gRPC row's) and "shm" (needs a lent buffer
and the producer's `shm_socket`); adding one means an entry below and, for our own producer,
the flag that turns it on (`--data-listen`, `--shm-socket`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Transport:
    name: str  # as in --transport, in the table and in the clients' results
    description: str
    parker_args: Mapping[str, Any]
    consumer_args: Mapping[str, Any]


TRANSPORTS: dict[str, Transport] = {
    "grpc": Transport(
        "grpc", "the gRPC stream (Park, Fetch), kvpark.wire framing",
        parker_args={"transport": "grpc"}, consumer_args={"transport": "grpc"},
    ),
}  # fmt: skip
DEFAULT_TRANSPORT = "grpc"
