"""Prometheus series of a decode worker's loads, measured where they happen.

A worker creates one `ConsumerMetrics` (in its own registry, or the default one its /metrics
endpoint already serves) and passes it to its clients or pool (`metrics=`). Every load is then
counted by path and reason, with its bytes, its duration, its time to first chunk and its
throughput, and the transport that carried it (with each shm or tcp path that failed before its
first byte); every fallback by reason with the chunks recomputed (counted when the load named
its chunks: a load of "every chunk" that fails does not know how many the id has). The failure
policy each load ran under is a label, and `kvpark_client_failure_policy` says which policy the
worker runs with, so an operator sees both what happened and what was meant to happen. Nothing
is estimated: each figure is read off the LoadResult the caller got.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from ._errors import UsageError
from ._result import POLICIES, LoadResult

# 1 ms (a warm shared-memory load) to a minute (a load timeout's far end).
_SECONDS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
# 10 MB/s (a slow TCP link) to 20 GB/s (shared memory on a fast host).
_BYTES_PER_SECOND = (1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2e9, 4e9, 8e9, 2e10)
# The `policy` label of a plain `load()`, which falls back to nothing by itself.
NO_POLICY = "none"


class ConsumerMetrics:
    def __init__(
        self, registry: CollectorRegistry = REGISTRY, *, policy: str = "recompute"
    ) -> None:
        if policy not in POLICIES:
            raise UsageError(f"policy: expected 'recompute' or 'fail', got {policy!r}")
        r = registry
        try:
            self.loads_total = Counter(
                "kvpark_client_loads", "Loads by path, reason and failure policy",
                ["path", "reason", "policy"], registry=r,
            )  # fmt: skip
        except ValueError as exc:  # the first series of a second ConsumerMetrics
            raise UsageError(
                "this registry already holds a ConsumerMetrics: give every client and pool of "
                "the worker the same one, or each its own registry= "
                f"({exc})"
            ) from None
        self.loaded_bytes_total = Counter(
            "kvpark_client_loaded_bytes", "Payload bytes loaded and verified", registry=r
        )
        # Which transport carries the loads shows a data plane that is offered but not used (a
        # blocked data port, a TLS client without data_tls, no shared socket): the loads still
        # succeed, over the gRPC stream, only slower.
        self.transport_loads_total = Counter(
            "kvpark_client_transport_loads",
            "Loads that got every chunk, by the transport that carried their bytes",
            ["transport"], registry=r,
        )  # fmt: skip
        self.transport_fallbacks_total = Counter(
            "kvpark_client_transport_fallbacks",
            "Loads whose shm or tcp path failed before its first byte and went on over the "
            "gRPC stream, by the transport that failed",
            ["transport"], registry=r,
        )  # fmt: skip
        self.load_seconds = Histogram(
            "kvpark_client_load_seconds", "Load wall time, whatever its outcome",
            buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.first_chunk_seconds = Histogram(
            "kvpark_client_first_chunk_seconds", "From the start of a load to its first chunk",
            buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.throughput = Histogram(
            "kvpark_client_load_throughput_bytes_per_second",
            "Bytes per second of loads that got every chunk",
            buckets=_BYTES_PER_SECOND, registry=r,
        )  # fmt: skip
        self.recomputed_chunks_total = Counter(
            "kvpark_client_recomputed_chunks",
            "Chunks the engine recomputed after a fallback, where the load named its chunks "
            "(num_chunks or chunk_ids); a whole-id load's unloaded rest has no known length",
            registry=r,
        )  # fmt: skip
        self.fallbacks_total = Counter(
            "kvpark_client_fallbacks", "Loads that fell back, by reason and failure policy",
            ["reason", "policy"], registry=r,
        )  # fmt: skip
        self.failure_policy = Gauge(
            "kvpark_client_failure_policy", "1 for the failure policy this worker runs with",
            ["policy"], registry=r,
        )  # fmt: skip
        self.failure_policy.labels(policy).set(1)

    def record_load(self, result: LoadResult, policy: str) -> None:
        reason = result.reason.lower() if result.reason else "none"
        self.loads_total.labels(result.path.value, reason, policy).inc()
        self.loaded_bytes_total.inc(result.bytes)
        if result.ok:
            self.transport_loads_total.labels(result.transport).inc()
        self.load_seconds.observe(result.elapsed_s)
        if result.first_chunk_s is not None:
            self.first_chunk_seconds.observe(result.first_chunk_s)
        if result.ok and result.elapsed_s > 0:
            self.throughput.observe(result.bytes / result.elapsed_s)

    def record_transport_fallback(self, transport: str) -> None:
        self.transport_fallbacks_total.labels(transport).inc()

    def record_fallback(self, result: LoadResult, policy: str, recomputed_chunks: int) -> None:
        reason = result.reason.lower() if result.reason else "none"
        self.fallbacks_total.labels(reason, policy).inc()
        self.recomputed_chunks_total.inc(recomputed_chunks)
