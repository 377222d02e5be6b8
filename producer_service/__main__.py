"""`kvpark-producer` / `python -m kvpark.producer`: start a producer from its configuration.

A thin layer over `config_sources.load_config`, `credentials.load_credentials` and
`server.serve`: a configuration error (an unreadable token or certificate file, or a pool larger
than the memory the process may use, see memory_room.py) is printed on one line and exits 2; a
clean shutdown on SIGTERM/SIGINT exits 0, also when the signal comes while the producer starts.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvpark.alloc import tune_allocator

from .config_sources import load_config
from .config_values import ConfigError
from .credentials import load_credentials
from .logs import configure_logging
from .memory_room import check_pool_fits, measure_room


@contextmanager
def noted_stop_signals() -> Iterator[Callable[[], bool]]:
    """SIGTERM and SIGINT noted, not fatal, until the server's event loop takes them over: a
    producer stopped while it loads its configuration then exits 0 without serving, as one
    stopped while serving does, rather than dying of the signal (143) or with a
    KeyboardInterrupt traceback. Yields whether one came."""
    received: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield lambda: bool(received)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    with noted_stop_signals() as stop_requested:
        return _main(argv, stop_requested)


def _main(argv: Sequence[str] | None, stop_requested: Callable[[], bool]) -> int:
    try:
        config = load_config(sys.argv[1:] if argv is None else argv)
        credentials = load_credentials(config)
        configure_logging(config.log_level, config.log_format)
        # Before the pool is allocated: one that cannot fit would get us OOM-killed silently.
        check_pool_fits(config.pool_bytes, measure_room(), config.max_tombstones)
    except ConfigError as exc:
        print(f"kvpark-producer: config error: {exc}", file=sys.stderr)
        return 2
    tune_allocator()  # multi-MiB messages off fresh mmaps (docs/performance.md)
    from .server import serve  # after config: a bad flag answers without importing grpc

    try:
        return asyncio.run(serve(config, credentials, stop_requested))
    except ConfigError as exc:  # found at start-up (the file-descriptor budget)
        print(f"kvpark-producer: config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvpark-producer: cannot start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
