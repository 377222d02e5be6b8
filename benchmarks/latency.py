"""Late-fetch rejection latency: the prober process, and ids that are really REAPED.

The contract's promise (docs/protocol.md) is that a Fetch arriving after its id was reaped is
answered at once, in one round trip, with `REASON_REAPED`. So the benchmark makes real reaped
ids — parks a tiny chunk and waits (by Lookup, not by sleeping a guess) until the producer's
reaper has tombstoned it — and the prober (`prober.py`, its own process) times late Fetches of
them, beside unary Lookups for the same id as the one-round-trip reference.
"""

from __future__ import annotations

import time
import uuid

from kvpark.pb import kvpark_pb2 as pb

from . import data
from .clients import Parker
from .helper import JsonLineChild
from .report import VerificationError


class ReapedIds:
    """Ids that are really REAPED on the producer, for late-fetch probes.

    `park_ahead()` parks one id without waiting (its lease runs out while other sections
    run); `get()` returns a REAPED id whose tombstone has at least `min_left_s` of retention
    left, waiting (by Lookup, never by a guessed sleep) for the parked one to be reaped, or
    parking a fresh one when the old tombstone is too close to being pruned.
    """

    def __init__(self, parker: Parker, retention_s: float, lease_s: float) -> None:
        self._parker = parker
        self._retention_s = retention_s
        self._lease_s = lease_s
        self._pending: str | None = None
        self._payload = data.pattern(256)
        self._crcs = data.chunk_crcs(self._payload, 256)

    def park_ahead(self) -> None:
        kid = f"bench-late-{uuid.uuid4().hex[:12]}"
        reply = self._parker.park(kid, self._payload, 256, self._crcs)
        if reply.status != pb.STATUS_OK:
            raise VerificationError(f"park of {kid!r} refused: {reply.detail}")
        self._pending = kid

    def get(self, min_left_s: float) -> str:
        if self._pending is None:
            self.park_ahead()
        assert self._pending is not None
        state = self._wait_reaped(self._pending)
        if state.age_s + min_left_s > self._retention_s:
            self.park_ahead()  # this tombstone would be pruned mid-measurement
            assert self._pending is not None
            self._wait_reaped(self._pending)
        return self._pending

    def _wait_reaped(self, kid: str) -> pb.IdState:
        deadline = time.monotonic() + self._lease_s + 15.0
        while True:
            state = self._parker.lookup([kid])[0]
            if state.state == pb.STATE_TOMBSTONED:
                if state.reason != pb.REASON_REAPED:
                    raise VerificationError(f"{kid!r} ended {state.reason}, expected REAPED")
                return state
            if state.state != pb.STATE_PARKED or time.monotonic() > deadline:
                raise RuntimeError(f"{kid!r} not reaped in time: {state}")
            time.sleep(0.05)


class Prober:
    """The prober process (prober.py) for one producer."""

    # An idle run of 2 x 2,000 round trips takes seconds; this bounds a prober that hangs.
    ANSWER_TIMEOUT_S = 300.0

    def __init__(self, target: str) -> None:
        self._child = JsonLineChild("prober", [target])

    def idle(self, n: int, kid: str) -> tuple[list[float], list[float]]:
        """(Lookup seconds, late-Fetch seconds), n of each, interleaved."""
        doc = self._child.ask(f"idle {n} {kid}", self.ANSWER_TIMEOUT_S)
        return doc["lookup"], doc["reject"]

    def start_loaded(self, kid: str, gap_s: float) -> None:
        doc = self._child.ask(f"loaded {kid} {gap_s}", self.ANSWER_TIMEOUT_S)
        if not doc.get("started"):
            raise RuntimeError(f"prober did not start: {doc}")

    def stop_loaded(self) -> list[float]:
        rejects: list[float] = self._child.ask("stop", self.ANSWER_TIMEOUT_S)["reject"]
        return rejects

    def close(self) -> None:
        self._child.close()
