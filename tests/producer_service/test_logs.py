"""RateLimitedWarnings: what is logged, what is counted, and that suppressed warnings cost no
field building (late calls can arrive thousands of times per second)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvpark.producer.logs import RateLimitedWarnings


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_first_warning_is_logged_with_fields_and_repeats_are_counted_unbuilt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    suppressed: list[str] = []
    built: list[str] = []
    warnings = RateLimitedWarnings(
        logging.getLogger("kvpark.test"), suppressed.append, interval_s=10.0, clock=clock
    )

    def fields(kid: str) -> Any:
        def build() -> dict[str, Any]:
            built.append(kid)
            return {"id": kid}

        return build

    with caplog.at_level(logging.WARNING, logger="kvpark.test"):
        assert warnings.warn("late_fetch", "a", "late", fields("a"))
        for _ in range(5):
            clock.now += 1.0
            assert not warnings.warn("late_fetch", "a", "late", fields("a"))
        clock.now += 10.0  # past the interval: logged again, with the count it suppressed
        assert warnings.warn("late_fetch", "a", "late", fields("a"))

    assert suppressed == ["late_fetch"] * 5
    assert built == ["a", "a"]  # only the two logged warnings built their fields
    records = [r for r in caplog.records if r.name == "kvpark.test"]
    assert [r.__dict__["kv"] for r in records] == [
        {"id": "a"},
        {"id": "a", "suppressed_since_last": 5},
    ]
