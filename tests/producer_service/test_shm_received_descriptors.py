"""Descriptors a producer receives over its shm socket are close-on-exec from the moment they
arrive, so a program it runs never inherits a client's memory; however many a message brings,
every one is closed again (more than fit in the room kept for them is a truncated control
message, which ends the connection); one sent before the hello was answered is refused at
once; and the one a connection may hold while its lend arrives is in the descriptor budget,
so a producer at its limit still serves with every shm connection holding one. A real
producer process; its descriptors are read from /proc."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
from collections.abc import Callable
from typing import Any

import grpc
from conftest import TEST_SETTINGS, ProducerProcess, wait_for

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer.config import ProducerConfig
from kvpark.producer.fd_budget import descriptors_needed
from kvpark.producer.shm_lending import DEFAULT_MAX_CONNECTIONS
from kvpark.shm import (
    FETCH_ROLE,
    LENGTH,
    SharedBuffer,
    ShmLender,
    decode_message,
    encode_message,
)

O_CLOEXEC = 0o2000000  # in /proc/<pid>/fdinfo's octal "flags"
LENDS_PER_CONNECTION = 64  # the most a producer takes over one shm connection
# A lend, sent with its descriptor on the first byte: the producer holds the descriptor until
# the rest of the message arrives.
LEND = encode_message({"op": "lend", "role": FETCH_ROLE, "token": None})


def descriptors_of(pid: int, name: str) -> dict[int, int]:
    """Process `pid`'s descriptors of the memfd `name`, each with its open flags."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError, StopIteration):  # closed meanwhile
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{name} "):
                with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                    flags = next(line for line in info if line.startswith("flags:"))
                found[int(fd)] = int(flags.split()[1], 8)
    return found


def connected(path: str) -> socket.socket:
    """A connection past its hello, speaking the wire format by hand to send what ShmLender
    never would."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    sock.sendall(encode_message({"op": "hello", "version": 1, "token": None}))
    assert read_answer(sock)["ok"]
    return sock


def read_answer(sock: socket.socket) -> dict[str, Any]:
    (size,) = LENGTH.unpack(sock.recv(LENGTH.size, socket.MSG_WAITALL))
    return decode_message(sock.recv(size, socket.MSG_WAITALL))


def test_a_received_descriptor_is_close_on_exec(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    producer = producer_process(shm_socket=shm_socket)
    name = f"kvpark-cloexec-{os.getpid()}"
    with connected(shm_socket) as sock, SharedBuffer(4096, name) as buffer:
        socket.send_fds(sock, [LEND[:1]], [buffer.fd])
        held = wait_for(lambda: descriptors_of(producer.proc.pid, name), what="the fd received")
        assert [flags & O_CLOEXEC for flags in held.values()] == [O_CLOEXEC], held


def test_descriptors_beyond_the_room_for_them_are_all_closed(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    producer = producer_process(shm_socket=shm_socket)
    name = f"kvpark-many-{os.getpid()}"
    with connected(shm_socket) as sock, SharedBuffer(4096, name) as buffer:
        socket.send_fds(sock, [LEND], [buffer.fd] * 10)
        answer = read_answer(sock)
        assert answer["error"].startswith("protocol error: a lend carries exactly one"), answer
        assert sock.recv(1) == b"", "the connection ends"
        wait_for(
            lambda: not descriptors_of(producer.proc.pid, name), what="every received fd closed"
        )


def test_a_descriptor_before_the_hello_is_refused_at_once(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    """Not held until its message completes (or times out): a connection that has shown no
    token holds nothing of the producer's but its socket."""
    producer = producer_process(shm_socket=shm_socket)
    name = f"kvpark-early-{os.getpid()}"
    hello = encode_message({"op": "hello", "version": 1, "token": None})
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
        SharedBuffer(4096, name) as buffer,
    ):
        sock.settimeout(5)
        sock.connect(shm_socket)
        socket.send_fds(sock, [hello[:1]], [buffer.fd])
        answer = read_answer(sock)
        assert answer == {
            "ok": False, "error": "protocol error: a descriptor before the hello was answered"
        }, answer  # fmt: skip
        assert sock.recv(1) == b"", "the connection ends"
        wait_for(lambda: not descriptors_of(producer.proc.pid, name), what="the fd closed")


def test_a_producer_at_its_descriptor_limit_serves_while_every_shm_connection_sends_a_lend(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    """The producer's descriptor limit is exactly its budget for the lends it holds, and every
    other connection the shm socket takes holds the descriptor of a lend whose message is
    still arriving. A new gRPC client is served."""
    settings = {
        "shm_socket": shm_socket, "metrics_listen": "", "max_connections": 16,
        "max_concurrent_rpcs": 8,
    }  # fmt: skip
    config = ProducerConfig.from_mapping({**TEST_SETTINGS, **settings})
    lends = LENDS_PER_CONNECTION  # over one connection
    budget = sum(descriptors_needed(config, lends).values())
    producer = producer_process(**settings)
    # Lowered once it serves: it would not start under a limit that leaves it fewer than
    # MIN_LENDS lends, and one lender's worth is enough to fill the budget here.
    resource.prlimit(producer.proc.pid, resource.RLIMIT_NOFILE, (budget, budget))
    name = f"kvpark-arriving-{os.getpid()}"
    with contextlib.ExitStack() as stack:
        lender = stack.enter_context(ShmLender(shm_socket, None, 5.0))
        lender.connect()
        for _ in range(lends):
            with SharedBuffer(4096) as lent:  # the producer's mapping keeps it
                lender.lend(lent, FETCH_ROLE)
        buffer = stack.enter_context(SharedBuffer(4096, name))
        socks = [
            stack.enter_context(connected(shm_socket)) for _ in range(DEFAULT_MAX_CONNECTIONS - 1)
        ]
        # All at once, once every hello is answered: each is held at most 5 s.
        for sock in socks:
            socket.send_fds(sock, [LEND[:1]], [buffer.fd])
        wait_for(
            lambda: len(descriptors_of(producer.proc.pid, name)) == len(socks),
            what="the producer to hold every connection's descriptor (out of descriptors, "
            "it cannot receive them all)",
        )
        with grpc.insecure_channel(producer.target) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).producer_epoch
