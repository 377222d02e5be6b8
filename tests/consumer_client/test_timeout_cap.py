"""Timeouts are capped at a week (kvpark.durations): a longer one is refused as misuse, since
gRPC deadlines and event-loop timers handed such values end at once or overflow; a week itself
still loads and parks."""

from __future__ import annotations

import pytest
from conftest import running_producer

from kvpark import AsyncKVConsumer, AsyncKVParker, Timeout, UsageError
from kvpark.durations import MAX_SECONDS


@pytest.mark.parametrize("field", ["total_s", "first_chunk_s", "per_gib_s", "base_s"])
def test_every_limit_is_at_most_a_week(field: str) -> None:
    extra = {"per_gib_s": 1.0} if field == "base_s" else {}
    Timeout(**{**extra, field: MAX_SECONDS})
    with pytest.raises(UsageError, match=f"Timeout.{field}: expected at most {MAX_SECONDS}"):
        Timeout(**{**extra, field: MAX_SECONDS + 1})


async def test_a_call_with_a_timeout_beyond_a_week_is_refused_and_a_week_loads() -> None:
    async with running_producer() as server:
        async with AsyncKVParker(server.target) as parker:
            with pytest.raises(UsageError, match="one week"):
                await parker.park("kv", [b"x" * 64], timeout=1e10)
            assert (await parker.park("kv", [b"x" * 64], timeout=MAX_SECONDS)).ok
        async with AsyncKVConsumer(server.target) as consumer:
            with pytest.raises(UsageError, match="one week"):
                await consumer.load("kv", num_chunks=1, timeout=1e10)
            with pytest.raises(UsageError, match="one week"):
                AsyncKVConsumer(server.target, timeout=1e10)
            result = await consumer.load("kv", num_chunks=1, timeout=MAX_SECONDS)
    assert result.ok, result
    assert result.data is not None and result.data.tobytes() == b"x" * 64
