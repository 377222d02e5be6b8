"""JSON over plain HTTP, as the fleet demo's proxy, prefill nodes and decode workers speak it.

The services talk like vLLM's disaggregation proxy and its engines: small JSON requests and
answers over HTTP/1.1. The standard library is enough (http.server, urllib), so the demo adds
no dependency. Every client call has a timeout; a refused or failed call raises `HTTPCallError`
with what the other side said.

A service is a table of routes, `(method, path) -> handler(body) -> (status, answer)`, served
by `serve()` on a thread per request until SIGTERM or SIGINT, which is how compose stops it.
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvpark.address import Address

Json = dict[str, Any]
Handler = Callable[[Json], tuple[int, Json]]
Routes = Mapping[tuple[str, str], Handler]


class HTTPCallError(Exception):
    """A call that did not get a 2xx answer: refused, timed out, or answered with an error
    (then `answer` is what the other side said, when it was JSON)."""

    def __init__(self, message: str, answer: Json | None = None) -> None:
        super().__init__(message)
        self.answer = answer or {}


def call(method: str, url: str, body: Json | None = None, *, timeout: float) -> Json:
    """One JSON request; the JSON answer. HTTPCallError for anything but a 2xx answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        said = exc.read().decode(errors="replace")
        try:
            answer = json.loads(said)
        except ValueError:
            answer = None
        raise HTTPCallError(
            f"{method} {url}: {exc.code} {said}", answer if isinstance(answer, dict) else None
        ) from None
    except (OSError, ValueError) as exc:  # refused, reset, timed out, not JSON
        raise HTTPCallError(f"{method} {url}: {exc}") from exc


def post(url: str, body: Json, *, timeout: float) -> Json:
    return call("POST", url, body, timeout=timeout)


def get(url: str, *, timeout: float) -> Json:
    return call("GET", url, timeout=timeout)


def parse_named_urls(text: str) -> dict[str, str]:
    """`"a=http://a:8000,b=http://b:8000"` -> {"a": "http://a:8000", "b": ...}, in order."""
    named: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith("http://"):
            raise ValueError(f"expected name=http://host:port, got {item!r}")
        named[name] = url.rstrip("/")
    if not named:
        raise ValueError("no name=url given")
    return named


def _handler_class(routes: Routes) -> type[BaseHTTPRequestHandler]:
    class JSONHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self, method: str) -> None:
            handler = routes.get((method, self.path.split("?", 1)[0]))
            if handler is None:
                self._answer(404, {"error": f"no route {method} {self.path}"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                status, answer = handler(body)
            except Exception as exc:  # an answer, not a dead connection, for the caller
                status, answer = 500, {"error": f"{type(exc).__name__}: {exc}"}
            self._answer(status, answer)

        def _answer(self, status: int, answer: Json) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            # One line per request would drown the demo's output; services log what matters.
            pass

    return JSONHandler


def serve(
    listen: str,
    routes: Routes,
    *,
    ready_file: str | None = None,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Serves `routes` on `listen` (host:port) until SIGTERM/SIGINT, then calls `on_stop`.

    `ready_file` is touched once the socket listens: compose's healthcheck tests for it, so
    services that depend on this one start only when it accepts connections."""
    address = Address.parse(listen)
    server = ThreadingHTTPServer((address.host, address.port), _handler_class(routes))
    server.daemon_threads = True
    stop = threading.Event()
    # PID 1 in a container gets no default signal handling: without these, `docker stop`
    # would wait out the grace period and SIGKILL.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    if ready_file:
        Path(ready_file).touch()
    stop.wait()
    server.shutdown()
    server.server_close()
    if on_stop is not None:
        on_stop()
