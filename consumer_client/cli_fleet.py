"""`kvpark info` and `kvpark lookup` across several producers: one table, one row per producer
(info) or per producer and id (lookup).

Every target is asked at once, on a thread of its own, each call under `--rpc-timeout`, so
dead producers cost one timeout together rather than one each. A producer that does not answer
gets a row with its gRPC status (UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED, ...) instead
of hiding the others, and one line on stderr with the whole error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

from ._core import valid_ids
from ._errors import RPCError
from ._models import IdStatus
from .cli_connect import Connection
from .cli_format import human_bytes, percent, table
from .cli_snapshot import Snapshot

T = TypeVar("T")

# Threads asking at once; more targets than this wait for a free thread, so a fleet of dead
# producers costs one --rpc-timeout per this many of them.
MAX_PARALLEL = 64

INFO_HEADER = (
    "TARGET", "STATUS", "EPOCH", "VERSION", "POOL USED/SIZE", "PARKED", "BOUND", "DELIVERED",
    "TOMBSTONES", "PARK BATCHES", "TRANSPORTS", "ADVERTISE",
)  # fmt: skip
LOOKUP_HEADER = (
    "TARGET", "STATUS", "ID", "STATE", "REASON", "CHUNKS", "BYTES", "AGE", "LEASE",
    "FINGERPRINT",
)  # fmt: skip
OK = "ok"


@dataclass(frozen=True)
class Answer(Generic[T]):
    """One target's answer: a value, or the error that stood in for it."""

    target: str
    value: T | None
    error: RPCError | None

    @property
    def status(self) -> str:
        return OK if self.error is None else self.error.code.name


def ask_all(targets: Sequence[str], ask: Callable[[str], T]) -> list[Answer[T]]:
    """`ask(target)` for every target at once; answers in the targets' order. A call that did
    not get through becomes that target's error; anything else (a usage error) is raised."""
    answers: list[Answer[T]] = []
    with ThreadPoolExecutor(min(len(targets), MAX_PARALLEL), "kvpark-ask") as pool:
        futures = [pool.submit(ask, target) for target in targets]
        for target, future in zip(targets, futures, strict=True):
            try:
                answers.append(Answer(target, future.result(), None))
            except RPCError as exc:
                answers.append(Answer(target, None, exc))
    return answers


def report_failures(command: str, answers: Sequence[Answer[Any]]) -> int:
    """One stderr line per target that did not answer; returns how many did not."""
    failed = [a for a in answers if a.error is not None]
    for answer in failed:
        print(f"kvpark {command}: {answer.target}: {answer.error}", file=sys.stderr)
    if failed:
        print(
            f"kvpark {command}: {len(failed)} of {len(answers)} producers did not answer",
            file=sys.stderr,
        )
    return len(failed)


# -------------------------------------------------------------------------------- info
def read_all(
    connection: Connection, targets: Sequence[str], timeout_s: float
) -> list[Answer[Snapshot]]:
    def ask(target: str) -> Snapshot:
        with connection.reader(target) as reader:
            return reader.read(timeout_s)

    return ask_all(targets, ask)


def snapshot_fields(snapshot: Snapshot) -> dict[str, Any]:
    """Everything `kvpark info --json` shows of one producer."""
    return {
        **asdict(snapshot.info),
        "pool_used_bytes": snapshot.pool_used_bytes,
        "transports": snapshot.transports,
        "stats": None if snapshot.stats is None else asdict(snapshot.stats),
    }


def info_row(answer: Answer[Snapshot]) -> list[str]:
    snapshot = answer.value
    if snapshot is None:
        return [answer.target, answer.status, *["-"] * (len(INFO_HEADER) - 2)]
    info, stats = snapshot.info, snapshot.stats
    used = snapshot.pool_used_bytes
    pool = f"{human_bytes(used)}/{human_bytes(info.pool_bytes)} {percent(used, info.pool_bytes)}"
    states = ["-"] * 5
    if stats is not None:
        states = [
            str(n)
            for n in (
                stats.parked_ids,
                stats.bound_ids,
                stats.delivered_ids,
                stats.tombstones,
                stats.open_park_batches,
            )
        ]
    return [
        answer.target,
        OK,
        str(info.producer_epoch),
        info.version,
        pool,
        *states,
        ",".join(snapshot.transports),
        info.advertise_address or "-",
    ]


def fleet_info(args: argparse.Namespace, connection: Connection, targets: Sequence[str]) -> int:
    """Prints the info table (or JSON list); returns how many targets did not answer."""
    answers = read_all(connection, targets, args.rpc_timeout)
    if args.json:
        print(json.dumps([_info_json(a) for a in answers], default=str))
    else:
        print(table(INFO_HEADER, [info_row(a) for a in answers]))
    return report_failures("info", answers)


def _info_json(answer: Answer[Snapshot]) -> dict[str, Any]:
    if answer.value is None:
        return {"target": answer.target, "ok": False, **_error_json(answer)}
    return {"target": answer.target, "ok": True, **snapshot_fields(answer.value)}


def _error_json(answer: Answer[Any]) -> dict[str, Any]:
    return {"error": answer.status, "detail": str(answer.error)}


# ------------------------------------------------------------------------------ lookup
def lookup_row(target: str, s: IdStatus) -> list[str]:
    return [
        target,
        OK,
        s.kv_request_id,
        str(s.state),
        str(s.reason) if s.reason else "-",
        f"{s.chunks_parked}/{s.total_chunks or '?'}",
        human_bytes(s.bytes),
        f"{s.age_s:.1f}s",
        f"{s.lease_remaining_s:.1f}s" if s.lease_remaining_s else "-",
        s.fingerprint.hex() if s.fingerprint else "-",
    ]


def fleet_lookup(
    args: argparse.Namespace, connection: Connection, targets: Sequence[str], ids: Sequence[str]
) -> int:
    """Prints one row per (target, id) (or a JSON list); returns how many targets did not
    answer."""
    ids = valid_ids(ids)  # a bad id is a usage error before any target is asked

    def ask(target: str) -> list[IdStatus]:
        with connection.consumer(target) as client:
            return client.lookup(ids, timeout=args.rpc_timeout)

    answers = ask_all(targets, ask)
    rows: list[list[str]] = []
    documents: list[dict[str, Any]] = []
    for answer in answers:
        if answer.value is None:
            for kid in ids:
                rows.append([answer.target, answer.status, kid, *["-"] * 7])
                documents.append(
                    {"target": answer.target, "kv_request_id": kid, "ok": False,
                     **_error_json(answer)}
                )  # fmt: skip
            continue
        for status in answer.value:
            rows.append(lookup_row(answer.target, status))
            documents.append({"target": answer.target, "ok": True, **status.as_json()})
    print(json.dumps(documents, default=str) if args.json else table(LOOKUP_HEADER, rows))
    return report_failures("lookup", answers)
