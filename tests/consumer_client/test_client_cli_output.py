"""`kvpark` when its output or its producer fails it: a fetch is confirmed only once every byte
went out, a failed write or open is one line and a non-zero exit (the id stays on the
producer), a fetch that never reached the producer exits 3, bad --target and TLS options are
usage errors, Ctrl-C and a reader of stdout that goes away end without a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from conftest import (
    ProducerProcess,
    free_port,
    park,
    park_requests,
    running_producer,
    state_of,
    stub_for,
    wait_for,
    wait_until,
)
from consumer_support import in_thread, joined, park_sync, payload

from kvpark.client import KVConsumer, LoadResult, cli
from kvpark.client._errors import classify_status
from kvpark.client.cli_connect import targets_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc

MiB = 2**20


def kvpark_command() -> list[str]:
    script = Path(sys.executable).parent / "kvpark"
    return [str(script)] if script.exists() else [sys.executable, "-m", "consumer_client"]


def kvpark_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}


def lookup_sync(target: str, kid: str) -> pb.IdState:
    with grpc.insecure_channel(target) as channel:
        reply = pb_grpc.KVProducerStub(channel).Lookup(pb.LookupRequest(kv_request_ids=[kid]))
        state: pb.IdState = reply.states[0]
        return state


async def run_cli(*argv: str) -> int:
    return int(await in_thread(cli.main, list(argv)))


def assert_one_line_error(stderr: str) -> None:
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


def test_a_reader_closing_the_pipe_midway_leaves_the_id_unconfirmed(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path
) -> None:
    producer = producer_process()
    chunks = payload(4, MiB)
    park_sync(producer.target, "piped", chunks, total=4)
    fetch = subprocess.Popen(
        [*kvpark_command(), "--target", producer.target, "fetch", "piped", "--out", "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=kvpark_env(),
    )
    assert fetch.stdout is not None and fetch.stderr is not None
    received = fetch.stdout.read(MiB)  # a reader that takes a quarter and goes away
    fetch.stdout.close()
    stderr = fetch.stderr.read().decode()
    assert fetch.wait(timeout=60) == cli.EXIT_FAILED, stderr
    assert received == joined(chunks)[:MiB]
    assert "fetched piped" not in stderr and "not confirmed" in stderr
    assert_one_line_error(stderr)

    # Not confirmed: the producer keeps the delivered id, and a retry gets every byte.
    assert lookup_sync(producer.target, "piped").state == pb.STATE_DELIVERED
    out = tmp_path / "retry.kv"
    retry = subprocess.run(
        [*kvpark_command(), "--target", producer.target, "fetch", "piped", "--out", str(out)],
        capture_output=True,
        timeout=60,
        env=kvpark_env(),
    )
    assert retry.returncode == cli.EXIT_OK, retry.stderr
    assert out.read_bytes() == joined(chunks)
    assert lookup_sync(producer.target, "piped").state == pb.STATE_TOMBSTONED


def run_without_a_reader(argv: list[str], *, unbuffered: bool) -> tuple[int, str]:
    """`kvpark argv` with stdout a pipe whose reader is gone before it writes (`| head -0`):
    its exit code and stderr. `unbuffered`: each print is written at once (PYTHONUNBUFFERED),
    else the text waits in stdout's buffer."""
    env = {k: v for k, v in kvpark_env().items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [*kvpark_command(), *argv], stdout=write_end, stderr=subprocess.PIPE, timeout=60,
            env=env,
        )  # fmt: skip
    finally:
        os.close(write_end)
    return proc.returncode, proc.stderr.decode()


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_a_reader_of_stdout_that_goes_away_ends_a_command_quietly(
    producer_process: Callable[..., ProducerProcess], unbuffered: bool
) -> None:
    """No traceback and exit 0, as `kvpark top` ends then, whether the text was still in
    stdout's buffer or being written (unbuffered, or a table larger than the buffer)."""
    a, b = producer_process(), producer_process()
    park_sync(a.target, "here", payload(1, 100), total=1)
    dead = f"127.0.0.1:{free_port()}"
    many_ids = [f"id-{n}" for n in range(500)]  # a table larger than stdout's buffer
    for argv in (
        ["--target", a.target, "info"],
        ["--target", a.target, "--json", "info"],
        ["info", "--target", a.target, "--target", b.target],
        ["--target", a.target, "lookup", "here"],
        ["--target", a.target, "lookup", *many_ids],
        ["lookup", "here", "--target", a.target, "--target", b.target],
        ["--help"],
    ):
        returncode, stderr = run_without_a_reader(argv, unbuffered=unbuffered)
        assert (returncode, stderr) == (cli.EXIT_OK, ""), argv
    # A producer that did not answer is reported on stderr if the table was still buffered
    # when the command went on to report it; cut short while printing, it ends all the same.
    argv = ["lookup", "here", "--target", a.target, "--target", dead]
    returncode, stderr = run_without_a_reader(argv, unbuffered=unbuffered)
    assert returncode == cli.EXIT_OK and "Traceback" not in stderr, stderr
    if unbuffered:
        assert stderr == ""
    else:
        assert stderr.startswith(f"kvpark lookup: {dead}: "), stderr


async def test_a_fetch_into_a_file_that_cannot_be_written_is_not_confirmed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_producer() as server, stub_for(server) as stub:
        chunks = payload(3, 5000)
        await park(stub, "unwritable", chunks, total=3)
        t = ("--target", server.target)

        missing_dir = tmp_path / "no-such-dir" / "x.kv"
        code = await run_cli(*t, "fetch", "unwritable", "--out", str(missing_dir))
        assert code == cli.EXIT_FAILED
        captured = capsys.readouterr()
        assert "fetched" not in captured.out and captured.out == ""
        assert f"cannot open {missing_dir}: No such file or directory" in captured.err
        assert_one_line_error(captured.err)
        assert (await state_of(stub, "unwritable")).state == pb.STATE_DELIVERED

        if Path("/dev/full").exists():  # every write fails with ENOSPC
            code = await run_cli(*t, "--json", "fetch", "unwritable", "--out", "/dev/full")
            assert code == cli.EXIT_FAILED
            captured = capsys.readouterr()
            assert captured.out == ""
            assert '"reason": "OUTPUT_FAILED"' in captured.err
            assert "No space left on device" in captured.err
            assert (await state_of(stub, "unwritable")).state == pb.STATE_DELIVERED

        out = tmp_path / "x.kv"
        assert await run_cli(*t, "fetch", "unwritable", "--out", str(out)) == cli.EXIT_OK
        assert out.read_bytes() == joined(chunks)
        assert (await state_of(stub, "unwritable")).state == pb.STATE_TOMBSTONED


@pytest.fixture
def silent_socket() -> Iterator[socket.socket]:
    """A listening socket that never answers: calls to it time out."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener


@pytest.fixture
def silent_listener(silent_socket: socket.socket) -> str:
    return f"127.0.0.1:{silent_socket.getsockname()[1]}"


async def test_a_fetch_that_never_reaches_the_producer_exits_3(
    silent_listener: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.kv"
    dead = f"127.0.0.1:{free_port()}"
    assert await run_cli("--target", dead, "fetch", "x", "--out", str(out)) == cli.EXIT_RPC
    assert "UNAVAILABLE" in capsys.readouterr().out and not out.exists()

    code = await run_cli(
        "--target", silent_listener, "--rpc-timeout", "0.5",
        "fetch", "x", "--timeout", "0.5", "--out", str(out),
    )  # fmt: skip
    assert code == cli.EXIT_RPC
    captured = capsys.readouterr()
    assert ("TIMEOUT" in captured.out or "DEADLINE_EXCEEDED" in captured.err) and not out.exists()


async def test_a_fetch_that_times_out_after_chunks_arrived_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_producer() as server, stub_for(server) as stub:
        # Chunk 0 of 2 is parked; the producer waits for chunk 1 longer than the load lasts.
        await park(stub, "half", {0: b"a" * 100}, total=2)
        out = tmp_path / "x.kv"
        code = await run_cli(
            "--target", server.target, "fetch", "half", "--chunks", "2",
            "--wait", "5", "--timeout", "0.5", "--out", str(out),
        )  # fmt: skip
        assert code == cli.EXIT_FAILED
        assert "failed: TIMEOUT after 1 chunks" in capsys.readouterr().out


async def test_a_fetch_an_overloaded_producer_sheds_exits_3_like_info(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A producer at its max_concurrent_rpcs refuses the Fetch (RESOURCE_EXHAUSTED) before any
    chunk: the call did not get through, the exit code info and lookup give for the same
    status (3), not the one of a producer that answered with a failure (1)."""
    async with running_producer(max_concurrent_rpcs=1) as server, stub_for(server) as stub:
        await park(stub, "busy", {0: b"a" * 100}, total=1)
        # A Park batch left open holds the producer's one call until it is cancelled.
        header = park_requests("holder", {}, commit=False)[0]
        release_holder = asyncio.Event()

        async def holder_requests() -> AsyncIterator[pb.ParkRequest]:
            yield header
            await release_holder.wait()

        holder = stub.Park(holder_requests())
        try:
            await wait_until(lambda: server.lot.statistics().open_batches == 1, what="holder")
            t = ("--target", server.target)
            assert await run_cli(*t, "info") == cli.EXIT_RPC
            assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err
            out = tmp_path / "x.kv"
            code = await run_cli(*t, "--json", "fetch", "busy", "--chunks", "1", "--out", str(out))
            assert code == cli.EXIT_RPC
            summary = json.loads(capsys.readouterr().out)
            assert summary["reason"] == "RPC_ERROR" and summary["chunks_loaded"] == 0
            assert not out.exists()
        finally:
            holder.cancel()
            release_holder.set()

        async def state_once_served() -> pb.IdState | None:
            try:
                return await state_of(stub, "busy")
            except grpc.aio.AioRpcError as exc:  # the holder's call not ended yet
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                return None

        # Shed, not refused: the id is still there for the retry.
        state = await wait_until(state_once_served, what="the holder's call to end")
        assert state.state == pb.STATE_PARKED


@pytest.mark.parametrize(
    ("code", "chunks_loaded", "did_not_get_through"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 0, True),
        (grpc.StatusCode.ABORTED, 0, True),
        (grpc.StatusCode.CANCELLED, 0, True),
        # The producer was reached: a fetch that failed partway, or a peer that broke the
        # contract, is a failure (1).
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 1, False),
        (grpc.StatusCode.INTERNAL, 0, False),
    ],
)
def test_which_load_statuses_did_not_get_through(
    code: grpc.StatusCode, chunks_loaded: int, did_not_get_through: bool
) -> None:
    rule = classify_status(code)
    assert rule.load_reason is not None
    result = LoadResult(
        kv_request_id="x", ok=False, reason=rule.load_reason, detail="", chunk_ids=None,
        chunks_loaded=chunks_loaded, bytes=100 * chunks_loaded, chunk_sizes=(100,) * chunks_loaded,
        elapsed_s=0.1, producer_epoch=0, grpc_code=code,
    )  # fmt: skip
    assert cli._did_not_get_through(result) is did_not_get_through


async def test_a_fetch_the_producer_calls_malformed_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Chunk ids beyond the id's chunks: the producer answered (INVALID_ARGUMENT), so it is
    a refusal (1), not a call that did not get through (3); the id stays parked."""
    async with running_producer() as server, stub_for(server) as stub:
        await park(stub, "two", {0: b"a" * 100, 1: b"b" * 100}, total=2)
        out = tmp_path / "x.kv"
        code = await run_cli(
            "--target", server.target, "fetch", "two", "--chunk-ids", "5", "--out", str(out)
        )  # fmt: skip
        assert code == cli.EXIT_FAILED
        assert "INVALID_ARGUMENT" in capsys.readouterr().err and not out.exists()
        assert (await state_of(stub, "two")).state == pb.STATE_PARKED


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("127.0.0.1:99999", "expected 'host:port'"),
        ("127.0.0.1:", "expected 'host:port'"),
        ("127.0.0.1:0", "'127.0.0.1:0': port 0 cannot be dialed"),
        ("not an address", "expected 'host:port'"),
        ("prefill-0", "expected 'host:port'"),  # gRPC would dial port 443
        ("http://prefill-0:50051", "expected 'host:port'"),  # gRPC would take it for a name
        ("::1:50051", "'::1:50051': put an IPv6 address in brackets"),
    ],
)
def test_a_bad_target_is_a_usage_error(
    target: str, message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--target", target, "info"])
    assert exit_.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"argument --target: {message}" in err and repr(target) in err

    with pytest.raises(SystemExit) as exit_:
        cli.main(["lookup", "x", "--target", "127.0.0.1:1", "--target", target])
    assert exit_.value.code == cli.EXIT_USAGE
    assert f"argument --target: {message}" in capsys.readouterr().err

    monkeypatch.setenv("KVPARK_TARGET", target)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["info"])
    assert exit_.value.code == cli.EXIT_USAGE
    assert "(the value of KVPARK_TARGET)" in capsys.readouterr().err


def test_targets_are_written_one_way() -> None:
    args = cli.build_parser().parse_args(["--target", " [::1]:50051", "info"])
    assert args.target == "[::1]:50051"


@pytest.mark.parametrize(
    "target",
    [
        "kvpark_producer_1:50051",  # a Docker Compose v1 service name
        "producer.kv.svc.cluster.local.:50051",  # fully qualified, with its trailing dot
        "dns:///prefill-0:50051",
    ],
)
def test_the_cli_takes_the_targets_the_client_takes(
    target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule: what `KVConsumer` dials, `--target`, KVPARK_TARGET and a targets file take."""
    KVConsumer(target).close()  # the library takes it
    parser = cli.build_parser()
    assert parser.parse_args(["--target", target, "info"]).target == target
    assert parser.parse_args(["lookup", "x", "--target", "h:1", "--target", target]).target == (
        target
    )
    listed = tmp_path / "producers.txt"
    listed.write_text(f"{target}  # the fleet\n")
    args = parser.parse_args(["info", "--targets-file", str(listed)])
    assert targets_of(args) == [target]
    monkeypatch.setenv("KVPARK_TARGET", target)
    assert cli.build_parser().parse_args(["info"]).target == target


async def test_a_grpc_target_reaches_a_producer(capsys: pytest.CaptureFixture[str]) -> None:
    async with running_producer() as server:
        for target in (f"dns:///{server.target}", f"ipv4:{server.target}"):
            assert await run_cli("--target", target, "--json", "info") == cli.EXIT_OK
            assert json.loads(capsys.readouterr().out)["producer_epoch"] == server.epoch


async def test_a_tls_key_without_its_certificate_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "client.key"
    key.write_text("not read")
    dead = f"127.0.0.1:{free_port()}"
    for command in (["info"], ["lookup", "x"], ["fetch", "x", "--out", str(tmp_path / "x")]):
        code = await run_cli("--target", dead, "--tls-key", str(key), *command)
        assert code == cli.EXIT_USAGE
        assert "--tls-cert and --tls-key go together" in capsys.readouterr().err


def test_bench_checks_its_json_file_before_it_runs(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "bench.json"
    bench = subprocess.run(
        [*kvpark_command(), "bench", "--quick", "--json-file", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
        env=kvpark_env(),
    )
    assert bench.returncode == cli.EXIT_USAGE
    assert bench.stdout == "" and "starting our own producer" not in bench.stderr
    assert f"--json-file: cannot write {missing}: No such file or directory" in bench.stderr
    assert_one_line_error(bench.stderr)

    writable = tmp_path / "bench.json"
    cli.bench.check_writable(writable)
    assert not writable.exists()  # checked, not left behind
    writable.write_text("kept")
    cli.bench.check_writable(writable)
    assert writable.read_text() == "kept"


def test_ctrl_c_ends_a_call_at_once_without_a_traceback(silent_socket: socket.socket) -> None:
    target = f"127.0.0.1:{silent_socket.getsockname()[1]}"
    info = subprocess.Popen(
        [*kvpark_command(), "--target", target, "--rpc-timeout", "60", "info"],
        stderr=subprocess.PIPE,
        text=True,
        env=kvpark_env(),
    )
    silent_socket.settimeout(30)
    connection, _ = silent_socket.accept()  # the call is under way, and never answered
    with connection:
        info.send_signal(signal.SIGINT)
        # Well before the call's 60 s deadline, with room for a busy machine.
        _, stderr = info.communicate(timeout=30)
    assert info.returncode == 130, stderr  # 128 + SIGINT, as shells report it
    assert stderr.strip() == "kvpark info: interrupted"


def test_ctrl_c_ends_a_fetch_without_a_traceback(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path
) -> None:
    producer = producer_process()
    park_sync(producer.target, "waited", {0: b"x" * 10}, total=2)
    fetch = subprocess.Popen(
        [
            *kvpark_command(), "--target", producer.target, "fetch", "waited", "--chunks", "2",
            "--wait", "9", "--timeout", "60", "--out", str(tmp_path / "x.kv"),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=kvpark_env(),
    )  # fmt: skip
    # Interrupted while the producer holds the Fetch, waiting for chunk 1.
    wait_for(
        lambda: (
            fetch.poll() is not None
            or lookup_sync(producer.target, "waited").state == pb.STATE_BOUND
        ),
        timeout=30,
        what="the Fetch bound on the producer",
    )
    assert fetch.poll() is None
    fetch.send_signal(signal.SIGINT)
    _, stderr = fetch.communicate(timeout=30)
    assert fetch.returncode == 130, stderr  # 128 + SIGINT, as shells report it
    assert stderr.strip() == "kvpark fetch: interrupted"
