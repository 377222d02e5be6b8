"""Figures, targets and their presentation: the table on stdout and the same as JSON.

A `Figure` is one measured quantity: its samples (one per repetition, or one per try for
latencies), the statistic reported (median, or a percentile), the spread (min-max of the
repetitions, or p50-p99 for latencies), an optional ratio to another figure of the same run,
and an optional target; `other_ratios` holds further ratios to figures of the same run (the
JSON carries them, the table shows one ratio column: a ratio worth reading there gets a row of
its own, `ratio_figure`). Targets are judged on ratios within one run wherever they are stated
as ratios, because this machine is noisy: absolute GB/s moves ±20 % between runs, ratios much
less.

A missed target is reported ("below target"), never an error. A wrong byte is: any check that
finds one raises `VerificationError`, and the command exits 1.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9


class VerificationError(RuntimeError):
    """A moved byte (or a CRC, or an outcome) was not what was sent: the run fails."""


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), nearest-rank on the sorted samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class Target:
    """`value <op> bound` where value is the figure's ratio (if `on_ratio`) or its value."""

    op: str  # ">=" or "<="
    bound: float
    on_ratio: bool
    text: str  # as printed in the table, e.g. ">= 0.75x raw TCP"

    def met(self, figure: Figure) -> bool | None:
        value = figure.ratio if self.on_ratio else figure.value
        if value is None or math.isnan(value):
            return None
        return value >= self.bound if self.op == ">=" else value <= self.bound


@dataclass
class Figure:
    key: str  # stable name in the JSON
    label: str  # as printed
    unit: str  # "GB/s", "ms", "us", "MiB"
    value: float
    samples: list[float] = field(default_factory=list)
    statistic: str = "median"  # "median", "p50", "p99", "max", "single"
    spread: tuple[float, float] | None = None
    spread_kind: str = "min-max"
    ratio: float | None = None
    ratio_to: str = ""  # the figure (key) the ratio divides by
    target: Target | None = None
    note: str = ""
    # Paired ratios to other figures of the run besides `ratio_to`: reference key -> ratio.
    other_ratios: dict[str, float] = field(default_factory=dict)
    group: str = "main"  # which table: "main" (the targets' figures) or "cpu" (CPU per GB)

    @property
    def status(self) -> str:
        if self.target is None:
            return ""
        met = self.target.met(self)
        return "n/a" if met is None else ("met" if met else "below target")

    def to_json(self) -> dict[str, Any]:
        met = self.target.met(self) if self.target is not None else None
        return {
            "key": self.key,
            "label": self.label,
            "unit": self.unit,
            "statistic": self.statistic,
            "value": self.value,
            "spread": list(self.spread) if self.spread is not None else None,
            "spread_kind": self.spread_kind if self.spread is not None else None,
            "n": len(self.samples),
            "samples": self.samples,
            "ratio": self.ratio,
            "ratio_to": self.ratio_to or None,
            "other_ratios": self.other_ratios or None,
            "target": self.target.text if self.target is not None else None,
            "target_met": met,
            "note": self.note or None,
            "group": self.group,
        }


def throughput(key: str, label: str, nbytes: int, seconds: Sequence[float]) -> Figure:
    """Median GB/s over repetitions (each moved `nbytes`), spread = slowest..fastest."""
    rates = [nbytes / s / GB for s in seconds]
    return Figure(
        key, label, "GB/s", statistics.median(rates), rates, spread=(min(rates), max(rates))
    )


def latency(key: str, label: str, seconds: Sequence[float], q: float, unit: str = "us") -> Figure:
    """The q-th percentile of per-try latencies, spread = p50..p99 (or p99..max for q=99)."""
    scale = 1e6 if unit == "us" else 1e3
    values = [s * scale for s in seconds]
    lo, hi = (50.0, 99.0) if q < 99 else (99.0, 100.0)
    return Figure(
        key,
        label,
        unit,
        percentile(values, q),
        values,
        statistic=f"p{q:g}",
        spread=(percentile(values, lo), percentile(values, hi)),
        spread_kind="p50-p99" if q < 99 else "p99-max",
    )


def set_ratio(figure: Figure, reference: Figure) -> Figure:
    figure.ratio = figure.value / reference.value if reference.value else math.nan
    figure.ratio_to = reference.key
    return figure


def paired_ratios(figure: Figure, reference: Figure) -> list[float]:
    """figure / reference per repetition, when both were measured in the same repetitions
    (one sample each, in order); [] otherwise. Each pair shares the machine's conditions of
    that moment, so the ratios are steadier than the ratio of the medians on a noisy machine."""
    if len(figure.samples) != len(reference.samples) or not figure.samples:
        return []
    return [a / b for a, b in zip(figure.samples, reference.samples, strict=True)]


def paired_ratio(figure: Figure, reference: Figure) -> float:
    """Median of the paired ratios; the ratio of the values when there are none."""
    ratios = paired_ratios(figure, reference)
    if ratios:
        return statistics.median(ratios)
    return figure.value / reference.value if reference.value else math.nan


def set_paired_ratio(figure: Figure, reference: Figure) -> Figure:
    figure.ratio = paired_ratio(figure, reference)
    figure.ratio_to = reference.key
    return figure


def ratio_figure(key: str, label: str, figure: Figure, reference: Figure) -> Figure:
    """A row whose value is the paired ratio figure / reference (unit "x"), spread = the
    lowest..highest repetition's ratio."""
    ratios = paired_ratios(figure, reference) or [paired_ratio(figure, reference)]
    return Figure(
        key,
        label,
        "x",
        statistics.median(ratios),
        ratios,
        spread=(min(ratios), max(ratios)),
        note=f"{figure.key} / {reference.key}, paired by repetition",
    )


# ------------------------------------------------------------------------------- output
def _fmt(value: float | None, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if unit in ("GB/s",):
        return f"{value:.2f}"
    if unit == "ratio":
        return f"{value:.2f}x"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render_table(figures: Sequence[Figure]) -> str:
    header = ("figure", "stat", "value", "spread", "n", "ratio", "target", "status")
    rows: list[tuple[str, ...]] = [header]
    for f in figures:
        spread = (
            f"{_fmt(f.spread[0], f.unit)}-{_fmt(f.spread[1], f.unit)}"
            if f.spread is not None
            else ""
        )
        ratio = ""
        if f.ratio is not None:
            ratio = f"{_fmt(f.ratio, 'ratio')} {f.ratio_to}" if f.ratio_to else _fmt(f.ratio)
        rows.append(
            (
                f.label,
                f.statistic,
                _fmt(f.value, "ratio") if f.unit == "x" else f"{_fmt(f.value, f.unit)} {f.unit}",
                spread,
                str(len(f.samples)) if f.samples else "",
                ratio,
                f.target.text if f.target is not None else "",
                f.status,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            c.ljust(w) if i in (0, 1, 6, 7) or n == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def json_document(meta: dict[str, Any], figures: Sequence[Figure], **extra: Any) -> str:
    """The run as JSON text; non-finite numbers (a figure that could not be computed) become
    null, so the document stays valid JSON."""
    judged = [f.target.met(f) for f in figures if f.target is not None]
    doc = {
        "meta": meta,
        "figures": [f.to_json() for f in figures],
        "targets": {
            "total": len(judged),
            "met": sum(1 for m in judged if m),
            "below": sum(1 for m in judged if m is False),
        },
        **extra,
    }
    return json.dumps(_finite(doc), indent=2, allow_nan=False) + "\n"


def write_json(path: Path, meta: dict[str, Any], figures: Sequence[Figure], **extra: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json_document(meta, figures, **extra))
    tmp.replace(path)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
