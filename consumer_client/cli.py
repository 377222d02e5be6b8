"""`kvpark`: operator commands against producers, a thin layer over the client library.

    kvpark info [--target HOST:PORT ...] [--targets-file FILE]
    kvpark lookup ID [ID ...] [--target HOST:PORT ...] [--targets-file FILE]
    kvpark top [--interval SECONDS] [--count N]
    kvpark fetch ID [--chunks N | --chunk-ids 0,1,...] [--fingerprint HEX] --out FILE|-
                                                                     (consumes the id!)
    kvpark release ID
    kvpark bench [--target HOST:PORT] [--quick] [--size SIZE] [--chunk SIZE,...] [--json-file F]

Connection options (`--target HOST:PORT`, env KVPARK_TARGET; `--token-file`, env KVPARK_TOKEN;
`--tls`, `--tls-ca`, `--tls-cert` with `--tls-key`, `--tls-server-name`; `--rpc-timeout`) and
`--json` go before or after the command; the token and TLS options apply to every target. With
TLS the TCP data connection of a fetch uses the same files as the gRPC channel, and both check
the producer's certificate for `--tls-server-name` when given (gRPC's
`grpc.ssl_target_name_override`: one certificate shared by producers dialed by pod IP), else
for the target's host.

`kvpark info` and `kvpark lookup` take several producers: `--target` repeated and/or
`--targets-file` (one host:port per line, `#` comments, blank lines skipped). Then they ask all
of them at once, each call under `--rpc-timeout`, and print one table: a row per producer
(info) or per producer and id (lookup), with a STATUS column that is `ok` or the gRPC status of
a producer that did not answer (UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED, ...), whose
error is also printed on stderr. With one `--target` (or none) they print the single-producer
form: `key: value` lines (info) or tab-separated rows (lookup). `--json` prints a list of
objects in the table form and one object (info) or list (lookup) in the single form.

`kvpark top` watches one producer (cli_top.py): pool use, ids by state, and rates per second
of parks, fetches, reaps, late rejections and bytes between refreshes; on a terminal `q` quits
and any other key refreshes at once.

Subcommands live in one `CommandRegistry`. A command is a name, a help line, a function that
adds its arguments and a function that runs it and returns an exit code; `COMMANDS.add()` is
the only place they are registered, and `build_parser` is the only place argparse is told
about them. `kvpark bench` (kvpark.client.bench) is registered here like the others.

Exit codes: 0 success; 1 the producer answered with a failure (a fetch that did not load, a
release it refused, a request it called malformed), a fetch whose bytes could not all be
written to `--out` (the delivery is then not confirmed: the producer keeps the id for a retry
within its delivery grace; a file written in full whose confirm fails is 0, with a warning),
or, asking several producers, at least one of them did not answer (the others' rows are printed
all the same); 2 usage (bad arguments, a `--target` or KVPARK_TARGET that the client library
would refuse: not a dialable host:port nor a gRPC target, unreadable token file, a TLS file
that is not a PEM certificate or key, --tls-server-name without TLS, a bad line in the targets
file, several --target for a command that takes one); 3 the call did not get through
(unreachable, deadline, overloaded, auth, not a kvpark producer; for a fetch, a connection that
broke, or a load timeout or a call shed (RESOURCE_EXHAUSTED, ABORTED, CANCELLED) before any
chunk came back); 130 interrupted by Ctrl-C. A reader of stdout that goes away (`| head`) ends
a command quietly with 0, as it ends `kvpark top` (a `fetch --out -` whose payload it cut short
is 1, as above). `kvpark top`: 0 when ended by `q`, Ctrl-C or `--count`, except 3 when the last
refresh of a `--count` run did not reach the producer (while it runs, a producer that does not
answer is shown and asked again). `kvpark bench` has its own: 0 every byte verified, 1 a wrong
byte or outcome or a section that could not run (or its `--json-file` could not be written), 2
usage (a `--json-file` that cannot be written is found before the run), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from kvpark.alloc import tune_allocator
from kvpark.fingerprints import fingerprint_problem

from . import cli_fleet, cli_top
from ._errors import (
    KVParkError,
    RequestRejectedError,
    RPCError,
    TransportError,
    UsageError,
    classify_status,
)
from ._models import IdStatus
from ._result import LoadResult, Reason
from ._sync import KVConsumer
from ._timeouts import Timeout
from .bench import command as bench
from .cli_connect import (
    DEFAULT_TARGET,
    TARGET_ENV,
    TOKEN_ENV,
    Connection,
    TargetOption,
    given_targets,
    positive_seconds,
    server_name_option,
    target_option,
    targets_of,
)
from .cli_snapshot import Snapshot

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_RPC = 3
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # Takes several --target (and --targets-file); the others refuse more than one.
    many_targets: bool = False
    # Runs on the main thread because it handles Ctrl-C itself (it reads the terminal, or has
    # a process of its own to stop). The others run on a worker thread: see `_run_command`.
    on_main_thread: bool = False


class CommandRegistry:
    """The subcommands of `kvpark`, in registration order."""

    def __init__(self) -> None:
        self._commands: dict[str, Command] = {}

    def add(self, command: Command) -> Command:
        if command.name in self._commands:
            raise ValueError(f"kvpark subcommand {command.name!r} is registered twice")
        self._commands[command.name] = command
        return command

    def __iter__(self) -> Iterator[Command]:
        return iter(list(self._commands.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._commands

    def names(self) -> list[str]:
        return list(self._commands)


# ------------------------------------------------------------------------- common options
def _add_common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Connection options, accepted before the subcommand and after it (`kvpark info --target
    X`); after it they carry no defaults so they never undo the ones given before."""

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    conn = parser.add_argument_group("connection")
    if top:
        parser.set_defaults(target_given=False)
    conn.add_argument(
        "--target",
        action=TargetOption,
        type=target_option,
        list_dest="targets_before" if top else "targets_after",
        default=default(os.environ.get(TARGET_ENV, DEFAULT_TARGET)),
        help=f"producer address host:port, or a gRPC target such as dns:///host:port (env "
        f"{TARGET_ENV}; default {DEFAULT_TARGET}); info and lookup take several",
    )
    conn.add_argument(
        "--token-file",
        type=Path,
        default=default(None),
        help=f"file holding the bearer token (or env {TOKEN_ENV}); sent as "
        "'authorization: Bearer <token>'",
    )
    conn.add_argument(
        "--tls",
        action="store_true",
        default=default(False),
        help="use TLS with the system's root CAs",
    )
    for flag, text in (
        ("--tls-ca", "CA bundle to verify the producer (implies --tls)"),
        ("--tls-cert", "client certificate for mTLS (implies --tls)"),
        ("--tls-key", "client key for mTLS (with --tls-cert)"),
    ):
        conn.add_argument(flag, type=Path, default=default(None), metavar="FILE", help=text)
    conn.add_argument(
        "--tls-server-name",
        type=server_name_option,
        default=default(None),
        metavar="NAME",
        help="with TLS: the name the producer's certificate must carry, checked instead of the "
        "target's host, by the gRPC channel and the TCP data connection alike "
        "(grpc.ssl_target_name_override; e.g. kvpark-producer when dialing pod IPs)",
    )
    conn.add_argument(
        "--rpc-timeout",
        type=positive_seconds,
        default=default(10.0),
        metavar="SECONDS",
        help="deadline of each unary call (default 10)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON instead of text"
    )


def client_from_args(args: argparse.Namespace, **client_args: Any) -> KVConsumer:
    """A `KVConsumer` for the common connection options."""
    return Connection.from_args(args).consumer(args.target, **client_args)


def _add_targets_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--targets-file",
        type=Path,
        metavar="FILE",
        help="ask the producers listed in FILE too (host:port per line, # comments)",
    )


def _asks_several(args: argparse.Namespace, targets: Sequence[str]) -> bool:
    """The table form: several producers, or a list of them (even of one)."""
    return len(targets) > 1 or args.targets_file is not None


# ------------------------------------------------------------------------------ output
def _emit(args: argparse.Namespace, data: Any, text: str, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    if args.json:
        print(json.dumps(data, default=str), file=out)
    else:
        print(text, file=out)


def _status_row(s: IdStatus) -> str:
    reason = f" ({s.reason})" if s.reason else ""
    total = s.total_chunks or "?"
    lease = f" lease {s.lease_remaining_s:.1f}s" if s.lease_remaining_s else ""
    fingerprint = f"\tfingerprint {s.fingerprint.hex()}" if s.fingerprint else ""
    return (
        f"{s.kv_request_id}\t{s.state}{reason}\tchunks {s.chunks_parked}/{total}\t"
        f"{s.bytes} bytes\tage {s.age_s:.1f}s{lease}{fingerprint}"
    )


# ----------------------------------------------------------------------------- commands
COMMANDS = CommandRegistry()


def _info_args(parser: argparse.ArgumentParser) -> None:
    _add_targets_file(parser)


def _info(args: argparse.Namespace) -> int:
    targets = targets_of(args)
    connection = Connection.from_args(args)
    if _asks_several(args, targets):
        failed = cli_fleet.fleet_info(args, connection, targets)
        return EXIT_FAILED if failed else EXIT_OK
    with connection.reader(args.target) as reader:
        snapshot = reader.read(args.rpc_timeout)
    fields = cli_fleet.snapshot_fields(snapshot)
    _emit(args, {"target": args.target, **fields}, _info_text(snapshot))
    return EXIT_OK


def _info_text(snapshot: Snapshot) -> str:
    # The stats follow one per line, so not also as one dict on the info's `stats:` line.
    fields = {key: value for key, value in asdict(snapshot.info).items() if key != "stats"}
    lines = [f"{key}: {value}" for key, value in fields.items()]
    lines.append(f"pool_used_bytes: {snapshot.pool_used_bytes}")
    lines.append(f"transports: {','.join(snapshot.transports)}")
    if snapshot.stats is None:
        lines.append("stats: not reported by this producer")
    else:
        lines += [f"{key}: {value}" for key, value in asdict(snapshot.stats).items()]
    return "\n".join(lines)


def _lookup_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ids", nargs="+", metavar="ID", help="kv_request_id to look up")
    _add_targets_file(parser)


def _lookup(args: argparse.Namespace) -> int:
    targets = targets_of(args)
    connection = Connection.from_args(args)
    if _asks_several(args, targets):
        failed = cli_fleet.fleet_lookup(args, connection, targets, args.ids)
        return EXIT_FAILED if failed else EXIT_OK
    with connection.consumer(args.target) as client:
        states = client.lookup(args.ids, timeout=args.rpc_timeout)
    _emit(args, [s.as_json() for s in states], "\n".join(_status_row(s) for s in states))
    return EXIT_OK


def _top(args: argparse.Namespace) -> int:
    return EXIT_OK if cli_top.watch(args) else EXIT_RPC


def _fetch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", metavar="ID", help="kv_request_id to fetch")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--chunks", type=int, metavar="N", help="fetch chunks 0..N-1")
    which.add_argument(
        "--chunk-ids", metavar="LIST", help="comma-separated chunk ids, in the order wanted"
    )
    parser.add_argument(
        "--out", required=True, metavar="FILE", help="where to write the bytes ('-' = stdout)"
    )
    parser.add_argument("--expected-epoch", type=int, default=0, metavar="EPOCH")
    parser.add_argument(
        "--fingerprint",
        type=fingerprint_argument,
        metavar="HEX",
        help="fetch only if the id was parked with this fingerprint, in hex as `kvpark lookup` "
        "shows it (otherwise it fails FINGERPRINT_MISMATCH and the id stays parked)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="total load timeout (default %(default)s)",
    )
    parser.add_argument("--first-chunk-timeout", type=positive_seconds, metavar="SECONDS")
    parser.add_argument(
        "--wait",
        type=positive_seconds,
        metavar="SECONDS",
        help="how long the producer waits for chunks not parked yet (FetchRequest.wait_timeout_s)",
    )


def _fetch(args: argparse.Namespace) -> int:
    chunk_ids = None
    if args.chunk_ids is not None:
        try:
            chunk_ids = [int(part) for part in args.chunk_ids.split(",")]
        except ValueError:
            raise UsageError(f"--chunk-ids: expected integers, got {args.chunk_ids!r}") from None
    timeout = Timeout(args.timeout, first_chunk_s=args.first_chunk_timeout)
    write_error: str | None = None
    confirm_error: str | None = None
    with client_from_args(args) as client:
        result = client.load(
            args.id,
            num_chunks=args.chunks,
            chunk_ids=chunk_ids,
            expected_epoch=args.expected_epoch,
            timeout=timeout,
            wait_timeout_s=args.wait or 0.0,
            fingerprint=args.fingerprint,
            confirm=False,
        )
        if result.ok:
            assert result.data is not None  # no `into`: the result owns its bytes
            write_error = _write_out(args.out, result.data.data)
            # Confirmed only once every byte is out: otherwise the id stays on the producer
            # for a retry within its delivery grace.
            if write_error is None and not result.delivery_id:
                # Every chunk verified, but the producer ended the transfer without naming a
                # delivery (it failed the id after the last chunk): nothing to confirm.
                confirm_error = f"no delivery to confirm ({result.detail})"
            elif write_error is None:
                # The file is complete either way: a confirm that does not get through only
                # leaves the id parked until the producer's delivery grace frees it.
                try:
                    confirmed = client.confirm(result, timeout=args.rpc_timeout)
                except KVParkError as exc:
                    confirm_error = f"{exc}; the producer frees the id after its delivery grace"
                else:
                    if not confirmed.ok:  # e.g. the delivery grace ran out while writing
                        confirm_error = f"refused, {confirmed.reason}: {confirmed.detail}"
    delivered = result.ok and write_error is None
    summary = {
        "kv_request_id": result.kv_request_id,
        "ok": delivered,
        "reason": result.reason,
        "detail": result.detail,
        "chunks_loaded": result.chunks_loaded,
        "bytes": result.bytes,
        "elapsed_s": round(result.elapsed_s, 6),
        "producer_epoch": result.producer_epoch,
        "out": args.out if delivered else None,
        "confirmed": delivered and confirm_error is None,
    }
    if confirm_error is not None:
        summary["confirm_error"] = confirm_error
    if write_error is not None:
        summary |= {"reason": OUTPUT_FAILED, "detail": write_error}
        text = (
            f"fetch {result.kv_request_id} failed: {write_error}; not confirmed, the producer "
            "keeps the id for a retry within its delivery grace"
        )
    elif result.ok:
        text = (
            f"fetched {result.kv_request_id}: {result.chunks_loaded} chunks, {result.bytes} "
            f"bytes in {result.elapsed_s:.3f}s -> {args.out}"
        )
    else:
        text = (
            f"fetch {result.kv_request_id} failed: {result.reason} after {result.chunks_loaded}"
            f" chunks, {result.elapsed_s:.3f}s{': ' + result.detail if result.detail else ''}"
            " (nothing written)"
        )
    # With --out - the payload owns stdout; a failure to write is reported on stderr.
    to_stderr = args.out == "-" or write_error is not None
    _emit(args, summary, text, sys.stderr if to_stderr else None)
    if confirm_error is not None:  # a warning: the file is complete
        warning = f"kvpark fetch: {result.kv_request_id} not confirmed: {confirm_error}"
        print(warning, file=sys.stderr)
    if delivered:
        return EXIT_OK
    return EXIT_RPC if _did_not_get_through(result) else EXIT_FAILED


def fingerprint_argument(text: str) -> bytes:
    """argparse type of `--fingerprint`: hex, as lookup prints it, within the contract's size."""
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected hex digits, got {text!r}") from None
    problem = fingerprint_problem(value) if value else "empty"
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


# The fetch summary's reason when the bytes were loaded but could not all be written out.
OUTPUT_FAILED = "OUTPUT_FAILED"


def _did_not_get_through(result: LoadResult) -> bool:
    """A load that failed without the producer answering it: the producer was unreachable or
    the connection broke (UNAVAILABLE), or, before any chunk came back, the load timed out or
    ended with a status `classify_status` calls a transport failure (the producer shedding
    load with RESOURCE_EXHAUSTED, ABORTED, CANCELLED): the code `info` and `lookup` exit with
    for the same status. Once chunks have arrived the producer was reached, and a failure is a
    fetch that failed partway, like the producer's own refusals."""
    if result.reason is Reason.UNAVAILABLE:
        return True
    if result.chunks_loaded > 0:
        return False
    if result.reason is Reason.TIMEOUT:
        return True
    return result.grpc_code is not None and issubclass(
        classify_status(result.grpc_code).error, TransportError
    )


def _write_out(out: str, data: memoryview) -> str | None:
    """Writes all of `data` to the file `out` ('-' = stdout); None when every byte went out,
    else what went wrong. A partly written file is removed, so no file looks complete that
    is not."""
    if out == "-":
        sys.stdout.flush()
        return _write_all(sys.stdout.fileno(), data, "stdout")
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError as exc:
        return f"cannot open {out}: {exc.strerror}"
    error = _write_all(fd, data, out)
    try:
        os.close(fd)
    except OSError as exc:
        error = error or f"cannot write {out}: {exc.strerror}"
    if error is not None and os.path.isfile(out):
        with contextlib.suppress(OSError):
            os.unlink(out)
    return error


def _write_all(fd: int, data: memoryview, name: str) -> str | None:
    """os.write until every byte is out: a write to a pipe whose reader went away mid-way
    can return short without an error, so each return value is checked."""
    view = memoryview(data).cast("B")
    total, done = len(view), 0
    while done < total:
        try:
            written = os.write(fd, view[done:])
        except OSError as exc:
            return f"cannot write {name}: {exc.strerror} after {done} of {total} bytes"
        if written <= 0:
            return f"cannot write {name}: it took nothing after {done} of {total} bytes"
        done += written
    return None


def _release_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", metavar="ID", help="kv_request_id to give up")


def _release(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        result = client.release(args.id, timeout=args.rpc_timeout)
    text = f"released {args.id}" if result.ok else f"release {args.id} refused: {result.reason}"
    _emit(args, asdict(result), text)
    return EXIT_OK if result.ok else EXIT_FAILED


COMMANDS.add(
    Command(
        "info",
        "show producers' epoch, pool, ids by state, limits and timeouts",
        _info_args,
        _info,
        many_targets=True,
    )
)
COMMANDS.add(
    Command(
        "lookup",
        "show the state of ids on producers",
        _lookup_args,
        _lookup,
        many_targets=True,
    )
)
COMMANDS.add(
    Command(
        "fetch",
        "load an id's chunks into a file (consumes the id on the producer)",
        _fetch_args,
        _fetch,
    )
)
COMMANDS.add(Command("release", "give an id up (needs the park token)", _release_args, _release))
COMMANDS.add(Command("bench", bench.HELP, bench.configure, bench.run, on_main_thread=True))
COMMANDS.add(Command("top", cli_top.HELP, cli_top.configure, _top, on_main_thread=True))


# -------------------------------------------------------------------------------- main
def build_parser(commands: CommandRegistry = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpark", description="Operator commands against a kvpark producer."
    )
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands:
        child = sub.add_parser(command.name, help=command.help, description=command.help)
        _add_common(child, top=False)
        command.configure(child)
        child.set_defaults(
            run=command.run,
            many_targets=command.many_targets,
            on_main_thread=command.on_main_thread,
        )
    return parser


def _run_command(args: argparse.Namespace) -> int:
    """Runs the command, on a worker thread unless it asks for the main one. A blocking gRPC
    call does not give its thread back for Ctrl-C (a unary call holds it until its deadline),
    and a streaming one cut by KeyboardInterrupt leaves grpc's call state broken, so the main
    thread only waits: Ctrl-C reaches it at once, and the worker, a daemon, ends with the
    process. A fetch cut off that way is never confirmed; the producer puts the id back."""
    if args.on_main_thread:
        code: int = args.run(args)
        return code
    outcome: list[int | BaseException] = []

    def work() -> None:
        try:
            outcome.append(args.run(args))
        except BaseException as exc:  # raised again on the main thread, where main() sorts it
            outcome.append(exc)

    worker = threading.Thread(target=work, name=f"kvpark {args.command}", daemon=True)
    worker.start()
    worker.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            # What stdout still buffers is written here, where a reader that went away is
            # handled, rather than at the interpreter's exit (a traceback there, exit 120).
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader of stdout went away (`kvpark info | head -1`): done, as `kvpark top` is
        # then. One code whether the text was still buffered or already being written
        # (PYTHONUNBUFFERED, a table larger than the buffer). Stdout is pointed at /dev/null
        # so that the interpreter's last flush does not fail again. (`fetch --out -` reports a
        # payload it could not write itself, and exits 1.)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = given_targets(args)
    if len(given) > 1 and not args.many_targets:
        print(
            f"kvpark {args.command}: takes one --target, got {len(given)}: {', '.join(given)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    tune_allocator()
    try:
        code = _run_command(args)
    except UsageError as exc:
        print(f"kvpark {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RequestRejectedError as exc:  # the producer answered: it refused the request
        print(f"kvpark {args.command}: {args.target}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except RPCError as exc:
        print(f"kvpark {args.command}: {args.target}: {exc}", file=sys.stderr)
        return EXIT_RPC
    except KVParkError as exc:
        print(f"kvpark {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        # Ctrl-C is how an operator stops a command: no traceback, the shell's 128 + SIGINT.
        print(f"kvpark {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
