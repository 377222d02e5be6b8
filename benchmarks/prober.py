"""Late-fetch rejection latency and the unary Lookup round trip, from a separate process.

The prober is a client of its own (`python -m benchmarks.prober TARGET`), so its latencies are
not inflated by this process's GIL while the benchmark streams data, and it uses the ordinary
generated stubs — the way a decode worker in any language would see the producer. Commands,
one per stdin line, each answered by one JSON line on stdout:

- `idle N KID` — N rounds of (one unary Lookup, one late Fetch of KID), back to back and
  interleaved so both share the same conditions; answers `{"lookup": [...], "reject": [...]}`
  in seconds.
- `loaded KID GAP_S` — late Fetches of KID every GAP_S seconds until a `stop` line; answers
  `{"reject": [...]}`.

A late Fetch must be answered with exactly one message, `TransferDone{STATUS_FAILED,
REASON_REAPED}`; anything else is reported as `{"error": ...}` and fails the run.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from shared.pb import kvpark_pb2 as pb
from shared.pb import kvpark_pb2_grpc as pb_grpc

Answer = dict[str, Any]


class _WrongAnswer(Exception):
    pass


def _late_fetch(stub: pb_grpc.KVProducerStub, kid: str) -> float:
    started = time.perf_counter()
    replies = list(stub.Fetch(pb.FetchRequest(kv_request_id=kid), timeout=10))
    elapsed = time.perf_counter() - started
    if (
        len(replies) != 1
        or replies[0].WhichOneof("kind") != "done"
        or replies[0].done.status != pb.STATUS_FAILED
        or replies[0].done.reason != pb.REASON_REAPED
    ):
        raise _WrongAnswer(f"late fetch of {kid!r} answered {replies!r}")
    return elapsed


def _lookup(stub: pb_grpc.KVProducerStub, kid: str) -> float:
    started = time.perf_counter()
    reply = stub.Lookup(pb.LookupRequest(kv_request_ids=[kid]), timeout=10)
    elapsed = time.perf_counter() - started
    if len(reply.states) != 1 or reply.states[0].kv_request_id != kid:
        raise _WrongAnswer(f"lookup of {kid!r} answered {reply!r}")
    return elapsed


def _idle(stub: pb_grpc.KVProducerStub, n: int, kid: str) -> Answer:
    lookups: list[float] = []
    rejects: list[float] = []
    for _ in range(n):
        lookups.append(_lookup(stub, kid))
        rejects.append(_late_fetch(stub, kid))
    return {"lookup": lookups, "reject": rejects}


def _loaded(stub: pb_grpc.KVProducerStub, kid: str, gap_s: float, stop: threading.Event) -> Answer:
    rejects: list[float] = []
    while not stop.is_set():
        rejects.append(_late_fetch(stub, kid))
        stop.wait(gap_s)
    return {"reject": rejects}


def main(argv: Sequence[str]) -> int:
    target = argv[0]
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KVProducerStub(channel)
        grpc.channel_ready_future(channel).result(timeout=30)
        lines = iter(sys.stdin.readline, "")
        for line in lines:
            parts = line.split()
            if not parts:
                continue
            answer: Answer
            try:
                if parts[0] == "idle":
                    answer = _idle(stub, int(parts[1]), parts[2])
                elif parts[0] == "loaded":
                    work = functools.partial(_loaded, stub, parts[1], float(parts[2]))
                    answer = _run_until_stop(work, lines)
                else:
                    answer = {"error": f"unknown command {parts[0]!r}"}
            except (_WrongAnswer, grpc.RpcError) as exc:
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)
    return 0


def _run_until_stop(work: Callable[[threading.Event], Answer], lines: Iterator[str]) -> Answer:
    """Runs `work` in a thread until a `stop` line arrives on stdin (or stdin closes)."""
    stop = threading.Event()
    result: list[Answer] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work(stop))
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    print(json.dumps({"started": True}), flush=True)
    for line in lines:
        if line.strip() == "stop":
            break
    stop.set()
    thread.join(timeout=30)
    if errors:
        return {"error": f"{type(errors[0]).__name__}: {errors[0]}"}
    return result[0] if result else {"error": "prober thread did not finish"}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
