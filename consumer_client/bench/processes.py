"""The processes `kvpark bench` starts, and their CPU time. Its own producer is `python -m
kvpark.producer`, as deployed, on a free loopback port with the image's glibc allocator
settings in its environment (multi-MiB buffers stay on the heap instead of being fresh,
page-faulting `mmap`s) and none of our KVPARK_ variables; it and the raw-TCP peer are stopped
by their PID, and nothing else is, also when the bench itself is sent SIGTERM
(`sigterm_as_exit`); on Linux the kernel ends the producer even when the bench is killed
outright (`_ends_with_us`; the peer ends when its stdin closes). A running child's CPU time
comes from /proc/<pid>/stat (Linux); elsewhere the figures that need it are left out.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from kvpark.alloc import ARENA_MAX, MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES

# MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483648 MALLOC_ARENA_MAX=2
ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
    "MALLOC_ARENA_MAX": str(ARENA_MAX),
}
START_TIMEOUT_S = 60.0  # the producer touches every page of its pool before it listens
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPARK_", "MALLOC_"))}
    return {**env, **ALLOCATOR_ENV, "PYTHONUNBUFFERED": "1"}


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of `pid` (all its threads); None where it cannot be read."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within it, SIGTERM raises SystemExit(128 + SIGTERM) in the main thread. By default the
    signal ends the process where it stands, and the `finally` blocks that stop our producer
    and helpers and remove their temporary files never run: the producer would go on serving,
    orphaned, with its socket on disk. Once one SIGTERM has arrived, more are ignored, so that
    they do not cut that clean-up short (stop_pid bounds it). The previous handler comes back
    at the end. Off the main thread, where no handler can be set, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ignore(signum: int, frame: FrameType | None) -> None:
        pass  # a handler, not SIG_IGN: an ignored disposition would pass to children we start

    def exit_(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, ignore)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_)
    try:
        yield
    finally:
        # None: a handler set outside Python, which cannot be put back; the default is.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _ends_with_us() -> Callable[[], None] | None:
    """A `preexec_fn` (Linux; None elsewhere) that has the kernel send the child SIGTERM when
    its parent ends, however it ends: SIGKILL runs none of our clean-up, and the producer,
    whose stdin is not ours, would otherwise serve on. The kernel ties the signal to the
    thread that starts the child: OwnProducer is started by the thread that runs the bench."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in it
    parent = os.getpid()

    def preexec() -> None:
        # Best effort: should the call fail, the child starts as it would without it.
        prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent ended before the request: no signal comes
            os._exit(1)

    return preexec


def stop_pid(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> int | None:
    """SIGTERM to a process we started, SIGKILL after `grace_s`; its exit status."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)
    return proc.returncode


def end_child(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """Ends a helper process that exits when its stdin closes (the raw-TCP peer, the late-fetch
    prober): closes its stdin, waits `grace_s`, then stops it by PID."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        stop_pid(proc)
    if proc.stdout is not None:
        proc.stdout.close()


class OwnProducer:
    """`python -m kvpark.producer` on a free loopback port, owned by this object, offering
    every transport: a data listener on another free loopback port, and a shared-memory
    socket in a private temporary directory."""

    def __init__(self, pool_bytes: int, max_chunk_bytes: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.target = f"127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="kvpark-bench-")
        # max-batch-share 1: the pool is sized for one transfer, which may fill it.
        argv = [sys.executable, "-m", "kvpark.producer", "--listen", self.target]
        argv += ["--pool-bytes", str(pool_bytes), "--max-chunk-bytes", str(max_chunk_bytes)]
        argv += ["--max-batch-share", "1", "--metrics-listen", "", "--log-level", "warning"]
        argv += ["--data-listen", "127.0.0.1:0", "--shm-socket", f"{self._dir.name}/shm.sock"]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=child_env(),
                                     preexec_fn=_ends_with_us())  # fmt: skip
        self.pid = self.proc.pid
        try:
            self._wait_listening(time.monotonic() + START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                self._log.seek(0)
                log = self._log.read().decode("utf-8", "replace")[-2000:].strip()
                raise RuntimeError(f"our producer exited {self.proc.returncode}: {log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("our producer is not listening after 60 s") from None
                time.sleep(0.05)

    def stop(self) -> int | None:
        try:
            return stop_pid(self.proc)
        finally:
            self._log.close()
            self._dir.cleanup()
