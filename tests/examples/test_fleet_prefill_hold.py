"""A prefill node's hold_rest: the first part parks at once, the rest only on /finish.

The first part is never empty (a batch of no chunks is no park): a one-chunk request is parked
whole and nothing is held. A rest is held only once its first part parked; one whose first
part failed would never be finished, so /finish must find nothing of it.

PrefillNode is driven directly, parking into a real producer (or, for the failure, into a
port where none listens).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ProducerProcess, example, free_port, process_producer

from kvpark import KVParker, Timeout

pytestmark = pytest.mark.timeout(60)


fleet_prefill = example("fleet_prefill")


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProducerProcess]:
    with process_producer(tmp_path_factory.mktemp("producer")) as p:
        yield p


def node_for(target: str, parker: KVParker) -> Any:
    # The node's own producer child is not needed: only /prefill and /finish are called.
    return fleet_prefill.PrefillNode("p1", parker, None, epoch=0, advertised=target)


def prefill(node: Any, rid: str, chunks: int) -> Any:
    body = {"request_id": rid, "chunks": chunks, "chunk_bytes": 1024, "hold_rest": True}
    status, answer = node.prefill(body)
    assert status == 200, answer
    return answer


def test_a_one_chunk_request_is_parked_whole(producer: ProducerProcess) -> None:
    with KVParker(producer.target, timeout=Timeout(total_s=10)) as parker:
        node = node_for(producer.target, parker)
        answer = prefill(node, "hold-one", 1)
        assert answer["park"]["ok"], answer
        assert answer["park"]["chunks_parked"] == 1
        assert answer["handle"]["num_chunks"] == 1
        status, _ = node.finish({"request_id": "hold-one"})
        assert status == 404


def test_the_rest_is_held_until_finish(producer: ProducerProcess) -> None:
    with KVParker(producer.target, timeout=Timeout(total_s=10)) as parker:
        node = node_for(producer.target, parker)
        answer = prefill(node, "hold-three", 3)
        assert answer["park"]["chunks_parked"] == 1, answer
        status, finished = node.finish({"request_id": "hold-three"})
        assert status == 200 and finished["park"]["ok"], finished
        # chunks_parked counts the id's chunks on the producer, all batches.
        assert finished["park"]["chunks_parked"] == 3


def test_a_rest_whose_first_part_failed_is_not_held() -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    with KVParker(target, timeout=Timeout(total_s=5)) as parker:
        node = node_for(target, parker)
        answer = prefill(node, "hold-lost", 4)
        assert not answer["park"]["ok"] and answer["handle"] is None, answer
        status, _ = node.finish({"request_id": "hold-lost"})
        assert status == 404


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_the_driver_expects_the_part_the_node_parks(producer: ProducerProcess, chunks: int) -> None:
    """The driver and its report judge a "streamed" request by `Shape.first_part`, the chunks
    parked at once: the count the node parks, for every size (one chunk included)."""
    with KVParker(producer.target, timeout=Timeout(total_s=10)) as parker:
        answer = prefill(node_for(producer.target, parker), f"hold-size-{chunks}", chunks)
    assert answer["park"]["chunks_parked"] == example("fleet_kv").Shape(chunks, 1).first_part
