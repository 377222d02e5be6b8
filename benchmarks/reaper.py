"""Reaper pass cost: one `Lot.reap()` that expires 1k ids out of 100k parked.

Measured in this process on the real `Lot` and `HostPool` with a fake clock, which is the only
way to make exactly 1k leases run out at once: ids are parked with one tiny chunk each (small
pool pages so 100k ids fit a small pool), their first chunks one fake millisecond apart, so
their lease deadlines are ordered; then the clock moves just far enough for the oldest 1k to
expire and one pass is timed. Each repetition first parks 1k fresh ids so the lot is back to
100k parked. The pass includes everything a real pass does: popping the lease heap, freeing the
pool slots, writing the tombstones and pruning old ones.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpark.checksum import crc32c_of
from kvpark.producer.lot import Lot, LotSettings, ParkBatch
from kvpark.producer.pool import HostPool

from .report import VerificationError

_PAYLOAD = b"kvpark-reaper-benchmark-chunk-64" * 2  # 64 bytes
_PAGE = 128
_STEP_S = 0.001  # fake time between two ids' first chunks
_LEASE_S = 600.0  # longer than the fake time it takes to park 100k ids


@dataclass
class _FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class ReaperResult:
    pass_seconds: list[float]
    parked: int
    expired_per_pass: int


def measure(parked: int, expired: int, reps: int, progress: Callable[[str], None]) -> ReaperResult:
    clock = _FakeClock()
    pool = HostPool((parked + expired + 16) * _PAGE, page_bytes=_PAGE)
    settings = LotSettings(
        unbound_store_timeout_s=_LEASE_S,
        tombstone_retention_s=3600.0,
        max_lease_s=_LEASE_S,
        max_tombstones=1_000_000,
    )
    lot = Lot(pool, settings, epoch=1, clock=clock)
    data = memoryview(_PAYLOAD)
    crc = crc32c_of(data)
    counter = 0
    deadlines: list[float] = []  # lease deadline of each id, in parking order

    def park(n: int) -> None:
        nonlocal counter
        for _ in range(n):
            kid = f"reaper-bench-{counter:08d}"
            clock.now += _STEP_S  # the fake clock only moves forward
            deadlines.append(clock.now + _LEASE_S)
            batch = lot.begin_park(kid, 1, 0)
            if not isinstance(batch, ParkBatch):
                raise VerificationError(f"reaper benchmark: park of {kid} refused: {batch}")
            refused = lot.park_chunk(batch, 0, data, crc)
            if refused is not None:
                raise VerificationError(f"reaper benchmark: chunk of {kid} refused: {refused}")
            lot.commit_park(batch, 1, len(data))
            counter += 1

    progress(f"reaper: parking {parked:,} ids")
    park(parked)
    oldest = 0  # index of the oldest id still parked
    times: list[float] = []
    for rep in range(reps):
        if rep:
            park(expired)  # back to `parked` ids
        progress(f"reaper: pass {rep + 1}/{reps}")
        # Just past the deadline of id oldest+expired-1, before that of id oldest+expired.
        last = oldest + expired - 1
        clock.now = (deadlines[last] + deadlines[last + 1]) / 2
        before = lot.statistics().parked_ids
        gc.collect()
        started = time.perf_counter()
        reaped = lot.reap()
        times.append(time.perf_counter() - started)
        if len(reaped) != expired or before != parked:
            raise VerificationError(
                f"reaper benchmark: pass {rep} reaped {len(reaped)} of {before} parked, "
                f"expected {expired} of {parked}"
            )
        oldest += expired
    lot.check_invariants()
    return ReaperResult(times, parked, expired)
