"""`kvpark bench`'s target lines from known samples: which figure each target judges, and
when a figure is too thin to judge at all. The end-to-end runs (test_kvpark_bench.py) cannot
choose the samples; here they are written by hand."""

from __future__ import annotations

from typing import Any

import pytest

from kvpark.client.bench.report import document, table
from kvpark.client.bench.sections import Row

from .bench_samples import SIZE, meta, row

META = meta(2)


def target(rows: list[Row], name: str) -> dict[str, Any]:
    return next(t for t in document(META, rows, SIZE)["targets"] if t["name"] == name)


def test_580_mb_over_tcp_is_the_median_of_an_even_number_of_repetitions() -> None:
    # Two repetitions: the median is their mean, as for every other figure, not the slower.
    rows = [row("raw_tcp", [0.1, 0.1], None), row("fetch", [0.2, 0.36])]
    fetched = target(rows, "580 MB fetched over tcp")
    assert fetched["measured"] == pytest.approx(0.28) and fetched["met"] is True, fetched


def test_a_p99_of_fewer_than_100_samples_is_too_few_to_judge() -> None:
    # 43 late fetches, all fast: their p99 is their maximum, not a percentile. It is shown,
    # with its count, but neither met nor missed.
    rows = [row("late_fetch_busy", [0.001] * 43)]
    late = target(rows, "late fetch during them, p99")
    assert late["measured"] == pytest.approx(1.0) and late["n"] == 43, late
    assert late["met"] is None and late["verdict"] == "too few samples", late
    text = table(document(META, rows, SIZE))
    line = next(x for x in text.splitlines() if x.startswith("late fetch during them, p99"))
    assert "too few samples" in line and "n=43" in line and " met " not in line, line


def test_a_p99_of_100_samples_is_judged() -> None:
    rows = [row("late_fetch_busy", [0.001] * 99 + [0.02])]  # the one slow try is the max
    late = target(rows, "late fetch during them, p99")
    assert late["measured"] == pytest.approx(1.0) and late["met"] is True, late
    assert late["verdict"] == "met" and late["n"] == 100, late
