"""The shared-memory lending path end to end with real memfds and a real Unix socket: a client
lends a sealed buffer, the producer maps the same pages (what one side writes the other reads,
no copy), unsuitable descriptors and wrong tokens are refused, a lend ends with its connection
(its unmap waiting for a producer copy in progress), and the socket file is created, guarded,
replaced and removed as promised. Ends with a copy-throughput print (no timing assertions).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import itertools
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import memfds_held, wait_for

from kvpark.producer.shm_lending import (
    DEFAULT_MAX_CONNECTIONS,
    LEGACY_HELLOS,
    LendGone,
    LentBuffer,
    ShmLendingServer,
    descriptors,
)
from kvpark.shm import (
    LENGTH,
    SharedBuffer,
    ShmBusy,
    ShmLender,
    ShmRefused,
    ShmTimedOut,
    ShmUnavailable,
    call_id,
    decode_message,
    encode_message,
    find_shared,
)

MiB = 1024 * 1024
TOKENS = {"park": "park-secret", "fetch": "fetch-secret"}
EPOCH = 1234567890123


def authorize_with(tokens: dict[str, str]) -> Callable[[str | None, str], str | None]:
    """The producer's rule: a role without a token is open; otherwise its own token only."""

    def authorize(token: str | None, role: str) -> str | None:
        expected = tokens.get(role)
        if expected is None or token == expected:
            return None
        if token is not None and token in tokens.values():
            return f"that token is not the {role} role's"
        return "missing or unknown token"

    return authorize


@pytest.fixture
def sock_dir(tmp_path: Path) -> Iterator[Path]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    if len(str(tmp_path)) < 60:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="kvshm", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def start_server(sock_dir: Path) -> Iterator[Callable[..., ShmLendingServer]]:
    servers: list[ShmLendingServer] = []

    def start(
        name: str = "shm.sock", tokens: dict[str, str] | None = None, **kwargs: Any
    ) -> ShmLendingServer:
        server = ShmLendingServer(
            str(sock_dir / name),
            EPOCH,
            authorize_with(TOKENS if tokens is None else tokens),
            **kwargs,
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server: Callable[..., ShmLendingServer]) -> ShmLendingServer:
    return start_server()


@pytest.fixture
def lenders() -> Iterator[Callable[..., ShmLender]]:
    made: list[ShmLender] = []

    def connect(server: ShmLendingServer, role: str | None = "fetch", **kwargs: Any) -> ShmLender:
        token = kwargs.pop("token", TOKENS.get(role) if role else None)
        lender = ShmLender(server.path, token, kwargs.pop("timeout_s", 5.0))
        lender.connect()
        made.append(lender)
        return lender

    yield connect
    for lender in made:
        lender.close()


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# A hello as a fetch-role client sends it.
HELLO = {"op": "hello", "version": 1, "token": TOKENS["fetch"]}


def raw_connection(path: str) -> socket.socket:
    """A client that speaks the wire format by hand, to send what ShmLender never would."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    assert raw_request(sock, HELLO)["epoch"] == EPOCH
    return sock


def raw_request(
    sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()
) -> dict[str, Any]:
    frame = encode_message(message)
    if fds:
        assert socket.send_fds(sock, [frame], list(fds)) == len(frame)
    else:
        sock.sendall(frame)
    return read_answer(sock)


def read_answer(sock: socket.socket) -> dict[str, Any]:
    header = sock.recv(LENGTH.size, socket.MSG_WAITALL)
    if not header:
        return {"closed": True}
    (size,) = LENGTH.unpack(header)
    return decode_message(sock.recv(size, socket.MSG_WAITALL))


def is_closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def memfd(nbytes: int, seals: int, allocate: bool = True, flags: int = 0) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, nbytes)
    if allocate:
        os.posix_fallocate(fd, 0, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


# --- one memory, both sides ---------------------------------------------------------------------


def test_a_fetch_lend_is_the_clients_memory(server: ShmLendingServer, lenders: Any) -> None:
    lender = lenders(server, "fetch")
    with SharedBuffer(8 * MiB) as buffer:
        lend_id = lender.lend(buffer, "fetch")
        assert len(lend_id) == 32 and int(lend_id, 16) >= 0
        lent = server.get(lend_id, "fetch")
        assert lent is not None and lent.nbytes == 8 * MiB and not lent.closed
        assert server.get(lend_id, "park") is None, "a fetch lend is not usable for Park"
        assert server.get("0" * 32, "fetch") is None

        pattern = np.random.default_rng(1).integers(0, 256, 4 * MiB, dtype=np.uint8)
        with lent.acquire() as view:
            assert not view.readonly
            np.frombuffer(view, np.uint8)[MiB : 5 * MiB] = pattern  # the producer writes...
        assert np.array_equal(buffer.array[MiB : 5 * MiB], pattern)  # ...the client reads

        buffer.array[:16] = 7  # and the other way round, on the same pages
        with lent.acquire() as view:
            assert bytes(view[:16]) == b"\x07" * 16


def test_a_park_lend_is_read_only_for_the_producer(server: ShmLendingServer, lenders: Any) -> None:
    lender = lenders(server, "park")
    with SharedBuffer(MiB) as buffer:
        buffer.array[:] = np.arange(MiB, dtype=np.uint64).astype(np.uint8)
        lend_id = lender.lend(buffer, "park")
        lent = server.get(lend_id, "park")
        assert lent is not None and server.get(lend_id, "fetch") is None
        with lent.acquire() as view:
            assert view.readonly
            assert np.array_equal(np.frombuffer(view, np.uint8), buffer.array)
            buffer.array[-1] = 99  # written after the lend: seen at once, nothing was copied
            assert view[-1] == 99


def mapped_bytes(memfd_name: str) -> int:
    """Bytes of this process's mappings of the memfd `memfd_name` that have their page table
    entries now (smaps Rss): what can be touched without a page fault."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            ours = len(fields) >= 6 and fields[5] == f"/memfd:{memfd_name}"
        elif ours and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


# Mapping every page up front takes madvise(MADV_POPULATE_*), Linux 5.14 and later; before
# that the pages fault in on first use and there is nothing up front to see.
_KERNEL = tuple(int(part) for part in os.uname().release.split("-")[0].split(".")[:2])
needs_populate = pytest.mark.skipif(_KERNEL < (5, 14), reason="MADV_POPULATE_* is Linux 5.14+")


@needs_populate
def test_both_ends_map_every_page_up_front(server: ShmLendingServer, lenders: Any) -> None:
    """The client's mapping is populated when made, the producer's right after the lend (on a
    thread of its own), so the first transfer through a new buffer takes no page fault per
    page (each costs more than copying the page)."""
    name = f"kvpark-test-{os.getpid()}-{time.monotonic_ns()}"
    with SharedBuffer(8 * MiB, name=name) as buffer:
        assert mapped_bytes(name) == 8 * MiB  # nothing touched yet
        lend_id = lenders(server, "fetch").lend(buffer, "fetch")
        assert server.get(lend_id, "fetch") is not None
        # The producer's mapping too (it lives in this process): nothing touched it either.
        wait_for(lambda: mapped_bytes(name) == 16 * MiB, what="the producer's pages mapped")


@needs_populate
def test_other_threads_run_while_a_buffer_maps_its_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapping every page of a new buffer takes ~0.1 s per 256 MiB, and other threads run
    throughout: an asyncio client makes its buffers on a worker thread, and its event loop
    stalled for as long when the mapping held the GIL (MAP_POPULATE in mmap()). Measured from
    the end of the allocation to the buffer's return, against a thread that ticks every
    half millisecond: no gap between its ticks may take half of that time."""
    allocated: list[float] = []
    fallocate = os.posix_fallocate

    def timed(fd: int, offset: int, length: int) -> None:
        fallocate(fd, offset, length)
        allocated.append(time.monotonic())

    monkeypatch.setattr(os, "posix_fallocate", timed)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        wait_for(lambda: len(ticks) > 1, what="the ticking thread running")
        name = f"kvpark-test-{os.getpid()}-{time.monotonic_ns()}"
        with SharedBuffer(256 * MiB, name=name):
            made = time.monotonic()
            assert mapped_bytes(name) == 256 * MiB
    finally:
        stop.set()
        ticker.join()
    [start] = allocated
    inside = [start, *(t for t in ticks if start < t < made), made]
    longest = max(b - a for a, b in itertools.pairwise(inside))
    assert longest < (made - start) / 2, f"a {longest:.3f}s stall of {made - start:.3f}s"


def test_many_threads_share_one_lender(server: ShmLendingServer, lenders: Any) -> None:
    lender = lenders(server, "fetch")
    ids: list[str] = []

    def work() -> None:
        with SharedBuffer(64 * 1024) as buffer:  # one each: a buffer is lent once at a time
            for _ in range(20):
                lend_id = lender.lend(buffer, "fetch")
                ids.append(lend_id)
                assert lender.release(lend_id) is True

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 160
    assert server.lend_count == 0


# --- find_shared --------------------------------------------------------------------------------


def test_find_shared_locates_views_and_slices() -> None:
    with SharedBuffer(64 * 1024) as a, SharedBuffer(64 * 1024) as b:
        assert find_shared(a.array) == (a, 0, 64 * 1024)
        assert find_shared(a.array[4096:8192]) == (a, 4096, 4096)
        assert find_shared(b.array[4096:8192]) == (b, 4096, 4096)
        as_floats = a.array[128:1152].view(np.float32).reshape(16, 16)
        assert find_shared(as_floats) == (a, 128, 1024)
        assert find_shared(as_floats[4:8]) == (a, 128 + 4 * 64, 4 * 64)
        assert find_shared(memoryview(a.array)[10:20]) == (a, 10, 10)
        assert find_shared(memoryview(b.array).cast("I")[2:4]) == (b, 8, 8)

        assert find_shared(a.array[::2]) is None, "strided: not one byte range"
        assert find_shared(as_floats[:, :4]) is None, "a column block is not contiguous"
        assert find_shared(a.array[10:10]) is None, "empty"
        assert find_shared(a.array[:100].copy()) is None
        assert find_shared(np.zeros(100, np.uint8)) is None
        assert find_shared(b"not shared") is None
        assert find_shared(object()) is None

        kept = a.array[:100]
    assert find_shared(kept) is None, "a closed buffer is no longer shared"
    kept[:] = 1  # still mapped: the mapping went with the buffer's last array, not before

    dropped = SharedBuffer(4096)
    fd, survivor = dropped.fd, dropped.array[:16]
    del dropped
    gc.collect()
    assert find_shared(survivor) is None, "a buffer dropped without close() leaves the registry"
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_buffer_is_sealed_allocated_and_closes_idempotently() -> None:
    buffer = SharedBuffer(3 * MiB)
    seals = fcntl.fcntl(buffer.fd, fcntl.F_GET_SEALS)
    assert seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) == (
        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    )
    with pytest.raises(PermissionError):
        os.ftruncate(buffer.fd, MiB)
    assert os.fstat(buffer.fd).st_blocks * 512 >= 3 * MiB
    assert buffer.array.flags.writeable and buffer.array.dtype == np.uint8
    fd = buffer.fd
    buffer.close()
    buffer.close()
    assert buffer.closed
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor went with close()
    with pytest.raises(ValueError):
        _ = buffer.array
    with pytest.raises(ValueError):
        SharedBuffer(0)


# --- refusals -----------------------------------------------------------------------------------


def test_unsuitable_descriptors_are_refused_and_closed(
    server: ShmLendingServer, sock_dir: Path
) -> None:
    sock = raw_connection(server.path)
    before = open_fd_count()
    both = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    plain = sock_dir / "plain"
    plain.write_bytes(bytes(MiB))
    pipe_read, pipe_write = os.pipe()
    os.close(pipe_write)
    cases = {
        "not sealed": memfd(MiB, 0),
        "shrink only": memfd(MiB, fcntl.F_SEAL_SHRINK),
        "not allocated": memfd(MiB, both, allocate=False),
        "empty": memfd(0, both, allocate=False),
        "regular file": os.open(plain, os.O_RDWR | os.O_CLOEXEC),
        "pipe": pipe_read,
    }
    with contextlib.suppress(OSError):  # a kernel without hugetlbfs, or other huge pages
        # Sealed and of a huge page's size; not allocated, as a node with no huge pages
        # reserved cannot, which the huge-page check answers first.
        cases["huge pages"] = memfd(2 * MiB, both, allocate=False, flags=os.MFD_HUGETLB)
    expected = {
        "not sealed": "not sealed",
        "shrink only": "not sealed",
        "not allocated": "not fully allocated",
        "empty": "empty",
        "huge pages": "backed by huge pages",
        "regular file": "not a memfd",
        "pipe": "not a memfd",
    }
    for case, fd in cases.items():
        answer = raw_request(sock, {"op": "lend", "role": "fetch", "token": TOKENS["fetch"]}, (fd,))
        assert answer["ok"] is False and expected[case] in answer["error"], (case, answer)
        os.close(fd)
    answer = raw_request(sock, {"op": "lend", "role": "fetch", "token": TOKENS["fetch"]})
    assert "exactly one descriptor" in answer["error"]
    two = (memfd(MiB, both), memfd(MiB, both))
    answer = raw_request(sock, {"op": "lend", "role": "fetch", "token": TOKENS["fetch"]}, two)
    assert "exactly one descriptor" in answer["error"]
    assert is_closed(sock)  # more than one is a protocol error: it ends the connection
    for fd in two:
        os.close(fd)
    # Every descriptor the producer received (its own copies) was closed again, and so was
    # its end of the connection.
    wait_for(lambda: open_fd_count() <= before - 1, what="the producer's copies closed")
    assert server.lend_count == 0
    sock.close()


@pytest.mark.parametrize(
    ("role", "token", "why"),
    [
        ("park", TOKENS["fetch"], "not the park role's"),
        ("fetch", TOKENS["park"], "not the fetch role's"),
    ],
)
def test_the_roles_token_is_required(
    server: ShmLendingServer, lenders: Any, role: str, token: str | None, why: str
) -> None:
    lender = lenders(server, None, token=token)
    with SharedBuffer(MiB) as buffer:
        with pytest.raises(ShmRefused, match=why) as refused:
            lender.lend(buffer, role)
        assert why in refused.value.reason
        assert isinstance(refused.value, ShmUnavailable) and isinstance(refused.value, OSError)
        # A refusal leaves the connection usable.
        assert lender.connected and lender.release("0" * 32) is False
    assert server.lend_count == 0


@pytest.mark.parametrize("token", ["wrong", None])
def test_a_connection_without_a_token_is_closed_at_its_hello(
    server: ShmLendingServer, lenders: Any, token: str | None
) -> None:
    """With tokens configured, a connection that holds neither role's token could lend
    nothing: it is refused at its hello and closed, rather than keeping one of the
    max_connections every client shares for as long as it likes."""
    with pytest.raises(ShmUnavailable, match="the hello needs a park or fetch token"):
        lenders(server, None, token=token)
    wait_for(lambda: server.connection_count == 0, what="the refused connection closed")
    # Clients with a token of either role connect; each role lends only for itself.
    with SharedBuffer(MiB) as buffer:
        assert server.get(lenders(server, "park").lend(buffer, "park"), "park") is not None


def test_clients_older_than_the_hello_token_still_lend_within_their_quota(
    server: ShmLendingServer, lenders: Any
) -> None:
    """A hello with no "token" key at all (a client that sends its token with each lend
    only) is let in, and lends with its token, up to LEGACY_HELLOS such connections at once;
    more are refused at the hello, and clients that send their token still connect."""
    legacy = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(LEGACY_HELLOS)]
    try:
        for sock in legacy:
            sock.settimeout(5)
            sock.connect(server.path)
            assert raw_request(sock, {"op": "hello", "version": 1})["ok"]
        fd = memfd(MiB, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        try:
            lend = {"op": "lend", "role": "fetch", "token": TOKENS["fetch"]}
            assert raw_request(legacy[0], lend, (fd,))["ok"]
        finally:
            os.close(fd)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as one_more:
            one_more.settimeout(5)
            one_more.connect(server.path)
            answer = raw_request(one_more, {"op": "hello", "version": 1})
            assert not answer["ok"] and "no token already, the most" in answer["error"]
        assert lenders(server, "fetch").epoch == EPOCH
    finally:
        for sock in legacy:
            sock.close()


def test_a_role_without_a_token_is_open(start_server: Any, lenders: Any) -> None:
    server = start_server(tokens={"park": TOKENS["park"]})
    with SharedBuffer(MiB) as buffer:
        assert server.get(lenders(server, None).lend(buffer, "fetch"), "fetch") is not None
        with pytest.raises(ShmRefused):
            lenders(server, None).lend(buffer, "park")


def test_lends_over_all_connections_are_bounded(start_server: Any, lenders: Any) -> None:
    """Each lend holds a producer descriptor, so the lends of all connections together have
    a limit too; a lend past it is refused with a reason, and one released makes room."""
    server = start_server(max_lends=2)
    first, second = lenders(server, "fetch"), lenders(server, "fetch")
    with SharedBuffer(MiB) as a, SharedBuffer(MiB) as b, SharedBuffer(MiB) as c:
        held = first.lend(a, "fetch")
        second.lend(b, "fetch")
        with pytest.raises(ShmRefused, match="holds 2 lends"):
            second.lend(c, "fetch")
        assert first.release(held) is True
        assert server.get(second.lend(c, "fetch"), "fetch") is not None


def test_a_lend_that_ended_counts_while_a_copy_still_holds_its_mapping(
    start_server: Any, lenders: Any
) -> None:
    """The limit counts mappings (each holds a descriptor), not lends: a lend whose client
    went away while a copy still uses it keeps its mapping until the copy ends, and is
    counted until then."""
    server = start_server(max_lends=1)
    first, second = lenders(server, "fetch"), lenders(server, "fetch")
    with SharedBuffer(MiB) as buffer:
        lent = server.get(first.lend(buffer, "fetch"), "fetch")
        assert lent is not None
        with lent.acquire():  # a copy into it is running
            first.close()
            wait_for(lambda: lent.closed, what="the lend to end with its connection")
            assert lent.mapped
            with pytest.raises(ShmRefused, match="holds 1 lends"):
                second.lend(buffer, "fetch")
        # The copy ended; the new lend's prefault may still hold the mapping a moment.
        wait_for(lambda: not lent.mapped, what="the mapping (and its descriptor) to go")
        assert server.get(second.lend(buffer, "fetch"), "fetch") is not None


def test_descriptors_trickled_with_one_message_end_the_connection(start_server: Any) -> None:
    """A client that sends a message a byte at a time, a descriptor with each byte, would make
    the server hold every one of them until the message completes (5 s), past its descriptor
    budget. The second descriptor of a message ends the connection, and the server closes
    what it received."""
    server = start_server()
    before = open_fd_count()
    sock = raw_connection(server.path)
    with open(os.devnull, "rb") as spare:
        sock.sendall(LENGTH.pack(1000))  # a message of 1,000 bytes begins
        for piece in (b"{", b" "):
            assert socket.send_fds(sock, [piece], [spare.fileno()]) == 1
        answer = read_answer(sock)
    assert answer["ok"] is False and "exactly one descriptor" in answer["error"], answer
    assert is_closed(sock)
    sock.close()
    wait_for(lambda: open_fd_count() <= before, what="the received descriptors closed")


def test_the_server_at_its_fullest_holds_no_more_descriptors_than_it_counts(
    start_server: Any,
) -> None:
    """`descriptors()` sizes the producer's descriptor limit, so it must cover the most the
    server can be made to hold: every connection it takes open, lends mapped, and on each
    connection a lend whose message is still arriving, its descriptor received."""
    max_lends = 4
    before = set(os.listdir("/proc/self/fd"))
    server = start_server(max_lends=max_lends)
    lend = {"op": "lend", "role": "fetch", "token": TOKENS["fetch"]}
    name = f"kvpark-arriving-{os.getpid()}"
    socks = [raw_connection(server.path) for _ in range(DEFAULT_MAX_CONNECTIONS)]
    try:
        for sock in socks[:max_lends]:
            with SharedBuffer(4096) as lent:  # the server's mapping keeps it
                assert raw_request(sock, lend, (lent.fd,))["ok"]
        without_buffer = set(os.listdir("/proc/self/fd"))
        with SharedBuffer(4096, name) as arriving:
            buffer_fds = set(os.listdir("/proc/self/fd")) - without_buffer  # its own and its mmap's
            for sock in socks:
                socket.send_fds(sock, [encode_message(lend)[:1]], [arriving.fd])
            wait_for(
                lambda: memfds_held(os.getpid(), name) == len(buffer_fds) + len(socks),
                what="every connection's descriptor received",
            )
            ours = buffer_fds | {str(sock.fileno()) for sock in socks}
            held = set(os.listdir("/proc/self/fd")) - before - ours
        assert len(held) <= descriptors(max_lends), (len(held), descriptors(max_lends))
    finally:
        for sock in socks:
            sock.close()


def test_lend_limits(start_server: Any, lenders: Any) -> None:
    server = start_server(max_lends_per_connection=2, max_lend_bytes=2 * MiB)
    lender = lenders(server, "fetch")
    fits = [SharedBuffer(2 * MiB) for _ in range(4)]
    with SharedBuffer(2 * MiB + 4096) as too_big:
        with pytest.raises(ShmRefused, match="max_lend_bytes"):
            lender.lend(too_big, "fetch")
        first = lender.lend(fits[0], "fetch")
        lender.lend(fits[1], "fetch")
        with pytest.raises(ShmRefused, match="2 lends"):
            lender.lend(fits[2], "fetch")
        assert lenders(server, "fetch").lend(fits[2], "fetch"), "the limit is per connection"
        assert lender.release(first) is True
        assert lender.release(first) is False
        assert server.get(first, "fetch") is None
        lender.lend(fits[3], "fetch")
    for buffer in fits:
        buffer.close()
    with pytest.raises(ValueError):
        lender.lend(fits[0], "fetch")  # a closed buffer is not sent at all
    with SharedBuffer(4096) as small, pytest.raises(ValueError):
        lender.lend(small, "decode")


def test_connections_beyond_the_limit_are_refused(start_server: Any, lenders: Any) -> None:
    server = start_server(max_connections=1)
    first = lenders(server, "fetch")
    with pytest.raises(ShmUnavailable, match="too many connections"):
        lenders(server, "fetch")
    first.close()
    wait_for(lambda: _connects(server), what="a slot after the first client left")


def _connects(server: ShmLendingServer) -> bool:
    try:
        with ShmLender(server.path, TOKENS["fetch"], 5.0) as lender:
            lender.connect()
        return True
    except ShmUnavailable:
        return False


def test_protocol_violations_close_the_connection(server: ShmLendingServer) -> None:
    both = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    fd = memfd(4096, both)
    violations: list[tuple[Callable[[socket.socket], object], bool]] = [
        # Nested deeper than the JSON parser's stack: first, so that every later case shows
        # the server still serves.
        (lambda s: s.sendall(LENGTH.pack(5000) + b"[" * 5000), False),
        (lambda s: s.sendall(encode_message({"op": "lend", "role": "fetch"})), False),
        (lambda s: s.sendall(encode_message({"op": "hello", "version": 99})), False),
        (lambda s: s.sendall(LENGTH.pack(5) + b"{oops"), True),
        (lambda s: s.sendall(LENGTH.pack(10**6)), True),
        (lambda s: s.sendall(encode_message(HELLO)), True),
        (
            lambda s: socket.send_fds(s, [encode_message({"op": "release", "lend_id": "x"})], [fd]),
            True,
        ),
        (lambda s: s.sendall(encode_message({"op": "dance"})), True),
        (lambda s: s.sendall(2 * encode_message({"op": "release", "lend_id": "x"})), True),
    ]
    for send, after_hello in violations:
        sock = raw_connection(server.path) if after_hello else socket.socket(socket.AF_UNIX)
        if not after_hello:
            sock.settimeout(5)
            sock.connect(server.path)
        send(sock)
        answer = read_answer(sock)
        assert answer.get("ok") is False and "protocol error" in answer["error"], answer
        assert is_closed(sock)
        sock.close()
    os.close(fd)


def test_a_message_that_fails_unforeseen_ends_its_connection_not_the_server(
    server: ShmLendingServer, lenders: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should handling one client's message raise what nobody foresaw, that client's
    connection ends and the server goes on: other clients keep their lends and new ones
    connect."""
    bystander = lenders(server, "fetch")
    buffer = SharedBuffer(4096)
    kept = bystander.lend(buffer, "fetch")
    handle = server._handle

    def failing_for_dance(conn: Any, payload: bytes, fds: list[int]) -> None:
        if b"dance" in payload:
            raise RuntimeError("unforeseen")
        handle(conn, payload, fds)

    monkeypatch.setattr(server, "_handle", failing_for_dance)
    sock = raw_connection(server.path)
    sock.sendall(encode_message({"op": "dance"}))
    assert is_closed(sock)
    sock.close()
    assert server.lend_count == 1 and server.get(kept, "fetch") is not None
    bystander.release(kept)
    raw_connection(server.path).close()  # a new client is greeted (asserted inside)
    buffer.close()


def test_a_silent_or_half_sent_client_is_cut_off(start_server: Any) -> None:
    server = start_server(message_timeout_s=0.2)
    silent = socket.socket(socket.AF_UNIX)
    silent.settimeout(5)
    silent.connect(server.path)
    half = raw_connection(server.path)
    half.sendall(encode_message({"op": "release", "lend_id": "x"})[:6])
    for sock in (silent, half):
        assert "incomplete" in read_answer(sock)["error"]
        assert is_closed(sock)
        sock.close()


# --- lifetime -----------------------------------------------------------------------------------


def test_a_lend_ends_with_its_connection(server: ShmLendingServer, lenders: Any) -> None:
    lender = lenders(server, "fetch")
    with SharedBuffer(MiB) as buffer, SharedBuffer(MiB) as other:
        kept = lender.lend(buffer, "fetch")
        idle = server.get(lender.lend(other, "fetch"), "fetch")
        lent = server.get(kept, "fetch")
        assert lent is not None and idle is not None
        # A new lend is held briefly while the producer maps its pages in (`_prefault`).
        wait_for(lambda: not idle.held and not lent.held, what="the new lends prefaulted")
        with lent.acquire() as view:
            lender.close()  # the client goes away while the producer copies
            wait_for(lambda: server.lend_count == 0, what="the lends to end")
            assert lent.closed and lent.mapped, "the unmap waits for the copy"
            view[:5] = b"still"  # the mapping is intact
            assert idle.closed and not idle.mapped, "nothing held it: unmapped at once"
        assert bytes(buffer.array[:5]) == b"still"
        assert not lent.mapped
        with pytest.raises(LendGone):
            lent.acquire().__enter__()
        with pytest.raises(LendGone):
            _ = lent.view
    assert server.lend_count == 0


def test_a_release_is_answered_once_no_call_holds_the_buffer(
    server: ShmLendingServer, lenders: Any
) -> None:
    """A client releases a buffer while a producer call still copies into it (a Fetch it cut
    off): the answer comes only after that copy let go, so memory the client reuses after
    `release` returns gets no late bytes. A lend nobody holds is answered at once."""
    lender = lenders(server, "fetch")
    with SharedBuffer(MiB) as buffer:
        assert lender.release(lender.lend(buffer, "fetch")) is True  # not held: at once
        lend_id = lender.lend(buffer, "fetch")
        lent = server.get(lend_id, "fetch")
        assert lent is not None
        order: list[str] = []
        with lent.acquire() as view:
            releasing = threading.Thread(
                target=lambda: order.append(f"answered {lender.release(lend_id)}")
            )
            releasing.start()
            wait_for(lambda: server.lend_count == 0, what="the release to arrive")
            view[:4] = b"last"  # the cut-off copy's last bytes
            order.append("copy done")
        releasing.join(10)
        assert order == ["copy done", "answered True"]
        assert bytes(buffer.array[:4]) == b"last" and not lent.mapped
        # The connection serves on: lend and release again.
        assert lender.release(lender.lend(buffer, "fetch")) is True


def test_a_view_kept_past_acquire_keeps_the_mapping(server: ShmLendingServer, lenders: Any) -> None:
    lender = lenders(server, "fetch")
    with SharedBuffer(MiB) as buffer:
        lent = server.get(lender.lend(buffer, "fetch"), "fetch")
        assert isinstance(lent, LentBuffer)
        leaked = np.frombuffer(lent.view[:8], np.uint8)  # outside acquire(): not recommended
        lender.close()
        wait_for(lambda: lent.closed, what="the lend to end")
        leaked[:] = 3  # memory-safe all the same: the mapping goes with the last reference
        assert bytes(buffer.array[:8]) == b"\x03" * 8


def test_handshake_answers_the_epoch(server: ShmLendingServer) -> None:
    with ShmLender(server.path, TOKENS["fetch"], 5.0) as lender:
        assert lender.epoch is None
        assert lender.connect() == EPOCH == lender.epoch
        assert lender.connect() == EPOCH


def test_unusable_sockets_fail_fast_and_say_why(sock_dir: Path, server: ShmLendingServer) -> None:
    started = time.monotonic()
    with pytest.raises(ShmUnavailable, match="no shm socket"):
        ShmLender(str(sock_dir / "missing.sock"), None, 5.0).connect()
    assert time.monotonic() - started < 1.0

    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(sock_dir / "dead.sock"))
    dead.close()  # the file stays, nobody listens
    with pytest.raises(ShmUnavailable, match="refused"):
        ShmLender(str(sock_dir / "dead.sock"), None, 5.0).connect()

    mute = socket.socket(socket.AF_UNIX)
    mute.bind(str(sock_dir / "mute.sock"))
    mute.listen(1)  # accepts into the backlog, never answers
    started = time.monotonic()
    with pytest.raises(ShmUnavailable, match=r"handshake .* timed out"):
        ShmLender(str(sock_dir / "mute.sock"), None, 0.3).connect()
    assert time.monotonic() - started < 2.0
    mute.close()

    lender = ShmLender(server.path, None, 5.0)
    with SharedBuffer(4096) as buffer, pytest.raises(ShmUnavailable, match="not connected"):
        lender.lend(buffer, "fetch")


def test_stop_ends_everything(start_server: Any, lenders: Any) -> None:
    server = start_server()
    lender = lenders(server, "fetch")
    with SharedBuffer(MiB) as buffer:
        lent = server.get(lender.lend(buffer, "fetch"), "fetch")
        assert lent is not None
        wait_for(lambda: not lent.held, what="the new lend prefaulted")
        server.stop()
        server.stop()
        assert not os.path.exists(server.path)
        assert lent.closed and not lent.mapped and server.lend_count == 0
        with pytest.raises(ShmUnavailable):
            lender.lend(buffer, "fetch")
        assert not lender.connected


# --- the socket file ------------------------------------------------------------------------------


def test_socket_file_mode_and_directory(start_server: Any, sock_dir: Path) -> None:
    server = start_server(name="sub/dir/shm.sock")
    mode = os.stat(server.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660


def test_a_stale_socket_is_replaced(start_server: Any, sock_dir: Path, lenders: Any) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_dir / "shm.sock"))
    stale.close()
    server = start_server()
    assert lenders(server, "fetch").epoch == EPOCH


def test_a_live_socket_or_another_file_is_never_replaced(
    start_server: Any, sock_dir: Path, lenders: Any
) -> None:
    regular = sock_dir / "regular"
    regular.write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        start_server(name="regular")
    assert regular.read_bytes() == b"precious"

    live = start_server()
    with pytest.raises(OSError) as in_use:
        start_server()
    assert in_use.value.errno == errno.EADDRINUSE
    assert lenders(live, "fetch").epoch == EPOCH, "the first server still serves"


def test_stop_leaves_a_successors_socket(start_server: Any, sock_dir: Path) -> None:
    first = start_server()
    os.unlink(first.path)  # e.g. an operator removed it, and a successor took the path
    successor = start_server()
    first.stop()
    assert os.path.exists(successor.path)


# --- throughput ---------------------------------------------------------------------------------


def test_copy_throughput_print(server: ShmLendingServer, lenders: Any) -> None:
    """Producer-side copies at the size of a large batch: from a park lend into a pool-like
    array, and from that array into a fetch lend. Printed, not asserted."""
    nbytes = 256 * MiB
    pool = np.empty(nbytes, np.uint8)
    pool[:] = 1  # fault the destination in: a real pool is preallocated and touched
    with SharedBuffer(nbytes) as buffer:
        buffer.array[:] = 5
        results = {}
        for name, role, into_lend in (
            ("park lend -> pool", "park", False),
            ("pool -> fetch lend", "fetch", True),
        ):
            # Lent for one role at a time: the producer maps a buffer once.
            lender = lenders(server, role)
            lend_id = lender.lend(buffer, role)
            lent = server.get(lend_id, role)
            assert lent is not None
            best = float("inf")
            with lent.acquire() as view:
                lent_array = np.frombuffer(view, np.uint8)
                for _ in range(5):
                    started = time.perf_counter()
                    if into_lend:
                        np.copyto(lent_array, pool)
                    else:
                        np.copyto(pool, lent_array)
                    best = min(best, time.perf_counter() - started)
                del lent_array
            results[name] = nbytes / best / 1e9
            assert lender.release(lend_id) is True
        assert np.array_equal(pool[:4096], buffer.array[:4096])
    print(
        "\nshm copy throughput (256 MiB, best of 5): "
        + ", ".join(f"{name} {gbps:.1f} GB/s" for name, gbps in results.items())
    )


def test_a_lend_with_no_time_left_leaves_the_connection_and_its_lends(
    server: ShmLendingServer, lenders: Any
) -> None:
    """A lend given no time (a load whose budget is spent) fails as timed out before anything
    is sent: the connection, and every lend made over it, stay as they were."""
    lender = lenders(server, "fetch")
    with SharedBuffer(4096) as held, SharedBuffer(4096) as late:
        lend_id = lender.lend(held, "fetch")
        with pytest.raises(ShmTimedOut):
            lender.lend(late, "fetch", 0.0)
        assert lender.connected
        assert server.get(lend_id, "fetch") is not None
        assert lender.release(lend_id) is True


def test_first_lends_from_many_threads_share_one_connection(server: ShmLendingServer) -> None:
    """Eight loads lending their buffers at once, before the client is connected: one thread
    connects and the others use its connection, so every lend id handed out is alive (two
    connections made at once would replace each other and end the loser's lends)."""
    for _ in range(5):
        ids = _first_lends_at_once(server, 8)
        assert all(ids), ids
        wait_for(lambda: server.lend_count == 0, what="the lends ended with the connection")


def _first_lends_at_once(server: ShmLendingServer, n: int) -> list[str | None]:
    """Lend ids that `n` threads got for `n` buffers of a new client, all starting together;
    None where a lend failed or had already ended on the producer when it returned."""
    from kvpark.client._shm import ShmAccess

    access = ShmAccess(server.path, TOKENS["fetch"], "fetch", lambda: EPOCH, lambda: None)
    buffers = [access.shared_buffer(4096) for _ in range(n)]
    start = threading.Barrier(n)
    ids: list[str | None] = [None] * n

    def lend(i: int) -> None:
        start.wait()
        found = access.lend_of(buffers[i], 5.0)
        ids[i] = found[0] if found else None

    threads = [threading.Thread(target=lend, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        return [i if i and server.get(i, "fetch") is not None else None for i in ids]
    finally:
        access.close()


# --- settling one call --------------------------------------------------------------------------


def test_releasing_a_call_waits_for_that_call_only_and_keeps_the_lend(
    server: ShmLendingServer, lenders: Any
) -> None:
    """Two Fetches copy into one lent buffer, each naming a call id of the lend. Releasing the
    first call is answered once that call let go, while the second still holds the buffer;
    the lend stays for further calls, and the released call cannot start copying again."""
    lender = lenders(server, "fetch")
    assert lender.takes_call_ids
    with SharedBuffer(MiB) as buffer:
        lend_id = lender.lend(buffer, "fetch")
        cut_off = server.get(call_id(lend_id, 1), "fetch")
        going_on = server.get(call_id(lend_id, 2), "fetch")
        assert cut_off is not None and going_on is not None
        order: list[str] = []
        with going_on.acquire() as other_view:
            with cut_off.acquire() as view:
                releasing = threading.Thread(
                    target=lambda: order.append(
                        f"answered {lender.release(call_id(lend_id, 1), timeout_s=5)}"
                    )
                )
                releasing.start()
                wait_for(
                    lambda: server.get(call_id(lend_id, 1), "fetch") is None,
                    what="the release to arrive",
                )
                view[:4] = b"last"  # the cut-off call's last bytes
                order.append("copy done")
            releasing.join(10)
            assert order == ["copy done", "answered True"]
            other_view[-4:] = b"more"  # the other call copies on
        assert bytes(buffer.array[:4]) == b"last" and bytes(buffer.array[-4:]) == b"more"
        assert server.lend_count == 1 and server.get(lend_id, "fetch") is not None
        with pytest.raises(LendGone):
            cut_off.acquire().__enter__()
        later = server.get(call_id(lend_id, 3), "fetch")
        assert later is not None
        with later.acquire():
            pass
        # Releasing a call of a lend the connection does not hold says so at once.
        assert lender.release(call_id("0" * 32, 1), timeout_s=5) is False
        assert lender.release(lend_id) is True and server.lend_count == 0


def test_a_release_answered_late_leaves_the_connection_and_its_lends(
    server: ShmLendingServer, lenders: Any
) -> None:
    """A release whose copy outlasts the time it was given: the caller hears ShmTimedOut, but
    the connection and the other lends made over it stay. Until the producer answers, a
    request cannot be sent (ShmBusy, nothing sent, nothing closed); once it has, the late
    answer is read first and the connection serves on."""
    lender = lenders(server, "fetch")
    with (
        SharedBuffer(MiB) as kept_buffer,
        SharedBuffer(MiB) as buffer,
        SharedBuffer(MiB) as another,
    ):
        kept = lender.lend(kept_buffer, "fetch")
        lend_id = lender.lend(buffer, "fetch")
        held = server.get(call_id(lend_id, 1), "fetch")
        assert held is not None
        with held.acquire():
            with pytest.raises(ShmTimedOut) as late:
                lender.release(call_id(lend_id, 1), timeout_s=0.1)
            assert not isinstance(late.value, ShmBusy)
            assert lender.connected
            with pytest.raises(ShmBusy):
                lender.lend(another, "fetch", timeout_s=0.1)
            assert lender.connected and server.lend_count == 2
        again = lender.lend(another, "fetch")
        assert server.get(again, "fetch") is not None
        assert server.get(kept, "fetch") is not None and server.lend_count == 3


def test_a_settle_answered_late_costs_other_loads_no_lend(server: ShmLendingServer) -> None:
    """A cut-off call whose copy outlasts its settle: the settle returns in its time (and says
    that a copy may still land). A lend wanted meanwhile is not made for that call only (the
    connection owes the release's answer); once the copy is over, lending works at once, and
    the lend made before is still live: shared memory was not switched off."""
    from kvpark.client._shm import SETTLE_GRACE_S, ShmAccess

    access = ShmAccess(server.path, TOKENS["fetch"], "fetch", lambda: EPOCH, lambda: None)
    try:
        shared, other = access.shared_buffer(4096), access.shared_buffer(4096)
        found = access.lend_of(shared, 5.0)
        assert found is not None
        held = server.get(found[0], "fetch")
        assert held is not None
        with held.acquire():
            started = time.monotonic()
            access.settle(found[0], timeout_s=0.0)
            assert time.monotonic() - started < SETTLE_GRACE_S + 0.5
            assert access.lend_of(other, 0.1) is None
        assert access.lend_of(other, 5.0) is not None
        assert server.get(held.lend_id, "fetch") is not None and server.lend_count == 2
    finally:
        access.close()
