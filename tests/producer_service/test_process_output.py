"""A producer run as a process by the tests keeps serving however much it logs: its output is
read as it comes (a pipe nobody reads holds about 64 KiB, after which the producer would block
on its next log line, and every call with it)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import ProducerProcess

from kvpark import KVParker, Timeout

pytestmark = pytest.mark.timeout(120)

# Each Release logs a line of about 200 bytes: 1,000 of them fill a pipe three times over.
RELEASES = 1000


def test_a_process_producer_serves_past_a_pipe_full_of_logs(
    producer_process: Callable[..., ProducerProcess],
) -> None:
    producer = producer_process()
    with KVParker(producer.target, timeout=Timeout(total_s=5)) as parker:
        for i in range(RELEASES):
            kid = f"logged-{i}"
            assert parker.park(kid, {0: b"kv"}).ok
            assert parker.release(kid).ok
    producer.proc.terminate()
    assert sum("released" in line for line in producer.output().splitlines()) >= RELEASES
