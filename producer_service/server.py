"""Producer lifecycle: start-up -> serve -> graceful shutdown, in one place.

`ProducerServer` owns the pool, the lot, the metrics and the grpc.aio server built from one
validated `ProducerConfig`. `serve()` is what the process runs: it installs the SIGTERM/SIGINT
handlers and performs the shutdown of docs/protocol.md (Shutdown) — health NOT_SERVING, new
Parks and Fetches refused SHUTTING_DOWN, bound Fetches drained for up to `shutdown_grace_s`,
the rest failed SHUTTING_DOWN — and returns exit code 0.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import ssl
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpark.address import Address
from kvpark.pb import kvpark_pb2 as pb
from kvpark.version import __version__

from .auth import TokenAuthInterceptor
from .call_limit import CallLimit
from .config import MESSAGE_FRAMING_BYTES, ProducerConfig
from .config_values import ConfigError
from .credentials import Credentials, load_credentials
from .data_listener import DataListener
from .data_threads import DataThreads
from .fd_budget import check_fd_budget, descriptors_needed, lends_within_limit
from .health_listener import HealthListener
from .idle_trim import IdleHeapTrim
from .listen_names import check_every_address_free
from .logs import LOGGER_NAME
from .lot import Clock, Lot, LotSettings
from .metrics import ProducerMetrics
from .open_streams import RESERVED_SLOTS, OpenStreams
from .pool import HostPool
from .servicer import SERVICE_NAME, KVProducerServicer, method_handlers
from .shm_lending import DEFAULT_MAX_LENDS, ShmLendingServer

log = logging.getLogger(LOGGER_NAME)
T = TypeVar("T")

# Transport keepalive: a peer that vanished without a FIN (network cut, paused container) is
# noticed within about PING + TIMEOUT seconds and its calls cancelled, so a bound id goes back
# to PARKED and an open batch is undone instead of holding pages for ever. grpc core also
# bounds every ping by `grpc.http2.ping_timeout_ms` (one minute by default), which otherwise
# wins over the keepalive timeout: both are set.
_KEEPALIVE_PING_MS = 5_000
_KEEPALIVE_TIMEOUT_MS = 5_000
# A connection that never completes its handshake (TCP open, no HTTP/2 preface or TLS hello)
# holds a file descriptor; one that carries no call for a while is closed too. Clients
# reconnect on their next call.
_HANDSHAKE_TIMEOUT_MS = 5_000
_CONNECTION_IDLE_MS = 5 * 60_000
# Every connection is recycled after this age (clients reconnect at once; calls in flight get
# the grace to finish). It bounds how long a consumer that stopped reading can keep the last
# frame grpc core holds for it, since a server has no other way to drop such a stream.
_CONNECTION_AGE_MS = 10 * 60_000
_CONNECTION_AGE_GRACE_MS = 30_000
# How often shutdown re-checks whether bound Fetches have drained.
_DRAIN_POLL_S = 0.02


def _grpc_options(config: ProducerConfig) -> list[tuple[str, Any]]:
    return [
        # A chunk plus framing must fit; a bit more is accepted so an oversized chunk gets our
        # INVALID_ARGUMENT naming max_chunk_bytes rather than the transport's RESOURCE_EXHAUSTED.
        ("grpc.max_receive_message_length", 2 * config.max_chunk_bytes + MESSAGE_FRAMING_BYTES),
        ("grpc.max_send_message_length", config.max_chunk_bytes + MESSAGE_FRAMING_BYTES),
        ("grpc.keepalive_time_ms", _KEEPALIVE_PING_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        ("grpc.server_handshake_timeout_ms", _HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_connection_idle_ms", _CONNECTION_IDLE_MS),
        ("grpc.max_connection_age_ms", _CONNECTION_AGE_MS),
        ("grpc.max_connection_age_grace_ms", _CONNECTION_AGE_GRACE_MS),
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        ("grpc.so_reuseport", 0),
    ]


def _server_credentials(credentials: Credentials) -> grpc.ServerCredentials:
    """TLS from the loaded files; a client CA makes client certificates mandatory (mTLS)."""
    assert credentials.tls_cert is not None and credentials.tls_key is not None
    client_ca = credentials.tls_client_ca
    return grpc.ssl_server_credentials(
        [(credentials.tls_key, credentials.tls_cert)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def _bound(key: str, value: str, bind: Callable[[], T]) -> T:
    """What `bind` returned (the port it took); its failure (a port in use, a host not on this
    machine, a socket path another producer serves) as an error naming the configuration key,
    like the gRPC listen's."""
    try:
        return bind()
    except OSError as exc:
        raise OSError(f"{key}: cannot bind {value!r}: {exc.strerror or exc}") from None


class ProducerServer:
    def __init__(
        self,
        config: ProducerConfig,
        *,
        credentials: Credentials | None = None,
        clock: Clock = time.monotonic,
        epoch: int | None = None,
    ) -> None:
        self.config = config
        # Read at construction when not given: the file I/O of the configuration's load step.
        self.credentials = credentials if credentials is not None else load_credentials(config)
        self.epoch = epoch if epoch is not None else (secrets.randbits(64) or 1)
        try:
            self.pool = HostPool(config.pool_bytes)
        except ValueError as exc:  # less than one page
            raise ConfigError(str(exc), keys=("pool_bytes",)) from None
        settings = LotSettings(
            unbound_store_timeout_s=config.unbound_store_timeout_s,
            tombstone_retention_s=config.tombstone_retention_s,
            max_lease_s=config.max_lease_s,
            max_fetch_wait_s=config.max_fetch_wait_s,
            max_tombstones=config.max_tombstones,
            reap_interval_s=config.reap_interval_s,
            park_idle_timeout_s=config.park_idle_timeout_s,
            delivery_grace_s=config.delivery_grace_s,
            max_batch_bytes=config.max_batch_pages * self.pool.page_bytes,
        )
        self.lot = Lot(self.pool, settings, self.epoch, clock)
        self.metrics = ProducerMetrics(self.pool.statistics(), self.lot.statistics())
        self._auth = self._token_interceptor()
        self.data_threads = DataThreads(config.data_threads)
        self.servicer = KVProducerServicer(
            self.lot,
            self.metrics,
            max_chunk_bytes=config.max_chunk_bytes,
            fetch_stall_timeout_s=config.fetch_stall_timeout_s,
            server_info=self.server_info,
            refuse_give_up=self._auth.refuse_give_up if self._auth else lambda metadata: None,
            advertise_address=config.advertise_address,
            data_threads=self.data_threads,
        )
        # The kvpark calls served at once, counted by kvpark (call_limit.py): grpc's own cap
        # would count health calls too, and a busy producer would refuse its probes.
        self.calls = CallLimit(
            config.max_concurrent_rpcs,
            f"the producer serves at most max_concurrent_rpcs ({config.max_concurrent_rpcs}) "
            "kvpark calls at once; retry when one has ended",
        )
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.idle_trim = IdleHeapTrim(clock=clock)
        self.port = 0
        self.metrics_port = 0
        self._health_listener: HealthListener | None = None
        self.health_port = 0
        self.data: DataListener | None = None
        self.data_port = 0
        self._data_address = ""
        self.shm: ShmLendingServer | None = None
        self._shm_lends = DEFAULT_MAX_LENDS  # fitted to the descriptor limit at start
        self._stopped = asyncio.Event()

    # ---------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._shm_lends = lends_within_limit(self.config)
        check_fd_budget(descriptors_needed(self.config, self._shm_lends))
        if self.config.shm_socket and self._shm_lends < DEFAULT_MAX_LENDS:
            log.warning(
                "the shm socket takes %d lends at once, not %d: the descriptor limit "
                "(ulimit -Hn) leaves no room for more",
                self._shm_lends, DEFAULT_MAX_LENDS,
            )  # fmt: skip
        # Health and reflection are bounded with or without tokens: their calls live in the
        # reserve grpc's cap keeps beyond the kvpark calls.
        interceptors: list[grpc.aio.ServerInterceptor] = [OpenStreams()]
        interceptors += [self._auth] if self._auth else []
        self._warn_half_protected(interceptors)
        server = grpc.aio.server(
            options=_grpc_options(self.config),
            interceptors=interceptors,
            # A backstop only: the kvpark calls are held to max_concurrent_rpcs by self.calls,
            # so whatever they do, the reserve is left for health and reflection.
            maximum_concurrent_rpcs=self.config.max_concurrent_rpcs + RESERVED_SLOTS,
        )
        server.add_generic_rpc_handlers([self.calls.service(method_handlers(self.servicer))])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                pb.DESCRIPTOR.services_by_name["KVProducer"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        try:
            # Every port is taken before the server starts: a port in use ends the start
            # here, before health says SERVING and with no gRPC server left running. The gRPC
            # port comes last: grpc.aio keeps the port of a server that never started bound
            # until the process ends, whereas what starts before it is stopped below.
            metrics_address = self.config.metrics_address
            if metrics_address is not None:
                self.metrics_port = _bound(
                    "metrics_listen",
                    self.config.metrics_listen,
                    lambda: self.metrics.serve(metrics_address.host, metrics_address.port),
                )
            self._start_transports()
            await self._start_health_listener()
            self.port = self._bind(server)
            await server.start()
        except BaseException:
            # A start that fails part-way leaves nothing listening (an embedding process goes
            # on, and `shutdown` has no server to stop).
            self._stop_side_services()
            await self._stop_health_listener()
            raise
        self._server = server
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap_forever(), name="kvpark-reaper")
        log.info(
            "producer serving",
            extra={
                "kv": {
                    "listen": self.config.listen,
                    "port": self.port,
                    "metrics_port": self.metrics_port,
                    "health_port": self.health_port,
                    "epoch": self.epoch,
                    "pool_bytes": self.pool.pool_bytes,
                    "version": __version__,
                }
            },
        )

    def _start_transports(self) -> None:
        """The out-of-band transports the configuration turns on, handed to the servicer."""
        c = self.config
        data_address = ""
        if c.data_address is not None:
            self.data = DataListener(
                c.data_address,
                tls=self._data_tls(),
                loop=asyncio.get_running_loop(),
                metrics=self.metrics,
            )
            self.data_port = _bound("data_listen", c.data_listen, self.data.start)
            advertised = Address.parse(c.advertise_address) if c.advertise_address else None
            # Without an advertised address the consumer connects to the host it dialed.
            data_address = str(Address(advertised.host, self.data_port)) if advertised else ""
            data_address = data_address or f":{self.data_port}"
        if c.shm_socket:
            self.shm = ShmLendingServer(
                c.shm_socket, self.epoch, self._refuse_lend, max_lends=self._shm_lends
            )
            _bound("shm_socket", c.shm_socket, self.shm.start)
        self.servicer.offer(data=self.data, data_address=data_address, shm=self.shm)
        self._data_address = data_address

    def _data_tls(self) -> ssl.SSLContext | None:
        """The data connection's TLS, from the same files as the gRPC port's."""
        c = self.config
        if not c.tls_enabled:
            return None
        assert c.tls_cert_file and c.tls_key_file
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(c.tls_cert_file, c.tls_key_file)
        if c.tls_client_ca_file:
            context.load_verify_locations(cafile=c.tls_client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _refuse_lend(self, token: str | None, role: str) -> str | None:
        """Whether a client may lend a buffer for `role` (the shm socket's token check)."""
        if self._auth is None:
            return None
        return self._auth.refuse_role(token, role)

    def _token_interceptor(self) -> TokenAuthInterceptor | None:
        park, fetch = self.credentials.park_token, self.credentials.fetch_token
        if not (park or fetch):
            return None
        return TokenAuthInterceptor(park, fetch, on_suppressed=self.metrics.count_suppressed)

    def _warn_half_protected(self, interceptors: list[grpc.aio.ServerInterceptor]) -> None:
        """A token for one role only leaves the other role's methods open (a role with no
        token is open: docs/protocol.md, Roles). That is valid — and on loopback, or with
        client certificates required, harmless — but on an exposed listen it is rarely meant,
        so it is said once at start-up."""
        c = self.config
        if c.listen_is_loopback or c.tls_client_ca_file is not None:
            return
        for interceptor in interceptors:
            if isinstance(interceptor, TokenAuthInterceptor) and interceptor.open_methods():
                log.warning(
                    "only one role has a token: %s answer anyone who reaches this listen "
                    "address; set the other role's token or require client certificates",
                    ", ".join(interceptor.open_methods()),
                    extra={"kv": {"listen": c.listen, "open": list(interceptor.open_methods())}},
                )

    def _bind(self, server: grpc.aio.Server) -> int:
        c = self.config
        if c.is_insecure_exposed:
            log.warning(
                "listening on a non-loopback address with neither TLS nor tokens "
                "(allow_insecure is set): anyone who reaches it can read and write KV cache",
                extra={"kv": {"listen": c.listen}},
            )
        check_every_address_free("listen", c.listen_address)
        try:
            if c.tls_enabled:
                port = server.add_secure_port(c.listen, _server_credentials(self.credentials))
            else:
                port = server.add_insecure_port(c.listen)
        except RuntimeError as exc:  # grpcio raises "Failed to bind" (older ones returned 0)
            raise OSError(f"listen: cannot bind {c.listen!r}: {exc}") from None
        if port == 0:
            raise OSError(f"listen: cannot bind {c.listen!r}")
        return int(port)

    @property
    def target(self) -> str:
        """Address a client on this host dials."""
        return str(self.config.listen_address.dialable(self.port))

    def server_info(self) -> pb.ServerInfo:
        c = self.config
        return pb.ServerInfo(
            producer_epoch=self.epoch,
            version=__version__,
            pool_bytes=self.pool.pool_bytes,
            pool_free_bytes=self.pool.free_bytes,
            max_chunk_bytes=c.max_chunk_bytes,
            unbound_store_timeout_s=c.unbound_store_timeout_s,
            tombstone_retention_s=c.tombstone_retention_s,
            consumer_load_timeout_s=c.consumer_load_timeout_s,
            max_lease_s=c.max_lease_s,
            max_fetch_wait_s=c.max_fetch_wait_s,
            park_idle_timeout_s=c.park_idle_timeout_s,
            delivery_grace_s=c.delivery_grace_s,
            fetch_stall_timeout_s=c.fetch_stall_timeout_s,
            max_batch_bytes=self.lot.max_batch_bytes,
            advertise_address=c.advertise_address,
            data_address=self._data_address,
            data_tls=self.data is not None and self.data.tls,
            shm_socket=c.shm_socket if self.shm is not None else "",
            stats=self._stats(),
        )

    def _stats(self) -> pb.ProducerStats:
        lot, m = self.lot.statistics(), self.metrics
        return pb.ProducerStats(
            parked_ids=lot.parked_ids,
            bound_ids=lot.bound_ids,
            delivered_ids=lot.delivered_ids,
            tombstones=lot.tombstones,
            open_park_batches=lot.open_batches,
            parks_total=m.parks,
            fetches_total=m.fetches,
            reaped_total=lot.reaped_total,
            late_fetch_rejections_total=lot.late_fetch_rejections_total,
            late_park_rejections_total=lot.late_park_rejections_total,
            consumed_total=lot.consumed_total,
            evicted_total=lot.evicted_total,
            parked_bytes_total=lot.parked_bytes_total,
            sent_bytes_total=m.sent_bytes,
        )

    async def _reap_forever(self) -> None:
        """Reaper passes at least every reap_interval_s, sooner when a lease ends sooner."""
        interval = self.config.reap_interval_s
        clock = self.lot.clock
        while True:
            try:
                reaped = self.lot.reap()
                if reaped:
                    log.info("reaped", extra={"kv": {"ids": len(reaped)}})
                self.metrics.publish(self.pool.statistics(), self.lot.statistics())
                busy = self.lot.bound_count > 0 or self.lot.statistics().open_batches > 0
                if self.idle_trim.due(self._data_activity(), busy=busy):
                    # In a thread: malloc_trim takes ~15 ms, a late Fetch must not wait for it.
                    await asyncio.to_thread(self.idle_trim.trim)
            except Exception:
                # A bug in one pass must not end reaping for good (leases would never expire
                # again and the pool would fill): say so loudly and try again next interval.
                log.exception("reaper pass failed")
            nxt = self.lot.next_deadline()
            await asyncio.sleep(interval if nxt is None else min(interval, max(0.0, nxt - clock())))

    def _data_activity(self) -> tuple[int, ...]:
        """Changes whenever chunks are parked, delivered, released, evicted or reaped, or a
        batch opens or closes (what grows or shrinks the heap)."""
        lot = self.lot.statistics()
        return (
            lot.parked_bytes_total,
            lot.pending_bytes,
            lot.delivered_total,
            lot.consumed_total,
            lot.evicted_total,
            lot.released_total,
            lot.reaped_total,
            self.pool.statistics().reservations_open,
        )

    async def shutdown(self, grace_s: float | None = None) -> None:
        """The shutdown of docs/protocol.md: NOT_SERVING, refuse Parks and Fetches, drain bound
        Fetches for the grace, fail the rest."""
        if self._server is None or self._stopped.is_set():
            return
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        self.lot.begin_shutdown()
        deadline = time.monotonic() + grace
        while self.lot.bound_count and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        remaining = self.lot.bound_count
        failed = self.lot.fail_all()
        log.info(
            "shutting down",
            extra={"kv": {"undrained_fetches": remaining, "ids_failed": failed}},
        )
        # The failed Fetches were woken (one in the middle of a batch cuts it short) and send
        # their TransferDone; give them a moment.
        await self._server.stop(1.0)
        if self._reaper is not None:
            self._reaper.cancel()
        self._stop_side_services()
        # Last: a probe during the drain hears NOT_SERVING, not a refused connection.
        await self._stop_health_listener()
        self._stopped.set()

    async def _start_health_listener(self) -> None:
        address = self.config.health_address
        if address is not None:
            self._health_listener = HealthListener(address, self.health)
            self.health_port = await self._health_listener.start()

    async def _stop_health_listener(self) -> None:
        listener, self._health_listener = self._health_listener, None
        if listener is not None:
            await listener.stop()

    def _stop_side_services(self) -> None:
        """Stops what runs beside the gRPC server: the out-of-band transports, the data
        threads and the metrics endpoint."""
        if self.data is not None:
            self.data.stop()
        if self.shm is not None:
            self.shm.stop()
        self.data_threads.close()
        self.metrics.close()


async def serve(
    config: ProducerConfig,
    credentials: Credentials,
    stop_requested: Callable[[], bool] = lambda: False,
) -> int:
    """Runs a producer until SIGTERM or SIGINT, shuts it down gracefully, returns 0.
    `stop_requested` says whether a signal came before this loop took them over; then
    nothing starts. The handlers come first: building the server touches every page of the
    pool (seconds for a large one), and a signal meanwhile must stop it as gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if stop_requested():
        log.info("signal received before serving; not starting")
        return 0
    log.debug("allocating the pool", extra={"kv": {"pool_bytes": config.pool_bytes}})
    server = ProducerServer(config, credentials=credentials)
    await server.start()
    await stop.wait()
    log.info("signal received, draining", extra={"kv": {"grace_s": config.shutdown_grace_s}})
    await server.shutdown()
    return 0
