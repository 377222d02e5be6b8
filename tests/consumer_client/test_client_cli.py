"""The `kvpark` operator CLI against running producers: in-process (calling `main`) and as the
installed command in a subprocess; exit codes; the subcommand registry and its plugin hook."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from conftest import ProducerProcess, free_port, park, running_producer, stub_for, wait_for
from consumer_support import in_thread, joined, park_sync, payload

from kvpark import KVConsumer, wire
from kvpark.checksum import crc32c_of
from kvpark.client import cli
from kvpark.fingerprints import fingerprint
from kvpark.pb import kvpark_pb2 as pb


async def run_cli(*argv: str) -> int:
    return int(await in_thread(cli.main, list(argv)))


def installed_kvpark() -> list[str]:
    """The `kvpark` command as installed next to this Python (else run as a module)."""
    script = Path(sys.executable).parent / "kvpark"
    return [str(script)] if script.exists() else [sys.executable, "-m", "consumer_client"]


async def test_info_lookup_fetch_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_producer() as server, stub_for(server) as stub:
        chunks = payload(3, 5000)
        await park(stub, "cli-1", chunks, total=3)
        await park(stub, "cli-2", chunks, total=3)
        t = ("--target", server.target)

        assert await run_cli(*t, "info") == cli.EXIT_OK
        text = capsys.readouterr().out.splitlines()
        assert f"producer_epoch: {server.epoch}" in text
        assert "parked_ids: 2" in text and "transports: grpc" in text
        assert not any(line.startswith("stats:") for line in text)  # once, one per line

        assert await run_cli("info", *t, "--json") == cli.EXIT_OK  # options after the command
        info = json.loads(capsys.readouterr().out)
        assert info["producer_epoch"] == server.epoch and info["target"] == server.target
        assert info["stats"]["parked_ids"] == 2 and info["stats"]["parks_total"] == 2
        assert info["pool_used_bytes"] == info["pool_bytes"] - info["pool_free_bytes"] > 0

        assert await run_cli(*t, "lookup", "cli-1", "nope") == cli.EXIT_OK
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("cli-1\tPARKED") and "chunks 3/3" in lines[0]
        assert lines[1].startswith("nope\tUNKNOWN")

        out = tmp_path / "kv.bin"
        code = await run_cli(*t, "fetch", "cli-1", "--chunks", "3", "--out", str(out))
        assert code == cli.EXIT_OK
        assert out.read_bytes() == joined(chunks)
        assert "fetched cli-1: 3 chunks" in capsys.readouterr().out

        again = tmp_path / "again.bin"
        code = await run_cli(*t, "--json", "fetch", "cli-1", "--out", str(again))
        assert code == cli.EXIT_FAILED and not again.exists()
        summary = json.loads(capsys.readouterr().out)
        assert summary["reason"] == "ALREADY_CONSUMED" and summary["out"] is None

        assert await run_cli(*t, "release", "cli-2") == cli.EXIT_OK
        assert capsys.readouterr().out.strip() == "released cli-2"
        assert await run_cli(*t, "release", "cli-2") == cli.EXIT_FAILED
        assert "RELEASED" in capsys.readouterr().out


async def test_lookup_shows_the_fingerprint_and_fetch_checks_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours, theirs = fingerprint("model-a", [1, 2, 3]), fingerprint("model-b", [1, 2, 3])
    async with running_producer() as server, stub_for(server) as stub:
        chunks = payload(2, 3000)
        await park(stub, "fp", chunks, total=2, fingerprint=ours)
        t = ("--target", server.target)

        assert await run_cli(*t, "lookup", "fp") == cli.EXIT_OK
        assert f"fingerprint {ours.hex()}" in capsys.readouterr().out
        assert await run_cli(*t, "--json", "lookup", "fp") == cli.EXIT_OK
        assert json.loads(capsys.readouterr().out)[0]["fingerprint"] == ours.hex()

        out = tmp_path / "kv.bin"
        code = await run_cli(*t, "--json", "fetch", "fp", "--fingerprint", theirs.hex(),
                             "--out", str(out))  # fmt: skip
        assert code == cli.EXIT_FAILED and not out.exists()
        assert json.loads(capsys.readouterr().out)["reason"] == "FINGERPRINT_MISMATCH"
        # The refused fetch left the id parked: the right fingerprint gets its bytes.
        code = await run_cli(*t, "fetch", "fp", "--fingerprint", ours.hex(), "--out", str(out))
        assert code == cli.EXIT_OK and out.read_bytes() == joined(chunks)
        capsys.readouterr()

    for bad, why in (("zz", "expected hex digits"), ("", "empty"), ("ab" * 65, "at most 64")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["fetch", "x", "--out", "-", "--fingerprint", bad])
        assert exit_.value.code == cli.EXIT_USAGE
        assert why in capsys.readouterr().err


async def test_exit_codes_for_usage_and_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    assert await run_cli("--target", dead, "--rpc-timeout", "2", "info") == cli.EXIT_RPC
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert await run_cli("--target", dead, "lookup", "bad\x01id") == cli.EXIT_USAGE
    assert "control character" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fetch", "x"])  # --out is required
    assert exit_.value.code == cli.EXIT_USAGE
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--rpc-timeout", "-1", "info"])
    assert exit_.value.code == cli.EXIT_USAGE
    assert "argument --rpc-timeout: expected seconds > 0 and <= 604800 (one week), got '-1'" in (
        capsys.readouterr().err
    )


def fetch_into_fifo(
    target: str, kid: str, rpc_timeout: str, tmp_path: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    """`kvpark fetch` of `kid`'s 4 chunks writing into a FIFO: it holds the fetch in its file
    writing (the load is over) until the test reads."""
    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    argv = ["--target", target, "--rpc-timeout", rpc_timeout, "--json"]
    fetch = subprocess.Popen(
        [*installed_kvpark(), *argv, "fetch", kid, "--chunks", "4", "--out", str(fifo)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return fetch, fifo


def test_installed_command_against_a_producer_process(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path
) -> None:
    producer = producer_process()
    chunks = payload(2, 3000)
    park_sync(producer.target, "proc-id", chunks, total=2)

    def run(*argv: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*installed_kvpark(), "--target", producer.target, *argv],
            capture_output=True,
            timeout=60,
        )

    info = run("--json", "info")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["version"]
    fetched = run("fetch", "proc-id", "--chunks", "2", "--out", "-")
    assert fetched.returncode == 0, fetched.stderr
    assert fetched.stdout == joined(chunks)  # the payload owns stdout
    assert b"fetched proc-id" in fetched.stderr
    looked = run("lookup", "proc-id")
    assert looked.returncode == 0 and b"TOMBSTONED (ALREADY_CONSUMED)" in looked.stdout


@pytest.mark.parametrize("why", ["producer killed", "grace ran out"])
def test_a_fetch_whose_confirm_fails_still_delivers_its_file(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path, why: str
) -> None:
    """The file is complete once written. A confirm that does not get through (the producer
    killed meanwhile) or is refused (the delivery grace ran out while the file was written)
    leaves an unconfirmed delivery, which the fetch reports as a warning, not a failure."""
    producer = producer_process(delivery_grace_s=0.2)
    chunks = payload(4, 256 * 1024)  # more than a pipe holds: the writer waits for our reads
    park_sync(producer.target, "slow", chunks, total=4)
    fetch, fifo = fetch_into_fifo(producer.target, "slow", "5", tmp_path)
    try:
        with open(fifo, "rb") as reader:
            first = reader.read(1)  # the load is over: the fetch is writing its file
            if why == "producer killed":
                producer.proc.kill()
                producer.proc.wait(timeout=10)
            else:
                wait_for(lambda: state_of(producer.target, "slow") == "TOMBSTONED", what="reap")
            rest = reader.read()
        out, err = fetch.communicate(timeout=60)
    finally:
        fetch.kill()
    assert fetch.returncode == cli.EXIT_OK, err
    assert first + rest == joined(chunks)
    summary = json.loads(out)  # the summary stays on stdout, the warning goes to stderr
    assert summary["ok"] is True and summary["out"] == str(fifo)
    assert summary["confirmed"] is False and summary["confirm_error"]
    assert b"kvpark fetch: slow not confirmed: " in err
    if why == "grace ran out":
        assert summary["confirm_error"].startswith("refused, ALREADY_CONSUMED")


def test_a_fetch_confirms_under_the_rpc_timeout(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path
) -> None:
    """The confirm is a unary call like the others: a producer that freezes (SIGSTOP) while
    the file is written fails it at --rpc-timeout with DEADLINE_EXCEEDED, well before the
    channel's keepalive (a ping every 2 s, 2 s to answer) would call the producer UNAVAILABLE
    and long before the client's own default timeout."""
    producer = producer_process()
    chunks = payload(4, 256 * 1024)  # more than a pipe holds: the writer waits for our reads
    park_sync(producer.target, "frozen", chunks, total=4)
    fetch, fifo = fetch_into_fifo(producer.target, "frozen", "0.5", tmp_path)
    try:
        with open(fifo, "rb") as reader:
            first = reader.read(1)  # the load is over: the fetch is writing its file
            producer.proc.send_signal(signal.SIGSTOP)
            rest = reader.read()
        out, err = fetch.communicate(timeout=60)
    finally:
        fetch.kill()
        producer.proc.send_signal(signal.SIGCONT)
    assert fetch.returncode == cli.EXIT_OK, err
    assert first + rest == joined(chunks)
    summary = json.loads(out)
    assert summary["ok"] is True and summary["confirmed"] is False
    assert summary["confirm_error"].startswith("Release: DEADLINE_EXCEEDED"), summary


def test_a_fetch_that_names_no_delivery_is_written_and_not_confirmed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every chunk verified, then the stream ends without a TransferDone (so no delivery id):
    the load succeeds and the file is written, and there is nothing to confirm. A kvpark
    producer never ends a Fetch so; a bare gRPC server stands in for one that does."""
    chunk = b"kv" * 1000

    def fetch(request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield wire.encode_fetch_chunk(0, crc32c_of(chunk), [chunk])

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_stream_rpc_method_handler(
        fetch, request_deserializer=pb.FetchRequest.FromString
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("kvpark.v1.KVProducer", {"Fetch": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out = tmp_path / "kv.bin"
    try:
        argv = ["--target", f"127.0.0.1:{port}", "--json", "fetch", "x", "--chunks", "1"]
        code = cli.main([*argv, "--out", str(out)])
    finally:
        server.stop(None)
    captured = capsys.readouterr()
    assert code == cli.EXIT_OK, captured.err
    assert out.read_bytes() == chunk
    summary = json.loads(captured.out)
    assert summary["ok"] is True and summary["confirmed"] is False
    assert summary["confirm_error"].startswith("no delivery to confirm (all chunks verified")
    assert "x not confirmed: no delivery to confirm" in captured.err


def state_of(target: str, kv_request_id: str) -> str:
    """The id's state name, as `kvpark lookup` reads it."""
    with KVConsumer(target) as client:
        (status,) = client.lookup([kv_request_id])
    return str(status.state)


def test_commands_are_registered_in_one_registry() -> None:
    names = cli.COMMANDS.names()
    assert names[:6] == ["info", "lookup", "fetch", "release", "bench", "top"]
    for name in names:  # the module docstring shows every command
        assert f"kvpark {name}" in (cli.__doc__ or "")

    registry = cli.CommandRegistry()
    for command in cli.COMMANDS:
        registry.add(command)
    ran: list[object] = []
    registry.add(
        cli.Command(
            "fake-bench",
            "measure load throughput",
            lambda p: p.add_argument("--size", default="1GiB"),
            lambda args: ran.append((args.target, args.size)) or 0,
        )
    )
    assert registry.names() == [*names, "fake-bench"]
    args = cli.build_parser(registry).parse_args(
        ["fake-bench", "--target", "h:1", "--size", "2GiB"]
    )
    assert args.run(args) == 0 and ran == [("h:1", "2GiB")]
    with pytest.raises(ValueError, match="twice"):
        registry.add(cli.COMMANDS._commands["info"])
