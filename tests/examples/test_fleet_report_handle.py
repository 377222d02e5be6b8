"""The fleet report reads a handle's producer address as the client does.

judge() compares it with the address the prefill node advertises, so it must be written the
way an address is written: an IPv6 host in brackets ([::1]:50051), not run into its port
(::1:50051), which would flag every parked request of an IPv6 fleet.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import example

from kvpark import KVHandle

fleet_report = example("fleet_report")


def answer_with(handle: dict[str, Any] | None) -> dict[str, Any]:
    """A proxy answer for a request whose prefill answered `handle`."""
    return {
        "prefill_node": "p1",
        "decode_worker": "d1",
        "queued_s": 0.0,
        "prefill": {
            "handle": handle,
            "park": {"ok": handle is not None, "reason": None, "elapsed_s": 0.01},
        },
        "decode": {
            "path": "remote",
            "reason": None,
            "chunks_loaded": 2,
            "recomputed_from": None,
            "load_s": 0.01,
            "verified": True,
            "ended_at": 0.0,
        },
    }


@pytest.mark.parametrize("advertised", ["[::1]:50051", "prefill-a:50051", "10.0.3.7:50051"])
def test_the_handle_producer_is_the_advertised_address(advertised: str) -> None:
    handle = KVHandle("r1", advertised, 7, 2, 10).to_dict()
    outcome = fleet_report.Outcome.from_answer("r1", "before", answer_with(handle))
    assert outcome.handle_producer == advertised
    assert outcome.handle_epoch == 7


def test_no_handle_names_no_producer() -> None:
    outcome = fleet_report.Outcome.from_answer("r1", "after", answer_with(None))
    assert outcome.handle_producer is None and outcome.handle_epoch is None
