"""`kvpark bench` stopped from outside leaves none of its processes or files behind: its own
producer (a child that would otherwise go on serving, orphaned), its raw-TCP peer, and the
private directory of the producer's shared-memory socket. The bench runs as an operator runs
it, the installed command in a subprocess, told to run far longer than the test waits: the
signal is sent once the transfer section has started its raw-TCP peer, so it finds the bench
at work with every kind of thing it must clean up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from conftest import wait_for


@dataclass(frozen=True)
class Bench:
    proc: subprocess.Popen[bytes]
    producer: int
    peer: int  # the raw-TCP peer
    directory: Path  # the producer's socket's
    out: Path  # the bench's stdout and stderr


def _stat(pid: int) -> list[str]:
    """State and parent PID of `pid`, from /proc (OSError once it is gone)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]


def gone(pid: int) -> bool:
    try:
        return _stat(pid)[0] == "Z"  # exited: a zombie is gone, whoever reaps it
    except OSError:
        return True


def _children(pid: int) -> dict[int, list[str]]:
    """`pid`'s child processes and their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            if entry.name.isdigit() and _stat(int(entry.name))[1] == str(pid):
                argv = (entry / "cmdline").read_bytes().decode().split("\0")
                found[int(entry.name)] = argv
    return found


def _at_work(proc: subprocess.Popen[bytes], out: Path) -> Bench | None:
    """The bench, once its producer's socket exists and its raw-TCP peer runs."""
    children = _children(proc.pid)
    producer = [(pid, argv) for pid, argv in children.items() if "kvpark.producer" in argv]
    peer = [pid for pid, argv in children.items() if "kvpark.client.bench.rawtcp" in argv]
    if not (producer and peer):
        return None
    pid, argv = producer[0]
    socket = Path(argv[argv.index("--shm-socket") + 1])
    return Bench(proc, pid, peer[0], socket.parent, out) if socket.exists() else None


@contextlib.contextmanager
def running_bench(tmp_path: Path) -> Iterator[Bench]:
    """A bench at work; whatever of it outlives the test is ended here, by PID, and removed."""
    script = Path(sys.executable).parent / "kvpark"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "kvpark.client"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}
    out = tmp_path / "out"
    with out.open("wb") as f:
        proc = subprocess.Popen(
            [*command, "bench", "--quick", "--reps", "50"], stdout=f, stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    bench: Bench | None = None
    try:
        bench = wait_for(lambda: _at_work(proc, out), 60, "the bench at work")
        yield bench
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if bench is not None:
            for pid in (bench.producer, bench.peer):
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(bench.directory, ignore_errors=True)


def test_sigterm_stops_the_producer_and_removes_its_directory(tmp_path: Path) -> None:
    with running_bench(tmp_path) as bench:
        os.kill(bench.proc.pid, signal.SIGTERM)
        status = bench.proc.wait(timeout=60)
        wait_for(lambda: gone(bench.producer), 15, "the producer to exit")
        wait_for(lambda: gone(bench.peer), 15, "the raw-TCP peer to exit")
        assert not bench.directory.exists()
        assert status == 128 + signal.SIGTERM, bench.out.read_text()


def test_the_producer_ends_with_a_bench_killed_outright(tmp_path: Path) -> None:
    # SIGKILL runs none of the bench's clean-up (the directory stays, removed by the fixture):
    # the kernel ends the producer, and the peer ends when its stdin closes.
    with running_bench(tmp_path) as bench:
        os.kill(bench.proc.pid, signal.SIGKILL)
        assert bench.proc.wait(timeout=60) == -signal.SIGKILL
        wait_for(lambda: gone(bench.producer), 30, "the producer to exit")
        wait_for(lambda: gone(bench.peer), 15, "the raw-TCP peer to exit")
