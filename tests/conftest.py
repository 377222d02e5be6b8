"""Shared fixtures: real producers on port 0 (in-process or as a subprocess) and a fake clock.

Tests build real objects (no stubs that bypass constructors) and wait for conditions with
`wait_until`, never for time to pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from kvpark.address import Address
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer.config import ProducerConfig
from kvpark.producer.server import ProducerServer

ROOT = Path(__file__).resolve().parent.parent


def example(name: str) -> ModuleType:
    """The example script `examples/<name>.py` as a module. examples/ is not a package and not
    installed; its scripts import each other by name, so the folder goes on sys.path."""
    folder = str(ROOT / "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


MiB = 1024 * 1024

# Small, fast settings every test producer starts from; tests override what they exercise.
TEST_SETTINGS: dict[str, Any] = {
    "listen": "127.0.0.1:0",
    "metrics_listen": "",
    "pool_bytes": 64 * MiB,
    "max_chunk_bytes": 4 * MiB,
    "unbound_store_timeout_s": 60,
    "tombstone_retention_s": 60,
    "consumer_load_timeout_s": 30,
    "max_fetch_wait_s": 10,
    "reap_interval_s": 0.05,
    "shutdown_grace_s": 2,
}


@dataclass
class FakeClock:
    """A monotonic clock tests move by hand."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_config(**overrides: Any) -> ProducerConfig:
    return ProducerConfig.from_mapping({**TEST_SETTINGS, **overrides})


@asynccontextmanager
async def running_producer(
    clock: Callable[[], float] = time.monotonic, **overrides: Any
) -> AsyncIterator[ProducerServer]:
    server = ProducerServer(make_config(**overrides), clock=clock)
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown(grace_s=0)


def channel_options(max_bytes: int = 64 * MiB) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]


@asynccontextmanager
async def stub_for(server: ProducerServer) -> AsyncIterator[pb_grpc.KVProducerStub]:
    """A client built from the ordinary generated stubs, as any other language would."""
    async with grpc.aio.insecure_channel(server.target, options=channel_options()) as channel:
        yield pb_grpc.KVProducerStub(channel)


async def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    """Polls `predicate` until it returns something truthy; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(0.01)


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    """Blocking twin of `wait_until` for sync tests: polls a condition, never sleeps for time
    to pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.005)


def park_requests(
    kid: str,
    chunks: dict[int, bytes],
    total: int = 0,
    batch_bytes: int = 0,
    crc: bool = True,
    commit: bool = True,
    fingerprint: bytes = b"",
) -> list[pb.ParkRequest]:
    """One Park batch with plain generated messages: header, chunks, and (unless `commit` is
    False) the ParkCommit that names what was sent."""
    from kvpark.checksum import crc32c_of

    header = pb.ParkHeader(
        kv_request_id=kid, total_chunks=total, batch_bytes=batch_bytes, fingerprint=fingerprint
    )
    msgs = [pb.ParkRequest(header=header)]
    for cid, data in chunks.items():
        msgs.append(
            pb.ParkRequest(
                chunk=pb.Chunk(chunk_id=cid, data=data, crc32c=crc32c_of(data) if crc else None)
            )
        )
    if commit:
        size = sum(len(d) for d in chunks.values())
        msgs.append(pb.ParkRequest(commit=pb.ParkCommit(chunks=len(chunks), bytes=size)))
    return msgs


async def park(
    stub: pb_grpc.KVProducerStub, kid: str, chunks: dict[int, bytes], **kw: Any
) -> pb.ParkResponse:
    return await stub.Park(iter(park_requests(kid, chunks, **kw)))


async def fetch_all(stub: pb_grpc.KVProducerStub, kid: str, **kw: Any) -> list[pb.FetchResponse]:
    return [m async for m in stub.Fetch(pb.FetchRequest(kv_request_id=kid, **kw))]


async def state_of(stub: pb_grpc.KVProducerStub, kid: str) -> pb.IdState:
    reply = await stub.Lookup(pb.LookupRequest(kv_request_ids=[kid]))
    return reply.states[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ProducerProcess:
    """A producer running as `python -m kvpark.producer` (for signals and SIGKILL).

    Its output is read as it comes, into `log`: a pipe nobody reads fills after about 64 KiB
    (a few hundred log lines), and the producer would then block on its next log line with
    every call it serves."""

    proc: subprocess.Popen[str]
    target: str
    metrics_port: int
    log: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    def read_output(self) -> None:
        """Starts reading the output into `log` (once the start-up check is done with it)."""
        stream = self.proc.stdout
        assert stream is not None and self._reader is None
        self._reader = threading.Thread(
            target=lambda: self.log.extend(stream), name="producer-output", daemon=True
        )
        self._reader.start()

    def output(self, timeout: float = 30.0) -> str:
        """Everything the producer wrote, once it has exited (its output ends with it)."""
        self.proc.wait(timeout=timeout)
        if self._reader is not None:
            self._reader.join(timeout=timeout)
        return "".join(self.log)

    def close_output(self) -> None:
        """After the process has ended: the reader sees the end of its output first."""
        if self._reader is not None:
            self._reader.join(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()


# Sets a child's limits, then becomes the real command (argv[2:]) by exec.
_LAUNCHER = """
import json, os, resource, sys
limits = json.loads(sys.argv[1])
for name in ("RLIMIT_NOFILE", "RLIMIT_AS"):
    if limits[name] is not None:
        resource.setrlimit(getattr(resource, name), (limits[name], limits[name]))
if limits["umask"] is not None:
    os.umask(limits["umask"])
os.execv(sys.argv[2], sys.argv[2:])
"""


@dataclass(frozen=True)
class ChildLimits:
    """Limits a test's child process starts under (None: inherited).

    A launcher sets them and then execs the command, rather than `preexec_fn`: that forks this
    process, whose gRPC threads (left busy by earlier tests) can leave the child aborting before
    it runs, and runs Python between fork and exec."""

    nofile: int | None = None
    address_space: int | None = None
    umask: int | None = None

    def wrap(self, args: list[str]) -> list[str]:
        """`args` run under these limits."""
        limits = {"RLIMIT_NOFILE": self.nofile, "RLIMIT_AS": self.address_space}
        setup = json.dumps({**limits, "umask": self.umask})
        return [sys.executable, "-c", _LAUNCHER, setup, *args]


def start_producer_process(
    tmp_path: Path, limits: ChildLimits | None = None, **overrides: Any
) -> ProducerProcess:
    """`python -m kvpark.producer` with the test settings and `overrides`, ready to serve,
    started under `limits`."""
    port, metrics_port = free_port(), free_port()
    settings = {
        **TEST_SETTINGS,
        "listen": f"127.0.0.1:{port}",
        "metrics_listen": f"127.0.0.1:{metrics_port}",
        **overrides,
    }
    args = [sys.executable, "-m", "kvpark.producer"]
    for key, value in settings.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    if limits is not None:
        args = limits.wrap(args)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path
    )
    target = str(Address.parse(str(settings["listen"])).dialable())
    deadline = time.monotonic() + 20
    with grpc.insecure_channel(target) as channel:
        # One readiness future, cancelled before the channel closes: a future left polling a
        # closed channel dies in grpc's thread with "Channel closed!".
        ready = grpc.channel_ready_future(channel)
        try:
            while True:
                if proc.poll() is not None:
                    output = proc.stdout.read() if proc.stdout else ""
                    raise AssertionError(f"producer exited {proc.returncode}: {output}")
                try:
                    ready.result(timeout=0.2)
                    break
                except grpc.FutureTimeoutError:
                    if time.monotonic() > deadline:
                        proc.kill()
                        raise
        finally:
            ready.cancel()
    metrics = str(settings["metrics_listen"])
    started = ProducerProcess(proc, target, Address.parse(metrics).port if metrics else 0)
    started.read_output()
    return started


@contextmanager
def process_producer(tmp_path: Path, **overrides: Any) -> Iterator[ProducerProcess]:
    """`start_producer_process`, stopped (SIGTERM) and its output closed on the way out."""
    p = start_producer_process(tmp_path, **overrides)
    try:
        yield p
    finally:
        p.proc.terminate()
        p.proc.wait(timeout=10)
        p.close_output()


def memfds_held(pid: int, name: str) -> int:
    """How many of process `pid`'s descriptors are the memfd `name`: a producer's mapping of
    a lend holds one until it is unmapped."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{name} ")
    return held


@pytest.fixture
def shm_socket() -> Iterator[str]:
    """A path for a producer's shm socket, in a directory of its own (Unix socket paths are
    short, so not under pytest's tmp_path)."""
    directory = tempfile.mkdtemp(prefix="kvpark-")
    yield os.path.join(directory, "shm.sock")
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def producer_process(tmp_path: Path) -> Iterator[Callable[..., ProducerProcess]]:
    started: list[ProducerProcess] = []

    def start(**overrides: Any) -> ProducerProcess:
        p = start_producer_process(tmp_path, **overrides)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait(timeout=10)
        p.close_output()
