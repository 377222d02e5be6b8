"""Hand-written bench samples for the report tests: a run's metadata and result rows, so a
test chooses every figure the report computes from."""

from __future__ import annotations

from typing import Any

from kvpark.client.bench.sections import Row

SIZE = 580_000_000


def meta(reps: int) -> dict[str, Any]:
    """The metadata of a run of `reps` repetitions of SIZE bytes in 1 MiB chunks over tcp."""
    return {"ok": True, "failures": [], "verified_bytes": 0, "elapsed_s": 1.0,
            "plan": {"size_bytes": SIZE, "chunk_bytes": [2**20], "reps": reps,
                     "latency_tries": 0, "transports": ["tcp"], "quick": False},
            "producer": {"own": True, "target": "127.0.0.1:1", "pid": 1, "version": "x"},
            "versions": {"python": "3", "grpcio": "1", "numpy": "2", "kvpark": "0",
                         "crc32c": "crc32c-rs"},
            "cpus": 2}  # fmt: skip


def row(kind: str, seconds: list[float], transport: str | None = "tcp") -> Row:
    """A row of `kind` with one sample per entry of `seconds` (CPU figures fixed)."""
    r = Row(kind, transport, 2**20)
    for s in seconds:
        r.add(s, 0.1, 0.1)
    return r
