"""Fleet demo decode worker: loads each request's KV by the handle the proxy forwards.

One `ConsumerPool` serves every request, whichever prefill node parked it: the handle names the
producer (its advertised address) and its epoch, and the pool keeps one client per producer.
A load that fails — the producer is gone, the KV was reaped, the stream broke — falls back
to recomputing the missing chunks (`load_or_recompute`, policy "recompute"); a request that
came without a handle (its prefill node could not park) is recomputed whole. Every byte of the
result, loaded or recomputed, is then compared with the request's KV (fleet_kv.py).

HTTP (JSON, fleet_http.py):

    POST /decode  {"request_id", "chunks", "chunk_bytes", "handle": {...} | null}
        -> {"worker", "path", "reason", "chunks_loaded", "recomputed_from", "load_s",
            "verified", "ended_at", ...}
    GET  /loads   -> {"worker", "loading": {request_id: chunks loaded so far}}
    GET  /stats   -> {"worker", "loads": {"path/reason": n}, "fallbacks": {reason: n}}: the
                     worker's ConsumerMetrics series, as its /metrics would show them

Settings: FLEET_WORKER (name), FLEET_LISTEN (default 0.0.0.0:8000), FLEET_READY_FILE,
DEMO_FETCH_TOKEN, FLEET_LOAD_TIMEOUT_S (the client's load timeout, default 5).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import fleet_kv
import numpy as np
from fleet_http import Json, serve
from prometheus_client import CollectorRegistry

from kvpark import ConsumerMetrics, ConsumerPool, KVHandle, LoadPath, Timeout


def say(worker: str, text: str) -> None:
    # One write per line: print() writes the newline separately, and the lines of requests
    # served at once would run into each other.
    sys.stdout.write(f"{worker}: {text}\n")
    sys.stdout.flush()


class DecodeWorker:
    def __init__(self, worker: str, pool: ConsumerPool, registry: CollectorRegistry) -> None:
        self.worker = worker
        self.pool = pool
        self.registry = registry
        self._loading: dict[str, int] = {}
        self._lock = threading.Lock()

    def _progress(self, rid: str) -> Callable[[int, int, memoryview], None]:
        def on_chunk(index: int, chunk_id: int, view: memoryview) -> None:
            with self._lock:
                self._loading[rid] = index + 1

        return on_chunk

    def decode(self, body: Json) -> tuple[int, Json]:
        rid = str(body["request_id"])
        shape = fleet_kv.Shape(int(body["chunks"]), int(body["chunk_bytes"]))
        kv = np.zeros(shape.nbytes, dtype=np.uint8)

        def recompute(first_missing: int) -> int:
            fleet_kv.fill(rid, shape, kv, first_missing)
            return first_missing

        if body.get("handle") is None:
            # Nothing was parked: the engine prefills the whole prompt itself.
            recompute(0)
            answer: Json = {
                "path": str(LoadPath.RECOMPUTE),
                "reason": "NO_HANDLE",
                "chunks_loaded": 0,
                "recomputed_from": 0,
                "load_s": 0.0,
                "producer": None,
            }
        else:
            handle = KVHandle.from_dict(body["handle"])
            with self._lock:
                self._loading[rid] = 0
            try:
                report = self.pool.load_or_recompute(
                    handle, into=kv, recompute=recompute, on_chunk=self._progress(rid)
                )
            finally:
                with self._lock:
                    self._loading.pop(rid, None)
            result = report.result
            answer = {
                "path": str(report.path),
                "reason": None if report.reason is None else str(report.reason),
                "chunks_loaded": result.chunks_loaded,
                "recomputed_from": report.recomputed_from,
                "load_s": result.elapsed_s,
                "producer": handle.producer,
                "producer_epoch": handle.producer_epoch,
            }
            if report.path is not LoadPath.REMOTE:
                loaded = f"{result.chunks_loaded}/{shape.chunks} chunks from {handle.producer}"
                say(
                    self.worker,
                    f"{rid}: {report.path} after {result.elapsed_s * 1000:.1f} ms "
                    f"({report.reason}, {loaded}), recomputed from chunk {report.recomputed_from}",
                )
        verified = fleet_kv.matches(rid, shape, kv)
        if not verified:
            say(self.worker, f"{rid}: KV DIFFERS from the request's")
        return 200, {"worker": self.worker, **answer, "verified": verified, "ended_at": time.time()}

    def loads(self, body: Json) -> tuple[int, Json]:
        with self._lock:
            return 200, {"worker": self.worker, "loading": dict(self._loading)}

    def stats(self, body: Json) -> tuple[int, Json]:
        loads: dict[str, float] = {}
        fallbacks: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == "kvpark_client_loads_total":
                    key = f"{sample.labels['path']}/{sample.labels['reason']}"
                    loads[key] = sample.value
                elif sample.name == "kvpark_client_fallbacks_total":
                    fallbacks[sample.labels["reason"]] = sample.value
        return 200, {"worker": self.worker, "loads": loads, "fallbacks": fallbacks}


def main() -> int:
    env = os.environ
    worker = env.get("FLEET_WORKER", "decode")
    load_timeout_s = float(env.get("FLEET_LOAD_TIMEOUT_S", "5"))
    registry = CollectorRegistry()
    with ConsumerPool(
        timeout=Timeout(total_s=load_timeout_s),
        token=env.get("DEMO_FETCH_TOKEN") or None,
        metrics=ConsumerMetrics(registry),
        max_producers=8,
        idle_close_s=60.0,
    ) as pool:
        decode = DecodeWorker(worker, pool, registry)
        routes = {
            ("POST", "/decode"): decode.decode,
            ("GET", "/loads"): decode.loads,
            ("GET", "/stats"): decode.stats,
        }
        say(worker, f"ready: loads by handle from any producer, load timeout {load_timeout_s:g}s")
        serve(
            env.get("FLEET_LISTEN", "0.0.0.0:8000"), routes, ready_file=env.get("FLEET_READY_FILE")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
