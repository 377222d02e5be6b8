"""Every Prometheus metric the producer exports, declared once, with units in the names.

The pool and the lot keep plain counters and statistics and never import prometheus_client.
The lot and the pool belong to the event loop's thread, and the HTTP endpoint scrapes from a
thread of its own, so the loop publishes a frozen snapshot of both (`publish`, on every reaper
pass: at most reap_interval_s old) and `_StateCollector` reads only that. Counters of outcomes
(`park_total`, `fetch_total`, ...) are incremented by the servicer where the outcome is
decided. Each producer owns its own `CollectorRegistry`, so several producers can live in one
test process. The standard `process_*` series (resident memory, CPU, file descriptors) come
along: RSS is the pool plus what gRPC's buffers hold in a burst, and it is what a container's
memory limit is measured against (README, "Memory").
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from kvpark.pb import kvpark_pb2 as pb

from .lot import LotStatistics, Reason, reason_name
from .pool import PoolStatistics

# Connections the /metrics endpoint serves at once; one more is closed as soon as it is
# accepted. Anyone who can reach the port may connect, so each connection (a descriptor and a
# thread) must be bounded, and the descriptors counted in the budget (fd_budget.py). A scraper
# or two and a health probe need a handful.
METRICS_MAX_CONNECTIONS = 16
# Seconds a connection has to send its whole request, and then again to take the reply; a
# client silent or dripping past that is closed, so silent connections cannot hold every slot.
METRICS_TIMEOUT_S = 5.0

# The `connection` label of kvpark_data_connections_total.
DATA_CONNECTIONS = ("new", "kept", "refused")
# The `transport` label of each Transport a Fetch can use.
_TRANSPORTS = {pb.TRANSPORT_GRPC: "grpc", pb.TRANSPORT_TCP: "tcp", pb.TRANSPORT_SHM: "shm"}

# `*_created` timestamp series double the scrape size and no dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Latency buckets from 100 µs (a one-RTT rejection) to minutes (a fetch that waited for data).
_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


class _StateCollector(Collector):
    """Gauges and totals from the snapshot the event loop published last."""

    def __init__(self, snapshot: Callable[[], tuple[PoolStatistics, LotStatistics]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        pool, lot = self._snapshot()
        gauges = {
            "kvpark_pool_bytes": ("Size of the host pool, bytes", pool.pool_bytes),
            "kvpark_pool_used_bytes": (
                "Pool bytes held by chunks and reservations (page-rounded)",
                pool.used_bytes,
            ),
            "kvpark_pool_stored_bytes": ("Payload bytes stored in the pool", pool.stored_bytes),
            "kvpark_pool_reserved_bytes": (
                "Pool bytes reserved by declared batches, not yet filled",
                pool.reserved_bytes,
            ),
            "kvpark_pool_pending_bytes": (
                "Payload bytes of open Park batches, not visible until their commit",
                lot.pending_bytes,
            ),
            "kvpark_parked_ids": (
                "Ids with committed chunks, no Fetch attached, not delivered",
                lot.parked_ids,
            ),
            "kvpark_bound_ids": ("Ids with a Fetch attached", lot.bound_ids),
            "kvpark_delivered_ids": (
                "Ids sent completely and kept until their consumer confirms",
                lot.delivered_ids,
            ),
            "kvpark_open_park_batches": ("Park batches not committed yet", lot.open_batches),
            "kvpark_tombstones": ("Ended ids remembered for late callers", lot.tombstones),
            "kvpark_keepalive_intents": (
                "KeepAlive intents for ids not committed yet",
                lot.intents,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        totals = {
            "kvpark_reaped": ("Parked ids whose lease ran out and were freed", lot.reaped_total),
            "kvpark_consumed": (
                "Delivered ids ended: confirmed, or their delivery grace passed",
                lot.consumed_total,
            ),
            "kvpark_confirmed": ("Deliveries confirmed by their consumer", lot.confirmed_total),
            "kvpark_delivered": ("Deliveries completed (repeats included)", lot.delivered_total),
            "kvpark_redelivered": (
                "Deliveries of an id that had been delivered before",
                lot.redelivered_total,
            ),
            "kvpark_evicted": (
                "Delivered ids freed early to make room for a Park",
                lot.evicted_total,
            ),
            "kvpark_stalled_fetches": (
                "Fetches cut off because their consumer read nothing",
                lot.stalled_fetches_total,
            ),
            "kvpark_idle_park_batches": (
                "Park batches undone after park_idle_timeout_s of silence",
                lot.idle_batches_total,
            ),
            "kvpark_released": ("Ids given up with Release", lot.released_total),
            "kvpark_late_fetch_rejections": (
                "Fetches for an ended id answered at once from its tombstone",
                lot.late_fetch_rejections_total,
            ),
            "kvpark_late_park_rejections": (
                "Parks for an ended id refused at once from its tombstone",
                lot.late_park_rejections_total,
            ),
            "kvpark_parked_bytes": ("Payload bytes stored by Park", lot.parked_bytes_total),
        }
        for name, (doc, value) in totals.items():
            yield CounterMetricFamily(name, doc, value=value)


class ProducerMetrics:
    """The producer's metrics, in its own registry."""

    def __init__(self, pool: PoolStatistics, lot: LotStatistics) -> None:
        self._published = (pool, lot)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StateCollector(lambda: self._published))
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.park_total = Counter(
            "kvpark_park", "Park calls by outcome", ["status", "reason"], registry=r
        )
        # Fetches answered with a TransferDone; one cut off before it (cancelled, stalled, a
        # broken data connection) has no outcome of the producer's to count.
        self.fetch_total = Counter(
            "kvpark_fetch", "Fetch calls answered, by the TransferDone's status and reason",
            ["status", "reason"], registry=r,
        )  # fmt: skip
        # By transport: an operator sees whether decode workers take the data plane on offer
        # (shm, tcp) or fall back to the slower gRPC stream.
        self.sent_bytes_total = Counter(
            "kvpark_sent_bytes", "Payload bytes sent to consumers, by transport", ["transport"],
            registry=r,
        )  # fmt: skip
        for transport in _TRANSPORTS.values():  # every series from the start, at 0
            self.sent_bytes_total.labels(transport)
        # How TCP data connections presented their tickets: on a new connection, on one kept
        # from an earlier Fetch, or refused. Many TCP Fetches and few "kept" means consumers
        # pay a connect (and a TLS handshake) per load. "refused" is every connection turned
        # away before a Fetch got it: a bad ticket, a failed TLS handshake (a client
        # certificate mismatch shows here) or no whole ticket in time (port probes too).
        self.data_connections_total = Counter(
            "kvpark_data_connections",
            "Data connections by how they presented a ticket: new, kept, or refused (a bad "
            "ticket, a failed TLS handshake, no whole ticket in time)",
            ["connection"], registry=r,
        )  # fmt: skip
        for connection in DATA_CONNECTIONS:
            self.data_connections_total.labels(connection)
        self.data_connections_idle = Gauge(
            "kvpark_data_connections_idle",
            "Kept data connections waiting for their consumer's next ticket",
            registry=r,
        )
        self.suppressed_warnings_total = Counter(
            "kvpark_suppressed_warnings",
            "Warnings not logged because the same warning was logged recently",
            ["kind"],
            registry=r,
        )
        self.fetch_duration_seconds = Histogram(
            "kvpark_fetch_duration_seconds",
            "Fetch call duration, from request to the stream's last message",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.time_to_fetch_seconds = Histogram(
            "kvpark_time_to_fetch_seconds",
            "Time from an id's first commit to each Fetch that bound it later (redeliveries "
            "included; a Fetch bound before the first commit is not counted)",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )

        # Plain totals beside the labelled counters, for ServerInfo.stats.
        self.parks = self.fetches = self.sent_bytes = 0
        self._parks = _Children(self.park_total, _labels)
        self._fetches = _Children(self.fetch_total, _labels)
        self._suppressed = _Children(self.suppressed_warnings_total, lambda kind: (kind,))

    def publish(self, pool: PoolStatistics, lot: LotStatistics) -> None:
        """Called on the event loop: what the next scrape reports (one tuple, swapped in one
        assignment, so a scrape never sees a pool from one moment and a lot from another)."""
        self._published = (pool, lot)

    def count_park(self, reason: Reason) -> None:
        self._parks.inc(reason)
        self.parks += 1

    def count_fetch(self, reason: Reason) -> None:
        self._fetches.inc(reason)
        self.fetches += 1

    def count_sent(self, nbytes: int, transport: pb.Transport) -> None:
        self.sent_bytes_total.labels(_TRANSPORTS[transport]).inc(nbytes)
        self.sent_bytes += nbytes

    def count_data_connection(self, connection: str) -> None:
        """One ticket presented (any thread): `connection` is one of DATA_CONNECTIONS."""
        self.data_connections_total.labels(connection).inc()

    def count_suppressed(self, kind: str) -> None:
        self._suppressed.inc(kind)

    def serve(self, host: str, port: int) -> int:
        """Starts the /metrics HTTP endpoint on `host`:`port`; returns the port bound."""
        # As prometheus_client does: the first address the host resolves to, in its family.
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        server = _MetricsServer(
            (str(sockaddr[0]), port),
            _DeadlineHandler.factory(self.registry),
            family,
            max_connections=METRICS_MAX_CONNECTIONS,
            timeout_s=METRICS_TIMEOUT_S,
        )
        threading.Thread(target=server.serve_forever, name="kvpark-metrics", daemon=True).start()
        self._http = server
        return int(server.server_address[1])

    def close(self) -> None:
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()


class _MetricsServer(ThreadingHTTPServer):
    """prometheus_client's handler on a server that bounds what a client can hold: at most
    `max_connections` served at once (a thread and a descriptor each), each given `timeout_s`
    to send its request and as long again to take the reply."""

    daemon_threads = True
    # Connections waiting in the kernel to be accepted hold no descriptor of ours; a backlog
    # of socketserver's 5 would leave a scraper's connection behind a burst of others.
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        handler: type,
        family: socket.AddressFamily,
        *,
        max_connections: int,
        timeout_s: float,
    ) -> None:
        self.address_family = family  # an IPv6 host needs an AF_INET6 socket
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Refused here, in the accepting thread, before a thread is started for it.
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _DeadlineHandler(MetricsHandler):
    """prometheus_client's handler reading its request under one deadline for the whole
    request: a per-read timeout alone would let a client that sends a byte now and then keep
    its slot forever."""

    server: _MetricsServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        deadline = time.monotonic() + self.server.timeout_s
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

    def end_headers(self) -> None:
        # The request is in: the reply gets its own timeout (sendall's is for the whole call),
        # so a scrape that took most of the deadline to arrive is still answered.
        self.connection.settimeout(self.server.timeout_s)
        super().end_headers()


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each given what is left until `deadline`."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not complete in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Children:
    """A labelled counter's children, each looked up once. `labels()` builds and validates its
    key on every call (a few µs); a late fetch is answered in tens of µs, so it shows."""

    def __init__(self, counter: Counter, labels_of: Callable[[Any], tuple[str, ...]]) -> None:
        self._counter = counter
        self._labels_of = labels_of
        self._children: dict[Any, Any] = {}

    def inc(self, key: Any) -> None:
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._counter.labels(*self._labels_of(key))
        child.inc()


def _labels(reason: Reason) -> tuple[str, str]:
    """(status, reason) label values: reason 0 means the call succeeded."""
    if reason == 0:
        return "ok", "none"
    return "failed", reason_name(reason).removeprefix("REASON_").lower()
