"""`kvpark-producer` / `python -m producer_service`: start a producer from its configuration.

A thin layer over `config.load_config` and `server.serve`: a configuration error is printed
on one line and exits 2; a clean shutdown on SIGTERM/SIGINT exits 0.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from .config import ConfigError, load_config
from .logs import configure_logging


def _tune_allocator() -> None:
    """glibc: keep multi-MiB buffers on the heap instead of fresh mmaps that page-fault on
    every message (performance-notes.md: 1.4-2.9x on gRPC). Harmless elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)
        libc.mallopt(m_trim_threshold, 2 * 1024 * 1024 * 1024)
    except (OSError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"kvpark-producer: config error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    _tune_allocator()
    from .server import serve  # after config: a bad flag answers without importing grpc

    try:
        return asyncio.run(serve(config))
    except OSError as exc:
        print(f"kvpark-producer: cannot start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
