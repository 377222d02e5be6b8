"""`python -m benchmarks.acceptfloor`: late-call latency while 16 streams run, on bare grpcio.

kvpark's late fetch is answered in about a millisecond when the producer is idle, but takes up
to ~0.5 s while 16 fetch streams run (docs/performance.md). This diagnostic reproduces that
with no kvpark code in the path, so the docs can cite a measurement that anyone can rerun and
that says whose delay it is. It is not part of `python -m benchmarks`.

Processes, all started here and stopped (by their pid) before it exits:

- a LOADED server and an IDLE server, both the minimal `grpc.aio` server of grpcfloor.py;
- this process: `--streams` threads sharing one sync channel (a `KVConsumer`'s options) each
  stream the same `--stream-bytes` window from the loaded server in `--message-bytes`
  messages, every byte verified — a round; aggregate = all bytes / the round's wall time;
- a prober process (`python -m benchmarks.acceptfloor probe`, a plain channel, like kvpark's
  prober) that sends one late call every `--gap-ms` while a round runs: to the loaded server
  in odd rounds and to the idle server in even ones, so both see the same machine load.

Each late call is answered with one message holding the server's `time.time()` at handler
entry, which splits its latency (both clocks are this machine's):

    total     client send .. client receive
    accept    client send .. server handler entry: connection, HTTP/2 and grpc's call setup
              on both sides, and the wait for the server's event loop to start the handler
    delivery  server handler entry .. client receive: the answer's way back

Printed: p50 and p99 (spread: p99..max) of each, loaded beside idle (the loaded rows carry the
ratio to the idle ones), and the aggregate throughput. A first experiment (2026-11-30) found the
loaded p99 at 100-500 ms, almost all of it in `accept`, and the idle p99 ~15 ms on the same
machine: the delay is grpcio's, before any handler runs.

Bounded: every stream has `--round-timeout-s` as its deadline, every late call 10 s, every
answer of a helper a deadline of its own. Exit 0 when it ran with every byte verified, 1 when
a byte or an answer was wrong or a helper failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from . import data
from .clients import zeroed
from .env import CpuMeter, MiB
from .grpcfloor import LATE, FloorClient, FloorServer
from .helper import Answer, JsonLineChild, answer_commands, repeat_until, run_until_stop
from .report import (
    Figure,
    VerificationError,
    latency,
    render_table,
    set_ratio,
    throughput,
    write_json,
)
from .transfer import check_loaded, threaded_batch

SERVERS = ("loaded", "idle")
METRICS = ("total", "accept", "delivery")  # the fields of one try, in this order
# A late call is answered in milliseconds even under load; this only bounds a hung server.
LATE_TIMEOUT_S = 10.0
# Bounds each answer of the prober (its start, and its tries once told to stop).
PROBER_ANSWER_S = 30.0

Try = tuple[float, float, float]  # seconds: total, accept, delivery


@dataclass(frozen=True)
class Settings:
    """One diagnostic run: the load of each round and the probe."""

    rounds: int = 6
    streams: int = 16
    stream_bytes: int = 36_000_000  # 16 x 36 MB: the benchmark's concurrency section
    message_bytes: int = 4 * MiB
    gap_s: float = 0.002
    round_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.rounds < 2:
            raise ValueError("rounds: at least 2 (one probing the loaded, one the idle server)")
        for name in ("streams", "stream_bytes", "message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if not self.gap_s >= 0 or not self.round_timeout_s > 0:
            raise ValueError("gap_s must be >= 0 and round_timeout_s > 0")

    def server_of_round(self, rnd: int) -> str:
        return SERVERS[rnd % 2]


@dataclass
class Results:
    # server ("loaded"/"idle") -> every late call's (total, accept, delivery) seconds
    tries: dict[str, list[Try]] = field(default_factory=lambda: {s: [] for s in SERVERS})
    aggregate_s: list[float] = field(default_factory=list)  # one round's wall time each
    cpu: dict[str, float] = field(default_factory=dict)  # env.CpuMeter over the rounds


# ================================================================================ the prober
class _LateCaller:
    """Late calls to one server on a plain channel, as a client of any language would."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._late = self._channel.unary_stream(LATE)
        grpc.channel_ready_future(self._channel).result(timeout=30)
        self.once()  # the channel's first call sets it up: not a try

    def once(self) -> Try:
        sent = time.time()
        started = time.perf_counter()
        replies = list(self._late(b"", timeout=LATE_TIMEOUT_S))
        total = time.perf_counter() - started
        received = time.time()
        if len(replies) != 1:
            raise _WrongAnswer(f"late call answered {len(replies)} messages, expected 1")
        entry = float(replies[0])
        return total, entry - sent, received - entry


class _WrongAnswer(Exception):
    pass


def probe_main() -> int:
    """The prober process: `late TARGET GAP_S` probes TARGET until `stop`; answers
    `{"started": true}`, then `{"tries": [[total, accept, delivery], ...]}`."""
    callers: dict[str, _LateCaller] = {}

    def late(args: Sequence[str], lines: Iterator[str]) -> Answer:
        target, gap_s = args[0], float(args[1])
        caller = callers.get(target) or callers.setdefault(target, _LateCaller(target))
        return run_until_stop(lambda stop: {"tries": repeat_until(stop, gap_s, caller.once)}, lines)

    answer_commands({"late": late}, (_WrongAnswer, grpc.RpcError))
    return 0


# ================================================================================= the run
def measure(settings: Settings, progress: Any) -> Results:
    s = settings
    out = Results()
    source = data.pattern(data.source_size(s.stream_bytes, 0))
    payload = data.window(source, 0, s.stream_bytes)
    with contextlib.ExitStack() as owned:
        progress("starting the loaded and the idle server and the prober")
        servers: dict[str, FloorServer] = {}
        for which, pattern_bytes in (("loaded", len(source)), ("idle", 0)):
            servers[which] = FloorServer(pattern_bytes)
            owned.callback(servers[which].close)
        prober = JsonLineChild("acceptfloor", ["probe"])
        owned.callback(prober.close)
        client = FloorClient(servers["loaded"].ready(), s.message_bytes)
        owned.callback(client.close)
        request, count = client.prepare(0, s.stream_bytes, s.message_bytes)
        batch, stop_threads = threaded_batch(client, s.streams, s.round_timeout_s)
        owned.callback(stop_threads)
        dests = [zeroed(s.stream_bytes) for _ in range(s.streams)]
        # The channel's first stream sets it up: not a round.
        check_loaded(request, client.load(request, count, dests[0], s.round_timeout_s), count,
                     dests[0], payload)  # fmt: skip
        meter = CpuMeter()
        for rnd in range(s.rounds):
            which = s.server_of_round(rnd)
            for dest in dests:
                dest.fill(0)
            started = prober.ask(f"late {servers[which].ready()} {s.gap_s}", PROBER_ANSWER_S)
            if not started.get("started"):
                raise RuntimeError(f"prober did not start: {started}")
            try:
                results, seconds = batch([request] * s.streams, [count] * s.streams, dests)
            finally:
                answer = prober.ask("stop", PROBER_ANSWER_S)
            tries: list[Try] = [(t[0], t[1], t[2]) for t in answer["tries"]]
            for result, dest in zip(results, dests, strict=True):
                check_loaded(request, result, count, dest, payload)
            out.aggregate_s.append(seconds)
            out.tries[which] += tries
            worst = max(t[0] for t in tries)
            progress(f"round {rnd + 1}/{s.rounds}: {s.streams} streams at "
                     f"{s.streams * s.stream_bytes / seconds / 1e9:.2f} GB/s; {len(tries)} late "
                     f"calls to the {which} server, slowest {worst * 1e3:.1f} ms")  # fmt: skip
        out.cpu = meter.stop()
    return out


def figures(settings: Settings, results: Results) -> list[Figure]:
    s = settings
    total = s.streams * s.stream_bytes
    out = [throughput(
        "acceptfloor_aggregate_gbps",
        f"bare gRPC, {s.streams} streams x {s.stream_bytes / 1e6:g} MB, aggregate", total,
        results.aggregate_s,
    )]  # fmt: skip
    for i, metric in enumerate(METRICS):
        for q in (50, 99):
            rows: dict[str, Figure] = {}
            for which in SERVERS:
                seconds = [t[i] for t in results.tries[which]]
                rows[which] = latency(f"acceptfloor_{which}_{metric}_p{q}_ms",
                                      f"late call {metric}, {which} server", seconds, q,
                                      unit="ms")  # fmt: skip
            set_ratio(rows["loaded"], rows["idle"])
            out += [rows["loaded"], rows["idle"]]
    return out


# ==================================================================================== main
def _parser() -> argparse.ArgumentParser:
    d = Settings()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.acceptfloor",
        description="Late-call latency on a bare grpc.aio server while it streams to 16 "
        "threads, beside an idle one: accept vs delivery (no kvpark code in the path).",
    )
    parser.add_argument("--rounds", type=int, default=d.rounds, help="load rounds, >= 2; late "
                        "calls alternate between the loaded and the idle server")  # fmt: skip
    parser.add_argument("--streams", type=int, default=d.streams)
    parser.add_argument("--stream-bytes", type=int, default=d.stream_bytes)
    parser.add_argument("--message-bytes", type=int, default=d.message_bytes)
    parser.add_argument("--gap-ms", type=float, default=d.gap_s * 1e3,
                        help="pause between late calls")  # fmt: skip
    parser.add_argument("--round-timeout-s", type=float, default=d.round_timeout_s,
                        help="deadline of every stream of a round")  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["probe"]:
        return probe_main()
    parser = _parser()
    ns = parser.parse_args(args)
    try:
        settings = Settings(
            rounds=ns.rounds, streams=ns.streams, stream_bytes=ns.stream_bytes,
            message_bytes=ns.message_bytes, gap_s=ns.gap_ms / 1e3,
            round_timeout_s=ns.round_timeout_s,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))  # exits 2
    from kvpark.alloc import tune_allocator

    from .cli import Progress

    tune_allocator()  # as every process of the benchmark (env.py)
    progress = Progress(quiet=ns.quiet)
    try:
        results = measure(settings, progress)
    except VerificationError as exc:
        print(f"VERIFICATION FAILED: {exc}")
        return 1
    except RuntimeError as exc:  # a helper failed or did not answer in time
        print(f"ERROR: {exc}")
        return 1
    rows = figures(settings, results)
    print(_header(settings, results, progress.elapsed))
    print(render_table(rows))
    if ns.json is not None:
        meta = {"settings": asdict(settings), "grpcio": grpc.__version__,
                "python": platform.python_version(), "cpu": results.cpu}  # fmt: skip
        write_json(ns.json, meta, rows, tries=results.tries, aggregate_s=results.aggregate_s)
        progress(f"wrote {ns.json}")
    return 0


def _header(settings: Settings, results: Results, elapsed: float) -> str:
    s = settings
    per_server = ", ".join(f"{len(results.tries[w])} to the {w} server" for w in SERVERS)
    return (
        f"\nbare grpcio {grpc.__version__}, python {platform.python_version()}: "
        f"{s.rounds} rounds of {s.streams} streams x {s.stream_bytes / 1e6:g} MB in "
        f"{s.message_bytes / MiB:g} MiB messages; a late call every {s.gap_s * 1e3:g} ms "
        f"({per_server}); other work on the machine: "
        f"{results.cpu.get('other_cores', float('nan')):.2f} cores; {elapsed:.1f} s\n"
    )


if __name__ == "__main__":
    sys.exit(main())
