"""The benchmark's processes: allocator environment, the producer under test, RSS and CPU.

Every process of a run — the producer, the raw-TCP peer, the late-fetch prober and this client
— runs with the glibc allocator fix (`kvpark.alloc`): multi-MiB buffers stay on the heap
instead of being fresh `mmap`s that page-fault on every message. Child processes
get it through the environment (`MALLOC_*_`, read by glibc at start-up; the producer also calls
`mallopt` itself); this process, already running, gets it from `kvpark.alloc.tune_allocator`.

The producer is a separate process started with `python -m kvpark.producer`, exactly as it is
deployed, on a free loopback port with metrics disabled; `ProducerProcess` owns it and stops it
(SIGTERM, then SIGKILL after a grace) — only the process it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc

from kvpark.alloc import ARENA_MAX, MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES
from kvpark.pb import kvpark_pb2 as pb

MiB = 1024 * 1024
GiB = 1024 * MiB
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")  # /proc reports CPU time in clock ticks

# The same values as kvpark.alloc (and the image's environment), for processes we start.
ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES),
    "MALLOC_ARENA_MAX": str(ARENA_MAX),
}


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: ours, allocator fix on, no KVPARK_ leftovers."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVPARK_") and not k.startswith("MALLOC_")
    }
    env.update(ALLOCATOR_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    # Children import this package and the project's even when it is not installed.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    if extra:
        env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` now (VmRSS)."""
    return _status_kib(pid, "VmRSS") * 1024


def peak_rss_bytes(pid: int) -> int:
    """Highest resident set size of `pid` since it started (VmHWM)."""
    return _status_kib(pid, "VmHWM") * 1024


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {key}")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) `pid` has used so far, from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) * _TICK_S


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Client channel options for multi-MiB messages."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


@dataclass(frozen=True)
class ProducerSettings:
    """The producer configuration a benchmark run uses (passed as command-line flags)."""

    pool_bytes: int = 1 * GiB
    max_chunk_bytes: int = 4 * MiB
    # Short enough that ids left unfetched are reaped within a run (late-fetch and churn
    # measurements), long enough that a 580 MB park is fetched well before its lease ends.
    unbound_store_timeout_s: float = 2.0
    # Long enough that the reaped ids the late-fetch probes use stay tombstoned through a
    # section; consumer_load_timeout_s must be below it (and the benchmark's loads use it).
    tombstone_retention_s: float = 60.0
    consumer_load_timeout_s: float = 30.0
    max_lease_s: float = 600.0
    max_fetch_wait_s: float = 10.0
    reap_interval_s: float = 0.25
    # One 580 MB batch in a 1 GiB pool: more than the producer's default share of it.
    max_batch_share: float = 1.0
    # A delivery holds its pages until the client confirms it; an unconfirmed one (a client
    # that died mid-run) gives them back this soon.
    delivery_grace_s: float = 10.0

    def flags(self) -> list[str]:
        out: list[str] = []
        for key, value in self.__dict__.items():
            out += [f"--{key.replace('_', '-')}", str(value)]
        return out


class ProducerProcess:
    """`python -m kvpark.producer` on a free loopback port, owned by this object."""

    def __init__(
        self,
        settings: ProducerSettings,
        *,
        command: Sequence[str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        """`command` replaces `python -m kvpark.producer` (e.g. a producer from another
        source tree, for before/after comparisons); the flags are appended to it."""
        self.settings = settings
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
        self._final_log = ""
        args = [
            *(command or (sys.executable, "-m", "kvpark.producer")),
            "--listen",
            self.target,
            "--metrics-listen",
            "",
            "--log-level",
            "warning",
            *settings.flags(),
        ]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env(extra_env),
        )
        self.pid = self.proc.pid
        try:
            self._wait_ready(start_timeout_s)
            self.info = self._server_info()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target) as channel:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"producer exited with {self.proc.returncode}: {self.log_tail()}"
                    )
                try:
                    grpc.channel_ready_future(channel).result(timeout=0.2)
                    return
                except grpc.FutureTimeoutError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"producer not ready after {timeout_s}s: {self.log_tail()}"
                        ) from None

    def _server_info(self) -> pb.ServerInfo:
        with grpc.insecure_channel(self.target) as channel:
            call = channel.unary_unary(
                "/kvpark.v1.KVProducer/GetServerInfo",
                request_serializer=pb.GetServerInfoRequest.SerializeToString,
                response_deserializer=pb.ServerInfo.FromString,
            )
            info: pb.ServerInfo = call(pb.GetServerInfoRequest(), timeout=10)
            return info

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def peak_rss(self) -> int:
        return peak_rss_bytes(self.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, limit: int = 4000) -> str:
        if self._log.closed:
            return self._final_log[-limit:]
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode("utf-8", "replace")
        return text[-limit:]

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM (the producer drains and exits 0), SIGKILL after `grace_s`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if not self._log.closed:
            self._final_log = self.log_tail(100_000)
            self._log.close()
        return self.proc.returncode


def start_child(module: str, args: Sequence[str]) -> subprocess.Popen[str]:
    """A helper process of this package (`python -m benchmarks.<module>`), pipes on stdio."""
    return subprocess.Popen(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        bufsize=1,
    )


def stop_child(proc: subprocess.Popen[str], timeout_s: float = 10.0) -> None:
    """Ends a helper this run started: close its stdin (its signal to exit), then kill."""
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        with contextlib.suppress(OSError):
            if stream is not None:
                stream.close()


def _system_ticks() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) * _TICK_S, steal * _TICK_S


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used) for every process we can read."""
    out: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(name)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) * _TICK_S)
    return out


class CpuMeter:
    """How busy the machine was during a section, and how much of that was not us.

    Other work on these 2 cores (other builds, tests) moves every figure; the report carries,
    per section, the average number of cores busy with processes outside this benchmark (this
    process and every process it started), and the hypervisor's steal time, so a reader can
    tell a quiet run from a contended one. Reads /proc (Linux); elsewhere it reports nothing.
    """

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._ok = os.path.exists("/proc/stat")
        self._system = _system_ticks() if self._ok else (0.0, 0.0)
        self._at_start = self._tree() if self._ok else {}
        self._waited = self._waited_children()

    @staticmethod
    def _tree() -> dict[int, float]:
        """CPU seconds of this process and all its descendants, by pid."""
        table = _process_table()
        me = os.getpid()
        ours = {me}
        grew = True
        while grew:
            grew = False
            for pid, (ppid, _) in table.items():
                if ppid in ours and pid not in ours:
                    ours.add(pid)
                    grew = True
        return {pid: table[pid][1] for pid in ours if pid in table}

    @staticmethod
    def _waited_children() -> float:
        t = os.times()
        return float(t.children_user + t.children_system)

    def stop(self) -> dict[str, float]:
        wall = max(1e-9, time.monotonic() - self._started)
        if not self._ok:
            return {"wall_s": round(wall, 3)}
        busy, steal = _system_ticks()
        system = busy - self._system[0]
        tree = self._tree()
        ours = sum(cpu - self._at_start.get(pid, 0.0) for pid, cpu in tree.items())
        ours += self._waited_children() - self._waited
        return {
            "wall_s": round(wall, 3),
            "busy_cores": round(system / wall, 3),
            "our_cores": round(ours / wall, 3),
            "other_cores": round(max(0.0, system - ours) / wall, 3),
            "steal_cores": round((steal - self._system[1]) / wall, 3),
        }
