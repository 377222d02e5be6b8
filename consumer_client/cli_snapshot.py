"""What one producer holds and has done, read by the operator views (`kvpark info`, `kvpark top`).

`KVConsumer.server_info()` answers with `ProducerInfo` (epoch, limits, timeouts, counters) and
keeps what it read for its loads; the operator views need a fresh answer on every poll and none
of a consumer's background calls, so they read `GetServerInfo` themselves, over one channel per
producer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc

from ._channel import DEFAULT_MAX_CHUNK_BYTES, ChannelSettings
from ._errors import error_from_rpc
from ._models import ProducerInfo, ProducerStats


@dataclass(frozen=True, slots=True)
class Snapshot:
    info: ProducerInfo
    # time.monotonic() when the answer arrived: rates divide by the gap between two of these.
    taken_at: float

    @property
    def stats(self) -> ProducerStats | None:
        return self.info.stats

    @property
    def pool_used_bytes(self) -> int:
        return self.info.pool_bytes - self.info.pool_free_bytes

    @property
    def transports(self) -> list[str]:
        """The transports a Fetch may use: grpc always, tcp (with TLS or not) and shm when the
        producer offers them."""
        offered = ["grpc"]
        if self.info.data_address:
            offered.append("tcp+tls" if self.info.data_tls else "tcp")
        if self.info.shm_socket:
            offered.append("shm")
        return offered


class SnapshotReader:
    """Reads `Snapshot`s of one producer over a channel of its own, until closed."""

    def __init__(self, settings: ChannelSettings) -> None:
        self.target = settings.target
        self._metadata = settings.metadata
        self._channel = settings.open_sync()
        self._stub = pb_grpc.KVProducerStub(self._channel)

    @classmethod
    def open(
        cls,
        target: str,
        *,
        token: str | None,
        credentials: grpc.ChannelCredentials | None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> SnapshotReader:
        settings = ChannelSettings.build(
            target,
            token=token,
            credentials=credentials,
            channel_options=channel_options,
            interceptors=(),
            max_chunk_bytes=DEFAULT_MAX_CHUNK_BYTES,
        )
        return cls(settings)

    def read(self, timeout_s: float) -> Snapshot:
        """One GetServerInfo under `timeout_s`; a failed call raises the client's RPCError."""
        try:
            msg = self._stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "GetServerInfo") from None
        return Snapshot(ProducerInfo.from_proto(msg), time.monotonic())

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()
