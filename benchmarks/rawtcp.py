"""Baseline: raw Python TCP over loopback between two processes — the practical limit.

The peer (`python -m benchmarks.rawtcp PORT NBYTES`) builds the benchmark pattern, connects
once, and for each `send OFFSET NBYTES CHUNK` line on its stdin `sendall`s that window of the
pattern in CHUNK-sized pieces, then answers `sent` on stdout. This process receives with
`recv_into` straight into a preallocated buffer (its pages touched before timing, like the
fetch's numpy array) and checks every byte against its own copy of the pattern. A repetition is
timed from writing the command to the last byte received, as a load is timed from its request
to its last chunk.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvpark.client.bench.rawtcp import receive_into

from . import data
from .env import start_child, stop_child


class CpuClock(Protocol):
    def start(self) -> None: ...

    def stop(self) -> tuple[float, float]: ...


class RawTcpPair:
    """This process (receiver) and a peer process (sender) on one loopback connection."""

    def __init__(self, source: data.U8, nbytes: int) -> None:
        self._source = source
        self._nbytes = nbytes
        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            listener.settimeout(60)
            self._peer = start_child("rawtcp", [str(listener.getsockname()[1]), str(len(source))])
            try:
                self._conn, _ = listener.accept()
            except BaseException:
                stop_child(self._peer)
                raise
        finally:
            listener.close()
        self._conn.settimeout(60)
        self._dest = np.empty(nbytes, dtype=np.uint8)

    @property
    def peer_pid(self) -> int:
        return self._peer.pid

    def once(self, rep: int, chunk: int, cpu: CpuClock | None = None) -> float:
        """Seconds to move repetition `rep`'s window in `chunk`-byte sends, bytes verified.
        `cpu` is started and stopped around the transfer alone."""
        nbytes = self._nbytes
        dest, conn = self._dest, self._conn
        dest.fill(0)  # touched, and nothing left over from the previous repetition
        expected = data.window(self._source, rep, nbytes)
        if cpu is not None:
            cpu.start()
        started = time.perf_counter()
        _command(self._peer, f"send {rep * data.REP_SHIFT} {nbytes} {chunk}")
        receive_into(conn, dest, chunk)
        seconds = time.perf_counter() - started
        _expect(self._peer, "sent")  # the peer's last sendall has returned
        if cpu is not None:
            cpu.stop()
        data.check_same(dest, expected, f"raw TCP, {chunk}-byte sends, window {rep}")
        return seconds

    def close(self) -> None:
        self._conn.close()
        stop_child(self._peer)


def _command(peer: subprocess.Popen[str], line: str) -> None:
    assert peer.stdin is not None
    peer.stdin.write(line + "\n")
    peer.stdin.flush()


def _expect(peer: subprocess.Popen[str], word: str) -> None:
    assert peer.stdout is not None and peer.stderr is not None
    line = peer.stdout.readline().strip()
    if line != word:
        err = peer.stderr.read() if peer.poll() is not None else ""
        raise RuntimeError(f"raw TCP peer said {line!r}, expected {word!r}: {err}")


def peer_main(argv: Sequence[str]) -> int:
    """The sending side, in its own process."""
    port, size = int(argv[0]), int(argv[1])
    source = data.pattern(size)
    view = memoryview(source)  # type: ignore[arg-type]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        for line in sys.stdin:
            parts = line.split()
            if not parts:
                continue
            if parts[0] != "send":
                print(f"unknown command {parts[0]!r}", file=sys.stderr)
                return 2
            offset, nbytes, chunk = int(parts[1]), int(parts[2]), int(parts[3])
            end = offset + nbytes
            for start in range(offset, end, chunk):
                sock.sendall(view[start : min(end, start + chunk)])
            print("sent", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(peer_main(sys.argv[1:]))
