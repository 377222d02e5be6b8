"""`host:port` addresses: parsed, shown and judged in one place.

The producer's listen addresses, the address it advertises to decode workers, the address a
client dials and the ones in KV handles all use this one grammar: `HOST:PORT` with a DNS name
or an IPv4 address, or `[IPV6]:PORT` with brackets. Hosts come back without brackets and go
out with them, so an IPv6 address survives every round trip.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

EXPECTED = "'HOST:PORT' or '[IPV6]:PORT' with a port in 0-65535"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")
_BRACKETED_RE = re.compile(r"\[([^\]]+)\]:([0-9]+)")
_DIGITS_RE = re.compile(r"[0-9]+")  # ASCII only: \d also accepts other scripts' digits


@dataclass(frozen=True, slots=True)
class Address:
    host: str  # a DNS name, an IPv4 address, or an IPv6 address without brackets
    port: int

    @classmethod
    def parse(cls, text: object) -> Address:
        """The address in `text`; ValueError saying what is wrong otherwise."""
        if not isinstance(text, str):
            raise ValueError(f"expected {EXPECTED}, got {type(text).__name__}")
        value = text.strip()
        bracketed = _BRACKETED_RE.fullmatch(value)
        if bracketed:
            host, port_text = bracketed.groups()
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"expected {EXPECTED} (not an IPv6 address in brackets)") from None
        else:
            host, _, port_text = value.rpartition(":")
            if ":" in host:
                raise ValueError(f"expected {EXPECTED} (put IPv6 addresses in brackets)")
            if not _HOSTNAME_RE.fullmatch(host):
                raise ValueError(f"expected {EXPECTED}")
            if _DIGITS_RE.fullmatch(host.replace(".", "")):
                try:
                    ipaddress.IPv4Address(host)
                except ValueError:
                    raise ValueError(f"expected {EXPECTED} (not an IPv4 address)") from None
        if not (_DIGITS_RE.fullmatch(port_text) and int(port_text) <= 65535):
            raise ValueError(f"expected {EXPECTED}")
        return cls(host, int(port_text))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host.lower() == "localhost":
            return True
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError:
            return False  # any other name may resolve to a routable address
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return ip.ipv4_mapped.is_loopback
        return ip.is_loopback

    @property
    def is_wildcard(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            return False

    def dialable(self, port: int | None = None) -> Address:
        """The address a client on this host dials to reach a server listening here (a
        wildcard listen is reached on loopback), with `port` when the listen port was 0."""
        host = self.host
        if self.is_wildcard or host == "":
            host = "::1" if ":" in host else "127.0.0.1"
        return Address(host, self.port if port is None else port)


# gRPC target schemes that name a host and port (unix: and other resolvers do not).
_TARGET_SCHEMES = ("dns:///", "dns:", "ipv4:", "ipv6:")


def target_address(target: str) -> Address | None:
    """The host:port a gRPC target dials ("dns:///h:1" and "h:1" alike), or None when it
    names none (a Unix socket, a list of addresses, another resolver)."""
    for scheme in _TARGET_SCHEMES:
        if target.startswith(scheme):
            target = target[len(scheme) :]
            break
    try:
        return Address.parse(target)
    except ValueError:
        return None
