"""The container health probe, `python -m kvpark.producer.healthcheck`, against real producers:
it dials the address the producer's own configuration gives (its JSON file and KVPARK_
variables), and refuses a deadline it could not keep as a usage error rather than reporting a
healthy producer unhealthy (a liveness probe would restart it)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import running_producer


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}
    return subprocess.run(
        [sys.executable, "-m", "kvpark.producer.healthcheck", *args],
        capture_output=True, text=True, timeout=60, env={**base, **(env or {})},
    )  # fmt: skip


async def test_probe_dials_the_listen_of_the_producers_config_file(tmp_path: Path) -> None:
    async with running_producer() as server:
        path = tmp_path / "kvpark.json"
        path.write_text(json.dumps({"listen": server.target}))
        result = await asyncio.to_thread(probe, env={"KVPARK_CONFIG": str(path)})
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.strip() == f"healthy: {server.target} (server): SERVING"
        # The environment wins over the file, as for the producer.
        wildcard = f"0.0.0.0:{server.port}"
        env = {"KVPARK_CONFIG": str(path), "KVPARK_LISTEN": wildcard, "KVPARK_PARK_TOKEN": "p"}
        result = await asyncio.to_thread(probe, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith(f"healthy: 127.0.0.1:{server.port} ")
        # A deadline of a week is kept; a longer one is a usage error (below).
        result = await asyncio.to_thread(probe, "--target", server.target, "--timeout", "604800")
        assert result.returncode == 0, result.stdout + result.stderr


def test_probe_reports_a_configuration_the_producer_would_refuse() -> None:
    result = probe(env={"KVPARK_LISTEN": "nowhere"})
    assert result.returncode == 1
    assert result.stdout.startswith("unhealthy: the producer's configuration is invalid: listen:")


@pytest.mark.parametrize("timeout", ["nan", "inf", "1e10", "0", "-1", "604801"])
def test_probe_timeout_out_of_range_is_a_usage_error(timeout: str) -> None:
    result = probe("--timeout", timeout)
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        f"argument --timeout: expected seconds > 0 and <= 604800 (one week), got {timeout!r}"
        in result.stderr
    )
