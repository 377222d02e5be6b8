"""A gRPC listen address given by name binds on every address of that name, or not at all.

grpc binds a name on each address it resolves to and starts if any one of them binds, with a
log line nobody reads: with another process on 127.0.0.1:P, `listen = localhost:P` would serve
on ::1 alone, and clients dialing 127.0.0.1:P (or `localhost`, resolved the other way) would
reach that other process. So each address is bound once here first, the way grpc binds it; one
that another socket holds refuses the start, naming the key and the address.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import Any

from kvpark.address import Address

# grpc's resolver answers `localhost` with both loopbacks whatever /etc/hosts says.
_LOCALHOST = [(socket.AF_INET, ("127.0.0.1", 0)), (socket.AF_INET6, ("::1", 0, 0, 0))]


def check_every_address_free(key: str, listen: Address) -> None:
    """OSError naming `key` when another socket holds one of the addresses `listen`'s name
    stands for. IP addresses (one socket, grpc's own error) and port 0 (each address would
    get its own port anyway) are left to grpc, and so is a name that does not resolve or an
    address this host does not have (grpc skips it too)."""
    if listen.port == 0:
        return
    try:
        ipaddress.ip_address(listen.host)
        return
    except ValueError:
        pass
    for family, sockaddr in _addresses(listen):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # As grpc binds: address reuse on (a port in TIME_WAIT is free), IPv6 only.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(
                        f"{key}: cannot bind {str(listen)!r} on {sockaddr[0]}: {exc.strerror}"
                    ) from None


def _addresses(listen: Address) -> list[tuple[int, Any]]:
    if listen.host.lower() == "localhost":
        return [(family, (host, listen.port, *rest)) for family, (host, _, *rest) in _LOCALHOST]
    try:
        resolved = socket.getaddrinfo(
            listen.host, listen.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return []
    return [(family, sockaddr) for family, _, _, _, sockaddr in resolved]
