"""The file-descriptor budget: enough for everything the producer may hold open at once,
checked at start-up rather than discovered when the next client cannot connect.

Each part the configuration turns on has a bound: a descriptor per client connection
(`max_connections`, plus a margin for the pool, logs and grpc's own pipes and epoll); the
listeners of the metrics endpoint and of the health port, and the connections each serves at
once; the data listener's kept connections and handshakes, and one connection per TCP Fetch
in flight (each a kvpark call, so at most `max_concurrent_rpcs`: the slots grpc keeps beyond
them are for health and reflection, which open no data connection); the shm socket's
connections, each with the descriptor of a lend whose message is arriving, and its lends,
each of which holds a descriptor for its mapping. A soft RLIMIT_NOFILE below their sum would
let silent or leaked connections, or lent buffers, lock every new client out with EMFILE
while grpc keeps retrying `accept`. The soft limit is raised to what is needed when the hard
limit allows it (an unprivileged process may), and a hard limit that is too low is a
configuration error naming each part.

The shm socket's lends are the one part sized to fit: up to 4,096, fewer where the hard limit
leaves less room (4,096 is a common hard limit outside containers, and the defaults with both
transports on would need 7,789), but at least one per shm connection.
"""

from __future__ import annotations

import resource
from collections.abc import Mapping

from . import data_listener, health_listener, metrics, shm_lending
from .config import ProducerConfig
from .config_values import ConfigError

# Descriptors the process needs besides one per client connection.
MARGIN = 64
# The fewest lends the shm socket takes when the limit is tight: one per connection.
MIN_LENDS = shm_lending.DEFAULT_MAX_CONNECTIONS


def descriptors_needed(
    config: ProducerConfig, lends: int = shm_lending.DEFAULT_MAX_LENDS
) -> dict[str, int]:
    """The most descriptors each part may hold at once (the shm socket with `lends`), by the
    key that bounds it or turns it on."""
    parts = {"max_connections": config.max_connections + MARGIN}
    if config.metrics_address is not None:
        parts["metrics_listen"] = 1 + metrics.METRICS_MAX_CONNECTIONS
    if config.health_address is not None:
        parts["health_listen"] = 1 + health_listener.MAX_CONNECTIONS
    if config.data_address is not None:
        parts["data_listen"] = data_listener.DESCRIPTORS + config.max_concurrent_rpcs
    if config.shm_socket:
        parts["shm_socket"] = shm_lending.descriptors(lends)
    return parts


def lends_within_limit(config: ProducerConfig) -> int:
    """The lends the shm socket takes: DEFAULT_MAX_LENDS, or what the hard limit leaves after
    every other part, but never fewer than MIN_LENDS (a limit that low is `check_fd_budget`'s
    error)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return shm_lending.DEFAULT_MAX_LENDS
    room = hard - sum(descriptors_needed(config, lends=0).values())
    return max(MIN_LENDS, min(shm_lending.DEFAULT_MAX_LENDS, room))


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
