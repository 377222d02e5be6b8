"""`kvpark bench`: its options, and one run from start to exit status. By default it measures a
producer of its own (processes.py), sized for one transfer and stopped at the end; `--target`
measures an existing one, with the park and fetch tokens (files, or KVPARK_PARK_TOKEN and
KVPARK_FETCH_TOKEN) and the other commands' TLS options. KVPARK_TARGET alone does not select
one: pushing hundreds of MB through a serving producer's pool is for an operator to ask for by
name. Progress goes to stderr; the table, or with --json the JSON document, to stdout. Exit
status: 0 the run completed with every byte verified (speed is reported, not judged); 1 a
byte, a CRC or an outcome was wrong, or a section could not run; 2 usage; 143 (128 + SIGTERM)
stopped by SIGTERM, after stopping its own producer and helpers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy

from kvpark.checksum import IMPLEMENTATION as CRC32C_IMPLEMENTATION
from kvpark.producer.pool import DEFAULT_PAGE_BYTES
from kvpark.version import __version__

from .._channel import DEFAULT_MAX_CHUNK_BYTES
from .._errors import UsageError
from .._models import ProducerInfo
from .._sync import KVConsumer
from ..cli_connect import ClientTls
from ..parker import KVParker
from . import report, sections
from .late_fetcher import ProberArgs
from .processes import OwnProducer, sigterm_as_exit
from .transports import DEFAULT_TRANSPORTS, TRANSPORTS

HELP = "measure park and fetch against raw TCP, and late fetches, on our own producer or --target"
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
FULL, QUICK = (580_000_000, 5, 1000), (64_000_000, 2, 200)  # size, reps, latency tries


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]i?b|b)?", text.strip(), re.IGNORECASE)
    value = int(float(match[1]) * _UNITS[(match[2] or "b").lower()]) if match else 0
    if not 1 <= value <= 2**40:
        raise argparse.ArgumentTypeError(f"expected a size such as 580MB or 1MiB, got {text!r}")
    return value


def _sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",")]


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {text!r}")
    return int(text)


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--size", type=parse_size, help="bytes per transfer (default 580MB, --quick 64MB)")
    add("--chunk", type=_sizes, action="extend", metavar="SIZE[,SIZE...]",
        help="chunk size(s) (default 1MiB)")  # fmt: skip
    add("--reps", type=_count, help="repetitions of each transfer (default 5, --quick 2)")
    add("--latency-tries", type=_count, metavar="N",
        help="Lookups and late fetches, each (default 1000, --quick 200)")  # fmt: skip
    add("--quick", action="store_true", help="small and fast: a smoke check, not a result")
    add("--transport", action="append", choices=sorted(TRANSPORTS),
        help="transport(s) to measure, one row each (default: every one the producer "
             f"offers of {', '.join(DEFAULT_TRANSPORTS)})")  # fmt: skip
    add("--park-token-file", type=Path, metavar="FILE",
        help="with --target: the park token (or env KVPARK_PARK_TOKEN)")  # fmt: skip
    add("--fetch-token-file", type=Path, metavar="FILE",
        help="with --target: the fetch token (or KVPARK_FETCH_TOKEN, --token-file)")  # fmt: skip
    add("--json-file", type=Path, metavar="PATH", help="also write the JSON document here")
    add("--quiet", action="store_true", help="no progress on stderr")


def plan_from_args(args: argparse.Namespace) -> sections.Plan:
    size, reps, tries = QUICK if args.quick else FULL
    chunks = tuple(dict.fromkeys(args.chunk or [2**20]))
    transports = tuple(dict.fromkeys(args.transport or DEFAULT_TRANSPORTS))
    return sections.Plan(args.size or size, chunks, args.reps or reps,
                         args.latency_tries or tries, transports, args.quick)  # fmt: skip


def _token(path: Path | None, env: str) -> str | None:
    try:
        return (path.read_text("utf-8") if path else os.environ.get(env, "")).strip() or None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the token in {path}: {exc}") from None


def client_args(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Connection arguments of the KVParker and of the KVConsumer."""
    tls_options = (args.tls, args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    if not args.target_given:
        if any(tls_options) or args.park_token_file or args.fetch_token_file or args.token_file:
            raise UsageError("tokens and TLS go with --target: our own producer has neither")
        return {}, {}
    # The other commands' TLS, data connection included: without it the tcp row would fall
    # back to the gRPC stream against a TLS producer.
    tls = ClientTls.from_args(args)
    fetch = _token(args.fetch_token_file, "KVPARK_FETCH_TOKEN")
    fetch = fetch or _token(args.token_file, "KVPARK_TOKEN")
    park = _token(args.park_token_file, "KVPARK_PARK_TOKEN")
    return {"token": park, **tls.channel_args()}, {"token": fetch, **tls.consumer_args()}


def own_pool_bytes(plan: sections.Plan) -> int:
    """Room for one transfer (each chunk takes whole pool pages), the latency id, a margin."""
    pages = [-(-plan.size // c) * -(-c // DEFAULT_PAGE_BYTES) for c in plan.chunks]
    return max(pages) * DEFAULT_PAGE_BYTES + 16 * 2**20


def check_fits(plan: sections.Plan, info: ProducerInfo) -> None:
    if plan.size > info.max_batch_bytes or max(plan.chunks) > info.max_chunk_bytes:
        raise UsageError(
            f"the producer takes batches up to {info.max_batch_bytes} bytes, "
            f"chunks up to {info.max_chunk_bytes}: lower --size or --chunk"
        )
    if info.pool_free_bytes < plan.size:
        raise RuntimeError(f"the pool has {info.pool_free_bytes} bytes free, not {plan.size}")


def offered_transports(
    info: ProducerInfo, wanted: tuple[str, ...], *, explicit: bool
) -> tuple[str, ...]:
    """The wanted transports the producer offers. One asked for by name that it does not
    offer is an error; the default set just shrinks to what is there."""
    offers = {"grpc": True, "tcp": bool(info.data_address), "shm": bool(info.shm_socket)}
    missing = [name for name in wanted if not offers[name]]
    if missing and explicit:
        raise RuntimeError(f"the producer does not offer {', '.join(missing)}")
    return tuple(name for name in wanted if offers[name])


def check_writable(path: Path) -> None:
    """Fails before the benchmark runs, rather than after minutes of it, when the JSON document
    could not be written to `path`. Appending creates no content and truncates nothing; a file
    created only to find that out is removed again."""
    existed = os.path.lexists(path)
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise UsageError(f"--json-file: cannot write {path}: {exc.strerror}") from None
    if not existed:
        path.unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    # SIGTERM (a job's timeout, a container stopping) ends the run through its clean-up.
    with sigterm_as_exit():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    park_args, fetch_args = client_args(args)
    if args.json_file is not None:
        check_writable(args.json_file)
    started = time.monotonic()

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    own: OwnProducer | None = None
    work = sections.Run(plan, {}, None, progress)
    failures: list[str] = []
    info: ProducerInfo | None = None
    target = args.target if args.target_given else None
    try:
        if target is None:
            progress("starting our own producer (python -m kvpark.producer)")
            own = OwnProducer(own_pool_bytes(plan), max(*plan.chunks, 2**20))
            target, work.producer_pid = own.target, own.pid
        work.target = target
        work.prober_args = ProberArgs(
            token=fetch_args.get("token"),
            tls_ca=getattr(args, "tls_ca", None),
            tls_key=getattr(args, "tls_key", None),
            tls_cert=getattr(args, "tls_cert", None),
            tls=fetch_args.get("credentials") is not None,
            server_name=getattr(args, "tls_server_name", None),
        )
        # The clients' default room, unless a chunk needs more: a limit below the producer's
        # own would only earn a warning.
        limit = max(*plan.chunks, DEFAULT_MAX_CHUNK_BYTES)
        for name in plan.transports:
            t = TRANSPORTS[name]
            work.clients[name] = (
                KVParker(target, max_chunk_bytes=limit, **park_args, **t.parker_args),
                KVConsumer(target, max_chunk_bytes=limit, **fetch_args, **t.consumer_args),
            )
        info = work.clients[plan.transports[0]][1].server_info(timeout=args.rpc_timeout)
        check_fits(plan, info)
        offered = offered_transports(info, plan.transports, explicit=bool(args.transport))
        for name in set(plan.transports) - set(offered):
            progress(f"{name}: not offered by this producer, left out")
            for client in work.clients.pop(name):
                client.close()
        work.plan = plan = dataclasses.replace(plan, transports=offered)
        for name, section in (
            ("warm-up", sections.warm_up),
            ("transfer", sections.transfer),
            ("concurrent", sections.concurrent),
            ("latency", sections.latency),
        ):
            try:
                section(work)
            except sections.Check as exc:
                failures.append(f"{name}: wrong answer: {exc}")
            except Exception as exc:  # this section could not run: reported, exit 1
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
    except UsageError:
        raise
    except Exception as exc:
        failures.append(f"set-up: {type(exc).__name__}: {exc}")
    finally:
        for parker, consumer in work.clients.values():
            parker.close()
            consumer.close()
        if own is not None and own.stop() not in (0, None):
            failures.append(f"our producer exited {own.proc.returncode}")
    meta = {"ok": not failures, "failures": failures, "verified_bytes": work.verified_bytes,
            "elapsed_s": time.monotonic() - started,
            "plan": {"size_bytes": plan.size, "chunk_bytes": plan.chunks, "reps": plan.reps,
                     "latency_tries": plan.latency_tries, "transports": plan.transports,
                     "quick": plan.quick},
            "producer": {"own": not args.target_given, "target": target, "pid": work.producer_pid,
                         "version": info.version if info else None},
            "versions": {"python": platform.python_version(), "grpcio": grpc.__version__,
                         "numpy": numpy.__version__, "kvpark": __version__,
                         "crc32c": CRC32C_IMPLEMENTATION},
            "cpus": os.cpu_count()}  # fmt: skip
    doc = report.document(meta, work.rows, plan.size)
    text = json.dumps(doc, indent=2)
    print(text if args.json else report.table(doc))
    if args.json_file is not None:
        try:
            args.json_file.write_text(text + "\n")
        except OSError as exc:
            print(f"kvpark bench: cannot write {args.json_file}: {exc.strerror}", file=sys.stderr)
            return 1
    return 0 if doc["ok"] else 1
