"""The /metrics endpoint bounds what an unauthenticated client can hold: connections beyond
its cap are closed at once, a silent connection is closed at its deadline, and a scrape gets
through while silent connections are held, with the producer's descriptors staying bounded."""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import urllib.request

from conftest import running_producer, wait_until

from kvpark.producer.metrics import METRICS_MAX_CONNECTIONS

SILENT = 4 * METRICS_MAX_CONNECTIONS
# Descriptors other threads of the producer (grpc's pollers, the reaper) may open meanwhile.
SLACK = 8


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def silent_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setblocking(False)  # looked at without waiting
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the producer closed its end (EOF or reset)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def try_scrape(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return reply.status == 200 and b"kvpark_pool_bytes" in reply.read()
    except (ConnectionError, http.client.HTTPException, OSError):
        return False


async def test_silent_metrics_connections_are_capped_and_timed_out() -> None:
    async with running_producer(metrics_listen="127.0.0.1:0") as server:
        port = server.metrics_port
        assert await asyncio.to_thread(try_scrape, port)
        before = open_fds()
        held = [silent_connection(port) for _ in range(SILENT)]
        try:
            # Everything beyond the cap is closed as soon as it is accepted.
            await wait_until(
                lambda: sum(map(closed_by_peer, held)) >= SILENT - METRICS_MAX_CONNECTIONS,
                what="connections beyond the cap closed",
            )
            # The client's own sockets are in this process too: what is left is the producer's.
            assert open_fds() - len(held) - before <= METRICS_MAX_CONNECTIONS + SLACK
            # A well-behaved scraper gets in while the silent connections are still held
            # open by their clients: the ones in slots are closed at their deadline.
            assert await wait_until(
                lambda: asyncio.to_thread(try_scrape, port), timeout=20, what="a scrape"
            )
            await wait_until(
                lambda: all(map(closed_by_peer, held)), timeout=20, what="every silent one closed"
            )
            assert open_fds() - len(held) - before <= SLACK
        finally:
            for sock in held:
                sock.close()


async def test_a_dripping_request_is_closed_at_its_deadline() -> None:
    """A client sending a byte now and then, each within any per-read timeout, still has one
    deadline for its whole request."""
    async with running_producer(metrics_listen="127.0.0.1:0") as server:
        sock = silent_connection(server.metrics_port)
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()

            def drip() -> bool:
                if closed_by_peer(sock):
                    return True
                try:
                    sock.send(b"G")  # never completes a request line
                except BlockingIOError:
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    return True
                return False

            await wait_until(drip, timeout=20, what="the dripping connection closed")
            assert loop.time() - start < 15
        finally:
            sock.close()
