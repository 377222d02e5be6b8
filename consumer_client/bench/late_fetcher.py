"""The late-fetch prober of `kvpark bench`'s concurrent section: another decode worker, in its
own process, whose fetches of a released id are turned away while the producer serves other
loads. A process of its own, because a thread among the loading threads would measure this
process's GIL, not the producer's answer.

    python -m kvpark.client.bench.late_fetcher TARGET KV_REQUEST_ID [CA [KEY CERT]]
    (the fetch token in KVPARK_FETCH_TOKEN; with CA, TLS with that root and client key/cert,
    checking the name in KVPARK_TLS_SERVER_NAME when set, as `--tls-server-name`)

It warms up, prints `ready`, then for each `go` line on stdin fetches the id back to back
until the `stop` line (at least once), and prints the seconds of each try as one JSON list.
Every answer must be RELEASED; anything else ends it with exit status 1. End of stdin ends it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from .._result import Reason
from .._sync import KVConsumer
from ..cli_connect import SERVER_NAME_OPTION
from .processes import child_env, end_child

CALL_TIMEOUT_S = 10.0
SERVER_NAME_ENV = "KVPARK_TLS_SERVER_NAME"


@dataclass(frozen=True)
class ProberArgs:
    """How the prober reaches the producer: its fetch token and TLS files (None: plaintext)."""

    token: str | None = None
    tls_ca: Path | None = None
    tls_key: Path | None = None
    tls_cert: Path | None = None
    tls: bool = False
    server_name: str | None = None

    def env(self) -> dict[str, str]:
        token = {"KVPARK_FETCH_TOKEN": self.token} if self.token else {}
        return token | ({SERVER_NAME_ENV: self.server_name} if self.server_name else {})

    def argv(self) -> list[str]:
        if not self.tls:
            return []
        return [str(p) if p else "" for p in (self.tls_ca, self.tls_key, self.tls_cert)]


class Prober:
    """The prober process, owned by this object: started warmed up, stopped by its PID."""

    def __init__(self, target: str, kid: str, args: ProberArgs) -> None:
        env = child_env() | args.env()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, target, kid, *args.argv()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        if self._line() != "ready":
            self.close()
            raise RuntimeError("the late-fetch prober did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def _say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def go(self) -> None:
        self._say("go")

    def stop(self) -> list[float]:
        """The seconds of every try since `go`."""
        self._say("stop")
        line = self._line()
        if not line:
            raise RuntimeError(f"the late-fetch prober ended ({self.proc.poll()})")
        tries: list[float] = json.loads(line)
        return tries

    def close(self) -> None:
        end_child(self.proc)


def _late_fetch(consumer: KVConsumer, kid: str) -> float:
    started = time.perf_counter()
    result = consumer.load(kid, num_chunks=1, timeout=CALL_TIMEOUT_S)
    seconds = time.perf_counter() - started
    if result.reason is not Reason.RELEASED:
        raise SystemExit(f"prober: the late fetch of {kid!r} answered {result}")
    return seconds


def _tries_until_stop(consumer: KVConsumer, kid: str) -> list[float]:
    stop = threading.Event()

    def wait_for_stop() -> None:
        sys.stdin.readline()
        stop.set()

    waiter = threading.Thread(target=wait_for_stop)
    waiter.start()
    tries = [_late_fetch(consumer, kid)]  # at least one, however soon the stop comes
    while not stop.is_set():
        tries.append(_late_fetch(consumer, kid))
    waiter.join()
    return tries


def main(argv: Sequence[str]) -> int:
    target, kid, *tls = argv
    token = os.environ.get("KVPARK_FETCH_TOKEN") or None
    pem = [Path(path).read_bytes() if path else None for path in tls]  # CA, key, cert
    credentials = grpc.ssl_channel_credentials(*pem) if tls else None
    name = os.environ.get(SERVER_NAME_ENV)
    options = [(SERVER_NAME_OPTION, name)] if name else []
    with KVConsumer(
        target, token=token, credentials=credentials, channel_options=options, transport="grpc"
    ) as consumer:
        for _ in range(5):  # connection and first-call set-up are not tries
            _late_fetch(consumer, kid)
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() == "go":
                print(json.dumps(_tries_until_stop(consumer, kid)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
