"""A TCP Fetch's write shares its data thread: it is one job for the whole transfer while no
other job waits (no hop back to the event loop per batch), and once another job waits and it
has sent SHARE_BYTES it goes back in the queue behind that job, at a frame boundary, then
goes on where it stopped. Real sockets, a real one-thread DataThreads (SHARE_BYTES made small
so a few frames exceed it) and a real in-process producer."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest
from conftest import MiB, running_producer, wait_until

from kvpark import KVConsumer, KVParker
from kvpark.producer import transports
from kvpark.producer.data_threads import DataThreads
from kvpark.producer.lot import ReadyChunk
from kvpark.producer.transports import TcpStream
from kvpark.tcp_frames import FrameWriter, recv_header, recv_payload

FRAME = 64 * 1024
FRAMES = 16


def read_all(sock: socket.socket, into: bytearray) -> None:
    while (header := recv_header(sock)) is not None:
        payload = bytearray(header[2])
        recv_payload(sock, [memoryview(payload)], header[2])
        into += payload


async def test_a_long_tcp_write_lets_a_waiting_job_run_in_the_middle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transports, "SHARE_BYTES", FRAME)
    writers: list[FrameWriter] = []

    class Recorded(FrameWriter):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            writers.append(self)

    monkeypatch.setattr(transports, "FrameWriter", Recorded)
    data = np.random.default_rng(5).integers(0, 256, FRAME * FRAMES, dtype=np.uint8).tobytes()
    view = memoryview(data)
    chunks = [ReadyChunk(i, 0, [view[i * FRAME : (i + 1) * FRAME]], FRAME) for i in range(FRAMES)]
    threads = DataThreads(1)
    ours, theirs = socket.socketpair()
    received = bytearray()
    reader = threading.Thread(target=read_all, args=(theirs, received))
    reader.start()
    try:
        holding, gate = threading.Event(), threading.Event()

        def hold() -> None:  # the one thread, until the jobs below are queued
            holding.set()
            gate.wait(10)

        threads.submit(hold)
        await wait_until(holding.is_set, what="the thread held")
        stream = TcpStream(ours, stall_s=10, threads=threads)
        send = asyncio.create_task(stream.send(chunks))
        await wait_until(lambda: writers and threads.waiting() == 1, what="the write queued")
        sent_when_it_ran = threads.submit(lambda: writers[0].sent_bytes)
        gate.set()
        await send
        total = FRAMES * (16 + FRAME)
        assert 0 < sent_when_it_ran.result(10) < total  # it ran between two frames
        assert writers[0].sent_bytes == total
        stream.close()
        reader.join(10)
        assert bytes(received) == data  # every frame whole and in order
    finally:
        threads.close()
        ours.close()
        theirs.close()


async def test_a_tcp_fetch_alone_goes_out_in_one_thread_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """8 MiB over TCP, more than the first batch of the other transports (4 MiB), with no
    other job waiting: one data-thread job, its end frame included."""
    monkeypatch.setattr(transports, "WRITE_PAUSE_S", 10.0)  # a late reader never splits it
    async with running_producer(data_listen="127.0.0.1:0", pool_bytes=64 * MiB) as server:
        parts = [np.full(MiB, i, np.uint8) for i in range(8)]

        def park() -> bool:
            with KVParker(server.target, transport="grpc") as parker:
                return parker.park("big", parts).ok

        assert await asyncio.to_thread(park)
        jobs: list[object] = []
        real_submit = server.data_threads.submit

        def counted(fn: Callable[..., object], *args: object) -> object:
            jobs.append(fn)
            return real_submit(fn, *args)

        monkeypatch.setattr(server.data_threads, "submit", counted)
        with KVConsumer(server.target, transport="tcp") as consumer:
            result = await asyncio.to_thread(consumer.load, "big", num_chunks=8)
        assert result.ok and result.transport == "tcp", result
        assert bytes(result.data) == b"".join(p.tobytes() for p in parts)
        assert len(jobs) == 1, jobs
