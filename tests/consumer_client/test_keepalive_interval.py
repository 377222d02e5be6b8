"""A keep-alive's interval.

- `interval_s` is seconds in (0, one week]: a bool or a longer wait is refused before anything
  runs (True would otherwise be one second, and a wait beyond what thread and timer waits take
  would fail every round).
- The default interval follows only the leases a round extends. A DELIVERED id's grace only
  shrinks: followed, it would drive the rounds to the 50 ms floor, every round's deadline with
  them, and a large set whose round no longer fits that deadline would fail every round from
  then on, its ids reaped. For the same reason a failed round, which reports nothing, leaves
  the next round paced by the lease a round grants, not by the short leases last reported.
"""

from __future__ import annotations

import grpc
import pytest

from kvpark import AsyncKVConsumer, IdStatus, KVConsumer, State, TransportError, UsageError
from kvpark.client.keepalive import _KeepAliveState
from kvpark.durations import MAX_SECONDS


@pytest.mark.parametrize("interval_s", [True, False, MAX_SECONDS + 1, 1e10])
def test_a_bool_or_an_interval_beyond_a_week_is_refused(interval_s: object) -> None:
    with KVConsumer("h:1") as client, pytest.raises(UsageError, match="interval_s"):
        client.keep_alive(["x"], interval_s=interval_s)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="interval_s"):
        AsyncKVConsumer("h:1").keep_alive(["x"], interval_s=interval_s)  # type: ignore[arg-type]


def _status(kid: str, state: State, lease_remaining_s: float) -> IdStatus:
    return IdStatus(
        kv_request_id=kid,
        state=state,
        reason=None,
        chunks_parked=1,
        total_chunks=1,
        bytes=1,
        age_s=1.0,
        lease_remaining_s=lease_remaining_s,
        fingerprint=b"",
    )


def test_a_delivered_grace_does_not_set_the_interval() -> None:
    state = _KeepAliveState(["parked", "delivered", "intent"], interval_s=None, extend_s=30.0)
    state.record(
        [
            _status("parked", State.PARKED, 30.0),
            _status("delivered", State.DELIVERED, 0.06),  # grace nearly over
            _status("intent", State.UNKNOWN, 27.0),
        ]
    )
    assert state.interval(None) == pytest.approx(9.0)  # a third of the intent's 27 s


def test_after_a_failed_round_the_pace_is_the_lease_a_round_grants() -> None:
    # A parked id at its max_lease_s cap: its lease cannot grow, and the rounds speed up.
    state = _KeepAliveState(["capped", "other"], interval_s=None, extend_s=30.0)
    state.record([_status("capped", State.PARKED, 0.09), _status("other", State.PARKED, 30.0)])
    assert state.call_timeout(None) == pytest.approx(0.05)
    # A round that short failed (too many ids to renew in 50 ms): the leases it would have
    # reported are unknown, and the next round gets the time a round grants.
    state.record_error(
        TransportError("KeepAlive: deadline exceeded", code=grpc.StatusCode.DEADLINE_EXCEEDED)
    )
    assert state.interval(None) == pytest.approx(10.0)
    assert state.call_timeout(None) == 5.0
    # Answered again, the reported leases set the pace again.
    state.record([_status("capped", State.PARKED, 0.06), _status("other", State.PARKED, 30.0)])
    assert state.interval(None) == pytest.approx(0.05)
