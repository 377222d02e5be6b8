"""`kvpark bench`'s figures from known samples: the paired ratios (per repetition, then the
median) and the target lines. The end-to-end runs (test_kvpark_bench.py) can only check that
a ratio is positive; here the expected value is computed by hand."""

from __future__ import annotations

from kvpark.client.bench.report import document, table

from .bench_samples import SIZE, meta, row

META = meta(3)


def test_concurrent_ratio_pairs_each_repetition_with_the_one_load_before_it() -> None:
    # A slow repetition (the machine's slow moment) slows the one load and the 16 alike:
    # paired, each repetition says 1.0; medians taken apart would say 0.5 or 2.0.
    rows = [
        row("raw_tcp", [0.2, 0.2, 0.2], None),
        row("raw_tcp_one", [0.2, 0.2, 0.2], None),
        row("fetch_one", [0.2, 0.4, 0.4]),
        row("fetch_concurrent", [0.2, 0.2, 0.4]),
    ]
    doc = document(META, rows, SIZE)
    concurrent = next(r for r in doc["transfer"] if r["kind"] == "fetch_concurrent")
    assert concurrent["ratio_to_single"] == 1.0  # per repetition: 1.0, 2.0, 1.0
    target = next(t for t in doc["targets"] if t["name"] == "16 concurrent tcp fetches")
    assert target["measured"] == 1.0 and target["met"] is True


def test_raw_tcp_transfers_at_once_pair_with_raw_tcps_one_transfer_alone() -> None:
    """The machine's own concurrency reference pairs with the raw transfer run just before it,
    and the loads' ratio still pairs with the one load, not with that raw transfer."""
    rows = [
        row("raw_tcp", [0.2, 0.2, 0.2], None),
        row("raw_tcp_one", [0.1, 0.1, 0.1], None),
        row("raw_tcp_concurrent", [0.125, 0.125, 0.2], None),
        row("fetch_one", [0.2, 0.2, 0.2]),
        row("fetch_concurrent", [0.2, 0.2, 0.4]),
    ]
    doc = document(META, rows, SIZE)
    ratios = {r["kind"]: r.get("ratio_to_single") for r in doc["transfer"]}
    assert ratios["raw_tcp_concurrent"] == 0.8  # per repetition: 0.8, 0.8, 0.5
    assert ratios["fetch_concurrent"] == 1.0  # 1.0, 1.0, 0.5; with raw TCP's one: 0.5
    assert ratios["raw_tcp_one"] is None and ratios["fetch_one"] is None
    assert "raw TCP, 16 at once" in table(doc)


def test_concurrent_rows_ratio_to_raw_tcp_measured_in_their_own_section() -> None:
    """The concurrent section's rows are "x raw TCP" of the raw transfer of the whole measured
    in that section, repetition by repetition; the transfer section's raw TCP, run earlier at
    another speed, is the reference of that section's rows only."""
    rows = [
        row("raw_tcp", [0.1, 0.1, 0.1], None),  # the transfer section: raw TCP ran fast then
        row("fetch", [0.2, 0.2, 0.2]),
        row("raw_tcp_one", [0.2, 0.4, 0.2], None),  # the concurrent section: slower, drifting
        row("raw_tcp_concurrent", [0.4, 0.4, 0.4], None),
        row("fetch_one", [0.2, 0.4, 0.4]),
        row("fetch_concurrent", [0.4, 0.8, 0.4]),
        row("fetch_concurrent_probed", [0.8, 0.8, 0.8]),
    ]
    doc = document(META, rows, SIZE)
    ratios = {r["kind"]: r["ratio_to_raw_tcp"] for r in doc["transfer"]}
    assert ratios["fetch"] == 0.5  # 0.1 / 0.2, to the transfer section's raw TCP
    assert ratios["raw_tcp_one"] == 1.0
    assert ratios["raw_tcp_concurrent"] == 0.5  # 0.5, 1.0, 0.5
    assert ratios["fetch_one"] == 1.0  # 1.0, 1.0, 0.5
    assert ratios["fetch_concurrent"] == 0.5  # 0.5, 0.5, 0.5; with the transfer's: 0.25
    assert ratios["fetch_concurrent_probed"] == 0.25  # 0.25, 0.5, 0.25


def test_a_target_just_missed_does_not_print_as_its_goal() -> None:
    rows = [row("raw_tcp", [1.0, 1.0, 1.0], None), row("fetch", [2.228] * 3)]  # 0.4488x
    text = table(document(META, rows, SIZE))
    line = next(x for x in text.splitlines() if x.startswith("fetch over tcp "))
    assert "0.449" in line and "MISSED" in line, line


def test_the_latency_table_says_idle_only_of_the_idle_rows() -> None:
    rows = [row("lookup", [0.001] * 3), row("late_fetch", [0.001] * 3),
            row("late_fetch_busy", [0.002] * 3)]  # fmt: skip
    lines = table(document(META, rows, SIZE)).splitlines()

    def line(start: str) -> str:
        return next(x for x in lines if x.startswith(start))

    assert "idle" not in line("latency"), lines
    assert "idle" in line("unary Lookup") and "idle" in line("late fetch (RELEASED"), lines
    assert "idle" not in line("late fetch during 16 fetches"), lines
