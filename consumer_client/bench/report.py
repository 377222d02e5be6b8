"""`kvpark bench`'s figures: the JSON document, and the table printed from it. Throughput is the
median over repetitions (GB = 10^9 bytes) beside the slowest and fastest; ratios are paired,
computed per repetition and then the median: to raw TCP, with the raw TCP step of the same
repetition of the transfer section (back to back there), or for the concurrent section's rows
with that section's one raw transfer of the whole ("raw TCP, one beside the 16") of the same
repetition; to one fetch (the concurrent loads), with the one load run just before them. CPU
cost is CPU seconds per GB moved, this process plus the other end (null when it is not ours to
read, a producer given by --target); latencies are nearest-rank percentiles over every try.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import median
from typing import Any

from . import targets
from .sections import STREAMS, Row

GB = 1e9
NAMES = {"raw_tcp": "raw TCP loopback", "park": "park", "fetch": "fetch",
         "fetch_one": f"one fetch, beside the {STREAMS}",
         "fetch_concurrent": f"{STREAMS} fetches at once",
         "fetch_concurrent_probed": f"{STREAMS} at once, late fetches too",
         "raw_tcp_one": f"raw TCP, one beside the {STREAMS}",
         "raw_tcp_concurrent": f"raw TCP, {STREAMS} at once",
         "lookup": "unary Lookup (idle)",
         "late_fetch": "late fetch (RELEASED id, idle)",
         "late_fetch_busy": f"late fetch during {STREAMS} fetches"}  # fmt: skip
TRANSFER_KINDS = ("raw_tcp", "park", "fetch", "raw_tcp_one", "raw_tcp_concurrent", "fetch_one",
                  "fetch_concurrent", "fetch_concurrent_probed")  # fmt: skip
# A row of transfers at once -> the one transfer each repetition of it is paired with.
_PAIRED_WITH = {"fetch_concurrent": "fetch_one", "fetch_concurrent_probed": "fetch_one",
                "raw_tcp_concurrent": "raw_tcp_one"}  # fmt: skip
# The concurrent section's rows take their raw TCP reference from that section, not from the
# transfer section's: the machine's speed drifts between sections (sections.concurrent).
_CONCURRENT_KINDS = {*_PAIRED_WITH, *_PAIRED_WITH.values()}
LATENCY_KINDS = ("lookup", "late_fetch", "late_fetch_busy")


def percentile(values: Sequence[float], q: float) -> float:
    return sorted(values)[max(1, math.ceil(q / 100 * len(values))) - 1]


def _transfer(row: Row, raw: Row, nbytes: int) -> dict[str, Any]:
    rates = [nbytes / GB / s for s in row.seconds]
    # Paired with the raw-TCP step of the same repetition (the seconds are in repetition order).
    ratios = [r / t for r, t in zip(raw.seconds, row.seconds, strict=False)]
    this = median(c[0] for c in row.cpu) * GB / nbytes
    others = [c[1] for c in row.cpu]
    other = None if None in others else median(c or 0.0 for c in others) * GB / nbytes
    return {"kind": row.kind, "transport": row.transport, "chunk_bytes": row.chunk_bytes,
            "gbps": median(rates), "gbps_min": min(rates), "gbps_max": max(rates),
            "seconds": row.seconds,
            "ratio_to_raw_tcp": median(ratios),
            "cpu_s_per_gb": {"this": this, "other": other,
                             "total": None if other is None else this + other}}  # fmt: skip


def document(meta: dict[str, Any], rows: Sequence[Row], nbytes: int) -> dict[str, Any]:
    transfer: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []
    raw: dict[tuple[str, int], Row] = {}  # (raw_tcp or raw_tcp_one, chunk size) -> the row
    # (kind, transport, chunk) -> the one transfer measured beside the concurrent ones
    single: dict[tuple[str, str | None, int], Row] = {}
    for row in (r for r in rows if r.seconds):
        if row.kind in ("raw_tcp", "raw_tcp_one"):
            raw[row.kind, row.chunk_bytes] = row
        if row.kind in _PAIRED_WITH.values():
            single[row.kind, row.transport, row.chunk_bytes] = row
        reference = "raw_tcp_one" if row.kind in _CONCURRENT_KINDS else "raw_tcp"
        if row.kind in TRANSFER_KINDS and (reference, row.chunk_bytes) in raw:
            transfer.append(_transfer(row, raw[reference, row.chunk_bytes], nbytes))
            one_kind = _PAIRED_WITH.get(row.kind, "")
            alone = single.get((one_kind, row.transport, row.chunk_bytes))
            if alone is not None:
                # Aggregate throughput over one load's: the same bytes, in one wall time each,
                # paired per repetition (they ran back to back).
                paired = zip(alone.seconds, row.seconds, strict=False)
                transfer[-1]["ratio_to_single"] = median(one / all_ for one, all_ in paired)
        elif row.kind in LATENCY_KINDS:
            latency.append({"kind": row.kind, "transport": row.transport, "n": len(row.seconds),
                            "p50_us": percentile(row.seconds, 50) * 1e6,
                            "p99_us": percentile(row.seconds, 99) * 1e6})  # fmt: skip
            if row.kind == "late_fetch" and latency[-2]["kind"] == "lookup":
                latency[-1]["p50_ratio_to_lookup"] = latency[-1]["p50_us"] / latency[-2]["p50_us"]
    doc = {**meta, "transfer": transfer, "latency": latency}
    doc["targets"] = [t.as_dict() for t in targets.evaluate(doc)]
    return doc


def table(doc: dict[str, Any]) -> str:
    plan, producer, v = doc["plan"], doc["producer"], doc["versions"]
    who = f"our own, pid {producer['pid']}" if producer["own"] else "given by --target"
    lines = [f"kvpark bench{' --quick' if plan['quick'] else ''}: {plan['size_bytes'] / 1e6:g} MB "
             f"per transfer, {plan['reps']} repetition(s); producer {producer['target']} ({who})",
             f"python {v['python']}, grpcio {v['grpcio']}, numpy {v['numpy']}, {v['crc32c']}, "
             f"kvpark {v['kvpark']}; {doc['cpus']} CPUs", ""]  # fmt: skip
    cells = [["transfer", "chunk", "GB/s", "slowest-fastest", "x raw TCP", "CPU s/GB (this+other)",
              "x one fetch"]]  # fmt: skip
    for r in doc["transfer"]:
        cpu = {k: "?" if x is None else f"{x:.2f}" for k, x in r["cpu_s_per_gb"].items()}
        cells.append([NAMES[r["kind"]] + (f", {r['transport']}" if r["transport"] else ""),
                      f"{r['chunk_bytes'] / 2**20:g} MiB", f"{r['gbps']:.2f}",
                      f"{r['gbps_min']:.2f}-{r['gbps_max']:.2f}", f"{r['ratio_to_raw_tcp']:.2f}",
                      f"{cpu['total']} ({cpu['this']} + {cpu['other']})",
                      f"{r['ratio_to_single']:.2f}" if "ratio_to_single" in r else ""])  # fmt: skip
    lines += [*_columns(cells), ""] if doc["transfer"] else []
    # Idle and busy rows share the table: each row's name says which it is.
    cells = [["latency", "n", "p50 us", "p99 us", "x Lookup p50"]]
    for r in doc["latency"]:
        ratio = r.get("p50_ratio_to_lookup")
        cells.append([f"{NAMES[r['kind']]}, {r['transport']}", str(r["n"]), f"{r['p50_us']:,.0f}",
                      f"{r['p99_us']:,.0f}", "" if ratio is None else f"{ratio:.2f}"])  # fmt: skip
    lines += [*_columns(cells), ""] if doc["latency"] else []
    cells = [["target", "measured", "goal", "", "unit"]]
    for t in doc["targets"]:
        measured = "-" if t["measured"] is None else _significant(t["measured"])
        verdict = "MISSED" if t["verdict"] == "missed" else t["verdict"]
        # A percentile's sample count beside its unit: how much the figure can be trusted.
        unit = t["unit"] if t["n"] is None else f"{t['unit']}, n={t['n']}"
        cells.append([t["name"], measured, f"{'>=' if t['at_least'] else '<='} {t['goal']:g}",
                      verdict, unit])  # fmt: skip
    lines += [*_columns(cells), ""]
    if doc["ok"]:
        lines.append(f"ok: every byte verified ({doc['verified_bytes'] / 1e6:,.0f} MB compared "
                     f"after raw TCP and fetch) in {doc['elapsed_s']:.1f} s")  # fmt: skip
    lines += [f"FAILED: {failure}" for failure in doc["failures"]]
    return "\n".join(lines)


def _significant(value: float) -> str:
    """Three significant digits (at two decimals 0.449 against a goal of 0.45 would print
    "0.45 >= 0.45 MISSED"), whole numbers from 1000 on (not 1.23e+03)."""
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in rows]  # fmt: skip
