"""Late-fetch rejection latency and the unary Lookup round trip, from a separate process.

The prober is a client of its own (`python -m benchmarks.prober TARGET`), so its latencies are
not inflated by this process's GIL while the benchmark streams data, and it uses the ordinary
generated stubs — the way a decode worker in any language would see the producer. Commands,
one per stdin line, each answered by one JSON line on stdout:

- `idle N KID` — N rounds of (one unary Lookup, one late Fetch of KID), back to back and
  interleaved so both share the same conditions; answers `{"lookup": [...], "reject": [...]}`
  in seconds.
- `loaded KID GAP_S` — late Fetches of KID every GAP_S seconds (at least one) until a `stop`
  line; answers `{"started": true}` at once, then `{"reject": [...]}`.

(The line protocol is helper.py's.)

A late Fetch must be answered with exactly one message, `TransferDone{STATUS_FAILED,
REASON_REAPED}`; anything else is reported as `{"error": ...}` and fails the run.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc

from .helper import Answer, answer_commands, repeat_until, run_until_stop


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
    return {"reject": repeat_until(stop, gap_s, lambda: _late_fetch(stub, kid))}


def main(argv: Sequence[str]) -> int:
    target = argv[0]
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KVProducerStub(channel)
        grpc.channel_ready_future(channel).result(timeout=30)

        def loaded(args: Sequence[str], lines: Iterator[str]) -> Answer:
            return run_until_stop(functools.partial(_loaded, stub, args[0], float(args[1])), lines)

        answer_commands(
            {"idle": lambda args, _: _idle(stub, int(args[0]), args[1]), "loaded": loaded},
            (_WrongAnswer, grpc.RpcError),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
