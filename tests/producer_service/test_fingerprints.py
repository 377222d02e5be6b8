"""Fingerprints at the producer (docs/protocol.md, Fingerprints): an id parked with one is
handed only to a Fetch that names the same or none; a Fetch that names another, or names one
for an id parked without, ends FINGERPRINT_MISMATCH before any chunk with the id as it was,
also when it was bound before the first commit; every batch of an id names the same. Real
producer, generated stubs."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from conftest import (
    fetch_all,
    park,
    park_requests,
    running_producer,
    state_of,
    stub_for,
    wait_until,
)

from kvpark.fingerprints import MAX_FINGERPRINT_BYTES, fingerprint
from kvpark.pb import kvpark_pb2 as pb

OURS = fingerprint("model-a", [1, 2, 3])
THEIRS = fingerprint("model-b", [1, 2, 3])
CHUNKS = {0: b"a" * 1000, 1: b"b" * 1000}


def ended(messages: list[pb.FetchResponse]) -> pb.TransferDone:
    assert all(m.WhichOneof("kind") == "done" for m in messages), "a chunk was sent"
    return messages[-1].done


async def test_a_fetch_gets_the_id_only_with_its_fingerprint_or_none() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        assert (await park(stub, "kv", CHUNKS, fingerprint=OURS)).status == pb.STATUS_OK
        done = ended(await fetch_all(stub, "kv", expected_fingerprint=THEIRS))
        assert (done.status, done.reason) == (pb.STATUS_FAILED, pb.REASON_FINGERPRINT_MISMATCH)
        assert f"parked is {OURS[:8].hex()}" in done.detail
        assert f"expected is {THEIRS[:8].hex()}" in done.detail
        state = await state_of(stub, "kv")
        assert state.state == pb.STATE_PARKED and state.chunks_parked == 2
        assert state.fingerprint == OURS  # Lookup shows which prompt the id holds
        got = await fetch_all(stub, "kv", expected_fingerprint=OURS)
        assert got[-1].done.status == pb.STATUS_OK
        assert b"".join(m.chunk.data for m in got[:-1]) == CHUNKS[0] + CHUNKS[1]
        # No expectation: no check (a consumer that does not use fingerprints).
        assert (await fetch_all(stub, "kv"))[-1].done.status == pb.STATUS_OK
        server.lot.check_invariants()


async def test_an_id_parked_without_a_fingerprint_fails_a_fetch_that_expects_one() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        assert (await park(stub, "kv", CHUNKS)).status == pb.STATUS_OK
        done = ended(await fetch_all(stub, "kv", expected_fingerprint=OURS))
        assert done.reason == pb.REASON_FINGERPRINT_MISMATCH
        assert "parked is none" in done.detail
        state = await state_of(stub, "kv")
        assert state.state == pb.STATE_PARKED and state.fingerprint == b""
        server.lot.check_invariants()


async def test_a_fetch_bound_before_the_first_commit_is_judged_by_it() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        early = asyncio.ensure_future(
            fetch_all(stub, "kv", expected_fingerprint=OURS, wait_timeout_s=10)
        )
        await wait_until(lambda: server.lot.bound_count == 1, what="the early Fetch bound")
        assert (await park(stub, "kv", CHUNKS, fingerprint=THEIRS)).status == pb.STATUS_OK
        done = ended(await asyncio.wait_for(early, 10))
        assert done.reason == pb.REASON_FINGERPRINT_MISMATCH
        state = await state_of(stub, "kv")
        assert state.state == pb.STATE_PARKED and state.chunks_parked == 2
        server.lot.check_invariants()


async def test_an_empty_commit_fixes_no_fingerprint() -> None:
    """A batch that commits no chunk parks nothing: a Fetch already waiting for the id with a
    fingerprint, and the batch that brings the KV with it, are judged by the real commit."""
    async with running_producer() as server, stub_for(server) as stub:
        waiting = asyncio.ensure_future(
            fetch_all(stub, "kv", expected_fingerprint=OURS, wait_timeout_s=10)
        )
        await wait_until(lambda: server.lot.bound_count == 1, what="the early Fetch bound")
        real = stub.Park()
        for message in park_requests("kv", CHUNKS, total=2, fingerprint=OURS)[:-1]:
            await real.write(message)
        await wait_until(lambda: server.lot.statistics().open_batches == 1, what="batch open")
        assert (await park(stub, "kv", {})).status == pb.STATUS_OK  # empty, no fingerprint
        assert (await state_of(stub, "kv")).fingerprint == b""
        await real.write(park_requests("kv", CHUNKS)[-1])
        assert (await real).status == pb.STATUS_OK
        got = await asyncio.wait_for(waiting, 10)
        assert got[-1].done.status == pb.STATUS_OK, got[-1].done
        assert b"".join(m.chunk.data for m in got[:-1]) == CHUNKS[0] + CHUNKS[1]
        server.lot.check_invariants()


async def test_every_batch_of_an_id_names_the_same_fingerprint() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        first = {0: CHUNKS[0]}
        assert (await park(stub, "kv", first, total=2, fingerprint=OURS)).status == pb.STATUS_OK
        for other in (THEIRS, b""):
            answer = await park(stub, "kv", {1: CHUNKS[1]}, total=2, fingerprint=other)
            assert answer.reason == pb.REASON_FINGERPRINT_MISMATCH, answer
        # Two batches open at once, the first commit fixes it: the other's commit is refused.
        one = stub.Park()
        other = stub.Park()
        for call, fp in ((one, b""), (other, THEIRS)):
            for message in park_requests("kv2", {0: CHUNKS[0]}, fingerprint=fp)[:-1]:
                await call.write(message)
        # Both headers taken (a header after the first commit is refused at once).
        await wait_until(lambda: server.lot.statistics().open_batches == 2, what="two batches")
        await one.write(park_requests("kv2", {0: CHUNKS[0]})[-1])
        assert (await one).status == pb.STATUS_OK
        await other.write(park_requests("kv2", {0: CHUNKS[0]})[-1])
        answer = await other
        assert answer.reason == pb.REASON_FINGERPRINT_MISMATCH, answer
        state = await state_of(stub, "kv")
        assert state.chunks_parked == 1
        server.lot.check_invariants()


@pytest.mark.parametrize("where", ["park", "fetch"])
async def test_a_fingerprint_longer_than_64_bytes_is_invalid(where: str) -> None:
    too_long = b"x" * (MAX_FINGERPRINT_BYTES + 1)
    async with running_producer() as server, stub_for(server) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            if where == "park":
                await park(stub, "kv", CHUNKS, fingerprint=too_long)
            else:
                await fetch_all(stub, "kv", expected_fingerprint=too_long)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 64 bytes" in (raised.value.details() or "")
        assert (await state_of(stub, "kv")).state == pb.STATE_UNKNOWN
        server.lot.check_invariants()


def test_the_fingerprint_is_stable_and_separates_its_inputs() -> None:
    assert fingerprint("m", [1, 2, 3]) == fingerprint("m", (1, 2, 3))
    assert len(fingerprint("m", [1])) == 16
    distinct = {
        fingerprint("m", [1, 2, 3]),
        fingerprint("m", [1, 2]),
        fingerprint("m2", [1, 2, 3]),
        fingerprint("m", [1, 2, 3], "lora-x"),
        fingerprint("m", [1, 2, 3], b"lora-x", b""),
        fingerprint("m", [12, 3]),
    }
    assert len(distinct) == 6
    # A fixed vector: prefill and decode hosts on different builds must agree on the encoding.
    assert fingerprint("model-a", [1, 2, 3]).hex() == "ca1d60970def539bd7ab4456d8fa2c5d"
    with pytest.raises(ValueError, match="model"):
        fingerprint("", [1])
    # What would hash like another prompt's tokens, or not fit, is refused.
    for bad in ([1.7], [True], [2**63], [[1, 2]]):
        with pytest.raises(ValueError, match="token_ids"):
            fingerprint("m", bad)
    assert fingerprint("m", np.array([1, 2, 3], np.uint32)) == fingerprint("m", [1, 2, 3])
