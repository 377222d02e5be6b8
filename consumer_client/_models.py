"""Plain values the unary calls return, converted from the generated messages at the edge.

The public API never hands out protobuf objects: they are mutable, their enums are bare ints,
and a caller should not need `kvpark.pb` to read a state. Each value here mirrors one message
of the contract (names as in the .proto, units in the field names).
"""

from __future__ import annotations

import builtins
import enum
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvpark.pb import kvpark_pb2 as pb

from ._result import Reason


class State(enum.StrEnum):
    """Where an id stands on a producer (the contract's `State` without the prefix)."""

    UNKNOWN = "UNKNOWN"
    PARKED = "PARKED"
    BOUND = "BOUND"
    TOMBSTONED = "TOMBSTONED"
    DELIVERED = "DELIVERED"

    @classmethod
    def from_proto(cls, value: int) -> State:
        try:
            return cls(str(pb.State.Name(value)).removeprefix("STATE_"))
        except ValueError:  # STATE_UNSPECIFIED or a state newer than this client
            return cls.UNKNOWN


def _reason_or_none(value: int) -> Reason | None:
    return None if value == pb.REASON_UNSPECIFIED else Reason.from_proto(value)


@dataclass(frozen=True, slots=True)
class IdStatus:
    """One id's state, from Lookup or KeepAlive."""

    kv_request_id: str
    state: State
    # With TOMBSTONED: how the id ended; None otherwise.
    reason: Reason | None
    chunks_parked: int
    # Declared total chunks; 0 = not known.
    total_chunks: int
    bytes: int
    # Seconds since the first commit (PARKED/BOUND/DELIVERED), since the id was first seen (BOUND
    # before any commit), or since the id ended (TOMBSTONED).
    age_s: float
    # Seconds until the lease runs out (PARKED), the delivery grace ends (DELIVERED) or a
    # KeepAlive intent expires (UNKNOWN); 0 otherwise.
    lease_remaining_s: float
    # What the id's KV was computed from, as fixed by its first commit (see
    # `kvpark.fingerprint`); b"" when parked without one, or not parked.
    fingerprint: builtins.bytes = b""  # `bytes` here is the field above

    @classmethod
    def from_proto(cls, msg: Any) -> IdStatus:
        return cls(
            kv_request_id=msg.kv_request_id,
            state=State.from_proto(msg.state),
            reason=_reason_or_none(msg.reason),
            chunks_parked=msg.chunks_parked,
            total_chunks=msg.total_chunks,
            bytes=msg.bytes,
            age_s=msg.age_s,
            lease_remaining_s=msg.lease_remaining_s,
            fingerprint=msg.fingerprint,
        )

    @property
    def ended(self) -> bool:
        return self.state is State.TOMBSTONED

    def as_json(self) -> dict[str, Any]:
        """The fields for a JSON document, the fingerprint as hex (JSON has no bytes)."""
        return {**asdict(self), "fingerprint": self.fingerprint.hex()}


@dataclass(frozen=True, slots=True)
class ProducerStats:
    """The contract's ProducerStats: ids by state now, and totals since the process started."""

    parked_ids: int
    bound_ids: int
    delivered_ids: int
    tombstones: int
    open_park_batches: int
    parks_total: int
    fetches_total: int
    reaped_total: int
    late_fetch_rejections_total: int
    late_park_rejections_total: int
    consumed_total: int
    evicted_total: int
    parked_bytes_total: int
    sent_bytes_total: int

    @classmethod
    def from_proto(cls, msg: Any) -> ProducerStats:
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class ProducerInfo:
    """A producer process's epoch, limits and timeouts (the contract's ServerInfo)."""

    producer_epoch: int
    version: str
    pool_bytes: int
    pool_free_bytes: int
    max_chunk_bytes: int
    unbound_store_timeout_s: float
    tombstone_retention_s: float
    consumer_load_timeout_s: float
    max_lease_s: float
    max_fetch_wait_s: float
    park_idle_timeout_s: float
    delivery_grace_s: float
    fetch_stall_timeout_s: float
    max_batch_bytes: int
    advertise_address: str
    # The out-of-band transports it offers: the TCP data address (":port" = the host dialed)
    # and whether it runs TLS, and the shm socket path; empty when not offered.
    data_address: str
    data_tls: bool
    shm_socket: str
    # Its counts as of the answer; None from a producer that reports none.
    stats: ProducerStats | None = None

    @classmethod
    def from_proto(cls, msg: Any) -> ProducerInfo:
        return cls(
            producer_epoch=msg.producer_epoch,
            version=msg.version,
            pool_bytes=msg.pool_bytes,
            pool_free_bytes=msg.pool_free_bytes,
            max_chunk_bytes=msg.max_chunk_bytes,
            unbound_store_timeout_s=msg.unbound_store_timeout_s,
            tombstone_retention_s=msg.tombstone_retention_s,
            consumer_load_timeout_s=msg.consumer_load_timeout_s,
            max_lease_s=msg.max_lease_s,
            max_fetch_wait_s=msg.max_fetch_wait_s,
            park_idle_timeout_s=msg.park_idle_timeout_s,
            delivery_grace_s=msg.delivery_grace_s,
            fetch_stall_timeout_s=msg.fetch_stall_timeout_s,
            max_batch_bytes=msg.max_batch_bytes,
            advertise_address=msg.advertise_address,
            data_address=msg.data_address,
            data_tls=msg.data_tls,
            shm_socket=msg.shm_socket,
            stats=ProducerStats.from_proto(msg.stats) if msg.HasField("stats") else None,
        )


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """The answer to Release (giving an id up, or confirming a delivery): ok, or the reason it
    was refused (UNKNOWN_ID, ALREADY_BOUND, or the tombstone's reason) and the detail."""

    kv_request_id: str
    ok: bool
    reason: Reason | None
    detail: str = ""

    @classmethod
    def from_proto(cls, kv_request_id: str, msg: Any) -> ReleaseResult:
        ok = msg.status == pb.STATUS_OK
        reason = None if ok else Reason.from_proto(msg.reason)
        return cls(kv_request_id, ok, reason, msg.detail)
