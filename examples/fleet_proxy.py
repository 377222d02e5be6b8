"""Fleet demo proxy: sends each request to a prefill node, then its KV handle to a decode worker.

The shape of vLLM's disaggregation proxy: the prefill node prefills and parks the request's KV
with its own producer and answers with a handle (where the KV is: producer address, epoch,
chunks); the proxy forwards the handle, untouched and unread, with the request to a decode
worker, which loads the KV from that producer or recomputes it. The proxy never touches KV
and keeps no state about producers: a node whose producer died still prefills, and its
requests fall back on the decode side.

HTTP (JSON, fleet_http.py):

    POST /v1/handoff  {"request_id", "chunks", "chunk_bytes",
                       "prefill_node"?, "decode_worker"?, "hold_rest"?}
        Round robin over prefill nodes and over decode workers, unless the request names one.
        -> {"request_id", "prefill_node", "decode_worker", "prefill": {...}, "decode": {...},
            "queued_s"}; 400 when it names a node or worker the proxy does not know (checked
            before the prefill, so nothing is parked); 502 when a node or worker could not be
            reached (the request is lost).
    POST /admin/decode-gate  {"open": bool}: while closed, prefilled requests wait here for
        decode, as behind a busy decode tier (the demo uses it to hold handles in flight).
    GET  /admin/stats -> {"waiting", "done", "failed"}: "failed" counts every handoff that
        did not answer 200.

Settings: FLEET_PREFILL_NODES and FLEET_DECODE_WORKERS ("name=http://host:port,..."),
FLEET_LISTEN (default 0.0.0.0:8000), FLEET_READY_FILE, FLEET_CALL_TIMEOUT_S (per forwarded call,
default 30), FLEET_GATE_MAX_S (longest a request waits at a closed gate, default 60).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

from fleet_http import HTTPCallError, Json, parse_named_urls, post, serve


def say(text: str) -> None:
    # One write per line: print() writes the newline separately, and the lines of requests
    # served at once would run into each other.
    sys.stdout.write(f"proxy: {text}\n")
    sys.stdout.flush()


class Proxy:
    def __init__(
        self,
        prefill_nodes: dict[str, str],
        decode_workers: dict[str, str],
        call_timeout_s: float,
        gate_max_s: float,
    ) -> None:
        self.prefill_nodes = prefill_nodes
        self.decode_workers = decode_workers
        self.call_timeout_s = call_timeout_s
        self.gate_max_s = gate_max_s
        self._next_node = itertools.cycle(prefill_nodes)
        self._next_worker = itertools.cycle(decode_workers)
        self._gate = threading.Event()
        self._gate.set()
        self._lock = threading.Lock()
        self._counts = {"waiting": 0, "done": 0, "failed": 0}

    def _pick(self, named: object, rotation: itertools.cycle[str]) -> str:
        if named is not None:
            return str(named)
        with self._lock:
            return next(rotation)

    def _count(self, key: str, delta: int = 1) -> None:
        with self._lock:
            self._counts[key] += delta

    def handoff(self, body: Json) -> tuple[int, Json]:
        # Every request that does not end done counts as failed, whichever way it fails.
        try:
            status, answer = self._handoff(body)
        except Exception:
            self._count("failed")
            raise
        self._count("done" if status == 200 else "failed")
        return status, answer

    def _handoff(self, body: Json) -> tuple[int, Json]:
        rid = str(body["request_id"])
        request = {k: body[k] for k in ("request_id", "chunks", "chunk_bytes")}
        # Names are checked before anything runs: a request for a worker that does not exist
        # must not be prefilled and leave its KV parked for nobody.
        for key, table in (
            ("prefill_node", self.prefill_nodes),
            ("decode_worker", self.decode_workers),
        ):
            named = body.get(key)
            if named is not None and named not in table:
                known = ", ".join(table)
                return 400, {"error": f"unknown {key} {named!r}; known: {known}"}
        node = self._pick(body.get("prefill_node"), self._next_node)
        worker = self._pick(body.get("decode_worker"), self._next_worker)
        try:
            prefill = post(
                f"{self.prefill_nodes[node]}/prefill",
                {**request, "hold_rest": bool(body.get("hold_rest"))},
                timeout=self.call_timeout_s,
            )
        except HTTPCallError as exc:
            return 502, {"error": f"prefill on {node}: {exc}", "prefill_node": node}

        waited = time.monotonic()
        self._count("waiting")
        try:
            self._gate.wait(self.gate_max_s)
        finally:
            self._count("waiting", -1)
        queued_s = time.monotonic() - waited

        try:
            # The handle goes on as the prefill node wrote it; the proxy does not read it.
            decode = post(
                f"{self.decode_workers[worker]}/decode",
                {**request, "handle": prefill["handle"]},
                timeout=self.call_timeout_s,
            )
        except HTTPCallError as exc:
            return 502, {"error": f"decode on {worker}: {exc}", "prefill_node": node}
        return 200, {
            "request_id": rid,
            "prefill_node": node,
            "decode_worker": worker,
            "prefill": prefill,
            "decode": decode,
            "queued_s": queued_s,
        }

    def decode_gate(self, body: Json) -> tuple[int, Json]:
        if body["open"]:
            self._gate.set()
        else:
            self._gate.clear()
        say(f"decode dispatch {'open' if body['open'] else 'paused'}")
        return 200, {"open": self._gate.is_set()}

    def stats(self, body: Json) -> tuple[int, Json]:
        with self._lock:
            return 200, dict(self._counts)


def main() -> int:
    env = os.environ
    proxy = Proxy(
        parse_named_urls(env["FLEET_PREFILL_NODES"]),
        parse_named_urls(env["FLEET_DECODE_WORKERS"]),
        call_timeout_s=float(env.get("FLEET_CALL_TIMEOUT_S", "30")),
        gate_max_s=float(env.get("FLEET_GATE_MAX_S", "60")),
    )
    say(
        f"prefill nodes {', '.join(proxy.prefill_nodes)}; "
        f"decode workers {', '.join(proxy.decode_workers)}"
    )
    routes = {
        ("POST", "/v1/handoff"): proxy.handoff,
        ("POST", "/admin/decode-gate"): proxy.decode_gate,
        ("GET", "/admin/stats"): proxy.stats,
    }
    serve(env.get("FLEET_LISTEN", "0.0.0.0:8000"), routes, ready_file=env.get("FLEET_READY_FILE"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
