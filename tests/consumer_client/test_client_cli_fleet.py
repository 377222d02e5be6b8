"""`kvpark info` and `kvpark lookup` across several producers: one table with a row per producer
(or per producer and id), a dead producer's row beside the live ones, exit codes, the targets
file and its errors, and dead producers asked at once rather than one after another."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import free_port, park, running_producer, stub_for
from consumer_support import in_thread, payload

from kvpark.client import cli


async def run_cli(*argv: str) -> int:
    return int(await in_thread(cli.main, list(argv)))


def table(text: str) -> list[dict[str, str]]:
    """The rows of a `kvpark` table as {column: cell}; columns are two or more spaces apart."""
    header, *rows = text.strip().splitlines()
    names = re.split(r" {2,}", header)
    out = []
    for row in rows:
        cells = re.split(r" {2,}", row)
        assert len(cells) == len(names), f"{row!r} does not match {header!r}"
        out.append(dict(zip(names, cells, strict=True)))
    return out


@contextmanager
def silent_listeners(n: int) -> Iterator[list[str]]:
    """Addresses that accept TCP connections (the kernel's backlog) but never answer: a gRPC
    call to them runs into its deadline, like one to a frozen producer."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(16)
            sockets.append(s)
        yield [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    finally:
        for s in sockets:
            s.close()


async def test_info_and_lookup_show_live_and_dead_producers_in_one_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_producer() as a, running_producer() as b, stub_for(a) as stub_a:
        await park(stub_a, "on-a", payload(2, 4000), total=2, fingerprint=b"\x0f\xa0")
        dead = f"127.0.0.1:{free_port()}"
        targets = ["--target", a.target, "--target", b.target, "--target", dead]

        assert await run_cli("info", *targets) == cli.EXIT_FAILED
        out, err = capsys.readouterr()
        rows = table(out)
        assert [r["TARGET"] for r in rows] == [a.target, b.target, dead]
        assert [r["STATUS"] for r in rows] == ["ok", "ok", "UNAVAILABLE"]
        assert rows[0]["EPOCH"] == str(a.epoch) and rows[1]["EPOCH"] == str(b.epoch)
        assert (rows[0]["PARKED"], rows[1]["PARKED"], rows[2]["PARKED"]) == ("1", "0", "-")
        assert rows[0]["POOL USED/SIZE"].split("/")[1].startswith("64.0 MiB")
        assert rows[0]["TRANSPORTS"] == "grpc" and rows[2]["EPOCH"] == "-"
        # Only the dead producer is reported, with the whole error, and the count.
        first, count = err.splitlines()
        assert first.startswith(f"kvpark info: {dead}: GetServerInfo: UNAVAILABLE")
        assert count == "kvpark info: 1 of 3 producers did not answer"

        # Two live producers alone: every row ok, exit 0.
        assert await run_cli("info", "--target", a.target, "--target", b.target) == cli.EXIT_OK
        out, err = capsys.readouterr()
        assert [r["STATUS"] for r in table(out)] == ["ok", "ok"] and err == ""

        assert await run_cli("lookup", "on-a", "nope", *targets) == cli.EXIT_FAILED
        out, err = capsys.readouterr()
        rows = table(out)
        assert [(r["TARGET"], r["ID"], r["STATUS"], r["STATE"]) for r in rows] == [
            (a.target, "on-a", "ok", "PARKED"),
            (a.target, "nope", "ok", "UNKNOWN"),
            (b.target, "on-a", "ok", "UNKNOWN"),
            (b.target, "nope", "ok", "UNKNOWN"),
            (dead, "on-a", "UNAVAILABLE", "-"),
            (dead, "nope", "UNAVAILABLE", "-"),
        ]
        assert rows[0]["CHUNKS"] == "2/2" and rows[0]["LEASE"].endswith("s")
        assert (rows[0]["FINGERPRINT"], rows[1]["FINGERPRINT"]) == ("0fa0", "-")
        assert f"kvpark lookup: {dead}: Lookup: UNAVAILABLE" in err

        # --json: a list of objects, the dead producer's with its error.
        assert await run_cli("--json", "info", *targets) == cli.EXIT_FAILED
        documents = json.loads(capsys.readouterr().out)
        assert [d["ok"] for d in documents] == [True, True, False]
        assert documents[0]["stats"]["parked_ids"] == 1
        assert documents[0]["producer_epoch"] == a.epoch
        assert documents[2] == {
            "target": dead,
            "ok": False,
            "error": "UNAVAILABLE",
            "detail": documents[2]["detail"],
        }
        assert "UNAVAILABLE" in documents[2]["detail"]


async def test_targets_file_and_targets_before_and_after_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_producer() as a, running_producer() as b:
        dead = f"127.0.0.1:{free_port()}"
        targets = tmp_path / "producers.txt"
        targets.write_text(
            f"# prefill fleet\n{a.target}\n\n   {b.target}   # the second one\n{dead}\n"
            f"{a.target}\n"  # listed twice: asked once
        )
        assert await run_cli("info", "--targets-file", str(targets)) == cli.EXIT_FAILED
        rows = table(capsys.readouterr().out)
        assert [(r["TARGET"], r["STATUS"]) for r in rows] == [
            (a.target, "ok"),
            (b.target, "ok"),
            (dead, "UNAVAILABLE"),
        ]

        # One line in a file is still a fleet: the table, not the single-producer form.
        one = tmp_path / "one.txt"
        one.write_text(f"{a.target}\n")
        assert await run_cli("lookup", "x", "--targets-file", str(one)) == cli.EXIT_OK
        assert table(capsys.readouterr().out)[0]["TARGET"] == a.target

        # --target before and after the command add up, in order.
        assert await run_cli("--target", b.target, "info", "--target", a.target) == cli.EXIT_OK
        assert [r["TARGET"] for r in table(capsys.readouterr().out)] == [b.target, a.target]


async def test_bad_targets_files_are_one_line_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("# fleet\n127.0.0.1:5000\nprefill-1 5000\n")
    assert await run_cli("info", "--targets-file", str(bad)) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"kvpark info: {bad}:3: expected 'host:port' or a gRPC target such as "
        "'dns:///host:port' or 'unix:PATH', got 'prefill-1 5000'\n"
    )

    zero = tmp_path / "zero.txt"
    zero.write_text("127.0.0.1:0\n")
    assert await run_cli("lookup", "x", "--targets-file", str(zero)) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        f"kvpark lookup: {zero}:1: '127.0.0.1:0': port 0 cannot be dialed\n"
    )

    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    assert await run_cli("info", "--targets-file", str(empty)) == cli.EXIT_USAGE
    assert "no targets in it" in capsys.readouterr().err

    missing = tmp_path / "missing.txt"
    assert await run_cli("info", "--targets-file", str(missing)) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        f"kvpark info: cannot read {missing}: No such file or directory\n"
    )

    # A bad id is refused before any producer is asked.
    assert await run_cli("lookup", "bad\x01", "--targets-file", str(zero)) == cli.EXIT_USAGE
    # Commands on one producer refuse several.
    code = await run_cli("--target", "h:1", "release", "x", "--target", "h:2")
    assert code == cli.EXIT_USAGE
    assert capsys.readouterr().err.endswith("kvpark release: takes one --target, got 2: h:1, h:2\n")


async def test_frozen_producers_cost_one_timeout_together(
    capsys: pytest.CaptureFixture[str],
) -> None:
    timeout_s = 1.0
    with silent_listeners(4) as frozen:
        argv = ["info", "--rpc-timeout", str(timeout_s)]
        for target in frozen:
            argv += ["--target", target]
        started = time.monotonic()
        assert await run_cli(*argv) == cli.EXIT_FAILED
        elapsed = time.monotonic() - started
    rows = table(capsys.readouterr().out)
    assert [r["STATUS"] for r in rows] == ["DEADLINE_EXCEEDED"] * 4
    # One after another they would take 4 timeouts; asked at once, about one.
    assert timeout_s <= elapsed < 3 * timeout_s, elapsed


async def test_installed_command_with_a_targets_file(tmp_path: Path) -> None:
    """The real `kvpark` process: table on stdout, the dead producer on stderr, exit 1."""
    script = Path(sys.executable).parent / "kvpark"
    base = [str(script)] if script.exists() else [sys.executable, "-m", "consumer_client"]
    async with running_producer() as a, running_producer() as b:
        dead = f"127.0.0.1:{free_port()}"
        targets = tmp_path / "producers.txt"
        targets.write_text(f"{a.target}\n{dead}  # drained for maintenance\n{b.target}\n")
        proc = await asyncio.create_subprocess_exec(
            *base,
            "info",
            "--targets-file",
            str(targets),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == cli.EXIT_FAILED, err
    rows = table(out.decode())
    assert [(r["TARGET"], r["STATUS"]) for r in rows] == [
        (a.target, "ok"),
        (dead, "UNAVAILABLE"),
        (b.target, "ok"),
    ]
    assert err.decode().startswith(f"kvpark info: {dead}: GetServerInfo: UNAVAILABLE")
