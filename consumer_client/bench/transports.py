"""The transports `kvpark bench` measures: one entry here each, one row pair (park, fetch) in
the table each. An entry names the keyword arguments its `KVParker` and its `KVConsumer` get
(`transport=`), so a row never measures what the clients' "auto" would pick instead; every
result says which transport carried it, and the run checks that against the row.

- "grpc": the gRPC stream both ways, the path every client in every language has.
- "tcp": Fetch over the producer's zero-copy data connection. Park never goes over it, so the
  row's park is made over the gRPC stream, untimed (the grpc row measures that path).
- "shm": park from and load into `shared_buffer`s the clients lent the producer: the one-copy
  path. The bytes are placed in the parker's buffer before the clock starts, as a prefill
  worker writes its KV there in the first place.
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
    # Whether the park row measures this transport (False: parked over grpc, untimed).
    parks: bool = True
    # Whether park and load go through the clients' shared buffers.
    shared: bool = False


TRANSPORTS: dict[str, Transport] = {
    "grpc": Transport(
        "grpc", "the gRPC stream (Park, Fetch), kvpark.wire framing",
        parker_args={"transport": "grpc"}, consumer_args={"transport": "grpc"},
    ),
    "tcp": Transport(
        "tcp", "Fetch over the zero-copy data connection (sendmsg from the pool, recv_into)",
        parker_args={"transport": "grpc"}, consumer_args={"transport": "tcp"}, parks=False,
    ),
    "shm": Transport(
        "shm", "park from and fetch into lent shared-memory buffers (one copy each way)",
        parker_args={"transport": "shm"}, consumer_args={"transport": "shm"}, shared=True,
    ),
}  # fmt: skip
DEFAULT_TRANSPORTS = ("grpc", "tcp", "shm")
