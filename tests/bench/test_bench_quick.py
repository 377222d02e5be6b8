"""`python -m benchmarks --quick`: a smoke check of the lab's whole suite (run with -m slow).

Runs the command in a subprocess (it starts its own producer and helper processes) and checks
that it exits 0 — every byte it moved was verified — and that the JSON carries every
measurement of docs/performance.md with a finite value. Targets are not asserted: this machine's
throughput and latency vary with whatever else runs on it, and a missed target is reported by
the benchmark, not a failure. A wrong byte is a failure (exit 1), and so is a missing figure.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytestmark = pytest.mark.slow

# Every measurement of the suite, by its JSON key.
EXPECTED = {
    # baselines, fetch and park at 1, 2 and 4 MiB
    *(f"raw_tcp_{m}mib_gbps" for m in (1, 2, 4)),
    *(f"grpc_floor_{m}mib_gbps" for m in (1, 2, 4)),
    *(f"fetch_over_grpc_floor_{m}mib" for m in (1, 2, 4)),
    *(f"fetch_{m}mib_gbps" for m in (1, 2, 4)),
    *(f"park_{m}mib_gbps" for m in (1, 2, 4)),
    "fetch_580mb_seconds",
    # late-fetch rejection beside a unary round trip
    "lookup_p50_us",
    "lookup_p99_us",
    "reject_p50_us",
    "reject_p99_ms",
    # 16 streams, and rejections while they run
    "single_stream_576mb_gbps",
    "concurrent_16_streams_gbps",
    "loaded_reject_p50_ms",
    "loaded_reject_p99_ms",
    # memory
    "rss_pool_full_mib",
    "rss_peak_mib",
    "churn_rss_growth_mib",
    "churn_rss_peak_mib",
    "churn_ids_per_s",
    # reaper
    "reaper_pass_ms",
}
# The bare-gRPC floor (benchmarks/grpcfloor.py) beside raw TCP, in throughput and CPU per GB.
FLOOR = {
    *(f"grpc_floor_{m}mib_gbps" for m in (1, 2, 4)),
    *(f"cpu_floor_{m}mib_s_per_gb" for m in (1, 2, 4)),
}
# Figures with a target: each must be judged (met or below), never skipped.
TARGETED = {
    *(f"fetch_{m}mib_gbps" for m in (1, 2, 4)),
    *(f"park_{m}mib_gbps" for m in (1, 2, 4)),
    "reject_p50_us",
    "reject_p99_ms",
    "concurrent_16_streams_gbps",
    "loaded_reject_p99_ms",
    "rss_pool_full_mib",
    "churn_rss_growth_mib",
    "reaper_pass_ms",
}


@pytest.mark.timeout(300)
def test_quick_benchmark_runs_and_reports_every_measurement(run_json: Any) -> None:
    proc, doc = run_json("benchmarks", ["--quick"], 280)
    assert doc["ok"] is True and doc["failure"] is None
    assert doc["meta"]["bytes_verified"] > 580_000_000 * 12  # raw, floor, park, fetch x 3
    figures = {f["key"]: f for f in doc["figures"]}
    assert figures.keys() >= EXPECTED, f"missing: {sorted(EXPECTED - figures.keys())}"
    for key in EXPECTED:
        figure = figures[key]
        assert math.isfinite(figure["value"]), (key, figure)
        assert figure["n"] >= 1 and figure["samples"], (key, figure)
    for key in FLOOR:
        figure = figures[key]
        assert figure["value"] > 0 and figure["n"] >= 1, (key, figure)
        assert figure["ratio_to"].startswith(("raw_tcp_", "cpu_raw_")), (key, figure)
    for m in (1, 2, 4):
        # fetch's second paired ratio, to the floor of the same repetitions
        floor_ratio = figures[f"fetch_{m}mib_gbps"]["other_ratios"][f"grpc_floor_{m}mib_gbps"]
        assert floor_ratio > 0
        assert figures[f"fetch_over_grpc_floor_{m}mib"]["value"] == pytest.approx(floor_ratio)
    for key in TARGETED:
        assert figures[key]["target"], key
        assert figures[key]["target_met"] in (True, False), (key, figures[key])
    # Latencies come from at least 1,000 tries each, even in --quick.
    assert figures["reject_p50_us"]["n"] >= 1000 and figures["lookup_p50_us"]["n"] >= 1000
    # The table went to stdout, with a status for each target.
    assert "raw TCP loopback" in proc.stdout and "targets:" in proc.stdout
    assert "bare gRPC stream, 1 MiB messages" in proc.stdout
    assert "moved and verified byte for byte" in proc.stdout


def test_bench_help_and_bad_arguments(run_module: Any) -> None:
    ok = run_module("benchmarks", ["--help"], 60)
    assert ok.returncode == 0 and "--quick" in ok.stdout
    bad = run_module("benchmarks", ["--only", "nonsense"], 60)
    assert bad.returncode == 2 and "unknown section" in bad.stderr
