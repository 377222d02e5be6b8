"""The baseline, measured in the same run: raw Python TCP over loopback between two processes.
The peer (`python -m kvpark.client.bench.rawtcp PORT PATTERN_BYTES`, our producer's allocator
environment) builds the pattern, connects once, and for each `send OFFSET NBYTES CHUNK` line
`sendall`s memoryviews of that window, CHUNK bytes at a time, then answers `sent`; this process
`recv_into`s a preallocated array. No framing, no CRC, no copy but the kernel's: what Python can
move between two processes on this machine at all. Timed from the command to the last byte.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from . import payload
from .processes import child_env, cpu_seconds, end_child, spent, stop_pid

IO_TIMEOUT_S = 60.0  # a stalled peer fails the run instead of hanging it


class RawTcp:
    """This process receives; a peer process it owns sends."""

    def __init__(self, pattern_bytes: int) -> None:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            listener.settimeout(IO_TIMEOUT_S)
            port = str(listener.getsockname()[1])
            self.peer = subprocess.Popen(
                [sys.executable, "-m", __name__, port, str(pattern_bytes)], env=child_env(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                self._conn, _ = listener.accept()
            except BaseException:
                stop_pid(self.peer)
                raise
        self._conn.settimeout(IO_TIMEOUT_S)

    def transfer(self, offset: int, dest: payload.U8, chunk: int) -> tuple[float, float | None]:
        """Fills `dest` from the peer's pattern at `offset`: (seconds, the peer's CPU seconds).
        The caller compares the bytes."""
        assert self.peer.stdin is not None and self.peer.stdout is not None
        view, nbytes = memoryview(dest), len(dest)  # type: ignore[arg-type]
        cpu = cpu_seconds(self.peer.pid)
        started = time.perf_counter()
        self.peer.stdin.write(f"send {offset} {nbytes} {chunk}\n")
        self.peer.stdin.flush()
        received = 0
        while received < nbytes:
            n = self._conn.recv_into(view[received:], min(chunk, nbytes - received))
            if n == 0:
                raise RuntimeError("the raw TCP peer closed the connection early")
            received += n
        seconds = time.perf_counter() - started
        if (answer := self.peer.stdout.readline().strip()) != "sent":  # its last sendall returned
            raise RuntimeError(f"the raw TCP peer answered {answer!r}, not 'sent'")
        return seconds, spent(cpu, cpu_seconds(self.peer.pid))

    def close(self) -> None:
        self._conn.close()
        end_child(self.peer)


def peer_main(argv: Sequence[str]) -> int:
    port, pattern_bytes = int(argv[0]), int(argv[1])
    view = memoryview(payload.pattern(pattern_bytes))  # type: ignore[arg-type]
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        for line in sys.stdin:
            offset, nbytes, chunk = (int(word) for word in line.split()[1:4])
            for start in range(offset, offset + nbytes, chunk):
                sock.sendall(view[start : min(offset + nbytes, start + chunk)])
            print("sent", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(peer_main(sys.argv[1:]))
