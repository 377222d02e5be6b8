"""A TCP Fetch's write shares its data thread: it is one job for the whole transfer while no
other job waits (no hop back to the event loop per batch), and once another job waits and it
has sent SHARE_BYTES it goes back in the queue behind that job, at a frame boundary, then
goes on where it stopped. Real sockets and a real one-thread DataThreads; SHARE_BYTES is made
small so a few frames exceed it."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest
from conftest import wait_until

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
        gate = threading.Event()
        threads.submit(gate.wait, 10)  # holds the one thread until the jobs below queue
        stream = TcpStream(ours, stall_s=10, threads=threads)
        send = asyncio.create_task(stream.send(chunks))
        await wait_until(lambda: threads.waiting() == 1, what="the write queued")
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


async def test_a_tcp_write_alone_is_one_job() -> None:
    """Nothing else waits: the whole batch goes out in one thread job."""
    data = bytes(range(256)) * (FRAME // 256) * FRAMES
    view = memoryview(data)
    chunks = [ReadyChunk(i, 0, [view[i * FRAME : (i + 1) * FRAME]], FRAME) for i in range(FRAMES)]
    threads = DataThreads(1)
    jobs = 0
    real_submit = threads.submit

    def counted(*args: object) -> object:
        nonlocal jobs
        jobs += 1
        return real_submit(*args)  # type: ignore[arg-type]

    threads.submit = counted  # type: ignore[method-assign]
    ours, theirs = socket.socketpair()
    received = bytearray()
    reader = threading.Thread(target=read_all, args=(theirs, received))
    reader.start()
    try:
        stream = TcpStream(ours, stall_s=10, threads=threads)
        await stream.send(chunks)
        stream.close()
        reader.join(10)
        assert bytes(received) == data and jobs == 1
    finally:
        threads.close()
        theirs.close()
