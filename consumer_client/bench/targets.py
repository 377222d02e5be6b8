"""The data plane's targets, checked against one run's figures and printed under its table.
A target is reported met or missed, never judged in the exit status: speed depends on the
machine, and a busy host says nothing about the code. Ratios are to raw TCP measured in the
same run (report.py), so the machine's speed cancels out; the absolute one (580 MB in 0.30 s)
is scaled from the run's size. A percentile target is judged only on enough samples (below
P99_MIN_SAMPLES its verdict is "too few samples"). docs/performance.md says where each target
comes from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import Any

REFERENCE_BYTES = 580_000_000
# The gRPC stream's ratios to raw TCP (1 MiB chunks) before the data plane: "no regression".
GRPC_BEFORE = {"park": 0.43, "fetch": 0.45}
# The nearest-rank p99 of fewer than 100 samples is their maximum: one slow try would be the
# whole figure, and a lucky handful would read "met" for a percentile never measured.
P99_MIN_SAMPLES = 100


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None  # None: the run has no figure for it (a transport not measured)
    goal: float
    at_least: bool  # True: measured >= goal; False: measured <= goal
    unit: str
    n: int | None = None  # the samples behind `measured`, where it is a percentile of them
    min_n: int = 0  # fewer samples than this: too few to judge

    @property
    def too_few(self) -> bool:
        return self.measured is not None and self.n is not None and self.n < self.min_n

    @property
    def met(self) -> bool | None:
        """None when there is nothing to judge: no figure, or one of too few samples."""
        if self.measured is None or self.too_few:
            return None
        return self.measured >= self.goal if self.at_least else self.measured <= self.goal

    @property
    def verdict(self) -> str:
        if self.too_few:
            return "too few samples"
        return {True: "met", False: "missed", None: "not measured"}[self.met]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "measured": self.measured, "goal": self.goal,
                "at_least": self.at_least, "unit": self.unit, "n": self.n, "min_n": self.min_n,
                "met": self.met, "verdict": self.verdict}  # fmt: skip


def evaluate(doc: dict[str, Any]) -> list[Target]:
    def transfer(kind: str, transport: str, key: Callable[[dict[str, Any]], Any]) -> Any:
        rows = [r for r in doc["transfer"] if (r["kind"], r["transport"]) == (kind, transport)]
        return key(rows[0]) if rows else None

    def latency(kind: str, transport: str, key: str) -> Any:
        rows = [r for r in doc["latency"] if (r["kind"], r["transport"]) == (kind, transport)]
        return rows[0][key] if rows else None

    ratio = lambda r: r["ratio_to_raw_tcp"]  # noqa: E731
    raw_cpu = transfer("raw_tcp", None, lambda r: r["cpu_s_per_gb"]["total"])  # type: ignore[arg-type]
    tcp_cpu = transfer("fetch", "tcp", lambda r: r["cpu_s_per_gb"]["total"])
    scale = REFERENCE_BYTES / doc["plan"]["size_bytes"]
    tcp_s = transfer("fetch", "tcp", lambda r: median(r["seconds"]))
    return [
        Target("fetch over tcp", transfer("fetch", "tcp", ratio), 0.9, True, "x raw TCP"),
        Target("fetch over tcp, CPU per GB",
               tcp_cpu / raw_cpu if tcp_cpu and raw_cpu else None, 1.3, False,
               "x raw TCP's"),
        Target("park over shm", transfer("park", "shm", ratio), 1.5, True, "x raw TCP"),
        Target("fetch over shm", transfer("fetch", "shm", ratio), 1.5, True, "x raw TCP"),
        Target("580 MB fetched over tcp", None if tcp_s is None else tcp_s * scale, 0.30, False,
               "s" if scale == 1 else f"s (scaled from {doc['plan']['size_bytes'] / 1e6:g} MB)"),
        Target("16 concurrent tcp fetches",
               transfer("fetch_concurrent", "tcp", lambda r: r["ratio_to_single"]), 0.9, True,
               "x one fetch"),
        Target("late fetch during them, p99",
               _ms(latency("late_fetch_busy", "tcp", "p99_us")), 10.0, False, "ms",
               n=latency("late_fetch_busy", "tcp", "n"), min_n=P99_MIN_SAMPLES),
        *(Target(f"{kind} over grpc", transfer(kind, "grpc", ratio), before, True,
                 "x raw TCP (before the data plane)")
          for kind, before in GRPC_BEFORE.items()),
    ]  # fmt: skip


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1000
