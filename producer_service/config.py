"""The producer's configuration schema: one frozen, validated `ProducerConfig` per process.

The field declarations are the single table of keys: each field's metadata holds its parser
(config_values.py) and its help text, `KEYS` is derived from them, and the command line and
environment names are derived from `KEYS` (config_sources.py). Construction validates every
value and every cross-field rule, so an invalid config can never exist; `replace` re-validates.
Validation does no I/O: reading token and certificate files is the load step of
credentials.py, done once at start-up. Every problem is one `ConfigError` whose one-line
message names the key and shows the bad value's repr (token values are never shown).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpark.address import Address

from .config_values import (
    ConfigError,
    choice,
    parse_address,
    parse_advertised_address,
    parse_bool,
    parse_bytes,
    parse_count,
    parse_optional_address,
    parse_optional_file,
    parse_optional_token,
    parse_seconds,
    parse_share,
    parse_socket_path,
    seconds_at_least,
    show,
)
from .pool import DEFAULT_PAGE_BYTES

__all__ = ["ENV_PREFIX", "KEYS", "ConfigError", "KeySpec", "ProducerConfig"]

ENV_PREFIX = "KVPARK_"
# What a gRPC message may carry beyond its chunk (framing, the other fields): the server's
# limits are max_chunk_bytes plus this to send, twice max_chunk_bytes plus this to receive.
MESSAGE_FRAMING_BYTES = 64 * 1024
# grpc takes those limits as 32-bit ints.
MAX_CHUNK_BYTES_CEILING = (2**31 - 1 - MESSAGE_FRAMING_BYTES) // 2
# Shorter reaper gaps buy nothing (leases are seconds long, and the reaper also wakes at the
# next deadline) and keep an idle producer's event loop spinning.
MIN_REAP_INTERVAL_S = 0.01


@dataclass(frozen=True, slots=True)
class _Kind:
    """What sort of value a key holds: its parser, its CLI metavar and its --help group."""

    parse: Callable[[str, object], object]
    metavar: str
    group: str
    secret: bool = False


_ADDRESS = _Kind(parse_address, "HOST:PORT", "network")
_OPTIONAL_ADDRESS = _Kind(parse_optional_address, "HOST:PORT", "network")
_ADVERTISED_ADDRESS = _Kind(parse_advertised_address, "HOST:PORT", "network")
_BYTES = _Kind(parse_bytes, "SIZE", "memory")
_SECONDS = _Kind(parse_seconds, "SECONDS", "timeouts and limits")
_REAP_SECONDS = _Kind(seconds_at_least(MIN_REAP_INTERVAL_S), "SECONDS", "timeouts and limits")
_COUNT = _Kind(parse_count, "COUNT", "timeouts and limits")
_SHARE = _Kind(parse_share, "SHARE", "memory")
_LOG_LEVEL = _Kind(choice("debug", "info", "warning", "error"), "LEVEL", "logging")
_LOG_FORMAT = _Kind(choice("text", "json"), "FORMAT", "logging")
_FILE = _Kind(parse_optional_file, "FILE", "security")
_SOCKET_PATH = _Kind(parse_socket_path, "PATH", "network")
_TOKEN = _Kind(parse_optional_token, "TOKEN", "security", secret=True)
_BOOL = _Kind(parse_bool, "BOOL", "security")


def _key(kind: _Kind, help: str) -> dict[str, object]:
    """Field metadata that makes a dataclass field a configuration key."""
    return {"kind": kind, "help": help}


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One configuration key: its default, its parser and the help the CLI prints."""

    name: str
    default: object
    parse: Callable[[str, object], object]
    help: str
    metavar: str
    group: str
    secret: bool

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True, slots=True, repr=False)
class ProducerConfig:
    """The producer's configuration, validated at construction (see the module docstring).

    Construct it with `load_config` (CLI, environment, file), `from_mapping` (programmatic) or
    keyword arguments; derive variants with `replace`. Token values are never shown by repr.
    Each field is one configuration key (docs/protocol.md lists the timing and size keys); its
    metadata holds the parser and the help text.
    """

    listen: str = field(
        default="127.0.0.1:50051",
        metadata=_key(_ADDRESS, "gRPC address; containers use 0.0.0.0:50051; port 0 = any"),
    )
    metrics_listen: str = field(
        default="127.0.0.1:9400",
        metadata=_key(_OPTIONAL_ADDRESS, "Prometheus /metrics address; empty disables"),
    )
    health_listen: str = field(
        default="",
        metadata=_key(
            _OPTIONAL_ADDRESS,
            "loopback address of a plaintext gRPC health service outside max_connections, "
            "for liveness probes; empty disables",
        ),
    )
    data_listen: str = field(
        default="",
        metadata=_key(
            _OPTIONAL_ADDRESS,
            "address of the zero-copy TCP data listener for Fetch (TRANSPORT_TCP); empty disables",
        ),
    )
    shm_socket: str = field(
        default="",
        metadata=_key(
            _SOCKET_PATH,
            "Unix socket path where same-host clients lend shared-memory buffers "
            "(TRANSPORT_SHM); empty disables",
        ),
    )
    advertise_address: str = field(
        default="",
        metadata=_key(
            _ADVERTISED_ADDRESS,
            "host:port decode workers dial to reach this producer, published in ServerInfo and "
            "in KV handles; empty: not published",
        ),
    )
    pool_bytes: int = field(
        default=1024**3,
        metadata=_key(_BYTES, "host pool size, preallocated; e.g. 512MiB, 4GiB, 1GB"),
    )
    max_chunk_bytes: int = field(
        default=16 * 1024**2,
        metadata=_key(
            _BYTES,
            "largest chunk accepted; its whole 256 KiB pages must fit one Park batch "
            "(pool_bytes x max_batch_share), and it must be under 1 GiB (gRPC's limit)",
        ),
    )
    unbound_store_timeout_s: float = field(
        default=60.0,
        metadata=_key(_SECONDS, "lease of committed data nobody fetched, from its first commit"),
    )
    tombstone_retention_s: float = field(
        default=60.0,
        metadata=_key(_SECONDS, "how long an ended id is remembered with its reason"),
    )
    consumer_load_timeout_s: float = field(
        default=30.0,
        metadata=_key(_SECONDS, "the consumers' load timeout; < tombstone_retention_s"),
    )
    max_lease_s: float = field(
        default=600.0,
        metadata=_key(
            _SECONDS,
            "longest lease, from an id's first commit, however often it is kept alive or its "
            "fetches stall; also the longest a Park batch stays open without a commit; "
            ">= unbound_store_timeout_s",
        ),
    )
    max_fetch_wait_s: float = field(
        default=30.0,
        metadata=_key(
            _SECONDS, "longest a Fetch waits without any chunk becoming available to send"
        ),
    )
    park_idle_timeout_s: float = field(
        default=10.0,
        metadata=_key(
            _SECONDS,
            "longest a Park stream may stay silent, before its header included; its batch is "
            "undone then",
        ),
    )
    delivery_grace_s: float = field(
        default=30.0,
        metadata=_key(
            _SECONDS,
            "how long a delivered id keeps its bytes for its consumer's confirmation or a "
            "repeat Fetch",
        ),
    )
    fetch_stall_timeout_s: float = field(
        default=10.0,
        metadata=_key(
            _SECONDS,
            "a Fetch whose consumer reads nothing this long is cut off; the id keeps its bytes "
            "with a fresh lease (or delivery grace)",
        ),
    )
    max_batch_share: float = field(
        default=0.5,
        metadata=_key(_SHARE, "largest share of the pool one Park batch may reserve or store"),
    )
    max_concurrent_rpcs: int = field(
        default=1000,
        metadata=_key(
            _COUNT,
            "kvpark calls (Park, Fetch, ...) served at once; more are refused "
            "RESOURCE_EXHAUSTED (health and reflection have slots of their own, so a busy "
            "producer still answers its probes)",
        ),
    )
    max_connections: int = field(
        default=1000,
        metadata=_key(_COUNT, "client connections accepted at once; more are refused"),
    )
    data_threads: int = field(
        default=2,
        metadata=_key(
            _COUNT,
            "threads that move bulk bytes (TCP data sends, shared-memory copies), at a lower "
            "CPU priority than the event loop that answers control calls",
        ),
    )
    max_tombstones: int = field(
        default=1_000_000,
        metadata=_key(_COUNT, "tombstone count cap, oldest pruned first"),
    )
    reap_interval_s: float = field(
        default=0.25,
        metadata=_key(_REAP_SECONDS, "longest gap between reaper passes; >= 0.01"),
    )
    shutdown_grace_s: float = field(
        default=10.0,
        metadata=_key(_SECONDS, "drain time for bound fetches at shutdown"),
    )
    log_level: str = field(
        default="info",
        metadata=_key(_LOG_LEVEL, "debug, info, warning or error"),
    )
    log_format: str = field(
        default="text",
        metadata=_key(_LOG_FORMAT, "text, or json for machines"),
    )
    tls_cert_file: str | None = field(
        default=None,
        metadata=_key(_FILE, "PEM certificate chain: serve TLS (with tls_key_file)"),
    )
    tls_key_file: str | None = field(
        default=None,
        metadata=_key(_FILE, "PEM private key of tls_cert_file"),
    )
    tls_client_ca_file: str | None = field(
        default=None,
        metadata=_key(_FILE, "PEM CA bundle: require client certificates (mTLS)"),
    )
    park_token: str | None = field(
        default=None,
        metadata=_key(_TOKEN, "bearer token for Park and Release (prefill side)"),
    )
    park_token_file: str | None = field(
        default=None,
        metadata=_key(_FILE, "file holding park_token (safer than a flag or variable)"),
    )
    fetch_token: str | None = field(
        default=None,
        metadata=_key(_TOKEN, "bearer token for Fetch, KeepAlive, Lookup (decode side)"),
    )
    fetch_token_file: str | None = field(
        default=None,
        metadata=_key(_FILE, "file holding fetch_token"),
    )
    allow_insecure: bool = field(
        default=False,
        metadata=_key(_BOOL, "permit a non-loopback listen with neither TLS nor tokens"),
    )

    def __post_init__(self) -> None:
        for spec in KEYS.values():
            object.__setattr__(self, spec.name, spec.parse(spec.name, getattr(self, spec.name)))
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.tombstone_retention_s <= self.consumer_load_timeout_s:
            raise ConfigError(
                f"tombstone_retention_s ({self.tombstone_retention_s!r}) must be greater than "
                f"consumer_load_timeout_s ({self.consumer_load_timeout_s!r}), or a consumer "
                "still waiting on a reaped id sees UNKNOWN instead of its reason",
                keys=("tombstone_retention_s", "consumer_load_timeout_s"),
            )
        self._check_chunk_fits_a_batch()
        if self.max_chunk_bytes > MAX_CHUNK_BYTES_CEILING:
            raise ConfigError(
                f"max_chunk_bytes ({self.max_chunk_bytes!r}) must be <= "
                f"{MAX_CHUNK_BYTES_CEILING}: gRPC's message limit (2 x max_chunk_bytes + 64 "
                "KiB) is a 32-bit int",
                keys=("max_chunk_bytes",),
            )
        if self.max_lease_s < self.unbound_store_timeout_s:
            raise ConfigError(
                f"max_lease_s ({self.max_lease_s!r}) must be >= unbound_store_timeout_s "
                f"({self.unbound_store_timeout_s!r})",
                keys=("max_lease_s", "unbound_store_timeout_s"),
            )
        self._check_listens()
        self._check_tls()
        for role in ("park", "fetch"):
            if getattr(self, f"{role}_token") is not None and getattr(self, f"{role}_token_file"):
                raise ConfigError(
                    f"{role}_token and {role}_token_file are mutually exclusive; set one "
                    f"({role}_token_file={getattr(self, f'{role}_token_file')!r}, {role}_token "
                    "value not shown)",
                    keys=(f"{role}_token", f"{role}_token_file"),
                )
        data = self.data_address
        protected = self.tls_enabled or self.auth_enabled or self.allow_insecure
        if data is not None and not (data.is_loopback or protected):
            raise ConfigError(
                f"data_listen: {self.data_listen!r} is not a loopback address and neither "
                "TLS nor tokens are set; configure TLS or tokens, or set allow_insecure=true",
                keys=("data_listen", "allow_insecure"),
            )
        self._check_data_is_reachable()
        if self.is_insecure_exposed and not self.allow_insecure:
            raise ConfigError(
                f"listen: {self.listen!r} is not a loopback address and neither TLS "
                "(tls_cert_file + tls_key_file) nor tokens (park_token, fetch_token or their "
                "_file keys) are set; configure TLS or tokens, or set allow_insecure=true to "
                "serve without them",
                keys=("listen", "allow_insecure"),
            )

    def _check_chunk_fits_a_batch(self) -> None:
        """A chunk takes whole pool pages, and one Park batch holds at most max_batch_pages:
        a largest chunk that takes more pages than that could never be parked (TOO_LARGE)."""
        if self.pool_pages == 0:
            raise ConfigError(
                f"pool_bytes ({self.pool_bytes!r}) must hold at least one "
                f"{DEFAULT_PAGE_BYTES}-byte page",
                keys=("pool_bytes",),
            )
        chunk_pages = -(-self.max_chunk_bytes // DEFAULT_PAGE_BYTES)
        if chunk_pages > self.max_batch_pages:
            raise ConfigError(
                f"max_chunk_bytes ({self.max_chunk_bytes!r}) takes {chunk_pages} pages of "
                f"{DEFAULT_PAGE_BYTES} bytes, more than one Park batch may hold: "
                f"{self.max_batch_pages}, the whole pages of pool_bytes ({self.pool_bytes!r}) "
                f"x max_batch_share ({self.max_batch_share!r}); lower max_chunk_bytes or raise "
                "pool_bytes or max_batch_share",
                keys=("max_chunk_bytes", "pool_bytes", "max_batch_share"),
            )

    def _check_data_is_reachable(self) -> None:
        """The data port is offered at the advertised host: a data listener on loopback behind
        an address other hosts dial would be offered where nobody can connect to it."""
        data = self.data_address
        if data is None or not self.advertise_address or not data.is_loopback:
            return
        if not Address.parse(self.advertise_address).is_loopback:
            raise ConfigError(
                f"data_listen ({self.data_listen!r}) is a loopback address, but its port is "
                f"offered at the host of advertise_address ({self.advertise_address!r}), "
                "which other hosts dial; listen on an address they can reach (e.g. "
                "0.0.0.0:50052) or leave data_listen empty",
                keys=("data_listen", "advertise_address"),
            )

    def _check_listens(self) -> None:
        """Every port needs an address of its own, and the health port, which serves without
        TLS or tokens, a loopback one."""
        health_port = self.health_address
        if health_port is not None and not health_port.is_loopback:
            raise ConfigError(
                f"health_listen: {self.health_listen!r} is not a loopback address; the health "
                "port serves without TLS or tokens, for probes on this host (e.g. "
                "127.0.0.1:50053)",
                keys=("health_listen",),
            )
        named = [("listen", self.listen, self.listen_address)]
        for key in ("data_listen", "metrics_listen", "health_listen"):
            value = getattr(self, key)
            if value:
                named.append((key, value, Address.parse(value)))
        for i, (key, value, address) in enumerate(named):
            for other_key, other_value, other in named[:i]:
                if _same_socket(address, other):
                    raise ConfigError(
                        f"{key} ({value!r}) must not use the same address as {other_key} "
                        f"({other_value!r})",
                        keys=(key, other_key),
                    )

    def _check_tls(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError(
                f"tls_cert_file ({self.tls_cert_file!r}) and tls_key_file "
                f"({self.tls_key_file!r}) must be set together",
                keys=("tls_cert_file", "tls_key_file"),
            )
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError(
                f"tls_client_ca_file ({self.tls_client_ca_file!r}) requires tls_cert_file and "
                "tls_key_file: client certificates are only checked on a TLS port",
                keys=("tls_client_ca_file", "tls_cert_file", "tls_key_file"),
            )

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def auth_enabled(self) -> bool:
        """True when at least one role's token is configured (inline or from a file)."""
        return any(
            getattr(self, key) is not None
            for key in ("park_token", "park_token_file", "fetch_token", "fetch_token_file")
        )

    @property
    def listen_address(self) -> Address:
        return Address.parse(self.listen)

    @property
    def listen_is_loopback(self) -> bool:
        return self.listen_address.is_loopback

    @property
    def is_insecure_exposed(self) -> bool:
        """Non-loopback `listen` with neither TLS nor tokens: valid only because
        `allow_insecure` is true, and the server warns about it at start-up."""
        return not (self.listen_is_loopback or self.tls_enabled or self.auth_enabled)

    @property
    def pool_pages(self) -> int:
        """Whole pages the pool holds: what `pool_bytes` allocates (the rest is left out)."""
        return self.pool_bytes // DEFAULT_PAGE_BYTES

    @property
    def max_batch_pages(self) -> int:
        """Pages one Park batch may reserve or store: `max_batch_share` of the pool, rounded
        down to whole pages, at least one."""
        # Rounded to a millionth of a page first: a share that makes whole pages (0.7 of
        # 8,064) must not lose one to the float product landing just below (5,644.799...).
        return max(1, math.floor(round(self.pool_pages * self.max_batch_share, 6)))

    @property
    def data_address(self) -> Address | None:
        """`data_listen` parsed, or None when the TCP data path is off."""
        return Address.parse(self.data_listen) if self.data_listen else None

    @property
    def metrics_address(self) -> Address | None:
        """`metrics_listen` parsed, or None when disabled."""
        return Address.parse(self.metrics_listen) if self.metrics_listen else None

    @property
    def health_address(self) -> Address | None:
        """`health_listen` parsed, or None when disabled."""
        return Address.parse(self.health_listen) if self.health_listen else None

    def as_dict(self, *, redact: bool = True) -> dict[str, object]:
        """Every key and its value; token values are replaced by '***' unless `redact=False`."""
        return {
            name: "***"
            if redact and spec.secret and getattr(self, name) is not None
            else getattr(self, name)
            for name, spec in KEYS.items()
        }

    def __repr__(self) -> str:
        items = ", ".join(f"{name}={value!r}" for name, value in self.as_dict().items())
        return f"ProducerConfig({items})"

    # --- constructors -----------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> ProducerConfig:
        """Defaults overridden by `values` (raw values welcome: "180", "4GiB", "true").
        Unknown keys are rejected."""
        reject_unknown_keys(values, "from_mapping")
        kwargs: dict[str, Any] = dict(values)
        return cls(**kwargs)

    def replace(self, **changes: object) -> ProducerConfig:
        """A copy with `changes` applied, validated like a new config."""
        reject_unknown_keys(changes, "replace")
        kwargs: dict[str, Any] = changes
        return dataclasses.replace(self, **kwargs)


def _same_socket(a: Address, b: Address) -> bool:
    """Whether two listeners would bind the same port on a shared host (port 0: any free one,
    never a clash)."""
    same_host = a.host == b.host or a.is_wildcard or b.is_wildcard
    return a.port != 0 and a.port == b.port and same_host


def _spec_of(f: dataclasses.Field[Any]) -> KeySpec:
    kind: _Kind = f.metadata["kind"]
    return KeySpec(
        name=f.name,
        default=f.default,
        parse=kind.parse,
        help=f.metadata["help"],
        metavar=kind.metavar,
        group=kind.group,
        secret=kind.secret,
    )


KEYS: dict[str, KeySpec] = {
    f.name: _spec_of(f) for f in dataclasses.fields(ProducerConfig) if f.init
}
"""Every configuration key, in declaration order, derived from the fields of ProducerConfig."""


def suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def reject_unknown_keys(values: Iterable[object], source: str) -> None:
    for name in values:
        if name not in KEYS:
            hint = suggest(name, KEYS) if isinstance(name, str) else ""
            raise ConfigError(f"{source}: unknown key {show(name)}{hint}", keys=())
