"""The file-descriptor budget: enough for everything the producer may hold open at once,
checked at start-up rather than discovered when the next client cannot connect.

Each part the configuration turns on has a bound: a descriptor per client connection
(`max_connections`, plus a margin for the pool, logs, metrics and grpc's own pipes and epoll);
the data listener's kept connections and handshakes, and one connection per TCP Fetch in
flight (each a call, so at most `max_concurrent_rpcs`); the shm socket's connections and its
lends, each of which holds a descriptor for its mapping. A soft RLIMIT_NOFILE below their sum
would let silent or leaked connections, or lent buffers, lock every new client out with
EMFILE while grpc keeps retrying `accept`. The soft limit is raised to what is needed when the
hard limit allows it (an unprivileged process may), and a hard limit that is too low is a
configuration error naming each part.
"""

from __future__ import annotations

import resource
from collections.abc import Mapping

from . import data_listener, shm_lending
from .config import ProducerConfig
from .config_values import ConfigError

# Descriptors the process needs besides one per client connection.
MARGIN = 64


def descriptors_needed(config: ProducerConfig) -> dict[str, int]:
    """The most descriptors each part may hold at once, by the key that bounds it or turns it
    on."""
    parts = {"max_connections": config.max_connections + MARGIN}
    if config.data_address is not None:
        parts["data_listen"] = data_listener.DESCRIPTORS + config.max_concurrent_rpcs
    if config.shm_socket:
        parts["shm_socket"] = shm_lending.DESCRIPTORS
    return parts


def check_fd_budget(parts: Mapping[str, int]) -> int:
    """Makes sure the process may hold the sum of `parts` descriptors; returns the soft limit
    in force. Raises ConfigError when the hard limit is lower."""
    needed = sum(parts.values())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            shares = ", ".join(f"{key} {count}" for key, count in parts.items())
            raise ConfigError(
                f"needs {needed} file descriptors ({shares}), but the hard limit (ulimit -Hn) "
                f"is {hard}; lower max_connections or max_concurrent_rpcs, leave data_listen or "
                "shm_socket empty, or raise the limit",
                keys=tuple(parts),
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        soft = needed
    return int(soft)
