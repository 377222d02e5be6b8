"""kvpark producer: the gRPC server that parks KV chunks in a preallocated host-memory pool and
streams them to the decode worker on Fetch. Import the submodules directly (for example
`kvpark.producer.config`); this package only re-exports the version."""

from __future__ import annotations

from kvpark.version import __version__

__all__ = ["__version__"]
