"""`python -m benchmarks --quick` as CI runs it: a smoke check of the whole benchmark.

Runs the command in a subprocess (it starts its own producer and helper processes) and checks
that it exits 0 — every byte it moved was verified — and that the JSON carries every
measurement of issue #5 with a finite value. Targets are not asserted: this machine's
throughput and latency vary with whatever else runs on it, and a missed target is reported by
the benchmark, not a failure. A wrong byte is a failure (exit 1), and so is a missing figure.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every measurement the issue asks for, by its JSON key.
EXPECTED = {
    # baseline, fetch and park at 1, 2 and 4 MiB
    *(f"raw_tcp_{m}mib_gbps" for m in (1, 2, 4)),
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
# Figures the issue gives a target for: each must be judged (met or below), never skipped.
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
def test_quick_benchmark_runs_and_reports_every_measurement(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["failure"] is None
    assert doc["meta"]["bytes_verified"] > 580_000_000 * 9  # raw, park, fetch x 3 sizes
    figures = {f["key"]: f for f in doc["figures"]}
    assert figures.keys() >= EXPECTED, f"missing: {sorted(EXPECTED - figures.keys())}"
    for key in EXPECTED:
        figure = figures[key]
        assert math.isfinite(figure["value"]), (key, figure)
        assert figure["n"] >= 1 and figure["samples"], (key, figure)
    for key in TARGETED:
        assert figures[key]["target"], key
        assert figures[key]["target_met"] in (True, False), (key, figures[key])
    # Latencies come from at least 1,000 tries each, as the issue asks, even in --quick.
    assert figures["reject_p50_us"]["n"] >= 1000 and figures["lookup_p50_us"]["n"] >= 1000
    # The table went to stdout, with a status for each target.
    assert "raw TCP loopback" in proc.stdout and "targets:" in proc.stdout
    assert "moved and verified byte for byte" in proc.stdout


def test_bench_help_and_bad_arguments() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert ok.returncode == 0 and "--quick" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "nonsense"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown section" in bad.stderr


def test_kvpark_bench_subcommand_prints_json() -> None:
    """`kvpark bench` is the same benchmark, wired into the operator CLI as a plugin; there the
    CLI's common `--json` flag prints the JSON document instead of the table."""
    proc = subprocess.run(
        [sys.executable, "-m", "consumer_client", "bench", "--quick", "--only", "reaper",
         "--json", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True
    assert [f["key"] for f in doc["figures"]] == ["reaper_pass_ms"]
