"""Fleet demo prefill node: a prefill worker and its own producer, one container.

The worker starts `kvpark-producer` as its child process (configured by the container's
`KVPARK_*` variables, advertising the node's compose name), parks each request's KV into it
with `KVParker` over loopback, and answers the proxy with the park's handle
(`ParkResult.handle.to_dict()`), as a vLLM prefill engine answers with `kv_transfer_params`.

Why a child process and not a producer container of its own: the demo kills one node's
producer in the middle of the run, and `up --exit-code-from` stops the whole stack as soon as
any container exits. Here the producer process dies of a real SIGKILL while its container,
the prefill worker and everything else keep running; the worker learns the exit status from
waitpid and logs it.

HTTP (JSON, fleet_http.py):

    POST /prefill   {"request_id", "chunks", "chunk_bytes", "hold_rest": false}
        -> {"node", "handle": {...} | null, "park": {"ok", "reason", "elapsed_s", ...}}
        Synthetic KV (fleet_kv.py) parked in one batch. With "hold_rest" only the first half
        (chunks // 2, at least one) is committed (the batch declares the whole chunk count)
        and the handle goes out at once, as a prefill that streams its KV while it still
        computes; the rest waits for POST /finish. A request of one chunk is parked whole
        and nothing is held. A park that fails answers "handle": null and why, and holds
        nothing.
    POST /finish    {"request_id"} -> {"node", "park": {...}}: parks a held rest; 404 when
        nothing of the request is held.
    POST /admin/kill-producer -> {"pid", "returncode", "killed_at", ...}: SIGKILLs the child.
    GET  /status    -> {"node", "producer": {"pid", "advertised", "epoch", "running", ...}}

Settings: FLEET_NODE (this node's name), FLEET_LISTEN (HTTP, default 0.0.0.0:8000),
FLEET_READY_FILE, DEMO_PARK_TOKEN, FLEET_PARK_TIMEOUT_S (default 10), and the producer's
KVPARK_* (KVPARK_LISTEN's port is where the worker parks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import fleet_kv
from fleet_http import Json, serve

from kvpark import KVParker, ParkResult, Timeout, TransportError
from kvpark.address import Address

# How long the producer may take to serve after it was started (pool allocation included).
PRODUCER_START_S = 60.0


def say(node: str, text: str) -> None:
    # One write per line: print() writes the newline separately, and the lines of requests
    # served at once would run into each other.
    sys.stdout.write(f"{node}: {text}\n")
    sys.stdout.flush()


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited {returncode}"


class ProducerChild:
    """`kvpark-producer` as a child process; one thread owns waitpid and records the status."""

    def __init__(self, node: str) -> None:
        self.node = node
        # The producer reads the KVPARK_* variables; it ignores the others.
        self.proc = subprocess.Popen(["kvpark-producer"], env=dict(os.environ))
        self.started_at = time.time()
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.killed_at: float | None = None
        self.stopping = False
        self.exited = threading.Event()
        threading.Thread(target=self._wait, name="waitpid", daemon=True).start()

    def _wait(self) -> None:
        self.returncode = self.proc.wait()
        self.exited_at = time.time()
        if self.stopping:
            how = "stopped"
        elif self.killed_at is not None:
            how = "ended as asked"
        else:
            how = "DIED unasked"
        # Logged before anyone waiting on `exited` goes on: the worker may exit right after.
        say(self.node, f"producer pid {self.proc.pid} {how}: {describe_exit(self.returncode)}")
        self.exited.set()

    def kill(self) -> Json:
        """SIGKILL, then the status waitpid reports. A producer that already exited is
        described as it ended: it is not signalled again, nor its `killed_at` moved."""
        # Popen's returncode is set as soon as the waitpid thread reaps the child, before
        # `exited` is; from then on its pid may name another process.
        if self.proc.returncode is None:
            self.killed_at = time.time()
            # Through Popen, not os.kill(pid): Popen checks whether it reaped the child first.
            self.proc.kill()
        if not self.exited.wait(10):
            raise RuntimeError(f"producer pid {self.proc.pid} still running 10 s after SIGKILL")
        return self.describe()

    def stop(self, grace_s: float) -> None:
        """SIGTERM (the producer drains and exits 0), SIGKILL after `grace_s`."""
        if self.exited.is_set():
            return
        self.stopping = True
        self.proc.terminate()
        if not self.exited.wait(grace_s):
            self.proc.kill()
            self.exited.wait(5)

    def describe(self) -> Json:
        code = self.returncode
        return {
            "pid": self.proc.pid,
            "running": not self.exited.is_set(),
            "returncode": code,
            "exit": None if code is None else describe_exit(code),
            "killed_at": self.killed_at,
            "exited_at": self.exited_at,
        }


def park_summary(result: ParkResult) -> Json:
    return {
        "ok": result.ok,
        "reason": None if result.reason is None else str(result.reason),
        "detail": "" if result.ok else result.detail,
        "chunks_parked": result.chunks_parked,
        "elapsed_s": result.elapsed_s,
    }


class PrefillNode:
    def __init__(
        self, node: str, parker: KVParker, producer: ProducerChild, epoch: int, advertised: str
    ) -> None:
        self.node = node
        self.advertised = advertised
        self.parker = parker
        self.producer = producer
        self.epoch = epoch
        self._held: dict[str, tuple[fleet_kv.Shape, dict[int, fleet_kv.Bytes]]] = {}
        self._lock = threading.Lock()

    def prefill(self, body: Json) -> tuple[int, Json]:
        rid = str(body["request_id"])
        shape = fleet_kv.Shape(int(body["chunks"]), int(body["chunk_bytes"]))
        chunks = {c: fleet_kv.chunk(rid, c, shape) for c in range(shape.chunks)}
        if body.get("hold_rest"):
            half = shape.first_part
            first = {c: data for c, data in chunks.items() if c < half}
            rest = {c: data for c, data in chunks.items() if c >= half}
            result = self.parker.park(rid, first, total_chunks=shape.chunks)
            # Held only once the first part is parked: a rest whose start failed is never
            # finished, and would stay here for good.
            if result.ok and rest:
                with self._lock:
                    self._held[rid] = (shape, rest)
        else:
            result = self.parker.park(rid, chunks)
        if not result.ok:
            took = f"{result.elapsed_s * 1000:.1f} ms"
            say(self.node, f"park {rid} failed in {took}: {result.reason} {result.detail}")
        handle = result.handle.to_dict() if result.ok else None
        return 200, {"node": self.node, "handle": handle, "park": park_summary(result)}

    def finish(self, body: Json) -> tuple[int, Json]:
        rid = str(body["request_id"])
        with self._lock:
            held = self._held.pop(rid, None)
        if held is None:
            return 404, {"error": f"{self.node} holds nothing of {rid!r}"}
        shape, rest = held
        result = self.parker.park(rid, rest, total_chunks=shape.chunks)
        return 200, {"node": self.node, "park": park_summary(result)}

    def kill_producer(self, body: Json) -> tuple[int, Json]:
        say(self.node, f"SIGKILL to producer pid {self.producer.proc.pid}, as asked")
        return 200, {"node": self.node, **self.producer.kill()}

    def status(self, body: Json) -> tuple[int, Json]:
        serving: int | None = None
        if not self.producer.exited.is_set():
            try:
                serving = self.parker.server_info(timeout=2.0).producer_epoch
            except TransportError:
                serving = None
        producer = {
            **self.producer.describe(),
            "advertised": self.advertised,
            "epoch": self.epoch,
            "serving_epoch": serving,
        }
        return 200, {"node": self.node, "producer": producer}


def wait_until_serving(node: str, parker: KVParker, producer: ProducerChild) -> int:
    """The producer's epoch once it answers; exits with the producer's status if it died."""
    deadline = time.monotonic() + PRODUCER_START_S
    while True:
        if producer.exited.is_set():
            say(node, "the producer exited before it served; see its log above")
            sys.exit(1)
        try:
            return parker.server_info(timeout=2.0).producer_epoch
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> int:
    env = os.environ
    node = env.get("FLEET_NODE", "prefill")
    listen = env.get("FLEET_LISTEN", "0.0.0.0:8000")
    target = str(Address.parse(env.get("KVPARK_LISTEN", "127.0.0.1:50051")).dialable())
    park_timeout = Timeout(total_s=float(env.get("FLEET_PARK_TIMEOUT_S", "10")))
    # The whole drain budget: the producer's shutdown_grace_s, with room to spare.
    grace_s = float(env.get("KVPARK_SHUTDOWN_GRACE_S", "10")) + 3.0

    producer = ProducerChild(node)
    with KVParker(target, timeout=park_timeout, token=env.get("DEMO_PARK_TOKEN")) as parker:
        epoch = wait_until_serving(node, parker, producer)
        advertised = env.get("KVPARK_ADVERTISE_ADDRESS", target)
        pid = producer.proc.pid
        say(node, f"producer pid {pid} serves, epoch {epoch:016x}, advertised as {advertised}")
        prefill = PrefillNode(node, parker, producer, epoch, advertised)
        routes = {
            ("POST", "/prefill"): prefill.prefill,
            ("POST", "/finish"): prefill.finish,
            ("POST", "/admin/kill-producer"): prefill.kill_producer,
            ("GET", "/status"): prefill.status,
        }
        serve(listen, routes, ready_file=env.get("FLEET_READY_FILE"))
    producer.stop(grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
