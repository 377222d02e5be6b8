"""Fixtures of the compose suite: the engine check, one image build, and the test stack.

Without a Docker engine the compose tests skip with one line (NO_ENGINE); under CI=true a
missing engine, compose CLI or base image is a failure instead, because CI is meant to run them
(.ci/run -> scripts/test.sh ensures the engine and the base image first).

The session's stack is its own compose project, `kvpark-test-<pid>`: docker-compose.yml plus
tests/compose/docker-compose.test.yml (short timeouts, producer ports published on 127.0.0.1 at
ports Docker picks). It is torn down with `down -v --remove-orphans` whatever happens, test
failure and Ctrl-C included. Fault tests stop, pause or restart the producer; the `producer`
fixture brings it back to healthy before every test, so the order of tests does not matter.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from .stack import BASE_IMAGE, DEMO_FILE, NO_ENGINE, TEST_FILE, Stack, compose_command, docker
from .stack import engine_problem as _engine_problem

IN_CI = os.environ.get("CI") == "true"
# Fresh per run, so nothing here depends on the demo values in docker-compose.yml.
PARK_TOKEN = "test-park-" + secrets.token_hex(8)
FETCH_TOKEN = "test-fetch-" + secrets.token_hex(8)
TOKENS_ENV = {"DEMO_PARK_TOKEN": PARK_TOKEN, "DEMO_FETCH_TOKEN": FETCH_TOKEN}


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skips (or, under CI=true, fails) compose tests when Docker is not usable. Raised from
    this hook rather than a fixture so that pytest folds all the skips into one summary line."""
    if item.get_closest_marker("compose") is None:
        return
    problem = _engine_problem()
    if problem is not None:
        if IN_CI:
            pytest.fail(f"{NO_ENGINE}: {problem} [CI=true: the compose tests must run]")
        pytest.skip(NO_ENGINE)
    if compose_command() is None:
        message = "compose tests: neither `docker compose` nor `docker-compose` works"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def docker_ready() -> None:
    """The base image the Dockerfile builds FROM is there (the engine was checked already)."""
    if docker("image", "inspect", BASE_IMAGE, check=False).returncode != 0:
        pytest.fail(
            f"compose tests: base image {BASE_IMAGE} is missing; run .ci/ensure-base-image.sh "
            "(or ./scripts/test.sh --docker), which pulls it or builds a local stand-in",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def kvpark_image(docker_ready: None) -> None:
    """Builds the kvpark image once per session (a warm cache makes this a few seconds)."""
    Stack(f"kvpark-test-build-{os.getpid()}", [DEMO_FILE]).build()


@pytest.fixture(scope="session")
def stack(kvpark_image: None) -> Iterator[Stack]:
    s = Stack(f"kvpark-test-{os.getpid()}", [DEMO_FILE, TEST_FILE], env=dict(TOKENS_ENV))
    s.down()  # a leftover of a crashed run with the same pid
    try:
        s.up("producer")
        s.wait_healthy()
        yield s
    finally:
        s.down()


@pytest.fixture
def producer(stack: Stack) -> Stack:
    """The session's stack with its producer running and healthy."""
    stack.ensure_producer()
    return stack
