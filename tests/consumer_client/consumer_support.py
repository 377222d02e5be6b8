"""Helpers for the consumer client tests: payloads, a recorder of the client's Fetch calls (the
path assertions: did the client cancel?), and sync waiting for threads and subprocesses.

The producers themselves come from tests/conftest.py (`running_producer`, `producer_process`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from conftest import park_requests

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc

KiB = 1024
MiB = 1024 * KiB
# What grpc puts in a call's details when the application cancelled it.
LOCAL_CANCEL = "Locally cancelled by application!"


def payload(n: int, size: int, seed: int = 0) -> dict[int, bytes]:
    """`n` chunks of `size` bytes (chunk i is `size + i` bytes, so offsets are checked too)."""
    rng = np.random.default_rng(seed)
    return {i: rng.bytes(size + i) for i in range(n)}


def joined(chunks: dict[int, bytes], order: Any = None) -> bytes:
    keys = sorted(chunks) if order is None else order
    return b"".join(chunks[i] for i in keys)


def park_sync(target: str, kid: str, chunks: dict[int, bytes], total: int = 0) -> pb.ParkResponse:
    """Parks with the ordinary generated stubs over a sync channel (for subprocess producers)."""
    options = [("grpc.max_send_message_length", 64 * MiB)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.KVProducerStub(channel)
        reply: pb.ParkResponse = stub.Park(iter(park_requests(kid, chunks, total=total)))
        return reply


# ------------------------------------------------------------------------------ call recorder
@dataclass
class RecordedCall:
    method: str
    call: Any
    # Times the client called cancel() on the call (sync client only: the aio framework wraps
    # the call, so there the final status tells: CANCELLED + LOCAL_CANCEL).
    cancels: int = 0
    outcome: tuple[grpc.StatusCode, str] | None = None


class _CountingCall:
    """Sync call proxy that counts cancel()."""

    def __init__(self, call: Any, record: RecordedCall) -> None:
        self._call = call
        self._record = record

    def __iter__(self) -> _CountingCall:
        return self

    def __next__(self) -> Any:
        return next(self._call)

    def cancel(self) -> Any:
        self._record.cancels += 1
        return self._call.cancel()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


@dataclass
class SyncRecorder(grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Records every server-streaming call a sync client makes (i.e. its Fetches)."""

    calls: list[RecordedCall] = field(default_factory=list)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        record = RecordedCall(details.method, None)
        record.call = continuation(details, request)
        self.calls.append(record)
        return _CountingCall(record.call, record)

    def outcomes(self) -> list[RecordedCall]:
        for r in self.calls:
            r.outcome = (r.call.code(), r.call.details())
        return self.calls


@dataclass
class AioRecorder(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Records every server-streaming call an asyncio client makes (i.e. its Fetches)."""

    calls: list[RecordedCall] = field(default_factory=list)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        call = await continuation(details, request)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.calls.append(RecordedCall(method, call))
        return call

    async def outcomes(self) -> list[RecordedCall]:
        for r in self.calls:
            r.outcome = (await r.call.code(), await r.call.details())
        return self.calls


def cancelled_by_client(record: RecordedCall) -> bool:
    assert record.outcome is not None, "call outcomes() first"
    code, details = record.outcome
    return record.cancels > 0 or (code == grpc.StatusCode.CANCELLED and details == LOCAL_CANCEL)


@contextmanager
def no_warnings_about_timeouts() -> Iterator[None]:
    import warnings

    from kvpark.client import TimeoutConfigWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", TimeoutConfigWarning)
        yield


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs a blocking (sync client) call off the event loop the in-process producer uses."""
    return await asyncio.to_thread(fn, *args, **kwargs)


@contextmanager
def no_thread_starts(name: str) -> Iterator[threading.Event]:
    """Within: a thread called `name` cannot start (`Thread.start` raises, as at a pids
    limit); other threads start as ever. The event is set at each refusal."""
    real_start = threading.Thread.start
    refused = threading.Event()

    def start(thread: threading.Thread) -> None:
        if thread.name == name:
            refused.set()
            raise RuntimeError("can't start new thread")
        real_start(thread)

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        yield refused
    finally:
        threading.Thread.start = real_start  # type: ignore[method-assign]
