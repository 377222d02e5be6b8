"""The ablation's producer set-ups (benchmarks/ablation.py) still speak the contract.

Each set-up wraps the real servicer differently; when the servicer's shape changes, a wrapper
can break without any figure saying so until someone reruns the 580 MB ablation. Here each
producer variant parks and serves a small request to the ordinary generated stubs: every byte,
the final TransferDone, and a late fetch's one-message REAPED answer.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import grpc
import pytest
from conftest import MiB, channel_options, park_requests, wait_for

from benchmarks.env import ProducerProcess, ProducerSettings
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc

SETTINGS = ProducerSettings(pool_bytes=16 * MiB, max_chunk_bytes=1 * MiB)


@pytest.mark.parametrize("variant", ["shipped", "no-alloc", "protobuf"])
def test_variant_parks_and_serves_with_generated_stubs(variant: str) -> None:
    producer = ProducerProcess(
        replace(SETTINGS, unbound_store_timeout_s=0.5),
        command=[sys.executable, "-m", "benchmarks.ablation", "producer", variant, "--"],
        allocator_fix=variant != "no-alloc",
    )
    try:
        with grpc.insecure_channel(producer.target, options=channel_options()) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            chunks = {c: bytes([c + 1]) * (300_000 + c) for c in range(3)}
            parked = stub.Park(iter(park_requests("kept", chunks, total=3)), timeout=30)
            assert parked.status == pb.STATUS_OK and parked.chunks_parked == 3
            replies = list(stub.Fetch(pb.FetchRequest(kv_request_id="kept"), timeout=30))
            assert {r.chunk.chunk_id: r.chunk.data for r in replies[:-1]} == chunks
            assert replies[-1].done.status == pb.STATUS_OK and replies[-1].done.chunks_sent == 3

            stub.Park(iter(park_requests("gone", {0: b"x"}, total=1)), timeout=30)
            wait_for(
                lambda: (
                    stub.Lookup(pb.LookupRequest(kv_request_ids=["gone"])).states[0].reason
                    == pb.REASON_REAPED
                ),
                what="the unfetched id to be reaped",
            )
            late = list(stub.Fetch(pb.FetchRequest(kv_request_id="gone"), timeout=30))
            assert len(late) == 1 and late[0].done.reason == pb.REASON_REAPED
    finally:
        producer.stop()
