"""The kvpark version string, one source for the producer, the client and ServerInfo.

It comes from the installed distribution's metadata, so a wheel built from `pyproject.toml`
reports exactly what it was built as; a source checkout that was never installed falls back to
the constant below, which must be kept equal to `[project] version` in `pyproject.toml`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# Keep equal to `[project] version` in pyproject.toml (used only when kvpark is not installed).
FALLBACK_VERSION = "0.1.0"

try:
    __version__: str = version("kvpark")
except PackageNotFoundError:
    __version__ = FALLBACK_VERSION

__all__ = ["FALLBACK_VERSION", "__version__"]
