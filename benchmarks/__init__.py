"""kvpark's lab: the experiments behind docs/performance.md, kept out of the wheel and image.

The operator's benchmark ships with the clients as `kvpark bench` (kvpark.client.bench): park
and fetch against raw TCP, and late-fetch latency. What stays here is the full suite and the
diagnostics that explain its figures, run from a checkout:

- `python -m benchmarks`: every section in one run (cli): raw TCP, bare gRPC, park and fetch at
  1/2/4 MiB with CPU per GB; 16 concurrent streams with late fetches meanwhile; late fetch vs
  Lookup; producer RSS with the pool full and over 100k ids of churn; a reaper pass;
- `python -m benchmarks.acceptfloor`: late-call latency while 16 streams run, on bare grpcio;
- `grpcfloor` (the bare-gRPC baseline), `rawtcp`, `prober`, `reaper`, `memory`: its sections.

Removed: the ablation (`benchmarks.ablation`, and its test). It measured a producer with
production modules patched at run time (`kvpark.producer.__main__.tune_allocator`,
`kvpark.producer.server.method_handlers`), so it benchmarked code that is not what ships, and
it broke silently whenever the servicer changed shape. Its chunk-size lever is now `kvpark
bench --chunk 64KiB,4MiB`; the allocator and framing levers it measured are recorded in
docs/performance.md section 4, to be remeasured, if ever, by a producer option rather than a
patch. Nothing here touches an installed module: the lab only calls the public clients, the
wire module and (reaper) the producer's Lot and HostPool as they are.

Modules: `cli` (the sections), `report` (figures, targets, table, JSON), `env` (processes,
allocator, RSS, CPU), `helper` (helper processes' line protocol), `data` (pattern and byte
checks), `clients` (raw Park uploader, fetch loaders), `transfer`, `latency`, `prober`,
`memory`, `reaper`, `rawtcp`, `grpcfloor`, `acceptfloor`.
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
