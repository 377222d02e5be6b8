"""What the fleet demo's requests should have done, whether they did, and the summary table.

A request's expected path follows from its prefill node and from when it ran relative to the
SIGKILL of that node's producer (its phase, see fleet_driver.py):

    phase     the request, when the producer was killed      killed node            other nodes
    before    done, both producers were up                   remote                 remote
    streamed  loading mid-stream                             partial (half)         remote
    queued    parked, its handle held at the proxy           recompute              remote
    after     prefilled after the kill (its park fails)      recompute, no handle   remote

A fallback must end within the client's load timeout plus `MARGIN_S`, and must be the client
noticing the dead producer (UNAVAILABLE, CANCELLED), not its timer running out. Every request
must come back (none lost) with every byte equal to its KV, loaded or recomputed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from fleet_kv import Shape

from kvpark import KVHandle

PHASES = ("before", "streamed", "queued", "after")
# Slack on the load timeout for a fallback: scheduling, the HTTP hop, a loaded CI machine.
MARGIN_S = 1.0
# How the client reports a producer that died under it or no longer accepts connections.
TRANSPORT_REASONS = ("UNAVAILABLE", "CANCELLED")


@dataclass
class Outcome:
    """One request, end to end, as the driver saw it come back from the proxy."""

    request_id: str
    phase: str
    node: str | None = None
    worker: str | None = None
    path: str | None = None
    reason: str | None = None
    chunks_loaded: int = 0
    recomputed_from: int | None = None
    load_s: float = 0.0
    park_ok: bool = False
    park_reason: str | None = None
    park_s: float = 0.0
    handle_producer: str | None = None
    handle_epoch: int | None = None
    verified: bool = False
    ended_at: float = 0.0
    queued_s: float = 0.0
    # For a request of the killed node that fell back: how long falling back took (check()).
    fallback_s: float | None = None
    # Set when the request was lost: the proxy answered an error or did not answer.
    error: str | None = None
    expected: str = ""
    problems: list[str] = field(default_factory=list)

    @classmethod
    def from_answer(cls, request_id: str, phase: str, answer: dict[str, Any]) -> Outcome:
        prefill, decode = answer["prefill"], answer["decode"]
        park = prefill["park"]
        handle = prefill["handle"] or {}
        return cls(
            request_id=request_id,
            phase=phase,
            node=answer["prefill_node"],
            worker=answer["decode_worker"],
            path=decode["path"],
            reason=decode["reason"],
            chunks_loaded=decode["chunks_loaded"],
            recomputed_from=decode["recomputed_from"],
            load_s=decode["load_s"],
            park_ok=park["ok"],
            park_reason=park["reason"],
            park_s=park["elapsed_s"],
            # As the client reads the handle: an IPv6 host comes back in brackets.
            handle_producer=KVHandle.from_dict(handle).producer if handle else None,
            handle_epoch=handle.get("producer_epoch"),
            verified=decode["verified"],
            ended_at=decode["ended_at"],
            queued_s=answer["queued_s"],
        )


def expected_path(phase: str, node: str, killed: str) -> str:
    if node != killed or phase == "before":
        return "remote"
    return "partial" if phase == "streamed" else "recompute"


def check(o: Outcome, summary: dict[str, Any]) -> None:
    """Fills in `expected`, `fallback_s` and `problems`."""
    killed = summary["killed_node"]
    if o.error is not None or o.node is None:
        o.problems.append(f"lost: {o.error}")
        return
    o.expected = expected_path(o.phase, o.node, killed)
    if o.path != o.expected:
        o.problems.append(f"took {o.path} ({o.reason}), expected {o.expected}")
    if not o.verified:
        o.problems.append("its KV differs from the request's")
    if o.node != killed or o.phase == "before":
        return
    # The time to fall back: from the kill for the load it cut off, else from the request's
    # own call to the dead producer (the load of a held handle, or the park that failed).
    if o.phase == "streamed":
        o.fallback_s = o.ended_at - summary["kill"]["killed_at"]
    else:
        o.fallback_s = o.load_s if o.park_ok else o.park_s
    # Whatever the phase, the client's own call ends within its timeout and a margin.
    spent, timeout = (
        (o.load_s, summary["load_timeout_s"])
        if o.park_ok
        else (o.park_s, summary["park_timeout_s"])
    )
    if max(spent, o.fallback_s) > timeout + MARGIN_S:
        o.problems.append(f"fell back after {max(spent, o.fallback_s):.3f}s, beyond {timeout:g}s")
    reason = o.reason if o.park_ok else o.park_reason
    if reason not in TRANSPORT_REASONS:
        o.problems.append(f"fell back on {reason}, not on noticing the producer's death")
    if o.phase == "after" and (o.park_ok or o.reason != "NO_HANDLE"):
        o.problems.append("parked after its producer was killed")
    half = Shape(summary["chunks"], 0).first_part
    if o.phase == "streamed" and (o.chunks_loaded, o.recomputed_from) != (half, half):
        o.problems.append(
            f"loaded {o.chunks_loaded} chunks, recomputed from {o.recomputed_from}; "
            f"expected the committed half ({half}) and then the rest"
        )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _reasons(outcomes: list[Outcome]) -> str:
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.error is not None:
            name = "LOST"
        elif o.reason == "NO_HANDLE":
            name = f"no handle (park {o.park_reason})"
        else:
            name = o.reason or "-"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(
        name if n == 1 or name == "-" else f"{name} x{n}" for name, n in counts.items()
    )


def table(outcomes: Iterable[Outcome], nodes: list[str]) -> str:
    """Per node and phase: how many took each path, why, and the slowest park and load."""
    header = (
        f"{'node':<10} {'phase':<9} {'requests':>8} {'remote':>6} {'partial':>7} "
        f"{'recompute':>9} {'lost':>4}  {'max park':>9} {'max load':>9}  reasons"
    )
    rows = [header]
    everything = list(outcomes)
    for node in nodes:
        mine = [o for o in everything if o.node == node]
        for phase in (*PHASES, "all"):
            group = mine if phase == "all" else [o for o in mine if o.phase == phase]
            if not group:
                continue
            paths = [o.path for o in group]
            lost = sum(o.error is not None for o in group)
            # Requests that came without a handle loaded nothing: no load time.
            loads = [o.load_s for o in group if o.park_ok]
            max_load = _ms(max(loads)) if loads else "-"
            reasons = _reasons(group) if phase != "all" else ""
            row = (
                f"{node:<10} {phase:<9} {len(group):>8} {paths.count('remote'):>6} "
                f"{paths.count('partial'):>7} {paths.count('recompute'):>9} {lost:>4}  "
                f"{_ms(max(o.park_s for o in group)):>9} {max_load:>9}  {reasons}"
            )
            rows.append(row.rstrip())
    return "\n".join(rows)


def _rounded(value: Any) -> Any:
    """Seconds to 0.1 ms, recursively: the line stays short (Docker splits log lines beyond
    16 KiB, which would break it in two)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def json_line(summary: dict[str, Any], outcomes: Iterable[Outcome]) -> str:
    """The run for machines: one line, `fleet-json: {...}`."""
    run = {**summary, "requests": [asdict(o) for o in outcomes]}
    return "fleet-json: " + json.dumps(_rounded(run), separators=(",", ":"))


def judge(summary: dict[str, Any], outcomes: list[Outcome]) -> list[str]:
    """Every problem with the run: the requests' own, then the fleet's."""
    killed = summary["killed_node"]
    problems: list[str] = []
    for o in outcomes:
        check(o, summary)
        problems += [f"{o.request_id}: {p}" for p in o.problems]

    kill = summary["kill"]
    if kill["returncode"] != -9:
        problems.append(f"{killed}'s producer ended with {kill['exit']}, not SIGKILL")
    start, end = summary["producers_at_start"], summary["producers_at_end"]
    if end[killed]["running"]:
        problems.append(f"{killed}'s producer is running again")
    for node in summary["nodes"]:
        if node != killed and (
            not end[node]["running"] or end[node]["serving_epoch"] != start[node]["epoch"]
        ):
            problems.append(f"{node}'s producer did not keep serving: {end[node]}")
    for o in outcomes:
        if not o.park_ok or o.node not in start:
            continue
        # The handle names the producer as its node advertises it, in the epoch it started with.
        if o.handle_producer != start[o.node]["advertised"]:
            problems.append(f"{o.request_id}: the handle names {o.handle_producer}")
        if o.handle_epoch != start[o.node]["epoch"]:
            problems.append(f"{o.request_id}: parked under epoch {o.handle_epoch}, not the start's")

    for node, park in summary["rest_parks"].items():
        if node == killed and (park["ok"] or park["reason"] not in TRANSPORT_REASONS):
            problems.append(f"{node}: the rest of its streamed request: {park}, expected a failure")
        elif node != killed and not park["ok"]:
            problems.append(f"{node}: could not park the rest of its streamed request: {park}")

    # The decode workers' own metrics (ConsumerMetrics) count the same loads and fallbacks.
    stats = summary["decode_stats"].values()
    loads = sum(sum(s["loads"].values()) for s in stats)
    fallbacks = sum(sum(s["fallbacks"].values()) for s in stats)
    handed = [o for o in outcomes if o.park_ok and o.error is None]
    if loads != len(handed) or fallbacks != sum(o.path != "remote" for o in handed):
        problems.append(f"decode metrics count {loads} loads, {fallbacks} fallbacks: {stats}")

    # Nothing else disturbed: every decode worker still served after the kill.
    after = {o.worker for o in outcomes if o.phase == "after" and o.verified}
    for worker in summary["decode_stats"]:
        if worker not in after:
            problems.append(f"{worker} served no request after the kill")
    return problems


def _slowest(outcomes: list[Outcome], phase: str) -> str:
    group = [o.fallback_s for o in outcomes if o.phase == phase and o.fallback_s is not None]
    return _ms(max(group)) if group else "-"


def node_lines(summary: dict[str, Any], outcomes: list[Outcome]) -> list[str]:
    """One line per node: what happened to its producer and to its requests."""
    killed, kill = summary["killed_node"], summary["kill"]
    lines = []
    for node in summary["nodes"]:
        mine = [o for o in outcomes if o.node == node]
        remote = sum(o.path == "remote" for o in mine)
        if node == killed:
            lines.append(
                f"{node}: producer pid {kill['pid']} {kill['exit']} (waitpid); "
                f"{sum(o.path in ('partial', 'recompute') for o in mine)} of {len(mine)} "
                "requests fell back: the load in flight "
                f"ended {_slowest(mine, 'streamed')} after the SIGKILL, queued loads within "
                f"{_slowest(mine, 'queued')}, later parks failed within {_slowest(mine, 'after')} "
                f"(bound {summary['load_timeout_s'] + MARGIN_S:g} s)"
            )
        else:
            status = summary["producers_at_end"][node]
            if status["serving_epoch"] == summary["producers_at_start"][node]["epoch"]:
                how = f"served throughout (epoch {status['serving_epoch']:016x}, as at the start)"
            else:
                how = f"did NOT serve throughout ({status['exit'] or 'another epoch'})"
            lines.append(
                f"{node}: producer pid {status['pid']} {how}; {remote} of {len(mine)} requests "
                "remote"
            )
    return lines


def verdict(summary: dict[str, Any], outcomes: list[Outcome], problems: list[str]) -> str:
    """The last line: `fleet: ok ...` or `fleet: FAILED ...`."""
    if problems:
        shown = "; ".join(problems[:8])
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        return f"fleet: FAILED ({len(problems)} problems): {shown}{more}"
    parts = []
    for node in summary["nodes"]:
        paths = [o.path for o in outcomes if o.node == node]
        counts = [f"{paths.count(p)} {p}" for p in ("remote", "partial", "recompute") if p in paths]
        if node == summary["killed_node"]:
            fallbacks = [o.fallback_s for o in outcomes if o.fallback_s is not None]
            counts.append(
                f"fallbacks within {_ms(max(fallbacks, default=0.0))} "
                f"(bound {summary['load_timeout_s'] + MARGIN_S:g} s)"
            )
            parts.append(f"{node} (producer SIGKILLed) {', '.join(counts)}")
        else:
            parts.append(f"{node} {', '.join(counts)}")
    return f"fleet: ok {len(outcomes)} requests, none lost, every byte verified; " + "; ".join(
        parts
    )
