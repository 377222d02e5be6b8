"""Producer configuration: one frozen, validated `ProducerConfig` per process (spec section 4).

Values come from four sources, later wins: the defaults declared on the dataclass fields, a JSON
file (`--config FILE` or `KVPARK_CONFIG`), the environment (`KVPARK_<KEY>`) and the command line
(`--<key-with-dashes>`). Every source hands raw values (strings, JSON numbers, `true`, `null`,
NaN...) to the same per-key parser in `ProducerConfig.__post_init__`, so an invalid config can
never be constructed, `dataclasses.replace` re-validates, and every problem surfaces as one
`ConfigError` whose one-line message names the key and shows the bad value's repr (token values
are never shown). The field declarations are the single table of keys: `KEYS` and the CLI flags
are derived from them, and a test checks that the three agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import ipaddress
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, NoReturn

from kvpark.version import __version__

__all__ = [
    "CONFIG_ENV_VAR",
    "ENV_PREFIX",
    "KEYS",
    "MAX_SECONDS",
    "ConfigError",
    "KeySpec",
    "ProducerConfig",
    "build_arg_parser",
    "load_config",
]

ENV_PREFIX = "KVPARK_"
# The one KVPARK_ variable that is not a key: it names the JSON config file.
CONFIG_ENV_VAR = "KVPARK_CONFIG"
# KVPARK_ variables that belong to the project's other tools, not to the producer: ignored here
# rather than rejected as typos, so one operator shell can hold them all. The `kvpark` CLI
# (kvpark.client.cli) reads the first two; the compose files interpolate the last two.
OTHER_TOOLS_ENV_VARS = frozenset(
    {"KVPARK_TARGET", "KVPARK_TOKEN", "KVPARK_IMAGE", "KVPARK_CERTS_DIR"}
)
# Upper bound of every seconds value: anything longer is a typo (ms for s), not a lease.
MAX_SECONDS = 7 * 24 * 3600
# Byte sizes travel as uint64 in ServerInfo and index int64 numpy buffers.
_MAX_BYTES = 2**63 - 1
_REPR_LIMIT = 120
# ASCII only: str.isdecimal() and \d also accept other scripts' digits.
_DIGITS_RE = re.compile(r"[0-9]+")


class ConfigError(ValueError):
    """An invalid configuration value or combination. The message is one line, names the key(s)
    and shows the bad value's repr; `keys` lists the keys involved (empty for file-level or
    command-line syntax errors)."""

    def __init__(self, message: str, *, keys: Sequence[str] = ()) -> None:
        # The CLI prints the message on one line; a repr never contains a raw newline, but an
        # OS or JSON error text might.
        super().__init__(" ".join(message.splitlines()))
        self.keys: tuple[str, ...] = tuple(keys)


# --- value parsers: (key, raw value) -> normalized value, or ConfigError -------------------


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _show_secret(value: object) -> str:
    # A token in an error message would end up in logs; say what is wrong with it instead.
    if isinstance(value, str):
        return f"<redacted string of {len(value)} characters>"
    return _show(value) if value is None or isinstance(value, bool) else type(value).__name__


def _bad(key: str, expected: str, value: object) -> ConfigError:
    return ConfigError(f"{key}: expected {expected}, got {_show(value)}", keys=(key,))


def _parse_seconds(key: str, value: object) -> float:
    expected = f"seconds > 0 and <= {MAX_SECONDS} (one week)"
    # bool is an int subclass and float("1") would accept True: reject it explicitly.
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _bad(key, expected, value)
    try:
        seconds = float(value)
    except (ValueError, OverflowError):
        raise _bad(key, expected, value) from None
    # float() accepts "nan" and "inf"; neither is a duration.
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
        raise _bad(key, expected, value)
    return seconds


_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")
# Case-insensitive: kB/KB/kb are SI (powers of 1000), KiB/Ki are IEC (powers of 1024). A bare
# K/M/G/T is refused because tools disagree on whether it means 1000 or 1024.
_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _prefix in enumerate("kmgtp", start=1):
    _SIZE_UNITS[f"{_prefix}b"] = 1000**_i
    _SIZE_UNITS[f"{_prefix}ib"] = 1024**_i
    _SIZE_UNITS[f"{_prefix}i"] = 1024**_i
_SIZE_EXPECTED = "a byte size > 0: an integer or a string such as '512MiB', '4GiB' or '1GB'"


def _parse_bytes(key: str, value: object) -> int:
    if isinstance(value, bool):
        raise _bad(key, _SIZE_EXPECTED, value)
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise _bad(key, _SIZE_EXPECTED, value)
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.fullmatch(value.strip())
        unit = _SIZE_UNITS.get(match.group(2).lower()) if match else None
        if match is None or unit is None:
            raise _bad(key, _SIZE_EXPECTED, value)
        exact = Fraction(match.group(1)) * unit
        if exact.denominator != 1:  # "0.3B", "1.0000001KiB"
            raise _bad(key, _SIZE_EXPECTED + " that is a whole number of bytes", value)
        size = int(exact)
    else:
        raise _bad(key, _SIZE_EXPECTED, value)
    if not 0 < size <= _MAX_BYTES:
        raise _bad(key, _SIZE_EXPECTED, value)
    return size


def _parse_count(key: str, value: object) -> int:
    expected = "a whole number > 0"
    if isinstance(value, bool):
        raise _bad(key, expected, value)
    if isinstance(value, int):
        count = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        count = int(value)  # JSON 1e6
    elif isinstance(value, str) and _DIGITS_RE.fullmatch(value.strip()):
        count = int(value.strip())
    else:
        raise _bad(key, expected, value)
    if count <= 0:
        raise _bad(key, expected, value)
    return count


def _parse_share(key: str, value: object) -> float:
    expected = "a share of the pool > 0 and <= 1 (e.g. 0.5)"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _bad(key, expected, value)
    try:
        share = float(value)
    except (ValueError, OverflowError):
        raise _bad(key, expected, value) from None
    if not (math.isfinite(share) and 0 < share <= 1):
        raise _bad(key, expected, value)
    return share


def _choice(*choices: str) -> Callable[[str, object], str]:
    expected = "one of " + ", ".join(choices)

    def parse(key: str, value: object) -> str:
        if isinstance(value, str) and value.strip().lower() in choices:
            return value.strip().lower()
        raise _bad(key, expected, value)

    return parse


_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


def _parse_bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
    raise _bad(key, "true or false ('1'/'0' and 'yes'/'no' also accepted)", value)


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")
_BRACKETED_RE = re.compile(r"\[([^\]]+)\]:([0-9]+)")
_ADDRESS_EXPECTED = "'HOST:PORT' or '[IPV6]:PORT' with a port in 0-65535"


def _split_address(key: str, value: object) -> tuple[str, int]:
    """Returns (host, port) of 'host:port' or '[v6]:port'; the host comes without brackets."""
    if not isinstance(value, str):
        raise _bad(key, _ADDRESS_EXPECTED, value)
    text = value.strip()
    bracketed = _BRACKETED_RE.fullmatch(text)
    if bracketed:
        host, port_text = bracketed.groups()
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _bad(
                key, _ADDRESS_EXPECTED + " (not an IPv6 address in brackets)", value
            ) from None
    else:
        host, _, port_text = text.rpartition(":")
        if ":" in host:
            raise _bad(key, _ADDRESS_EXPECTED + " (put IPv6 addresses in brackets)", value)
        if not _HOSTNAME_RE.fullmatch(host):
            raise _bad(key, _ADDRESS_EXPECTED, value)
        if _DIGITS_RE.fullmatch(host.replace(".", "")):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise _bad(key, _ADDRESS_EXPECTED + " (not an IPv4 address)", value) from None
    if not (_DIGITS_RE.fullmatch(port_text) and int(port_text) <= 65535):
        raise _bad(key, _ADDRESS_EXPECTED, value)
    return host, int(port_text)


def _parse_address(key: str, value: object) -> str:
    _split_address(key, value)  # raises unless value is a valid address string
    return str(value).strip()


def _parse_optional_address(key: str, value: object) -> str:
    if isinstance(value, str) and not value.strip():
        return ""  # "" disables the listener
    return _parse_address(key, value)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # any other name may resolve to a routable address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _parse_optional_file(key: str, value: object) -> str | None:
    # None (JSON null, the default) leaves the key unset; "" is refused rather than read as
    # "unset", so a template that renders an empty path cannot silently switch TLS or auth off.
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _bad(key, "a path to an existing file", value)
    if not Path(value).is_file():
        raise ConfigError(f"{key}: not an existing file: {_show(value)}", keys=(key,))
    return value


def _parse_optional_token(key: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or any(ch.isspace() for ch in value):
        raise ConfigError(
            f"{key}: expected a non-empty token without whitespace, got {_show_secret(value)}",
            keys=(key,),
        )
    return value


def _read_token_file(key: str, path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{key}: cannot read {_show(path)}: {reason}", keys=(key,)) from None
    token = text.rstrip("\r\n")  # files written by `echo` or editors end with a newline
    if not token:
        raise ConfigError(f"{key}: token file {_show(path)} is empty", keys=(key,))
    if any(ch.isspace() for ch in token):
        raise ConfigError(f"{key}: the token in {_show(path)} contains whitespace", keys=(key,))
    return token


# --- the table of keys ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Kind:
    """What sort of value a key holds: its parser, its CLI metavar and its --help group."""

    parse: Callable[[str, object], object]
    metavar: str
    group: str
    secret: bool = False


_ADDRESS = _Kind(_parse_address, "HOST:PORT", "network")
_OPTIONAL_ADDRESS = _Kind(_parse_optional_address, "HOST:PORT", "network")
_BYTES = _Kind(_parse_bytes, "SIZE", "memory")
_SECONDS = _Kind(_parse_seconds, "SECONDS", "timeouts and limits")
_COUNT = _Kind(_parse_count, "COUNT", "timeouts and limits")
_SHARE = _Kind(_parse_share, "SHARE", "memory")
_LOG_LEVEL = _Kind(_choice("debug", "info", "warning", "error"), "LEVEL", "logging")
_LOG_FORMAT = _Kind(_choice("text", "json"), "FORMAT", "logging")
_FILE = _Kind(_parse_optional_file, "FILE", "security")
_TOKEN = _Kind(_parse_optional_token, "TOKEN", "security", secret=True)
_BOOL = _Kind(_parse_bool, "BOOL", "security")


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
    Each field is one key of spec section 4; its metadata holds the parser and the help text.
    """

    listen: str = field(
        default="127.0.0.1:50051",
        metadata=_key(_ADDRESS, "gRPC address; containers use 0.0.0.0:50051; port 0 = any"),
    )
    metrics_listen: str = field(
        default="127.0.0.1:9400",
        metadata=_key(_OPTIONAL_ADDRESS, "Prometheus /metrics address; empty disables"),
    )
    advertise_address: str = field(
        default="",
        metadata=_key(
            _OPTIONAL_ADDRESS,
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
        metadata=_key(_BYTES, "largest chunk accepted; must be <= pool_bytes"),
    )
    unbound_store_timeout_s: float = field(
        default=60.0,
        metadata=_key(_SECONDS, "lease of parked data nobody fetched, from its first chunk"),
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
        metadata=_key(_SECONDS, "cap for KeepAlive extensions; >= unbound_store_timeout_s"),
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
            "with a fresh lease",
        ),
    )
    max_batch_share: float = field(
        default=0.5,
        metadata=_key(_SHARE, "largest share of the pool one Park batch may reserve or store"),
    )
    max_concurrent_rpcs: int = field(
        default=1000,
        metadata=_key(_COUNT, "calls served at once; more are refused RESOURCE_EXHAUSTED"),
    )
    max_connections: int = field(
        default=1000,
        metadata=_key(_COUNT, "client connections accepted at once; more are refused"),
    )
    max_tombstones: int = field(
        default=1_000_000,
        metadata=_key(_COUNT, "tombstone count cap, oldest pruned first"),
    )
    reap_interval_s: float = field(
        default=0.25,
        metadata=_key(_SECONDS, "longest gap between reaper passes"),
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

    # Tokens resolved from `*_token` or `*_token_file` at construction. Not keys: init=False,
    # so `dataclasses.replace` recomputes them (re-reading the files).
    _park_token_value: str | None = field(default=None, init=False, repr=False, compare=False)
    _fetch_token_value: str | None = field(default=None, init=False, repr=False, compare=False)

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
        if self.max_chunk_bytes > self.pool_bytes:
            raise ConfigError(
                f"max_chunk_bytes ({self.max_chunk_bytes!r}) must be <= pool_bytes "
                f"({self.pool_bytes!r})",
                keys=("max_chunk_bytes", "pool_bytes"),
            )
        if self.max_lease_s < self.unbound_store_timeout_s:
            raise ConfigError(
                f"max_lease_s ({self.max_lease_s!r}) must be >= unbound_store_timeout_s "
                f"({self.unbound_store_timeout_s!r})",
                keys=("max_lease_s", "unbound_store_timeout_s"),
            )
        self._check_metrics_listen()
        self._check_tls()
        park = self._resolve_token("park_token", self.park_token, self.park_token_file)
        fetch = self._resolve_token("fetch_token", self.fetch_token, self.fetch_token_file)
        if park is not None and park == fetch:
            # Roles are told apart by the token alone (spec section 6).
            raise ConfigError(
                "park_token and fetch_token must differ, or each role could call the other's "
                "RPCs (values not shown)",
                keys=("park_token", "fetch_token"),
            )
        object.__setattr__(self, "_park_token_value", park)
        object.__setattr__(self, "_fetch_token_value", fetch)
        if self.is_insecure_exposed and not self.allow_insecure:
            raise ConfigError(
                f"listen: {self.listen!r} is not a loopback address and neither TLS "
                "(tls_cert_file + tls_key_file) nor tokens (park_token, fetch_token or their "
                "_file keys) are set; configure TLS or tokens, or set allow_insecure=true to "
                "serve without them",
                keys=("listen", "allow_insecure"),
            )

    def _check_metrics_listen(self) -> None:
        if not self.metrics_listen:
            return
        host, port = _split_address("listen", self.listen)
        metrics_host, metrics_port = _split_address("metrics_listen", self.metrics_listen)
        same_host = host == metrics_host or _is_wildcard(host) or _is_wildcard(metrics_host)
        if port != 0 and port == metrics_port and same_host:
            raise ConfigError(
                f"metrics_listen ({self.metrics_listen!r}) must not use the same address as "
                f"listen ({self.listen!r})",
                keys=("metrics_listen", "listen"),
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

    @staticmethod
    def _resolve_token(key: str, token: str | None, token_file: str | None) -> str | None:
        if token is not None and token_file is not None:
            raise ConfigError(
                f"{key} and {key}_file are mutually exclusive; set one "
                f"({key}_file={token_file!r}, {key} value not shown)",
                keys=(key, f"{key}_file"),
            )
        if token_file is not None:
            return _read_token_file(f"{key}_file", token_file)
        return token

    # --- derived views ----------------------------------------------------------------------

    def resolved_park_token(self) -> str | None:
        """The park-role bearer token, from `park_token` or the contents of `park_token_file`."""
        return self._park_token_value

    def resolved_fetch_token(self) -> str | None:
        """The fetch-role bearer token, from `fetch_token` or `fetch_token_file`."""
        return self._fetch_token_value

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def auth_enabled(self) -> bool:
        """True when at least one role's token is configured."""
        return self._park_token_value is not None or self._fetch_token_value is not None

    @property
    def listen_is_loopback(self) -> bool:
        return _is_loopback(_split_address("listen", self.listen)[0])

    @property
    def is_insecure_exposed(self) -> bool:
        """Non-loopback `listen` with neither TLS nor tokens: valid only because
        `allow_insecure` is true, and the server warns about it at start-up."""
        return not (self.listen_is_loopback or self.tls_enabled or self.auth_enabled)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of `metrics_listen` (IPv6 without brackets), or None when disabled."""
        if not self.metrics_listen:
            return None
        return _split_address("metrics_listen", self.metrics_listen)

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
        _reject_unknown_keys(values, "from_mapping")
        kwargs: dict[str, Any] = dict(values)
        return cls(**kwargs)

    def replace(self, **changes: object) -> ProducerConfig:
        """A copy with `changes` applied, validated like a new config."""
        _reject_unknown_keys(changes, "replace")
        kwargs: dict[str, Any] = changes
        return dataclasses.replace(self, **kwargs)


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


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _reject_unknown_keys(values: Iterable[object], source: str) -> None:
    for name in values:
        if name not in KEYS:
            hint = _suggest(name, KEYS) if isinstance(name, str) else ""
            raise ConfigError(f"{source}: unknown key {_show(name)}{hint}", keys=())


# --- sources ----------------------------------------------------------------------------------


class _ArgumentParser(argparse.ArgumentParser):
    """argparse reports errors by printing and exiting 2; library code raises instead."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"command line: {message}")


def _format_default(spec: KeySpec) -> str:
    value = spec.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if spec.parse is _parse_bytes and isinstance(value, int):
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if value % size == 0:
                return f"{value // size}{unit}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def build_arg_parser() -> argparse.ArgumentParser:
    """The producer's command line: `--config FILE`, `--version` and one `--<key>` per key.
    Only flags actually given appear in the parsed namespace (defaults are suppressed), so the
    command line overrides lower sources key by key. Errors raise ConfigError."""
    parser = _ArgumentParser(
        prog="kvpark-producer",
        description="kvpark producer: parks KV-cache chunks in a host-memory pool and serves "
        "them to decode workers over gRPC. Sources, later wins: defaults < JSON file "
        f"(--config or {CONFIG_ENV_VAR}) < environment ({ENV_PREFIX}<KEY>) < command line.",
        allow_abbrev=False,  # --pool must not silently mean --pool-bytes
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"JSON file holding an object of keys (env {CONFIG_ENV_VAR})",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in KEYS.values():
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        help_text = f"{spec.help} (default: {_format_default(spec)}; env {spec.env_var})"
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if spec.parse is _parse_bool else {}
        groups[spec.group].add_argument(
            spec.flag,
            dest=spec.name,
            metavar=spec.metavar,
            help=help_text.replace("%", "%%"),
            **extra,
        )
    return parser


def _read_config_file(path: str) -> dict[str, object]:
    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        result: dict[str, object] = {}
        for name, value in pairs:
            if name in result:
                raise ConfigError(f"config: duplicate key {name!r} in {path!r}", keys=(name,))
            result[name] = value
        return result

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"config: cannot read config file {path!r}: {reason}") from None
    try:
        # NaN/Infinity/true/null pass through to the key parsers, which reject them with repr.
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config: {path!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path!r} must hold a JSON object, got {type(data).__name__}")
    _reject_unknown_keys(data, f"config file {path!r}")
    return data


def _read_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """({key: raw value} of the KVPARK_<KEY> variables, the KVPARK_CONFIG path or None)."""
    values: dict[str, str] = {}
    config_path: str | None = None
    known = {spec.env_var: name for name, spec in KEYS.items()}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        if var == CONFIG_ENV_VAR:
            config_path = environ[var]
        elif var in OTHER_TOOLS_ENV_VARS:
            continue  # the CLI's or the compose files' own; an operator's shell may hold all
        elif var in known:
            values[known[var]] = environ[var]
        else:
            # A misspelt variable would otherwise be ignored and the default used silently.
            hint = _suggest(var, [*known, CONFIG_ENV_VAR])
            raise ConfigError(f"environment: unknown variable {var!r}{hint}")
    return values, config_path


def _with_origins(exc: ConfigError, origins: Mapping[str, str]) -> ConfigError:
    """Appends where the offending value(s) came from; keys left at their default are not named."""
    if len(exc.keys) == 1 and exc.keys[0] in origins:
        return ConfigError(f"{exc} (from {origins[exc.keys[0]]})", keys=exc.keys)
    named = [f"{key} from {origins[key]}" for key in exc.keys if key in origins]
    if not named:
        return exc
    return ConfigError(f"{exc} ({'; '.join(named)})", keys=exc.keys)


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ProducerConfig:
    """The producer's config from defaults < JSON file < environment < command line.

    `argv` defaults to `sys.argv[1:]` and `environ` to `os.environ`. Raises ConfigError for
    any invalid value, unknown key, unknown KVPARK_ variable or bad command line; `--help`
    and `--version` print and raise SystemExit(0) as argparse does.
    """
    args = vars(build_arg_parser().parse_args(list(sys.argv[1:] if argv is None else argv)))
    env_values, env_config = _read_environment(os.environ if environ is None else environ)
    config_path = args.pop("config", env_config)
    if config_path is not None and not config_path:
        raise ConfigError("config: expected a path to a JSON file, got ''")

    merged: dict[str, object] = {}
    origins: dict[str, str] = {}
    if config_path is not None:
        for key, value in _read_config_file(config_path).items():
            merged[key], origins[key] = value, f"config file {config_path!r}"
    for key, value in env_values.items():
        merged[key], origins[key] = value, f"environment {KEYS[key].env_var}"
    for key, value in args.items():
        merged[key], origins[key] = value, f"command line {KEYS[key].flag}"
    try:
        return ProducerConfig.from_mapping(merged)
    except ConfigError as exc:
        raise _with_origins(exc, origins) from None
