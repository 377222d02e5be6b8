"""The fleet proxy checks the names a request gives before it prefills anything.

A request naming a prefill node or decode worker the proxy does not know must be refused with
a 400 that says which name, before any prefill node is called: a prefill would park KV that no
decode worker ever loads. Whatever way a handoff fails, the proxy's stats count it as failed.

The proxy runs over real HTTP (fleet_http's handler) in front of stand-in prefill and decode
services that record what they were asked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest
from conftest import example

pytestmark = pytest.mark.timeout(60)


fleet_http = example("fleet_http")
fleet_proxy = example("fleet_proxy")


@pytest.fixture
def serve() -> Iterator[Callable[[Any], str]]:
    """Serves a route table on a free loopback port; its base URL."""
    servers: list[ThreadingHTTPServer] = []

    def start(routes: Any) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), fleet_http._handler_class(routes))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fleet(serve: Callable[[Any], str]) -> tuple[str, list[str], list[str]]:
    """A proxy with one prefill node (p1) and one decode worker (d1); the proxy's URL and
    the request ids the node and the worker were asked about."""
    prefilled: list[str] = []
    decoded: list[str] = []

    def prefill(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prefilled.append(body["request_id"])
        return 200, {"node": "p1", "handle": {"stand-in": True}, "park": {"ok": True}}

    def decode(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        decoded.append(body["request_id"])
        return 200, {"worker": "d1", "path": "remote"}

    proxy = fleet_proxy.Proxy(
        {"p1": serve({("POST", "/prefill"): prefill})},
        {"d1": serve({("POST", "/decode"): decode})},
        call_timeout_s=10,
        gate_max_s=1,
    )
    url = serve({("POST", "/v1/handoff"): proxy.handoff, ("GET", "/admin/stats"): proxy.stats})
    return url, prefilled, decoded


def handoff(url: str, **names: str) -> dict[str, Any]:
    body = {"request_id": "r1", "chunks": 2, "chunk_bytes": 8, **names}
    return dict(fleet_http.post(f"{url}/v1/handoff", body, timeout=10))


@pytest.mark.parametrize(
    ("key", "names"),
    [
        ("decode_worker", {"decode_worker": "typo"}),
        ("prefill_node", {"prefill_node": "typo"}),
        # Both named, only the worker unknown: the known node must not be called either.
        ("decode_worker", {"prefill_node": "p1", "decode_worker": "typo"}),
    ],
)
def test_an_unknown_name_is_refused_before_any_prefill(
    fleet: tuple[str, list[str], list[str]], key: str, names: dict[str, str]
) -> None:
    url, prefilled, decoded = fleet
    with pytest.raises(fleet_http.HTTPCallError) as refused:
        handoff(url, **names)
    assert ": 400 " in str(refused.value), refused.value
    error = refused.value.answer["error"]
    assert key in error and "'typo'" in error, error
    assert "prefill_node" not in refused.value.answer
    assert prefilled == [] and decoded == []
    stats = fleet_http.get(f"{url}/admin/stats", timeout=10)
    assert stats == {"waiting": 0, "done": 0, "failed": 1}


def test_a_known_request_is_counted_done_and_a_refused_one_failed(
    fleet: tuple[str, list[str], list[str]],
) -> None:
    url, prefilled, decoded = fleet
    answer = handoff(url, prefill_node="p1", decode_worker="d1")
    assert (answer["prefill_node"], answer["decode_worker"]) == ("p1", "d1")
    with pytest.raises(fleet_http.HTTPCallError):
        handoff(url, decode_worker="typo")
    assert prefilled == decoded == ["r1"]
    stats = fleet_http.get(f"{url}/admin/stats", timeout=10)
    assert stats == {"waiting": 0, "done": 1, "failed": 1}
