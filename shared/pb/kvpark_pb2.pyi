from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNSPECIFIED: _ClassVar[Status]
    STATUS_OK: _ClassVar[Status]
    STATUS_FAILED: _ClassVar[Status]

class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[State]
    STATE_UNKNOWN: _ClassVar[State]
    STATE_PARKED: _ClassVar[State]
    STATE_BOUND: _ClassVar[State]
    STATE_TOMBSTONED: _ClassVar[State]
    STATE_DELIVERED: _ClassVar[State]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_GRPC: _ClassVar[Transport]
    TRANSPORT_TCP: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]

class FailureReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_UNSPECIFIED: _ClassVar[FailureReason]
    REASON_REAPED: _ClassVar[FailureReason]
    REASON_UNKNOWN_ID: _ClassVar[FailureReason]
    REASON_ALREADY_CONSUMED: _ClassVar[FailureReason]
    REASON_RELEASED: _ClassVar[FailureReason]
    REASON_EVICTED: _ClassVar[FailureReason]
    REASON_ALREADY_BOUND: _ClassVar[FailureReason]
    REASON_POOL_FULL: _ClassVar[FailureReason]
    REASON_TOO_LARGE: _ClassVar[FailureReason]
    REASON_WAIT_TIMEOUT: _ClassVar[FailureReason]
    REASON_EPOCH_MISMATCH: _ClassVar[FailureReason]
    REASON_SHUTTING_DOWN: _ClassVar[FailureReason]
    REASON_CHUNK_CONFLICT: _ClassVar[FailureReason]
    REASON_CHECKSUM_MISMATCH: _ClassVar[FailureReason]
    REASON_NOT_COMMITTED: _ClassVar[FailureReason]
    REASON_COMMIT_MISMATCH: _ClassVar[FailureReason]
    REASON_FINGERPRINT_MISMATCH: _ClassVar[FailureReason]
STATUS_UNSPECIFIED: Status
STATUS_OK: Status
STATUS_FAILED: Status
STATE_UNSPECIFIED: State
STATE_UNKNOWN: State
STATE_PARKED: State
STATE_BOUND: State
STATE_TOMBSTONED: State
STATE_DELIVERED: State
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_GRPC: Transport
TRANSPORT_TCP: Transport
TRANSPORT_SHM: Transport
REASON_UNSPECIFIED: FailureReason
REASON_REAPED: FailureReason
REASON_UNKNOWN_ID: FailureReason
REASON_ALREADY_CONSUMED: FailureReason
REASON_RELEASED: FailureReason
REASON_EVICTED: FailureReason
REASON_ALREADY_BOUND: FailureReason
REASON_POOL_FULL: FailureReason
REASON_TOO_LARGE: FailureReason
REASON_WAIT_TIMEOUT: FailureReason
REASON_EPOCH_MISMATCH: FailureReason
REASON_SHUTTING_DOWN: FailureReason
REASON_CHUNK_CONFLICT: FailureReason
REASON_CHECKSUM_MISMATCH: FailureReason
REASON_NOT_COMMITTED: FailureReason
REASON_COMMIT_MISMATCH: FailureReason
REASON_FINGERPRINT_MISMATCH: FailureReason

class Chunk(_message.Message):
    __slots__ = ("chunk_id", "crc32c", "data")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    crc32c: int
    data: bytes
    def __init__(self, chunk_id: _Optional[int] = ..., crc32c: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ParkHeader(_message.Message):
    __slots__ = ("kv_request_id", "total_chunks", "batch_bytes", "shm_lend_id", "fingerprint")
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_LEND_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    kv_request_id: str
    total_chunks: int
    batch_bytes: int
    shm_lend_id: str
    fingerprint: bytes
    def __init__(self, kv_request_id: _Optional[str] = ..., total_chunks: _Optional[int] = ..., batch_bytes: _Optional[int] = ..., shm_lend_id: _Optional[str] = ..., fingerprint: _Optional[bytes] = ...) -> None: ...

class ChunkRef(_message.Message):
    __slots__ = ("chunk_id", "crc32c", "offset", "nbytes")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    crc32c: int
    offset: int
    nbytes: int
    def __init__(self, chunk_id: _Optional[int] = ..., crc32c: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ChunkRefs(_message.Message):
    __slots__ = ("refs",)
    REFS_FIELD_NUMBER: _ClassVar[int]
    refs: _containers.RepeatedCompositeFieldContainer[ChunkRef]
    def __init__(self, refs: _Optional[_Iterable[_Union[ChunkRef, _Mapping]]] = ...) -> None: ...

class ParkCommit(_message.Message):
    __slots__ = ("chunks", "bytes")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    bytes: int
    def __init__(self, chunks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class ParkRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit", "chunk_refs")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_REFS_FIELD_NUMBER: _ClassVar[int]
    header: ParkHeader
    chunk: Chunk
    commit: ParkCommit
    chunk_refs: ChunkRefs
    def __init__(self, header: _Optional[_Union[ParkHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., commit: _Optional[_Union[ParkCommit, _Mapping]] = ..., chunk_refs: _Optional[_Union[ChunkRefs, _Mapping]] = ...) -> None: ...

class ParkResponse(_message.Message):
    __slots__ = ("status", "reason", "detail", "chunks_parked", "producer_epoch", "lease_remaining_s", "retry_after_s", "bytes_parked", "total_chunks", "advertise_address", "transports")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PARKED_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PARKED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    reason: FailureReason
    detail: str
    chunks_parked: int
    producer_epoch: int
    lease_remaining_s: float
    retry_after_s: float
    bytes_parked: int
    total_chunks: int
    advertise_address: str
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[_Union[FailureReason, str]] = ..., detail: _Optional[str] = ..., chunks_parked: _Optional[int] = ..., producer_epoch: _Optional[int] = ..., lease_remaining_s: _Optional[float] = ..., retry_after_s: _Optional[float] = ..., bytes_parked: _Optional[int] = ..., total_chunks: _Optional[int] = ..., advertise_address: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("kv_request_id", "chunk_ids", "expected_epoch", "wait_timeout_s", "accept_transports", "shm_lend_id", "shm_offset", "shm_length", "reuse_data_connection", "expected_fingerprint")
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    SHM_LEND_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REUSE_DATA_CONNECTION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    kv_request_id: str
    chunk_ids: _containers.RepeatedScalarFieldContainer[int]
    expected_epoch: int
    wait_timeout_s: float
    accept_transports: _containers.RepeatedScalarFieldContainer[Transport]
    shm_lend_id: str
    shm_offset: int
    shm_length: int
    reuse_data_connection: bool
    expected_fingerprint: bytes
    def __init__(self, kv_request_id: _Optional[str] = ..., chunk_ids: _Optional[_Iterable[int]] = ..., expected_epoch: _Optional[int] = ..., wait_timeout_s: _Optional[float] = ..., accept_transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., shm_lend_id: _Optional[str] = ..., shm_offset: _Optional[int] = ..., shm_length: _Optional[int] = ..., reuse_data_connection: _Optional[bool] = ..., expected_fingerprint: _Optional[bytes] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("chunk", "done", "data_offer", "placed")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFER_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    done: TransferDone
    data_offer: DataOffer
    placed: ChunksPlaced
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., done: _Optional[_Union[TransferDone, _Mapping]] = ..., data_offer: _Optional[_Union[DataOffer, _Mapping]] = ..., placed: _Optional[_Union[ChunksPlaced, _Mapping]] = ...) -> None: ...

class DataOffer(_message.Message):
    __slots__ = ("transport", "address", "ticket", "tls")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    address: str
    ticket: bytes
    tls: bool
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., address: _Optional[str] = ..., ticket: _Optional[bytes] = ..., tls: _Optional[bool] = ...) -> None: ...

class ChunkPlaced(_message.Message):
    __slots__ = ("chunk_id", "crc32c", "offset", "nbytes")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    crc32c: int
    offset: int
    nbytes: int
    def __init__(self, chunk_id: _Optional[int] = ..., crc32c: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ChunksPlaced(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkPlaced]
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkPlaced, _Mapping]]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("status", "reason", "detail", "chunks_sent", "bytes_sent", "delivery_id", "producer_epoch", "transport")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    status: Status
    reason: FailureReason
    detail: str
    chunks_sent: int
    bytes_sent: int
    delivery_id: int
    producer_epoch: int
    transport: Transport
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[_Union[FailureReason, str]] = ..., detail: _Optional[str] = ..., chunks_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., delivery_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("kv_request_ids", "extend_s")
    KV_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_S_FIELD_NUMBER: _ClassVar[int]
    kv_request_ids: _containers.RepeatedScalarFieldContainer[str]
    extend_s: float
    def __init__(self, kv_request_ids: _Optional[_Iterable[str]] = ..., extend_s: _Optional[float] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("states",)
    STATES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedCompositeFieldContainer[IdState]
    def __init__(self, states: _Optional[_Iterable[_Union[IdState, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("kv_request_id", "delivery_id")
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    kv_request_id: str
    delivery_id: int
    def __init__(self, kv_request_id: _Optional[str] = ..., delivery_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("status", "reason", "detail")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: Status
    reason: FailureReason
    detail: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[_Union[FailureReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("kv_request_ids",)
    KV_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    kv_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kv_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("states",)
    STATES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedCompositeFieldContainer[IdState]
    def __init__(self, states: _Optional[_Iterable[_Union[IdState, _Mapping]]] = ...) -> None: ...

class IdState(_message.Message):
    __slots__ = ("kv_request_id", "state", "reason", "chunks_parked", "total_chunks", "bytes", "age_s", "lease_remaining_s", "fingerprint")
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PARKED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    kv_request_id: str
    state: State
    reason: FailureReason
    chunks_parked: int
    total_chunks: int
    bytes: int
    age_s: float
    lease_remaining_s: float
    fingerprint: bytes
    def __init__(self, kv_request_id: _Optional[str] = ..., state: _Optional[_Union[State, str]] = ..., reason: _Optional[_Union[FailureReason, str]] = ..., chunks_parked: _Optional[int] = ..., total_chunks: _Optional[int] = ..., bytes: _Optional[int] = ..., age_s: _Optional[float] = ..., lease_remaining_s: _Optional[float] = ..., fingerprint: _Optional[bytes] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("producer_epoch", "version", "pool_bytes", "pool_free_bytes", "max_chunk_bytes", "unbound_store_timeout_s", "tombstone_retention_s", "consumer_load_timeout_s", "max_lease_s", "max_fetch_wait_s", "park_idle_timeout_s", "delivery_grace_s", "fetch_stall_timeout_s", "max_batch_bytes", "advertise_address", "data_address", "data_tls", "shm_socket", "stats")
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNBOUND_STORE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_LOAD_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_FETCH_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PARK_IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    FETCH_STALL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_TLS_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
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
    data_address: str
    data_tls: bool
    shm_socket: str
    stats: ProducerStats
    def __init__(self, producer_epoch: _Optional[int] = ..., version: _Optional[str] = ..., pool_bytes: _Optional[int] = ..., pool_free_bytes: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., unbound_store_timeout_s: _Optional[float] = ..., tombstone_retention_s: _Optional[float] = ..., consumer_load_timeout_s: _Optional[float] = ..., max_lease_s: _Optional[float] = ..., max_fetch_wait_s: _Optional[float] = ..., park_idle_timeout_s: _Optional[float] = ..., delivery_grace_s: _Optional[float] = ..., fetch_stall_timeout_s: _Optional[float] = ..., max_batch_bytes: _Optional[int] = ..., advertise_address: _Optional[str] = ..., data_address: _Optional[str] = ..., data_tls: _Optional[bool] = ..., shm_socket: _Optional[str] = ..., stats: _Optional[_Union[ProducerStats, _Mapping]] = ...) -> None: ...

class ProducerStats(_message.Message):
    __slots__ = ("parked_ids", "bound_ids", "delivered_ids", "tombstones", "open_park_batches", "parks_total", "fetches_total", "reaped_total", "late_fetch_rejections_total", "late_park_rejections_total", "consumed_total", "evicted_total", "parked_bytes_total", "sent_bytes_total")
    PARKED_IDS_FIELD_NUMBER: _ClassVar[int]
    BOUND_IDS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_IDS_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    OPEN_PARK_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PARKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FETCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REAPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LATE_FETCH_REJECTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LATE_PARK_REJECTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PARKED_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
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
    def __init__(self, parked_ids: _Optional[int] = ..., bound_ids: _Optional[int] = ..., delivered_ids: _Optional[int] = ..., tombstones: _Optional[int] = ..., open_park_batches: _Optional[int] = ..., parks_total: _Optional[int] = ..., fetches_total: _Optional[int] = ..., reaped_total: _Optional[int] = ..., late_fetch_rejections_total: _Optional[int] = ..., late_park_rejections_total: _Optional[int] = ..., consumed_total: _Optional[int] = ..., evicted_total: _Optional[int] = ..., parked_bytes_total: _Optional[int] = ..., sent_bytes_total: _Optional[int] = ...) -> None: ...
