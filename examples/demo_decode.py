"""Demo decode worker: loads the demo's three requests with the `kvpark` client and prints a table.

The prefill worker parks three requests (see prefill_worker.py); this worker takes each down a
different path:

- ``on-time``: loaded as soon as it is parked, while its lease runs -> remote.
- ``late``: left alone until its lease ran out and the producer reaped it; the load is answered
  REAPED at once (one round trip, not the load timeout) and the worker recomputes it locally.
- ``queued``: waits in the decode queue longer than the lease, but the worker keeps its lease
  alive with KeepAlive from the moment it learns of the request -> still remote.

Every wait is for a condition the producer reports (Lookup), never a fixed sleep. Every byte
loaded is compared with the prefill worker's synthetic KV, and "recompute" regenerates it, so the
table's paths are checked, not just printed. Exit status 0 when all three took the expected path
with the right bytes, 1 otherwise.

Settings: demo_common.py, plus
    DEMO_LOAD_TIMEOUT_S   the client's load timeout (default 10)
    DEMO_QUEUE_EXTRA_S    how far past its lease ``queued`` waits before it is loaded (default 2)
    DEMO_READY_FILE       touched once the keep-alive for ``queued`` runs (compose healthcheck)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from decode_worker import synthetic_chunk
from demo_common import NAMES, Settings, fill, request_ids

from kvpark.client import (
    IdStatus,
    KVConsumer,
    LoadPath,
    LoadReport,
    LoadResult,
    ProducerInfo,
    Reason,
    State,
    Timeout,
    TransportError,
)

CONNECT_TIMEOUT_S = 30.0
# Parked within this long after the worker is ready, or the prefill side is broken.
PARK_WAIT_S = 60.0
# A late fetch must be answered this fast to count as "at once".
LATE_ANSWER_LIMIT_S = 1.0


def say(text: str) -> None:
    print(f"decode-worker: {text}", flush=True)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Polls `predicate` (a Lookup) until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s:g}s waiting for {what}")
        time.sleep(0.02)


def connect(kv: KVConsumer) -> ProducerInfo:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return kv.server_info(timeout=2.0)
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@dataclass
class Row:
    name: str
    report: LoadReport[int]
    recompute_s: float
    bytes_ok: bool

    @property
    def result(self) -> LoadResult:
        return self.report.result


def load(kv: KVConsumer, name: str, kid: str, epoch: int, settings: Settings) -> Row:
    buf = np.empty(settings.request_bytes, dtype=np.uint8)
    recompute_s = 0.0

    def recompute(first_missing: int) -> int:
        # Stands in for the engine's prefill of the missing chunks: regenerate them.
        nonlocal recompute_s
        started = time.perf_counter()
        count = fill(buf, kid, first_missing, settings)
        recompute_s = time.perf_counter() - started
        return count

    report = kv.load_or_recompute(
        kid, num_chunks=settings.chunks, into=buf, expected_epoch=epoch, recompute=recompute
    )
    size = settings.chunk_bytes
    bytes_ok = all(
        buf[k * size : (k + 1) * size].tobytes() == synthetic_chunk(kid, k, size)
        for k in range(settings.chunks)
    )
    return Row(name, report, recompute_s, bytes_ok)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(rows: list[Row]) -> str:
    lines = [f"{'request':<10} {'path':<10} {'reason':<15} {'bytes':>10} {'time':>10}  throughput"]
    for row in rows:
        r = row.result
        rate = f"{human_bytes(r.bytes / r.elapsed_s)}/s" if r.bytes and r.elapsed_s > 0 else "-"
        lines.append(
            f"{row.name:<10} {row.report.path:<10} {r.reason or '-':<15} "
            f"{human_bytes(r.bytes):>10} {r.elapsed_s * 1000:>7.1f} ms  {rate}"
        )
    return "\n".join(lines)


def main() -> int:
    # PID 1 in a container gets no default SIGTERM handling: exit when compose stops us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = Settings.from_env()
    load_timeout = Timeout(total_s=float(os.environ.get("DEMO_LOAD_TIMEOUT_S", "10")))
    queue_extra_s = float(os.environ.get("DEMO_QUEUE_EXTRA_S", "2"))
    ready_file = os.environ.get("DEMO_READY_FILE")

    with KVConsumer(
        settings.target,
        timeout=load_timeout,
        token=settings.fetch_token,
        credentials=settings.credentials(),
    ) as kv:
        info = connect(kv)
        epoch, lease = info.producer_epoch, info.unbound_store_timeout_s
        ids = request_ids(epoch)
        say(
            f"producer {settings.target} epoch {epoch:016x}, lease (unbound_store_timeout_s) "
            f"{lease:g}s, load timeout {load_timeout.total_s:g}s"
        )

        def status(kid: str) -> IdStatus:
            return kv.lookup([kid])[0]

        def parked(kid: str) -> IdStatus | None:
            s = status(kid)
            complete = s.total_chunks and s.chunks_parked == s.total_chunks
            return s if s.state is State.PARKED and complete else None

        rows: list[Row] = []
        # The router told us about `queued` when it sent it to prefill: keep its lease alive
        # from now on, parked or not (KeepAlive records intent for ids not parked yet).
        with kv.keep_alive([ids["queued"]]) as keep_alive:
            if ready_file:
                Path(ready_file).touch()
            say("keeping 'queued' alive while it waits in the decode queue")

            wait_for(lambda: parked(ids["on-time"]), PARK_WAIT_S, "'on-time' to be parked")
            rows.append(load(kv, "on-time", ids["on-time"], epoch, settings))

            # Nobody keeps `late` alive: wait until the producer reaped it.
            wait_for(
                lambda: status(ids["late"]).state is State.TOMBSTONED,
                PARK_WAIT_S + lease,
                "'late' to be reaped",
            )
            rows.append(load(kv, "late", ids["late"], epoch, settings))

            # `queued` outlives its lease in the queue; the keep-alive holds it.
            def outlived_lease() -> IdStatus | None:
                s = parked(ids["queued"])
                return s if s is not None and s.age_s >= lease + queue_extra_s else None

            queued = wait_for(
                outlived_lease, PARK_WAIT_S + lease + queue_extra_s, "'queued' to outlive its lease"
            )
            keep_alive.discard(ids["queued"])  # admitted: its KV is loaded now
            rounds = keep_alive.statistics().rounds
            rows.append(load(kv, "queued", ids["queued"], epoch, settings))

    print(table(rows), flush=True)
    by_name = {row.name: row for row in rows}
    late = by_name["late"]
    print(
        f"late:    not fetched within its {lease:g}s lease; the producer answered "
        f"{late.result.reason} in {late.result.elapsed_s * 1000:.1f} ms (load timeout "
        f"{load_timeout.total_s:g}s); recomputed {late.report.recompute_value} chunks locally "
        f"in {late.recompute_s * 1000:.0f} ms",
        flush=True,
    )
    print(
        f"queued:  waited {queued.age_s:.1f}s after parking (lease {lease:g}s), kept alive by "
        f"{rounds} KeepAlive rounds",
        flush=True,
    )

    expected = {
        "on-time": (LoadPath.REMOTE, None),
        "late": (LoadPath.RECOMPUTE, Reason.REAPED),
        "queued": (LoadPath.REMOTE, None),
    }
    problems = []
    for name in NAMES:
        row = by_name[name]
        want = expected[name]
        if (row.report.path, row.report.reason) != want:
            problems.append(f"{name}: {row.report.path}/{row.report.reason}, expected {want}")
        if not row.bytes_ok:
            problems.append(f"{name}: bytes differ from the prefill worker's KV")
    if late.result.elapsed_s >= LATE_ANSWER_LIMIT_S:
        problems.append(f"late: answered in {late.result.elapsed_s:.3f}s, not at once")
    if problems:
        say("UNEXPECTED: " + "; ".join(problems))
        return 1
    say(
        f"ok: {settings.chunks} x {human_bytes(settings.chunk_bytes)} chunks per request, every "
        "byte matches the prefill worker's KV (CRC32C checked per chunk)"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TimeoutError as exc:
        say(str(exc))
        sys.exit(1)
