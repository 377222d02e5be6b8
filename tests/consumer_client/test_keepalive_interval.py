"""A keep-alive's `interval_s` is seconds in (0, one week]: a bool or a longer wait is refused
before anything runs (True would otherwise be one second, and a wait beyond what thread and
timer waits take would fail every round)."""

from __future__ import annotations

import pytest

from kvpark import AsyncKVConsumer, KVConsumer, UsageError
from kvpark.durations import MAX_SECONDS


@pytest.mark.parametrize("interval_s", [True, False, MAX_SECONDS + 1, 1e10])
def test_a_bool_or_an_interval_beyond_a_week_is_refused(interval_s: object) -> None:
    with KVConsumer("h:1") as client, pytest.raises(UsageError, match="interval_s"):
        client.keep_alive(["x"], interval_s=interval_s)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="interval_s"):
        AsyncKVConsumer("h:1").keep_alive(["x"], interval_s=interval_s)  # type: ignore[arg-type]
