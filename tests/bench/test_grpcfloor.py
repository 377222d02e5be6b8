"""The bare-gRPC floor (benchmarks/grpcfloor.py): its server process and client, small.

The quick benchmark runs the floor at full size; these check the path on a few MB: the
prepared window arrives byte for byte in the caller's array as the prepared number of
messages, a request that was not prepared is refused rather than served, and the client's
channel carries the consumer client's own options.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks import data
from benchmarks.clients import zeroed
from benchmarks.grpcfloor import FloorClient, FloorServer, consumer_channel_options
from benchmarks.transfer import check_loaded

# The lab (benchmarks/), outside the wheel: run with -m slow.
pytestmark = pytest.mark.slow

MiB = 1024 * 1024
NBYTES = 3 * MiB + 5  # a short last message too
WINDOWS = 2


@pytest.fixture(scope="module")
def floor() -> Iterator[FloorClient]:
    server = FloorServer(data.source_size(NBYTES, WINDOWS))
    try:
        client = FloorClient(server.ready(), 1 * MiB)
        try:
            yield client
        finally:
            client.close()
    finally:
        server.close()


def test_streams_the_prepared_window_byte_for_byte(floor: FloorClient) -> None:
    source = data.pattern(data.source_size(NBYTES, WINDOWS))
    dest = zeroed(NBYTES)
    for window_no in range(WINDOWS):
        request, count = floor.prepare(window_no, NBYTES, 1 * MiB)
        assert count == 4
        dest.fill(0)
        result = floor.load(request, count, dest, 30.0)
        check_loaded(request, result, count, dest, data.window(source, window_no, NBYTES))
        assert result.seconds > 0


def test_refuses_a_request_that_was_not_prepared(floor: FloorClient) -> None:
    _, count = floor.prepare(0, NBYTES, 1 * MiB)
    result = floor.load(f"1 {NBYTES} {MiB}", count, zeroed(NBYTES), 30.0)  # window 1
    assert not result.ok and result.reason.startswith("FAILED_PRECONDITION")
    assert result.chunks == 0


def test_channel_options_are_the_consumer_clients_with_room_for_the_message() -> None:
    small = dict(consumer_channel_options(1 * MiB))
    large = dict(consumer_channel_options(64 * MiB))
    assert "grpc.keepalive_time_ms" in small and "grpc.http2.max_frame_size" in small
    assert small["grpc.max_receive_message_length"] > 1 * MiB
    assert large["grpc.max_receive_message_length"] > 64 * MiB
    # The message limits (receive, and send since the clients park too) follow the size; no
    # other option does.
    sized = {"grpc.max_receive_message_length", "grpc.max_send_message_length"}
    assert {k: v for k, v in small.items() if k not in sized} == {
        k: v for k, v in large.items() if k not in sized
    }
