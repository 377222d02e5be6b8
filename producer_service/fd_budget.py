"""The file-descriptor budget: enough for every connection the producer accepts, checked at
start-up rather than discovered when the next client cannot connect.

Each client connection costs the producer one descriptor. With `max_connections` accepted at
once, a soft RLIMIT_NOFILE below that plus a margin would let silent or leaked connections lock
every new client out with EMFILE while grpc keeps retrying `accept`. The soft limit is raised
to what is needed when the hard limit allows it (an unprivileged process may), and a hard limit
that is too low is a configuration error naming `max_connections`.
"""

from __future__ import annotations

import resource

from .config_values import ConfigError


def check_fd_budget(needed: int) -> int:
    """Makes sure the process may hold `needed` descriptors; returns the soft limit in force.
    Raises ConfigError when the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ConfigError(
                f"max_connections: needs {needed} file descriptors with its margin, but the "
                f"hard limit (ulimit -Hn) is {hard}; lower max_connections or raise the limit",
                keys=("max_connections",),
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        soft = needed
    return int(soft)
