"""kvpark's lab: the experiments behind docs/performance.md, kept out of the wheel and image.

The operator's benchmark ships with the clients as `kvpark bench` (kvpark.client.bench): park
and fetch against raw TCP, and late-fetch latency. What stays here is the full suite and the
diagnostics that explain its figures, run from a checkout:

- `python -m benchmarks`: every section in one run (cli): raw TCP, bare gRPC, park and fetch at
  1/2/4 MiB with CPU per GB; 16 concurrent streams with late fetches meanwhile; late fetch vs
  Lookup; producer RSS with the pool full and over 100k ids of churn; a reaper pass;
- `python -m benchmarks.acceptfloor`: late-call latency while 16 streams run, on bare grpcio;
- `grpcfloor` (the bare-gRPC baseline), `rawtcp`, `prober`, `reaper`, `memory`: its sections.

Nothing here touches an installed module: the lab only calls the public clients, the wire
module and (reaper) the producer's Lot and HostPool as they are. A benchmark that patched
production modules at run time would measure code that does not ship and break silently when
the servicer changes shape; the chunk-size lever is measured with `kvpark bench --chunk
64KiB,4MiB`, and the allocator and framing levers would need a producer option, not a patch.

Modules: `cli` (the sections), `report` (figures, targets, table, JSON), `env` (processes,
allocator, RSS, CPU), `helper` (helper processes' line protocol), `data` (pattern and byte
checks), `clients` (raw Park uploader, fetch loaders), `transfer`, `latency`, `prober`,
`memory`, `reaper`, `rawtcp`, `grpcfloor`, `acceptfloor`.
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
