"""Parsers of configuration values: one per kind of key (seconds, byte sizes, counts, shares,
addresses, files, tokens, choices, booleans), each turning a raw value from any source (a
string from the environment or the command line, a JSON number, `true`, `null`, NaN...) into
the normalized value or one `ConfigError` that names the key and shows the bad value's repr
(token values are never shown). No I/O: validation never touches the file system.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import PurePosixPath

from kvpark.address import Address
from kvpark.durations import MAX_SECONDS  # every seconds value: longer is a typo (ms for s)
from kvpark.tokens import TOKEN_EXPECTED, is_valid_token

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


def show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _show_secret(value: object) -> str:
    # A token in an error message would end up in logs; say what is wrong with it instead.
    if isinstance(value, str):
        return f"<redacted string of {len(value)} characters>"
    return show(value) if value is None or isinstance(value, bool) else type(value).__name__


def _bad(key: str, expected: str, value: object) -> ConfigError:
    return ConfigError(f"{key}: expected {expected}, got {show(value)}", keys=(key,))


_SECONDS_EXPECTED = f"seconds > 0 and <= {MAX_SECONDS} (one week)"


def parse_seconds(key: str, value: object) -> float:
    expected = _SECONDS_EXPECTED
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


def seconds_at_least(minimum: float) -> Callable[[str, object], float]:
    """`parse_seconds` with a floor, for a key whose tiny values are mistakes that cost (a
    timer that fires thousands of times a second keeps a core busy)."""
    expected = f"seconds >= {minimum} and <= {MAX_SECONDS} (one week)"

    def parse(key: str, value: object) -> float:
        try:
            seconds = parse_seconds(key, value)
        except ConfigError:
            raise _bad(key, expected, value) from None
        if seconds < minimum:
            raise _bad(key, expected, value)
        return seconds

    return parse


def seconds_argument(text: str) -> float:
    """argparse type of a command-line duration (the `kvpark` CLI's timeouts, the health
    probe's): the rule of `parse_seconds`, reported as argparse reports a bad value."""
    try:
        return parse_seconds("", text)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"expected {_SECONDS_EXPECTED}, got {text!r}") from None


_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")
# Case-insensitive: kB/KB/kb are SI (powers of 1000), KiB/Ki are IEC (powers of 1024). A bare
# K/M/G/T is refused because tools disagree on whether it means 1000 or 1024.
_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _prefix in enumerate("kmgtp", start=1):
    _SIZE_UNITS[f"{_prefix}b"] = 1000**_i
    _SIZE_UNITS[f"{_prefix}ib"] = 1024**_i
    _SIZE_UNITS[f"{_prefix}i"] = 1024**_i
_SIZE_EXPECTED = "a byte size > 0: an integer or a string such as '512MiB', '4GiB' or '1GB'"


def parse_bytes(key: str, value: object) -> int:
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


# Counts end up in C ints (grpc's limits, thread pools): more than this is refused here, not
# by an OverflowError at start-up.
_MAX_COUNT = 2**31 - 1


def parse_count(key: str, value: object) -> int:
    expected = f"a whole number > 0 and <= {_MAX_COUNT}"
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
    if not 0 < count <= _MAX_COUNT:
        raise _bad(key, expected, value)
    return count


def parse_share(key: str, value: object) -> float:
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


def choice(*choices: str) -> Callable[[str, object], str]:
    expected = "one of " + ", ".join(choices)

    def parse(key: str, value: object) -> str:
        if isinstance(value, str) and value.strip().lower() in choices:
            return value.strip().lower()
        raise _bad(key, expected, value)

    return parse


_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


def parse_bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
    raise _bad(key, "true or false ('1'/'0' and 'yes'/'no' also accepted)", value)


def parse_address_value(key: str, value: object) -> Address:
    try:
        return Address.parse(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}, got {show(value)}", keys=(key,)) from None


def parse_address(key: str, value: object) -> str:
    parse_address_value(key, value)  # raises unless value is a valid address string
    return str(value).strip()


def parse_optional_address(key: str, value: object) -> str:
    if isinstance(value, str) and not value.strip():
        return ""  # "" disables the listener
    return parse_address(key, value)


def parse_advertised_address(key: str, value: object) -> str:
    """An address other hosts dial, or "" for none: a wildcard host or port 0 only mean
    something to a listener, and a handle naming one could never be dialled."""
    text = parse_optional_address(key, value)
    if text:
        address = Address.parse(text)
        if address.is_wildcard or address.port == 0:
            expected = "a host and port other hosts can dial (no wildcard host, no port 0)"
            raise _bad(key, expected, value)
    return text


def parse_optional_file(key: str, value: object) -> str | None:
    # None (JSON null, the default) leaves the key unset; "" is refused rather than read as
    # "unset", so a template that renders an empty path cannot silently switch TLS or auth off.
    # Whether the file exists and what it holds is the load step's business (credentials.py):
    # validation does no I/O.
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _bad(key, "a path to a file", value)
    return value


# What the private directory the shm socket is first bound in adds to its directory's path.
PRIVATE_BIND_SUFFIX = "/.kvpark-XXXXXXXX/s"


def parse_socket_path(key: str, value: object) -> str:
    """An absolute Unix socket path, or "" for none. Linux limits such paths to 107 bytes. The
    path is published to clients, which connect to it from their own working directory: a
    relative one would name another file there, or none."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return ""
    if not isinstance(value, str) or "\x00" in value:
        raise _bad(key, "a filesystem path or empty", value)
    if not PurePosixPath(value).is_absolute():
        raise _bad(key, "an absolute path (clients connect to it from their own directory)", value)
    if len(value.encode()) > 107:
        raise _bad(key, "a path of at most 107 bytes (the Unix socket limit)", value)
    # The socket is first bound inside a private directory next to it (shm_lending.py):
    # "<directory>/.kvpark-XXXXXXXX/s" must fit the same limit.
    if len(str(PurePosixPath(value).parent).encode()) + len(PRIVATE_BIND_SUFFIX) > 107:
        raise _bad(
            key,
            f"a path whose directory is at most {107 - len(PRIVATE_BIND_SUFFIX)} bytes "
            "(the socket is bound in a private directory there first)",
            value,
        )
    return value


def parse_optional_token(key: str, value: object) -> str | None:
    if value is None:
        return None
    if not is_valid_token(value):
        raise ConfigError(
            f"{key}: expected {TOKEN_EXPECTED}, got {_show_secret(value)}", keys=(key,)
        )
    return value


_PEM_MARKER = b"-----BEGIN "


def holds_pem(data: bytes) -> bool:
    """Whether a certificate or key file's bytes hold a PEM block at all: what a file named
    by mistake (a DER file, a token, the wrong path) lacks."""
    return _PEM_MARKER in data
