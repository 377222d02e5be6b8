"""`KVHandle`: where a request's KV is, as the router passes it from prefill to decode.

The prefill side gets one from every successful park (`ParkResult.handle`); a proxy or router
forwards it with the request, as vLLM forwards `kv_transfer_params`; the decode side loads by it
(`ConsumerPool.load(handle, ...)`), from whichever producer it names, with the epoch checked so
a restarted producer answers EPOCH_MISMATCH at once instead of UNKNOWN after a wait.

On the wire it is a small JSON-able dict:

    {"kvpark": 1, "kv_request_id": "req-42", "remote_host": "10.0.3.7", "remote_port": 50051,
     "producer_epoch": 1234, "num_chunks": 8, "bytes": 33554432, "transports": ["tcp", "grpc"]}

`remote_host` / `remote_port` name the producer as decode workers reach it (its
`advertise_address`, not its listen address). Unknown keys are ignored, so a router may add its
own; a missing or malformed known key is a UsageError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpark.address import Address
from kvpark.ids import check_id
from kvpark.pb import kvpark_pb2 as pb

from ._errors import UsageError

FORMAT_VERSION = 1
# The most chunks one load asks for. A Fetch names them in its request, as packed varints:
# ids 0..2**24-1 take 62 MiB there, within the client's default request limit
# (DEFAULT_MAX_CHUNK_BYTES, 64 MiB), and far more than a producer serves in one Fetch (one per
# page of its pool: 2**24 pages of 256 KiB are a 4 TiB pool). A larger `num_chunks` would only
# build a list of ids no Fetch can carry.
MAX_FETCH_CHUNKS = 2**24
# The contract's Transport values by the names results, handles and options use.
TRANSPORT_NAMES = {pb.TRANSPORT_SHM: "shm", pb.TRANSPORT_TCP: "tcp", pb.TRANSPORT_GRPC: "grpc"}


@dataclass(frozen=True, slots=True)
class KVHandle:
    kv_request_id: str
    # host:port decode workers dial.
    producer: str
    producer_epoch: int
    # The id's chunk count (its total, once a commit or header fixed it), and the payload bytes
    # committed when the handle was made.
    num_chunks: int
    nbytes: int
    # What a Fetch of it may use at that producer, best first.
    transports: tuple[str, ...] = ("grpc",)

    def __post_init__(self) -> None:
        try:
            check_id(self.kv_request_id)
        except ValueError as exc:
            raise UsageError(f"KVHandle.kv_request_id: {exc}") from None
        try:
            port = Address.parse(self.producer).port
        except ValueError as exc:
            raise UsageError(f"KVHandle.producer: {exc}, got {self.producer!r}") from None
        if port == 0:
            raise UsageError(f"KVHandle.producer: port 0 cannot be dialed, got {self.producer!r}")
        # num_chunks 0: not known (the load takes all the id's chunks); more than one Fetch
        # carries could never be loaded. Epochs are never 0, and a Fetch reads 0 as "any
        # epoch": a handle with 0 would load from whatever process answers, even a restarted
        # one that has another request under the same id.
        for name, low, high in (
            ("num_chunks", 0, MAX_FETCH_CHUNKS),
            ("producer_epoch", 1, 2**64 - 1),
            ("nbytes", 0, 2**64 - 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise UsageError(f"KVHandle.{name}: expected {low}..{high}, got {value!r}")
        unknown = [t for t in self.transports if t not in TRANSPORT_NAMES.values()]
        if unknown:
            raise UsageError(f"KVHandle.transports: unknown {unknown}")

    def to_dict(self) -> dict[str, Any]:
        address = Address.parse(self.producer)
        return {
            "kvpark": FORMAT_VERSION,
            "kv_request_id": self.kv_request_id,
            "remote_host": address.host,
            "remote_port": address.port,
            "producer_epoch": self.producer_epoch,
            "num_chunks": self.num_chunks,
            "bytes": self.nbytes,
            "transports": list(self.transports),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVHandle:
        if not isinstance(data, Mapping):
            raise UsageError(f"KV handle: expected a mapping, got {type(data).__name__}")
        version = data.get("kvpark")
        if version != FORMAT_VERSION:
            raise UsageError(f"KV handle: format {version!r}, this client reads {FORMAT_VERSION}")
        missing = [
            k
            for k in ("kv_request_id", "remote_host", "remote_port", "producer_epoch")
            if k not in data
        ]
        if missing:
            raise UsageError(f"KV handle: missing {', '.join(missing)}")
        host, port = data["remote_host"], data["remote_port"]
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
            raise UsageError(f"KV handle: bad remote_host/remote_port {host!r}:{port!r}")
        if not 1 <= port <= 65535:
            raise UsageError(f"KV handle: remote_port {port} is not a port to dial (1..65535)")
        if host.startswith("[") and host.endswith("]"):  # an IPv6 host written as in a URL
            host = host[1:-1]
        transports = data.get("transports", ["grpc"])
        if not isinstance(transports, list | tuple):
            raise UsageError(f"KV handle: transports must be a list, got {transports!r}")
        return cls(
            kv_request_id=data["kv_request_id"],
            producer=str(Address(host, port)),
            producer_epoch=data["producer_epoch"],
            num_chunks=data.get("num_chunks", 0),
            nbytes=data.get("bytes", 0),
            transports=tuple(transports),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> KVHandle:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"KV handle: not JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def coerce(cls, value: KVHandle | Mapping[str, Any] | str) -> KVHandle:
        """A handle from itself, its dict or its JSON."""
        if isinstance(value, KVHandle):
            return value
        if isinstance(value, str):
            return cls.from_json(value)
        return cls.from_dict(value)
