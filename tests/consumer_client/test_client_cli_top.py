"""`kvpark top` as a real process: in a pseudo-terminal against a real producer (screens redrawn
in place, keys, rates from parks and fetches made between two refreshes, the producer killed,
Ctrl-C, the terminal restored), and through pipes (blocks, JSON lines, a dead producer)."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ProducerProcess, free_port
from consumer_support import park_sync, payload

from kvpark.client import KVConsumer, ProducerInfo, cli
from kvpark.client.cli_snapshot import ProducerStats, Snapshot
from kvpark.client.cli_top import ERASE_BELOW, HOME, KEY_HINT, SHOW_CURSOR, TopView

SCRIPT = Path(sys.executable).parent / "kvpark"
KVPARK = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "consumer_client"]
# Runs a command with the pseudo-terminal as its controlling terminal (a new session), so that
# Ctrl-C typed into the terminal reaches it as SIGINT, as in a shell.
IN_NEW_SESSION = "import os, sys; os.login_tty(0); os.execv(sys.argv[1], sys.argv[1:])"


class Terminal:
    """A pseudo-terminal with a command running in it; the test plays the user."""

    def __init__(self, argv: list[str], columns: int = 120, rows: int = 40) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", IN_NEW_SESSION, *argv],
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            close_fds=True,
        )
        self.output = ""
        self.ended = False  # the terminal was hung up: its command's session ended

    def frames(self) -> list[str]:
        """Every screen drawn in full so far, escape codes taken out."""
        return [
            part.partition(ERASE_BELOW)[0].replace("\x1b[K", "").replace("\r", "")
            for part in self.output.split(HOME)
            if ERASE_BELOW in part
        ]

    def wait_for(self, predicate: Callable[[], object], timeout: float = 30) -> None:
        """Reads the terminal until `predicate()` holds; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.ended:
                why = "the session ended" if self.ended else "timed out"
                raise AssertionError(f"{why}; the terminal shows:\n{self.output}")
            ready, _, _ = select.select([self.master], [], [], remaining)
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: hung up
                    data = b""
                self.ended = not data
                self.output += data.decode("utf-8", "replace")

    def frame(self, n: int) -> str:
        self.wait_for(lambda: len(self.frames()) >= n)
        return self.frames()[n - 1]

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def exit_code(self) -> int:
        """Waits for the command to end and reads what it wrote until then."""
        code = self.proc.wait(timeout=30)
        while not self.ended and select.select([self.master], [], [], 0)[0]:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                data = b""
            self.ended = not data
            self.output += data.decode("utf-8", "replace")
        return code

    def settings_restored(self) -> bool:
        lflag = termios.tcgetattr(self.slave)[3]
        return bool(lflag & termios.ECHO) and bool(lflag & termios.ICANON)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self.master)
        os.close(self.slave)


def blocks(text: str) -> list[str]:
    """The blocks `kvpark top` prints into a pipe, one per refresh."""
    return [b for b in re.split(r"^(?=kvpark top )", text, flags=re.MULTILINE) if b.strip()]


def line(frame: str, pattern: str) -> re.Match[str]:
    found = re.search(pattern, frame, re.MULTILINE)
    assert found, f"{pattern!r} not on the screen:\n{frame}"
    return found


def test_top_in_a_terminal_shows_pool_ids_and_rates_between_refreshes(
    producer_process: Callable[..., ProducerProcess],
) -> None:
    producer = producer_process()
    park_sync(producer.target, "warm", payload(1, 1000), total=1)
    # A long interval: every refresh after the first is asked for with a key, so the parks
    # below land between the first and second refresh for certain.
    term = Terminal([*KVPARK, "top", "--target", producer.target, "--interval", "300",
                     "--count", "3"])  # fmt: skip
    try:
        first = term.frame(1)
        assert HOME in term.output and "\x1b[2J" in term.output  # redrawn in place
        assert f"kvpark top  {producer.target}  refresh 1, every 300s" in first
        used = line(first, r"^pool +(\d+(?:\.\d)? \w+) used of 64\.0 MiB \(\d+\.\d%\)$")
        assert used.group(1) != "0 B"
        assert "ids          parked 1  bound 0  delivered 0  tombstones 0  open park " in first
        assert "rates        from the next refresh" in first
        assert first.rstrip().endswith(KEY_HINT)

        park_sync(producer.target, "p1", payload(2, 3000), total=2)
        park_sync(producer.target, "p2", payload(2, 3000), total=2)
        with KVConsumer(producer.target) as client:
            assert client.load("warm", num_chunks=1).ok  # confirmed on close
        term.type(b" ")
        second = term.frame(2)
        assert "refresh 2" in second
        assert "parked 2  bound 0  delivered 0  tombstones 1  open park batches 0" in second
        parks = line(second, r"^parks +\+2 +(\d+\.\d)/s$")
        assert float(parks.group(1)) > 0
        line(second, r"^fetches +\+1 +\d+\.\d/s$")
        line(second, r"^bytes sent +\+1000 B +\S+ \w+/s$")
        line(second, r"^bytes parked +\+11\.7 KiB +\S+ \w+/s$")  # 2 x (3000 + 3001) bytes
        line(second, r"^late fetch rejections +\+0 +0\.0/s$")

        producer.proc.kill()
        producer.proc.wait(timeout=10)
        term.type(b" ")
        third = term.frame(3)
        line(third, r"^error +GetServerInfo: UNAVAILABLE")
        assert "retrying every 300s" in third and "last answer" in third
        assert "parked 2  bound 0" in third  # the last answer stays on the screen
        # --count 3 reached with the producer gone: exit 3, the terminal as it was.
        assert term.exit_code() == cli.EXIT_RPC
        assert term.output.endswith(SHOW_CURSOR) and term.settings_restored()
    finally:
        term.close()


@pytest.mark.parametrize("producer", ["answering", "gone"])
@pytest.mark.parametrize("key", [b"\x03", b"q"], ids=["ctrl-c", "q"])
def test_top_ends_cleanly_on_ctrl_c_and_q(
    producer_process: Callable[..., ProducerProcess], key: bytes, producer: str
) -> None:
    """Ended by the operator, top exits 0, also when its last refresh did not reach the
    producer (a `--count` run that ends on such a refresh exits 3)."""
    target = producer_process().target if producer == "answering" else f"127.0.0.1:{free_port()}"
    term = Terminal([*KVPARK, "top", "--target", target, "--interval", "300"])
    try:
        term.frame(1)
        assert not term.settings_restored()  # cbreak while it runs: keys without Enter
        term.type(key)
        assert term.exit_code() == cli.EXIT_OK
        assert "Traceback" not in term.output
        assert term.settings_restored()
    finally:
        term.close()


# tgkill(2), which sends a signal to one thread of another process (Python has no call for it).
TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


def blocks_sigint(pid: int, tid: int) -> bool:
    """Whether a thread has SIGINT blocked (the kernel then hands it to another thread)."""
    with open(f"/proc/{pid}/task/{tid}/status") as status:
        mask = next(line for line in status if line.startswith("SigBlk:")).split()[1]
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(TGKILL is None, reason="tgkill's system call number is not known here")
def test_top_ends_at_once_when_ctrl_c_reaches_another_thread(
    producer_process: Callable[..., ProducerProcess],
) -> None:
    """The kernel may hand the SIGINT of a Ctrl-C to any thread of the process, e.g. one of
    grpc's; the main thread, waiting for a key or the 300-s interval, must still end now."""
    producer = producer_process()
    term = Terminal([*KVPARK, "top", "--target", producer.target, "--interval", "300"])
    try:
        term.frame(1)
        pid = term.proc.pid
        others = [
            int(tid)
            for tid in os.listdir(f"/proc/{pid}/task")
            if int(tid) != pid and not blocks_sigint(pid, int(tid))
        ]
        assert others, "grpc's threads run beside the main one, taking signals"
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(TGKILL, pid, others[0], signal.SIGINT) == 0, ctypes.get_errno()
        assert term.exit_code() == cli.EXIT_OK
        assert "Traceback" not in term.output
        assert term.settings_restored()
    finally:
        term.close()


def test_top_through_a_pipe_prints_blocks_and_json_lines(
    producer_process: Callable[..., ProducerProcess],
) -> None:
    producer = producer_process()
    park_sync(producer.target, "piped", payload(1, 500), total=1)
    base = [*KVPARK, "top", "--target", producer.target, "--interval", "0.05", "--count", "2"]

    text = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert text.returncode == cli.EXIT_OK, text.stderr
    assert "\x1b" not in text.stdout  # no escape codes into a file
    first_block, second_block = blocks(text.stdout)
    assert KEY_HINT not in text.stdout  # keys are read from a terminal only
    assert "refresh 1" in first_block and "from the next refresh" in first_block
    assert "refresh 2" in second_block and "ids          parked 1  bound 0" in second_block
    line(second_block, r"^parks +\+0 +0\.0/s$")

    lines = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60)
    assert lines.returncode == cli.EXIT_OK, lines.stderr
    first, second = (json.loads(x) for x in lines.stdout.splitlines())
    assert first["ok"] and first["rates"] is None and first["stats"]["parked_ids"] == 1
    assert second["refresh"] == 2 and second["rates_over_s"] > 0
    assert second["rates"]["parks_total"] == {"delta": 0, "per_s": 0.0}


def test_top_keeps_asking_a_producer_that_does_not_answer() -> None:
    dead = f"127.0.0.1:{free_port()}"
    run = subprocess.run(
        [*KVPARK, "top", "--target", dead, "--interval", "0.05", "--count", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == cli.EXIT_RPC and run.stderr == ""
    shown = blocks(run.stdout)
    assert len(shown) == 3
    for n, block in enumerate(shown, start=1):
        assert f"refresh {n}" in block and "GetServerInfo: UNAVAILABLE" in block


def _snapshot(epoch: int, parks: int, at: float) -> Snapshot:
    counters = dict.fromkeys(ProducerStats.__dataclass_fields__, 0)
    info = ProducerInfo(
        producer_epoch=epoch, version="v", pool_bytes=100, pool_free_bytes=75,
        max_chunk_bytes=10, unbound_store_timeout_s=1, tombstone_retention_s=2,
        consumer_load_timeout_s=1, max_lease_s=1, max_fetch_wait_s=1, park_idle_timeout_s=1,
        delivery_grace_s=1, fetch_stall_timeout_s=1, max_batch_bytes=50, advertise_address="",
        data_address="", data_tls=False, shm_socket="",
        stats=ProducerStats(**{**counters, "parks_total": parks}),
    )  # fmt: skip
    return Snapshot(info, at)


def test_rates_are_only_taken_between_answers_of_one_process() -> None:
    view = TopView("h:1", 1.0)
    view.observe(_snapshot(epoch=7, parks=10, at=100.0))
    assert view.rates is None and view.note == "from the next refresh"
    view.observe(_snapshot(epoch=7, parks=16, at=102.0))
    assert view.rates is not None and view.rates_over_s == 2.0
    assert (view.rates[0].label, view.rates[0].delta, view.rates[0].per_s) == ("parks", 6, 3.0)
    # A restarted producer counts from zero: no negative rates, a note instead.
    view.observe(_snapshot(epoch=8, parks=1, at=103.0))
    assert view.rates is None and "producer restarted (epoch 7 -> 8)" in view.note
    assert "pool         25 B used of 100 B (25.0%)" in view.lines(keys=False)
