"""kvpark's benchmark (issue #5): measures the data path against this machine's own limit.

`python -m benchmarks` (or `kvpark bench`) starts a producer process, moves a 580 MB request
through it (park, then fetch with `consumer_client` into a numpy array) beside raw TCP between
two processes, runs 16 fetch streams at once, times late-fetch rejections against a unary
round trip, reads the producer's memory with the pool full and over 100k ids of churn, and
times a reaper pass. Every byte moved is verified; targets are reported, not enforced. See
docs/performance.md for the method and results, and `cli` for the sections.

Modules: `cli` (the command and its sections), `report` (figures, targets, table, JSON),
`env` (processes, allocator, RSS, CPU), `helper` (the line protocol of helper processes),
`data` (payload pattern and byte checks), `rawtcp` (the TCP baseline), `grpcfloor` (the
bare-gRPC baseline), `clients` (raw Park uploader, fetch loaders), `transfer` (single stream
and 16 streams), `latency` and `prober` (late fetches), `memory` (pool full, churn), `reaper`.
Run on their own: `ablation` (what each data-path lever buys) and `acceptfloor` (late-call
latency on bare grpcio while 16 streams run).
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
