"""`python -m benchmarks.callfloor`: what a load's own gRPC call costs, against one exchange on
a call kept open.

Every kvpark load is one Fetch call, whatever carries its bytes. On a host whose cores the
producer shares with its consumers (this machine: 2 cores), every CPU second a load spends
outside its bytes is taken from the bytes of the loads running beside it, which is why sixteen
loads at once fall short of one load of them all (docs/performance.md, section 6). This
diagnostic measures that fixed cost with no kvpark code in the path, on the bare grpc.aio
server of grpcfloor.py (a process of its own) and a sync channel with `KVConsumer`'s options,
the two ways a load's control could travel:

    call      one unary-stream call per load, answered with two small messages (a TCP
              fetch's DataOffer and TransferDone): today's shape
    session   the same request and two answers as one exchange on a stream-stream call kept
              open: the floor of loads multiplexed on a long-lived call

Printed per load: wall time, this process's CPU, the server's CPU (from /proc) and both
together, medians over `--rounds` rounds of `--calls` loads, the two ways interleaved. It is
not part of `python -m benchmarks`.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from .env import MiB, cpu_seconds
from .grpcfloor import DONE, EXCHANGE, OFFER, SESSION, FloorServer, consumer_channel_options
from .report import VerificationError

CALL_TIMEOUT_S = 10.0  # one exchange on loopback takes about a millisecond; this bounds a hang
WARM_UP_CALLS = 100  # the first calls set up the connection and warm both processes' caches
Way = Callable[[grpc.Channel, int], None]


def calls(channel: grpc.Channel, count: int) -> None:
    """`count` loads, each its own unary-stream call."""
    call = channel.unary_stream(EXCHANGE)
    for _ in range(count):
        answers = list(call(b"load", timeout=CALL_TIMEOUT_S))
        if answers != [OFFER, DONE]:
            raise VerificationError(f"a call answered {answers!r}")


def session(channel: grpc.Channel, count: int) -> None:
    """`count` loads, each one exchange on the same stream-stream call."""
    requests: queue.Queue[bytes | None] = queue.Queue()

    def fed() -> Iterator[bytes]:
        while (request := requests.get()) is not None:
            yield request

    answers = channel.stream_stream(SESSION)(fed(), timeout=CALL_TIMEOUT_S + count)
    try:
        for _ in range(count):
            requests.put(b"load")
            got = (next(answers), next(answers))
            if got != (OFFER, DONE):
                raise VerificationError(f"an exchange answered {got!r}")
    finally:
        requests.put(None)  # the call's requests end, and so does the call
        answers.cancel()  # after its last answer: a no-op; after a failure: ends it now


def measure(
    way: Way, channel: grpc.Channel, count: int, server_pid: int
) -> tuple[float, float, float]:
    """(wall, this process's CPU, the server's CPU) seconds per load."""
    wall, cpu, peer = time.perf_counter(), time.process_time(), cpu_seconds(server_pid)
    way(channel, count)
    return (
        (time.perf_counter() - wall) / count,
        (time.process_time() - cpu) / count,
        (cpu_seconds(server_pid) - peer) / count,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.callfloor", description=__doc__)
    parser.add_argument("--calls", type=int, default=1000, help="loads per round (default 1000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each way (default 5)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    ways: dict[str, Way] = {"call": calls, "session": session}
    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
    server = FloorServer(MiB)  # the pattern is not used: the answers are fixed
    try:
        options = consumer_channel_options(MiB)
        with grpc.insecure_channel(server.ready(), options=options) as channel:
            for way in ways.values():
                way(channel, WARM_UP_CALLS)
            for _ in range(args.rounds):
                for name, way in ways.items():
                    figures[name].append(measure(way, channel, args.calls, server.pid))
    finally:
        server.close()
    print(f"per load, medians of {args.rounds} rounds of {args.calls}:")
    print(f"{'':8} {'wall':>8} {'client CPU':>11} {'server CPU':>11} {'both':>8}")
    for name, rows in figures.items():
        wall, client, peer = (statistics.median(row[i] for row in rows) for i in range(3))
        both = statistics.median(row[1] + row[2] for row in rows)
        print(
            f"{name:8} {wall * 1e3:6.2f}ms {client * 1e3:9.2f}ms {peer * 1e3:9.2f}ms "
            f"{both * 1e3:6.2f}ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
