"""A peer with no token cannot hold the producer's `max_concurrent_rpcs`: a refused call is
answered without waiting for its request message, so calls that send HEADERS and never a
message are ended at once and the slots stay free for token holders."""

from __future__ import annotations

import logging

import grpc
import pytest
from conftest import running_producer, wait_until
from h2_headers import HeadersOnlyClient

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer.first_message import FIRST_MESSAGE_S
from kvpark.producer.open_streams import OPEN_STREAMS

PARK_TOKEN = "park-secret-5c1e08"
FETCH_TOKEN = "fetch-secret-93ad27"
LIMIT = 4  # max_concurrent_rpcs
ROUNDS = 3  # LIMIT streams per round: each round alone would take every slot
# Every kvpark method, of every cardinality; the unary-request ones are those whose handler
# grpc would otherwise start only once a message arrived.
METHODS = ("Release", "Fetch", "Lookup", "KeepAlive", "GetServerInfo", "Park")


async def _ended_or_closed(raw: HeadersOnlyClient, streams: set[int]) -> None:
    await wait_until(
        lambda: streams <= raw.ended or raw.closed,
        timeout=10,
        what="the server to end every token-less HEADERS-only call",
    )


async def test_headers_only_calls_without_a_token_hold_no_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvpark")
    async with running_producer(
        park_token=PARK_TOKEN, fetch_token=FETCH_TOKEN, max_concurrent_rpcs=LIMIT
    ) as server:
        host, port = server.target.rsplit(":", 1)
        raw = HeadersOnlyClient(host, int(port))
        try:
            opened = 0
            for _ in range(ROUNDS):
                # At most LIMIT at once, so the server's own limit never answers them: each
                # must be ended by the refusal itself, while the connection stays up.
                batch = {
                    raw.open_stream(
                        f"/kvpark.v1.KVProducer/{METHODS[(opened + i) % len(METHODS)]}",
                        server.target,
                    )
                    for i in range(LIMIT)
                }
                opened += LIMIT
                await _ended_or_closed(raw, batch)
                assert not raw.closed, "the server closed the connection instead"
                assert batch <= raw.ended

            # The token-less connection is still open; a token holder gets every slot.
            async with grpc.aio.insecure_channel(server.target) as ch:
                stub = pb_grpc.KVProducerStub(ch)
                for _ in range(LIMIT + 1):
                    answer = await stub.Lookup(
                        pb.LookupRequest(kv_request_ids=["a"]),
                        metadata=(("authorization", f"Bearer {FETCH_TOKEN}"),),
                        timeout=10,
                    )
                    assert [s.kv_request_id for s in answer.states] == ["a"]
            assert not raw.closed
        finally:
            raw.close()

        # Every one of them was refused by the token check (logged once per peer, the rest
        # counted), not by anything else.
        logged = [r for r in caplog.records if r.getMessage() == "call refused"]
        codes = [getattr(r, "kv", {}).get("code") for r in logged]
        assert codes == ["UNAUTHENTICATED"] * len(logged)
        suppressed = server.metrics.registry.get_sample_value(
            "kvpark_suppressed_warnings_total", {"kind": "auth"}
        )
        assert len(logged) + (suppressed or 0) == ROUNDS * LIMIT


@pytest.mark.parametrize("method", ["Check", "Watch"])
async def test_health_calls_that_never_send_their_request_hold_only_the_open_places(
    method: str,
) -> None:
    """Health stays open without a token, but a health call that sends HEADERS and never its
    request holds one of a bounded number of places (OPEN_STREAMS), ended after
    FIRST_MESSAGE_S; the rest are refused at once, and a token holder still gets through."""
    async with running_producer(
        park_token=PARK_TOKEN, fetch_token=FETCH_TOKEN, max_concurrent_rpcs=24
    ) as server:
        host, port = server.target.rsplit(":", 1)
        raw = HeadersOnlyClient(host, int(port))
        try:
            path = f"/grpc.health.v1.Health/{method}"
            streams = [raw.open_stream(path, server.target) for _ in range(30)]
            await wait_until(
                lambda: len(raw.ended & set(streams)) >= 30 - OPEN_STREAMS,
                what="the calls beyond the open places refused",
            )
            async with grpc.aio.insecure_channel(server.target) as ch:
                answer = await pb_grpc.KVProducerStub(ch).Lookup(
                    pb.LookupRequest(kv_request_ids=["a"]),
                    metadata=(("authorization", f"Bearer {FETCH_TOKEN}"),),
                    timeout=10,
                )
                assert [s.kv_request_id for s in answer.states] == ["a"]
            # The waiting ones end by themselves once their request is overdue.
            await wait_until(
                lambda: set(streams) <= raw.ended,
                timeout=FIRST_MESSAGE_S + 10,
                what="every silent health call ended",
            )
            assert not raw.closed
        finally:
            raw.close()
