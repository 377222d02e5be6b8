"""A lend released after a shm Fetch that ended with an error is unmapped when its release is
answered, not at the producer's next cyclic garbage collection. A handler that ends by raising
(OUT_OF_RANGE: the next chunk does not fit in the lent range) leaves its frame in a reference
cycle with the exception's traceback; nothing the frame holds may keep the lend's mapping (and
the client's memfd with it) open. A real producer process, idle once the release is answered,
so no allocation of its own runs the collector; what it maps is read from /proc."""

from __future__ import annotations

import os
from collections.abc import Callable

import grpc
import pytest
from conftest import MiB, ProducerProcess, channel_options, memfds_held, park_requests, wait_for

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.shm import FETCH_ROLE, SharedBuffer, ShmLender


def test_a_lend_released_after_an_out_of_range_fetch_is_unmapped(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    producer = producer_process(shm_socket=shm_socket)
    pid = producer.proc.pid
    name = f"kvpark-abort-{os.getpid()}"
    with grpc.insecure_channel(producer.target, options=channel_options()) as channel:
        stub = pb_grpc.KVProducerStub(channel)
        stub.Park(iter(park_requests("kv", {0: bytes(MiB), 1: bytes(MiB)})), timeout=10)
        with ShmLender(shm_socket, None, 5.0) as lender, SharedBuffer(4 * MiB, name) as buffer:
            lender.connect()
            lend_id = lender.lend(buffer, FETCH_ROLE)
            wait_for(lambda: memfds_held(pid, name) == 1, what="the producer's mapping")
            # Room for chunk 0 and one byte more: chunk 1 does not fit.
            request = pb.FetchRequest(
                kv_request_id="kv",
                accept_transports=[pb.TRANSPORT_SHM],
                shm_lend_id=lend_id,
                shm_length=MiB + 1,
            )
            with pytest.raises(grpc.RpcError) as ended:
                list(stub.Fetch(request, timeout=10))
            assert ended.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert lender.release(lend_id) is True
            wait_for(
                lambda: memfds_held(pid, name) == 0,
                timeout=5,
                what="the released lend unmapped by the producer",
            )
