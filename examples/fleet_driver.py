"""Fleet demo driver: sends requests through the proxy and kills one node's producer mid-run.

The run, in phases (fleet_report.py says what each request is expected to do):

1. before: FLEET_PER_NODE requests per prefill node, every producer up.
2. streamed: one request per node, both to the first decode worker; each prefill commits only
   the first half of the KV and holds the rest back. The driver waits until that decode worker
   has loaded both halves and waits for more.
3. queued: the proxy's decode dispatch is paused and FLEET_PER_NODE requests per node are
   prefilled and parked; their handles wait at the proxy.
4. the kill: FLEET_KILL_NODE's prefill worker SIGKILLs its producer and reports what waitpid
   said. The killed node's streamed load must end at once (partial); then every node is asked
   to park the rest of its streamed request (only the killed one cannot), and the other loads
   finish remote. Decode dispatch resumes: the queued handles that name the dead producer fall
   back, the others load.
5. after: FLEET_PER_NODE more requests per node; the killed node's parks fail and its
   requests reach decode without a handle.

Then every producer's state and the decode workers' own metrics are read again and the run is
judged (fleet_report.py): a table per node and phase, one `fleet-json: {...}` line for
machines, and a last line `fleet: ok ...` (exit 0) or `fleet: FAILED ...` (exit 1). The whole
run is bounded by FLEET_RUN_DEADLINE_S.

Settings: FLEET_PROXY (http://host:port), FLEET_PREFILL_NODES, FLEET_DECODE_WORKERS
("name=http://host:port,..."), FLEET_KILL_NODE, FLEET_PER_NODE (default 3), FLEET_CHUNKS
(default 8), FLEET_CHUNK_BYTES (default 256 KiB), FLEET_LOAD_TIMEOUT_S and
FLEET_PARK_TIMEOUT_S (the clients' timeouts, for the bound), FLEET_RUN_DEADLINE_S (default 90).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fleet_report
from fleet_http import HTTPCallError, Json, get, parse_named_urls, post
from fleet_kv import Shape
from fleet_report import Outcome

# Every HTTP call's bound: a handoff is a park, a load (at most the load timeout) and a
# recompute, on a shared machine.
CALL_TIMEOUT_S = 60.0
# How long the driver waits for a condition another service reports (polled every 20 ms).
CONDITION_S = 30.0


def say(text: str) -> None:
    print(f"driver: {text}", flush=True)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + CONDITION_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {CONDITION_S:g}s waiting for {what}")
        time.sleep(0.02)


@dataclass(frozen=True)
class Sent:
    request_id: str
    phase: str
    future: Future[Outcome]

    def outcome(self) -> Outcome:
        return self.future.result(timeout=CALL_TIMEOUT_S + 5)


class Run:
    def __init__(self, env: dict[str, str]) -> None:
        self.proxy = env["FLEET_PROXY"].rstrip("/")
        self.nodes = parse_named_urls(env["FLEET_PREFILL_NODES"])
        self.workers = parse_named_urls(env["FLEET_DECODE_WORKERS"])
        self.killed = env["FLEET_KILL_NODE"]
        if self.killed not in self.nodes:
            raise ValueError(f"FLEET_KILL_NODE {self.killed!r} is not one of {list(self.nodes)}")
        self.per_node = int(env.get("FLEET_PER_NODE", "3"))
        chunks, chunk_bytes = env.get("FLEET_CHUNKS", "8"), env.get("FLEET_CHUNK_BYTES", "262144")
        self.shape = Shape(int(chunks), int(chunk_bytes))
        self.load_timeout_s = float(env.get("FLEET_LOAD_TIMEOUT_S", "10"))
        self.park_timeout_s = float(env.get("FLEET_PARK_TIMEOUT_S", "10"))
        # Room for every request of the largest phase at once (they block at a paused gate).
        self.executor = ThreadPoolExecutor(max_workers=2 * self.per_node * len(self.nodes) + 4)
        self.sent: list[Sent] = []

    def _handoff(self, rid: str, phase: str, extra: Json) -> Outcome:
        body = {
            "request_id": rid,
            "chunks": self.shape.chunks,
            "chunk_bytes": self.shape.chunk_bytes,
        }
        try:
            answer = post(f"{self.proxy}/v1/handoff", {**body, **extra}, timeout=CALL_TIMEOUT_S)
        except HTTPCallError as exc:
            # Lost; the proxy's answer says which node it went to, when it got that far.
            node = exc.answer.get("prefill_node")
            return Outcome(request_id=rid, phase=phase, node=node, error=str(exc))
        return Outcome.from_answer(rid, phase, answer)

    def send(self, phase: str, count: int, **extra: Any) -> list[Sent]:
        """`count` requests through the proxy at once; `extra` pins a node or worker."""
        batch = []
        for _ in range(count):
            rid = f"fleet-{len(self.sent):03d}-{phase}"
            sent = Sent(rid, phase, self.executor.submit(self._handoff, rid, phase, extra))
            self.sent.append(sent)
            batch.append(sent)
        return batch

    def producer(self, node: str) -> Json:
        return dict(get(f"{self.nodes[node]}/status", timeout=10)["producer"])

    def run(self) -> tuple[dict[str, Any], list[Outcome]]:
        started = time.monotonic()
        at_start = {node: self.producer(node) for node in self.nodes}
        fanout = self.per_node * len(self.nodes)
        first_worker = next(iter(self.workers))
        half = self.shape.first_part
        say(
            f"prefill nodes {', '.join(self.nodes)}; decode workers {', '.join(self.workers)}; "
            f"{self.shape.chunks} chunks x {self.shape.chunk_bytes // 1024} KiB per request; "
            f"load timeout {self.load_timeout_s:g}s"
        )

        for sent in self.send("before", fanout):
            sent.outcome()
        say(f"before: {fanout} requests handed off")

        streamed = {
            node: self.send(
                "streamed", 1, prefill_node=node, decode_worker=first_worker, hold_rest=True
            )[0]
            for node in self.nodes
        }

        def halves_loaded() -> bool:
            loading = get(f"{self.workers[first_worker]}/loads", timeout=10)["loading"]
            return all(loading.get(s.request_id, 0) >= half for s in streamed.values())

        wait_for(halves_loaded, f"{first_worker} to load the streamed requests' first halves")
        say(f"streamed: {first_worker} loaded {half} of {self.shape.chunks} chunks of each")

        post(f"{self.proxy}/admin/decode-gate", {"open": False}, timeout=10)
        queued = self.send("queued", fanout)
        wait_for(
            lambda: get(f"{self.proxy}/admin/stats", timeout=10)["waiting"] >= fanout,
            f"{fanout} parked requests to wait at the proxy",
        )
        say(f"queued: {fanout} requests parked, their handles held at the proxy")

        kill = post(f"{self.nodes[self.killed]}/admin/kill-producer", {}, timeout=20)
        say(f"SIGKILL: {self.killed}'s producer pid {kill['pid']}, waitpid: {kill['exit']}")
        cut = streamed[self.killed].outcome()
        noticed_s = cut.ended_at - kill["killed_at"]
        after_kill = f"{noticed_s * 1000:.1f} ms after the SIGKILL"
        say(f"streamed: the load from {self.killed} ended {cut.path} ({cut.reason}) {after_kill}")
        # Every node is asked to park the rest of its streamed request; the killed one cannot.
        rest_parks = {}
        for node, url in self.nodes.items():
            finish = {"request_id": streamed[node].request_id}
            rest_parks[node] = post(f"{url}/finish", finish, timeout=20)["park"]
        for sent in streamed.values():
            sent.outcome()
        post(f"{self.proxy}/admin/decode-gate", {"open": True}, timeout=10)
        for sent in queued:
            sent.outcome()
        say("queued: decode dispatch resumed, every held handle handed off")

        for sent in self.send("after", fanout):
            sent.outcome()
        say(f"after: {fanout} requests handed off")

        summary = {
            "nodes": list(self.nodes),
            "killed_node": self.killed,
            "kill": kill,
            "noticed_mid_stream_s": noticed_s,
            "rest_parks": rest_parks,
            "producers_at_start": at_start,
            "producers_at_end": {node: self.producer(node) for node in self.nodes},
            "decode_stats": {w: get(f"{url}/stats", timeout=10) for w, url in self.workers.items()},
            "chunks": self.shape.chunks,
            "chunk_bytes": self.shape.chunk_bytes,
            "load_timeout_s": self.load_timeout_s,
            "park_timeout_s": self.park_timeout_s,
            "elapsed_s": time.monotonic() - started,
        }
        return summary, [s.outcome() for s in self.sent]


def watchdog(deadline_s: float) -> None:
    """Ends the process if the run outlives its deadline: the demo must end by itself."""

    def expire() -> None:
        time.sleep(deadline_s)
        print(f"fleet: FAILED: the run did not end within {deadline_s:g}s", flush=True)
        os._exit(1)

    threading.Thread(target=expire, name="deadline", daemon=True).start()


def main() -> int:
    env = dict(os.environ)
    watchdog(float(env.get("FLEET_RUN_DEADLINE_S", "90")))
    run = Run(env)
    try:
        summary, outcomes = run.run()
    except Exception as exc:  # whatever broke, the run ends with its verdict line
        traceback.print_exc()
        print(f"fleet: FAILED: {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        run.executor.shutdown(wait=False, cancel_futures=True)
    problems = fleet_report.judge(summary, outcomes)
    print(fleet_report.table(outcomes, summary["nodes"]), flush=True)
    for line in fleet_report.node_lines(summary, outcomes):
        print(line, flush=True)
    print(fleet_report.json_line({**summary, "ok": not problems, "problems": problems}, outcomes))
    print(fleet_report.verdict(summary, outcomes, problems), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
