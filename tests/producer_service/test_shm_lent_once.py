"""The producer maps each memfd once. Every lend is a mapping of its own, prefaulted, with page
tables the producer pays for while the client pays for the memory once; so a lend of a memfd
that is lent and mapped already, over any connection and for either role, is refused with a
reason that says so, and the producer still maps it once. Released (and unmapped), it may be
lent again. A real producer process; what it maps is read from /proc."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from conftest import MiB, ProducerProcess, memfds_held, wait_for

from kvpark.shm import ALREADY_LENT, FETCH_ROLE, PARK_ROLE, SharedBuffer, ShmLender, ShmRefused

# Lends of one buffer tried over each connection: far fewer than the 64 a connection may hold.
TRIES = 16


def test_a_memfd_lent_already_is_refused_over_any_connection_until_released(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    producer = producer_process(shm_socket=shm_socket)
    pid = producer.proc.pid
    name = f"kvpark-once-{os.getpid()}"
    with (
        ShmLender(shm_socket, None, 5.0) as first,
        ShmLender(shm_socket, None, 5.0) as second,
        SharedBuffer(4 * MiB, name) as buffer,
    ):
        first.connect()
        second.connect()
        lend_id = first.lend(buffer, FETCH_ROLE)
        for lender, role in ((first, FETCH_ROLE), (second, FETCH_ROLE), (second, PARK_ROLE)):
            for _ in range(TRIES):
                with pytest.raises(ShmRefused) as refused:
                    lender.lend(buffer, role)
                assert refused.value.reason.startswith(ALREADY_LENT), refused.value
            assert lender.connected, "a refusal leaves the connection as it was"
        # The descriptor a lend brought is closed just after its answer went out.
        wait_for(lambda: memfds_held(pid, name) == 1, what="the one mapping alone")
        assert first.release(lend_id) is True
        wait_for(lambda: memfds_held(pid, name) == 0, what="the released lend unmapped")
        second.lend(buffer, PARK_ROLE)
        wait_for(lambda: memfds_held(pid, name) == 1, what="the new lend's mapping alone")
