"""The `kvpark` CLI's connection settings that cannot work are usage errors (exit 2) naming the
option or file: a deadline gRPC cannot keep, a TLS file that holds no PEM, a token gRPC cannot
send (metadata values are printable ASCII) or an empty token file, rather than an RPC failure
(exit 3) or a call made without the token meant."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import running_producer
from consumer_support import in_thread

from kvpark.client import cli


async def run_cli(*argv: str) -> int:
    return int(await in_thread(cli.main, list(argv)))


async def test_rpc_timeout_is_at_most_a_week(capsys: pytest.CaptureFixture[str]) -> None:
    """Longer deadlines overflow inside gRPC and end at once (DEADLINE_EXCEEDED, exit 3)."""
    async with running_producer() as server:
        code = await run_cli("--target", server.target, "--rpc-timeout", "604800", "info")
        assert code == cli.EXIT_OK, capsys.readouterr().err
        capsys.readouterr()
        for seconds in ("1e10", "604801", "nan", "inf"):
            with pytest.raises(SystemExit) as exit_:
                cli.main(["--target", server.target, "--rpc-timeout", seconds, "info"])
            assert exit_.value.code == cli.EXIT_USAGE
            err = capsys.readouterr().err
            expected = "expected seconds > 0 and <= 604800 (one week)"
            assert f"--rpc-timeout: {expected}, got {seconds!r}" in err


@pytest.mark.parametrize("option", ["--tls-ca", "--tls-cert", "--tls-key"])
async def test_tls_file_without_pem_is_a_usage_error(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_pem = tmp_path / "ca.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a not a PEM file")
    pair = {"--tls-cert": "--tls-key", "--tls-key": "--tls-cert"}.get(option)
    extra = [pair, str(not_pem)] if pair else []
    async with running_producer() as server:
        code = await run_cli("--target", server.target, option, str(not_pem), *extra, "info")
    assert code == cli.EXIT_USAGE
    assert f"{not_pem}: holds no PEM block" in capsys.readouterr().err


async def test_empty_token_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    async with running_producer(park_token="p-secret") as server:
        code = await run_cli("--target", server.target, "--token-file", str(empty), "info")
    assert code == cli.EXIT_USAGE
    assert f"{empty}: the token file is empty" in capsys.readouterr().err


@pytest.mark.parametrize("token", ["\ufeffp-secret", "p-sécret", "p\x01secret", "two words"])
async def test_token_grpc_cannot_send_is_a_usage_error(
    token: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "token"
    path.write_text(token + "\n", encoding="utf-8")
    async with running_producer(park_token="p-secret") as server:
        code = await run_cli("--target", server.target, "--token-file", str(path), "info")
        assert code == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert f"{path}: expected a non-empty token of printable ASCII" in err
        assert token not in err
        monkeypatch.setenv("KVPARK_TOKEN", token)
        assert await run_cli("--target", server.target, "info") == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert "KVPARK_TOKEN: expected a non-empty token of printable ASCII" in err
        assert token not in err
