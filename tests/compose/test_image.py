"""The producer image run on its own, as `docker run` users run it: its addresses come from the
environment, which its health probe reads too: `-e KVPARK_LISTEN=...` moves the producer,
`-e KVPARK_HEALTH_LISTEN=...` moves its health port and the probe with it, and
`-e KVPARK_METRICS_LISTEN=` turns metrics off."""

from __future__ import annotations

import re
import secrets
import time

import pytest

from .stack import IMAGE, docker

pytestmark = [pytest.mark.compose, pytest.mark.timeout(300)]


def serving_line(name: str) -> str:
    """The producer's 'producer serving' log line, once it is there."""
    deadline = time.monotonic() + 60
    while True:
        state = docker("inspect", "-f", "{{.State.Status}}", name).stdout.strip()
        result = docker("logs", name)
        logs = result.stdout + result.stderr
        if found := re.search(r"^.*producer serving.*$", logs, re.M):
            return found.group(0)
        assert state == "running", f"the producer ended:\n{logs}"
        assert time.monotonic() < deadline, f"no 'producer serving' within 60 s:\n{logs}"
        time.sleep(0.2)  # polling the container's log, not waiting for time to pass


def test_the_environment_moves_the_producer_and_its_probe_together(kvpark_image: None) -> None:
    name = f"kvpark-test-image-{secrets.token_hex(4)}"
    docker(
        "run", "-d", "--name", name, "--network", "none",
        "-e", "KVPARK_LISTEN=0.0.0.0:6000",
        "-e", "KVPARK_HEALTH_LISTEN=127.0.0.1:6001",
        "-e", "KVPARK_METRICS_LISTEN=",
        "-e", "KVPARK_POOL_BYTES=64MiB",
        # The tokens only satisfy the non-loopback rule; nothing reaches this producer.
        "-e", f"KVPARK_PARK_TOKEN=park-{secrets.token_hex(8)}",
        "-e", f"KVPARK_FETCH_TOKEN=fetch-{secrets.token_hex(8)}",
        IMAGE,
        timeout=120,
    )  # fmt: skip
    try:
        line = serving_line(name)
        assert "port=6000" in line and "metrics_port=0 " in line, line
        assert "health_port=6001" in line, line
        # What the image's HEALTHCHECK runs, run now rather than at its next interval.
        probe = docker(
            "exec", name, "python", "-m", "kvpark.producer.healthcheck", "--timeout", "3",
            check=False,
        )  # fmt: skip
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert "127.0.0.1:6001" in probe.stdout and "SERVING" in probe.stdout, probe.stdout
    finally:
        docker("rm", "-f", name, check=False)
