"""The container health probe, `python -m kvpark.producer.healthcheck`, against real producers:
it dials the address KVPARK_LISTEN gives, and refuses a deadline it could not keep as a usage
error rather than reporting a healthy producer unhealthy (a liveness probe would restart it)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from conftest import running_producer


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}
    return subprocess.run(
        [sys.executable, "-m", "kvpark.producer.healthcheck", *args],
        capture_output=True, text=True, timeout=60, env={**base, **(env or {})},
    )  # fmt: skip


async def test_probe_dials_kvpark_listen_and_ignores_what_it_cannot_judge() -> None:
    """KVPARK_LISTEN names the producer (a wildcard host is probed on loopback); other
    variables, even ones the producer would refuse on their own (a wildcard listen needs
    tokens or TLS, which may come as flags), do not make a serving producer unhealthy."""
    async with running_producer() as server:
        env = {"KVPARK_LISTEN": f"0.0.0.0:{server.port}", "KVPARK_TOMBSTONE_RETENTION_S": "1"}
        result = await asyncio.to_thread(probe, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith(f"healthy: 127.0.0.1:{server.port} ")
        # A deadline of a week is kept; a longer one is a usage error (below).
        result = await asyncio.to_thread(probe, "--target", server.target, "--timeout", "604800")
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("timeout", ["nan", "inf", "1e10", "0", "-1", "604801"])
def test_probe_timeout_out_of_range_is_a_usage_error(timeout: str) -> None:
    result = probe("--timeout", timeout)
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        f"argument --timeout: expected seconds > 0 and <= 604800 (one week), got {timeout!r}"
        in result.stderr
    )
