"""A client with interceptors, closed while a call is still inside one (an auth refresh, a
retry's back-off): the call then meets a closed channel. It must end as a call that close()
cancelled: a CANCELLED load, ClientClosedError for a park, a streamed batch or a unary call.
grpc's streaming interceptors hold back any exception raised while the call is built and
raise it only when the call is read, so it used to surface as a bare ValueError. No producer
is needed: the calls never leave the client."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from kvpark import ClientClosedError, KVConsumer, KVParker, Reason

UNREACHABLE = "127.0.0.1:1"


class HeldUntilClosed(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
):  # type: ignore[misc]
    """Holds the first call of every kind until `go_on` is set."""

    def __init__(self) -> None:
        self.entered, self.go_on = threading.Event(), threading.Event()

    def _hold(self) -> None:
        self.entered.set()
        assert self.go_on.wait(30)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self._hold()
        return continuation(details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self._hold()
        return continuation(details, request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        self._hold()
        return continuation(details, requests)


def closed_while_held(client: Any, held: HeldUntilClosed, call: Callable[[], Any]) -> Any:
    """Runs `call` on a thread, closes `client` while the call is in the interceptor, lets
    the call go on, and returns what it returned or raised."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test to judge
            outcome["value"] = exc

    caller = threading.Thread(target=run)
    caller.start()
    assert held.entered.wait(30)
    client.close()
    held.go_on.set()
    caller.join(30)
    assert not caller.is_alive()
    return outcome["value"]


def test_a_load_held_in_an_interceptor_past_close_ends_cancelled() -> None:
    held = HeldUntilClosed()
    consumer = KVConsumer(UNREACHABLE, interceptors=[held], transport="grpc", timeout=30)
    result = closed_while_held(consumer, held, lambda: consumer.load("held"))
    assert not isinstance(result, BaseException), repr(result)
    assert result.reason is Reason.CANCELLED, result


def test_a_lookup_held_in_an_interceptor_past_close_raises_client_closed() -> None:
    held = HeldUntilClosed()
    consumer = KVConsumer(UNREACHABLE, interceptors=[held], timeout=30)
    raised = closed_while_held(consumer, held, lambda: consumer.lookup(["held"]))
    assert isinstance(raised, ClientClosedError), repr(raised)


@pytest.mark.parametrize("call", ["release", "server_info"])
def test_a_parkers_unary_call_held_in_an_interceptor_past_close_raises_client_closed(
    call: str,
) -> None:
    held = HeldUntilClosed()
    parker = KVParker(UNREACHABLE, interceptors=[held], timeout=30)
    unary = (lambda: parker.release("held")) if call == "release" else parker.server_info
    raised = closed_while_held(parker, held, unary)
    assert isinstance(raised, ClientClosedError), repr(raised)


def test_a_park_held_in_an_interceptor_past_close_raises_client_closed() -> None:
    held = HeldUntilClosed()
    parker = KVParker(UNREACHABLE, interceptors=[held], transport="grpc", timeout=30)
    raised = closed_while_held(parker, held, lambda: parker.park("held", [np.ones(8, np.uint8)]))
    assert isinstance(raised, ClientClosedError), repr(raised)


def test_a_streamed_batch_held_in_an_interceptor_past_close_raises_client_closed() -> None:
    held = HeldUntilClosed()
    parker = KVParker(UNREACHABLE, interceptors=[held], transport="grpc", timeout=30)

    def park() -> Any:
        with parker.batch("held", total_chunks=1) as batch:
            batch.put(0, np.ones(8, np.uint8))
        return batch.result

    raised = closed_while_held(parker, held, park)
    assert isinstance(raised, ClientClosedError), repr(raised)
