"""A prefill node's producer child is killed once; asking again only describes how it ended.

`ProducerChild` starts `kvpark-producer` from PATH; here a stand-in script of that name takes
its place, so the test needs no producer, only a process to kill. Once the waitpid thread has
reaped the child, its pid may belong to another process: a later kill must signal nothing and
must not move `killed_at`, and a child that exited by itself is described as it exited.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import example, wait_for

pytestmark = pytest.mark.timeout(60)


fleet_prefill = example("fleet_prefill")


@pytest.fixture
def child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], Any]]:
    """Starts a ProducerChild whose `kvpark-producer` runs the given shell line."""
    started: list[Any] = []

    def start(script: str) -> Any:
        stand_in = tmp_path / "kvpark-producer"
        stand_in.write_text(f"#!/bin/sh\n{script}\n")
        stand_in.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        started.append(fleet_prefill.ProducerChild("node-under-test"))
        return started[-1]

    yield start
    for c in started:  # a test that failed early must not leave its stand-in running
        if c.proc.returncode is None:
            c.proc.kill()
        c.proc.wait(10)


def test_a_second_kill_describes_the_first(child: Callable[[str], Any]) -> None:
    producer = child("exec sleep 600")
    first = producer.kill()
    assert first["returncode"] == -9 and not first["running"], first
    assert first["exit"] == "killed by SIGKILL"
    assert first["killed_at"] is not None
    assert producer.kill() == first


def test_a_child_that_exited_by_itself_is_not_killed(child: Callable[[str], Any]) -> None:
    producer = child("exit 3")
    wait_for(producer.exited.is_set, what="the stand-in producer to exit")
    ended = producer.kill()
    assert ended["returncode"] == 3 and ended["exit"] == "exited 3", ended
    assert ended["killed_at"] is None
