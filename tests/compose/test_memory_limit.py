"""The producer image under a real container memory limit (a cgroup the engine sets): a pool
that cannot fit is refused at start-up with one line naming `pool_bytes` (exit 2), where the
kernel would otherwise SIGKILL the producer while it touches the pool (exit 137, empty log);
a pool that fits with a thin margin starts, with a warning."""

from __future__ import annotations

import secrets
import time

import pytest

from .stack import IMAGE, Stack, docker

pytestmark = [pytest.mark.compose, pytest.mark.timeout(300)]


def run_args(memory: str, pool: str) -> list[str]:
    # No network at all: nothing reaches this producer, and the tokens only satisfy the
    # non-loopback rule of the image's 0.0.0.0 listen.
    return [
        "--network", "none",
        "--memory", memory, "--memory-swap", memory,
        "-e", f"KVPARK_POOL_BYTES={pool}",
        "-e", f"KVPARK_PARK_TOKEN=park-{secrets.token_hex(8)}",
        "-e", f"KVPARK_FETCH_TOKEN=fetch-{secrets.token_hex(8)}",
        IMAGE,
    ]  # fmt: skip


def test_pool_larger_than_the_memory_limit_is_refused(kvpark_image: None) -> None:
    result = docker("run", "--rm", *run_args("160m", "256MiB"), timeout=120, check=False)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    [line] = result.stderr.splitlines()
    assert line.startswith("kvpark-producer: config error: pool_bytes: 256 MiB does not fit")
    assert "cgroup memory." in line  # the container's limit, not the host's free memory


def test_pool_with_a_thin_margin_starts_and_warns(kvpark_image: None) -> None:
    name = f"kvpark-test-memory-{secrets.token_hex(4)}"
    docker("run", "-d", "--name", name, *run_args("384m", "256MiB"), timeout=120)
    try:
        deadline = time.monotonic() + 60
        logs = ""
        while "producer serving" not in logs:
            assert time.monotonic() < deadline, f"no 'producer serving' within 60 s:\n{logs}"
            state = docker("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", name)
            assert state.stdout.split()[0] == "running", (state.stdout, logs)
            result = docker("logs", name)
            logs = result.stdout + result.stderr
            time.sleep(0.2)  # polling the container's log, not waiting for time to pass
        assert "pool_bytes leaves" in logs and "Size the memory limit" in logs
    finally:
        docker("rm", "-f", name, check=False)


def test_demo_producer_serves_within_its_memory_limit(producer: Stack) -> None:
    """The compose demo sizes the producer's limit by the README's rule, so its start-up check
    reads the cgroup and finds the margin enough: no thin-margin warning."""
    assert int(producer.inspect("{{.HostConfig.Memory}}")) == 512 * 1024 * 1024
    result = docker("logs", producer.container())
    logs = result.stdout + result.stderr
    assert "producer serving" in logs
    assert "pool_bytes leaves" not in logs
