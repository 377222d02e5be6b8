"""The baseline, measured in the same run: raw Python TCP over loopback between two processes.
The peer (`python -m kvpark.client.bench.rawtcp PORT PATTERN_BYTES CONNECTIONS`, our producer's
allocator environment) builds the pattern, connects CONNECTIONS times (naming each connection's
index first), and for each `send CONN OFFSET NBYTES CHUNK` line `sendall`s memoryviews of that
window on connection CONN, CHUNK bytes at a time, then answers `sent`; this process
`recv_into`s a preallocated array. No framing, no CRC, no copy but the kernel's: what Python can
move between two processes on this machine at all. Timed from the command to the last byte.

Several transfers at once (`transfer_at_once`) are the machine's own cost of concurrency, the
reference for kvpark's loads at once: the peer sends on SEND_THREADS threads, as the producer
sends on its data threads (two by default), and this process receives each connection on a
thread of the caller's.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from . import payload
from .processes import child_env, cpu_seconds, end_child, spent

IO_TIMEOUT_S = 60.0  # a stalled peer fails the run instead of hanging it
SEND_THREADS = 2  # the producer's data threads, by default
_INDEX_BYTES = 2  # a connection's index, the first thing the peer sends on it


class RawTcp:
    """This process receives; a peer process it owns sends, over `connections` connections."""

    def __init__(self, pattern_bytes: int, connections: int = 1) -> None:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(connections)
            listener.settimeout(IO_TIMEOUT_S)
            port = str(listener.getsockname()[1])
            self.peer = subprocess.Popen(
                [sys.executable, "-m", __name__, port, str(pattern_bytes), str(connections)],
                env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            self._conns: list[socket.socket] = []
            try:
                for _ in range(connections):
                    self._conns.append(listener.accept()[0])
                    self._conns[-1].settimeout(IO_TIMEOUT_S)
                self._conns.sort(key=_index)
            except BaseException:
                self.close()
                raise

    def transfer(self, offset: int, dest: payload.U8, chunk: int) -> tuple[float, float | None]:
        """Fills `dest` from the peer's pattern at `offset`: (seconds, the peer's CPU seconds).
        The caller compares the bytes."""
        return self.transfer_at_once([(offset, dest)], chunk, None)

    def transfer_at_once(
        self, windows: Sequence[tuple[int, payload.U8]], chunk: int, threads: Executor | None
    ) -> tuple[float, float | None]:
        """Fills each (offset, dest) window from the peer's pattern, all at once, window i on
        connection i, each received by one of `threads` (None: this thread, one window):
        (seconds until the last byte, the peer's CPU seconds). The caller compares the bytes."""
        assert self.peer.stdin is not None and self.peer.stdout is not None
        cpu = cpu_seconds(self.peer.pid)
        started = time.perf_counter()
        for i, (offset, dest) in enumerate(windows):
            self.peer.stdin.write(f"send {i} {offset} {len(dest)} {chunk}\n")
        self.peer.stdin.flush()
        if threads is None:
            ((_, dest),) = windows
            receive_into(self._conns[0], dest, chunk)
        else:
            receiving = [threads.submit(receive_into, self._conns[i], dest, chunk)
                         for i, (_, dest) in enumerate(windows)]  # fmt: skip
            for done in receiving:
                done.result()
        seconds = time.perf_counter() - started
        for _ in windows:  # each window's last sendall returned
            if (answer := self.peer.stdout.readline().strip()) != "sent":
                raise RuntimeError(f"the raw TCP peer answered {answer!r}, not 'sent'")
        return seconds, spent(cpu, cpu_seconds(self.peer.pid))

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        end_child(self.peer)


def _index(conn: socket.socket) -> int:
    index = bytearray(_INDEX_BYTES)
    receive_into(conn, index, _INDEX_BYTES)
    return int.from_bytes(index, "big")


def receive_into(conn: socket.socket, dest: payload.U8 | bytearray, chunk: int) -> None:
    """Fills `dest` from `conn` in reads of at most `chunk` bytes, as a plain Python receiver
    would (the lab's raw TCP baseline reads the same way)."""
    view, nbytes = memoryview(dest), len(dest)  # type: ignore[arg-type]
    received = 0
    while received < nbytes:
        n = conn.recv_into(view[received:], min(chunk, nbytes - received))
        if n == 0:
            raise RuntimeError("the raw TCP peer closed the connection early")
        received += n


def peer_main(argv: Sequence[str]) -> int:
    port, pattern_bytes, connections = (int(word) for word in argv[:3])
    view = memoryview(payload.pattern(pattern_bytes))  # type: ignore[arg-type]
    socks = [socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
             for _ in range(connections)]  # fmt: skip
    answering = threading.Lock()

    def send(sock: socket.socket, offset: int, nbytes: int, chunk: int) -> None:
        answer = "sent"
        try:
            for start in range(offset, offset + nbytes, chunk):
                sock.sendall(view[start : min(offset + nbytes, start + chunk)])
        except OSError as exc:  # the receiver sees the connection end at once, and why here
            answer = f"failed: {exc!r}"
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with answering:
            print(answer, flush=True)

    try:
        for i, sock in enumerate(socks):
            sock.sendall(i.to_bytes(_INDEX_BYTES, "big"))
        with ThreadPoolExecutor(SEND_THREADS) as threads:
            for line in sys.stdin:
                conn, offset, nbytes, chunk = (int(word) for word in line.split()[1:5])
                threads.submit(send, socks[conn], offset, nbytes, chunk)
    finally:
        for sock in socks:
            sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(peer_main(sys.argv[1:]))
