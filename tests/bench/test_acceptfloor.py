"""`python -m benchmarks.acceptfloor` on tiny sizes: it completes, stops what it started and
reports every figure for both servers. Latency values are not asserted (they depend on the
machine's load); that each figure exists, comes from real tries and is a finite, non-negative
number is.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

# The lab (benchmarks/), outside the wheel: run with -m slow.
pytestmark = pytest.mark.slow

TINY = ["--rounds", "2", "--streams", "4", "--message-bytes", str(1 << 20),
        "--stream-bytes", str(3 << 20), "--round-timeout-s", "30"]  # fmt: skip


def test_acceptfloor_reports_loaded_and_idle_late_calls(run_json: Any) -> None:
    proc, doc = run_json("benchmarks.acceptfloor", [*TINY, "--quiet"], 100)
    figures = {f["key"]: f for f in doc["figures"]}
    assert figures["acceptfloor_aggregate_gbps"]["value"] > 0
    assert figures["acceptfloor_aggregate_gbps"]["n"] == 2  # one sample per round
    for server in ("loaded", "idle"):
        # the prober tried at least once in that server's round: three numbers per try
        assert doc["tries"][server] and all(len(t) == 3 for t in doc["tries"][server])
        for metric in ("total", "accept", "delivery"):
            for q in (50, 99):
                figure = figures[f"acceptfloor_{server}_{metric}_p{q}_ms"]
                assert figure["n"] == len(doc["tries"][server]), figure
                assert math.isfinite(figure["value"]), figure
                if metric == "total":
                    assert figure["value"] > 0
    loaded_accept = figures["acceptfloor_loaded_accept_p99_ms"]
    assert loaded_accept["ratio_to"] == "acceptfloor_idle_accept_p99_ms"
    assert "late call accept, loaded server" in proc.stdout


def test_acceptfloor_refuses_a_single_round(run_module: Any) -> None:
    proc = run_module("benchmarks.acceptfloor", ["--rounds", "1"], 60)
    assert proc.returncode == 2 and "rounds" in proc.stderr
