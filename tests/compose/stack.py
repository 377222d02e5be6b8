"""Driving a compose project from the tests: the compose CLI, the engine check, containers.

`Stack` wraps one compose project (its own project name, so it never touches anyone else's
containers): `up`, health waits, published ports, one-off containers (`run`), and a teardown
that always runs `down -v --remove-orphans`. Works with `docker compose` (v2) and
`docker-compose` (v1), whichever answers. Every subprocess call is bounded in time.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from conftest import wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEMO_FILE = ROOT / "docker-compose.yml"
TLS_FILE = ROOT / "docker-compose.tls.yml"
TEST_FILE = HERE / "docker-compose.test.yml"
BASE_IMAGE = os.environ.get("BASE_IMAGE", "python:3.11-slim")
# The tag the compose files build and run (`${KVPARK_IMAGE:-kvpark:dev}` in them).
IMAGE = os.environ.get("KVPARK_IMAGE", "kvpark:dev")
# What the test override sets on the producer (tests/compose/docker-compose.test.yml).
LEASE_S = 2.0

NO_ENGINE = "compose tests: no Docker engine running (start one, or run ./scripts/test.sh --docker)"


class DockerError(AssertionError):
    pass


def sh(
    args: list[str], *, timeout: float, env: Mapping[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Runs a command with a time bound; DockerError (with its output) when it fails."""
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise DockerError(f"{' '.join(args)}: no answer within {timeout}s") from exc
    if check and proc.returncode != 0:
        output = proc.stdout[-3000:] + proc.stderr[-3000:]
        raise DockerError(f"{' '.join(args)} exited {proc.returncode}:\n{output}")
    return proc


def docker(*args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh(["docker", *args], timeout=timeout, check=check)


@functools.cache
def engine_problem() -> str | None:
    """None when a Docker engine answers; else why not (one line)."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    try:
        proc = docker("info", "--format", "{{.ServerVersion}}", timeout=15, check=False)
    except DockerError as exc:
        return str(exc)
    if proc.returncode != 0 or not proc.stdout.strip():
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return lines[-1] if lines else f"docker info exited {proc.returncode}"
    return None


@functools.cache
def compose_command() -> tuple[str, ...] | None:
    """`docker compose` (v2) when the plugin answers, else `docker-compose` (v1), else None."""
    for candidate in (("docker", "compose"), ("docker-compose",)):
        if shutil.which(candidate[0]) is None:
            continue
        try:
            if sh([*candidate, "version"], timeout=15, check=False).returncode == 0:
                return candidate
        except DockerError:
            continue
    return None


def _instant(rfc3339: str) -> tuple[str, str]:
    """A Docker timestamp ("2026-01-02T03:04:05.12Z", any number of fraction digits) as a
    tuple that orders correctly."""
    whole, _, fraction = rfc3339.rstrip("Z").partition(".")
    return whole, fraction.ljust(9, "0")


@dataclass
class Stack:
    """One compose project made of `files`, with `env` for the files' ${...} variables."""

    project: str
    files: list[Path]
    env: dict[str, str] = field(default_factory=dict)
    oneoffs: list[str] = field(default_factory=list)
    # Container ids and published ports, asked once per (re)start: each compose CLI call costs
    # a fraction of a second (v1 is a Python program), which matters next to a 2 s lease.
    _cache: dict[tuple[str, ...], str] = field(default_factory=dict)

    @property
    def compose(self) -> list[str]:
        command = compose_command()
        assert command is not None
        args = [*command, "-p", self.project]
        for f in self.files:
            args += ["-f", str(f)]
        return args

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def run(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return sh([*self.compose, *args], timeout=timeout, env=self._env(), check=check)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*self.compose, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self._env(),
            cwd=ROOT,
        )

    # ------------------------------------------------------------------------- lifecycle
    def build(self) -> None:
        self.run("build", "producer", timeout=900)

    def up(self, *services: str) -> None:
        self._cache.clear()
        self.run("up", "-d", "--no-build", *services, timeout=120)

    def restart(self) -> None:
        """Restarts the producer (SIGTERM: graceful) and waits until it serves again."""
        self._cache.clear()
        self.run("restart", "-t", "5", "producer", timeout=60)
        self.wait_healthy()
        wait_for(lambda: serving(self.target), 30, "the producer to serve on its published port")

    def down(self) -> None:
        """Removes everything of this project: containers (one-offs too), networks, volumes."""
        for name in self.oneoffs:
            docker("rm", "-f", "-v", name, timeout=60, check=False)
        self.oneoffs.clear()
        self._cache.clear()
        self.run("down", "-v", "--remove-orphans", "-t", "2", timeout=180, check=False)

    # ------------------------------------------------------------------------ containers
    def container(self, service: str = "producer") -> str:
        key = ("container", service)
        if key not in self._cache:
            cid = self.run("ps", "-q", service, timeout=30).stdout.strip()
            if not cid:
                raise DockerError(f"{self.project}: no container for service {service}")
            self._cache[key] = cid
        return self._cache[key]

    def inspect(self, template: str, service: str = "producer") -> str:
        return docker("inspect", "-f", template, self.container(service)).stdout.strip()

    @property
    def network(self) -> str:
        return f"{self.project}_default"

    def health(self, service: str = "producer") -> str:
        """'healthy', 'starting', 'unhealthy', or the state when not running.

        Only a probe that passed since the container last started counts: right after a
        restart Docker may still report the previous run's 'healthy' for a while."""
        state = json.loads(
            docker("inspect", "-f", "{{json .State}}", self.container(service)).stdout
        )
        if state["Status"] != "running":
            return str(state["Status"])
        health = state.get("Health") or {}
        status = str(health.get("Status", ""))
        if status == "healthy":
            started = _instant(state["StartedAt"])
            probes = health.get("Log") or []
            if not any(_instant(p["Start"]) >= started and p["ExitCode"] == 0 for p in probes):
                return "starting"
        return status

    def wait_healthy(self, service: str = "producer", timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while (health := self.health(service)) != "healthy":
            if time.monotonic() > deadline or health in ("exited", "dead"):
                logs = self.run("logs", "--tail", "40", service, check=False).stdout
                raise DockerError(
                    f"{service} is {health!r}, not healthy, after {timeout}s:\n{logs}"
                )
            time.sleep(0.1)

    def ensure_producer(self) -> None:
        """The producer is running and healthy (started again if a test stopped it), and
        answers through its published port."""
        if self.health() != "healthy":
            self.up("producer")
            self.wait_healthy()
        wait_for(lambda: serving(self.target), 30, "the producer to serve on its published port")

    def port(self, container_port: int, service: str = "producer") -> str:
        """The host address ("127.0.0.1:PORT") publishing `container_port`. Asked again after
        each (re)start: a container started again may get another host port."""
        key = ("port", service, str(container_port))
        if key not in self._cache:
            out = self.run("port", service, str(container_port), timeout=30).stdout.strip()
            host, _, port = out.rpartition(":")
            if not port.isdigit():
                raise DockerError(f"no published port for {service}:{container_port}: {out!r}")
            self._cache[key] = f"{'127.0.0.1' if host in ('', '0.0.0.0') else host}:{port}"
        return self._cache[key]

    @property
    def target(self) -> str:
        return self.port(50051)

    # ------------------------------------------------------------------- one-off containers
    def start_oneoff(self, service: str, *args: str, name: str) -> str:
        """`run -d` a one-off container of `service` (no dependencies); returns its name."""
        full = f"{self.project}_{name}"
        self.oneoffs.append(full)
        self.run("run", "-d", "--no-deps", "--name", full, service, *args, timeout=60)
        return full

    def oneoff_events(self, name: str) -> list[dict[str, Any]]:
        """The JSON lines a one-off printed so far (loader.py's events)."""
        out = docker("logs", name, timeout=30).stdout
        events = []
        for line in out.splitlines():
            if line.startswith("{"):
                events.append(json.loads(line))
        return events

    def wait_event(
        self, name: str, accept: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.oneoff_events(name):
                if accept(event):
                    return event
            if time.monotonic() > deadline:
                logs = docker("logs", name, timeout=30, check=False)
                raise DockerError(
                    f"{name}: no {what} within {timeout}s:\n{logs.stdout}{logs.stderr}"
                )
            time.sleep(0.05)

    def run_tool(
        self, service: str, *args: str, options: Iterable[str] = (), timeout: float = 60
    ) -> list[dict[str, Any]]:
        """Runs a one-off container of a tool service (loader, same-host) to the end, with
        extra `run` options (-e, -v); returns the JSON events it printed."""
        proc = self.run("run", "--rm", "--no-deps", "-T", *options, service, *args, timeout=timeout)
        events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if not events:
            raise DockerError(f"{service} printed no events:\n{proc.stdout}{proc.stderr}")
        return events

    def run_loader(
        self,
        *args: str,
        service: str = "loader",
        options: Iterable[str] = (),
        timeout: float = 60,
    ) -> dict[str, Any]:
        """Runs loader.py in a one-off container to the end; returns its result event."""
        if service != "loader":  # the loader service's entrypoint names the script already
            args = ("/kvpark-tests/loader.py", *args)
        events = self.run_tool(service, *args, options=options, timeout=timeout)
        for event in events:
            if event["event"] == "result":
                return event
        raise DockerError(f"loader printed no result: {events}")


class Lines:
    """Collects a Popen's output lines from a thread, so a test can wait for one of them."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if needle in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._thread.is_alive()):
                    raise AssertionError(f"no line with {needle!r} within {timeout}s:\n{self.text}")
                self._cond.wait(min(left, 0.2))

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise AssertionError(f"still running after {timeout}s:\n{self.text}") from None
        self._thread.join(timeout=10)
        return code

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


# ------------------------------------------------------------------------------ the demo
@dataclass(frozen=True)
class DemoRun:
    """What the demo's two workers printed."""

    prefill: str
    decode: str


def run_demo(stack: Stack) -> DemoRun:
    """Runs the demo's decode and prefill workers against the stack's producer, in the order
    compose gates them (decode ready first); both must exit 0."""
    decode = Lines(stack.popen("run", "--rm", "--no-deps", "-T", "decode-worker"))
    try:
        decode.wait_for("keeping 'queued' alive", timeout=60)
        prefill = stack.run(
            "run", "--rm", "--no-deps", "-T", "-e", "DEMO_EXIT_AFTER_PARK=true", "prefill-worker",
            timeout=120,
        )  # fmt: skip
        assert "parked queued" in prefill.stdout, prefill.stdout + prefill.stderr
        code = decode.finish(timeout=120)
    finally:
        if decode.proc.poll() is None:
            decode.proc.kill()
            decode.proc.wait(timeout=10)
    assert code == 0, decode.text
    return DemoRun(prefill=prefill.stdout, decode=decode.text)


DEMO_REQUESTS = ("on-time", "partial", "late", "queued")


def demo_rows(output: str) -> dict[str, list[str]]:
    """The demo table's rows by request name, split into words: request, path, reason,
    loaded, via (the transport), bytes, ... Compose prefixes each line with the service name
    (`decode-worker_1  | `), which is dropped first."""
    rows = {}
    for line in output.splitlines():
        words = line.split("| ", 1)[-1].split()
        if words and words[0] in DEMO_REQUESTS and "ms" in words:
            rows[words[0]] = words
    return rows


def tokens_match(row: list[str]) -> str:
    """A demo row's `tokens = local prefill` cell: after the load time ("... ms") and the
    chunks the decode worker computed."""
    return row[row.index("ms") + 2]


def loaded_via(output: str) -> list[str]:
    """The decode table's `via` column (the transport of each request's bytes, "-" for
    none), in DEMO_REQUESTS order."""
    rows = demo_rows(output)
    return [rows[name][4] for name in DEMO_REQUESTS]


def parked_via(output: str) -> dict[str, str]:
    """Each request's transport from the prefill worker's lines
    "parked NAME ID: ... via TRANSPORT in N parks, ..."."""
    return dict(re.findall(r"parked (\S+) +\S+: .* via (\S+) in ", output))


# ------------------------------------------------------------------------- host-side calls
def park(
    target: str,
    token: str,
    kv_request_id: str,
    chunks: Mapping[int, bytes],
    total_chunks: int,
    credentials: grpc.ChannelCredentials | None = None,
) -> pb.ParkResponse:
    """Parks `chunks` from the host with the generated stubs, as a prefill worker in any
    language would: header, chunks with their CRC32C, and the commit that makes them visible."""

    def requests() -> Iterable[pb.ParkRequest]:
        header = pb.ParkHeader(kv_request_id=kv_request_id, total_chunks=total_chunks)
        yield pb.ParkRequest(header=header)
        for cid, data in chunks.items():
            yield pb.ParkRequest(chunk=pb.Chunk(chunk_id=cid, data=data, crc32c=crc32c_of(data)))
        commit = pb.ParkCommit(chunks=len(chunks), bytes=sum(len(d) for d in chunks.values()))
        yield pb.ParkRequest(commit=commit)

    options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    channel = (
        grpc.secure_channel(target, credentials, options)
        if credentials is not None
        else grpc.insecure_channel(target, options)
    )
    with channel:
        stub = pb_grpc.KVProducerStub(channel)
        reply: pb.ParkResponse = stub.Park(
            requests(), metadata=(("authorization", f"Bearer {token}"),), timeout=30
        )
    assert reply.status == pb.STATUS_OK, reply
    return reply


def serving(target: str) -> bool:
    """The producer at `target` answers its gRPC health check with SERVING (plaintext)."""
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
