"""The data plane between containers (compose suite, see conftest.py).

The demo's producer offers all three transports: its shm socket on the `kvpark-shm` volume,
which only containers on "its host" mount (the prefill worker; `same-host` here), and its TCP
data port 50052 on the compose network, which is not published to the host. So:

- a prefill-side container lends the producer a memfd over the shared socket and parks by
  reference: ParkResult.transport "shm";
- a decode-side container (no volume, the `loader`) loads over the data port: "tcp";
- a same-host container that loads into a buffer it lent gets it over shared memory: "shm";
- whoever cannot use them loads over the gRPC stream: the host, which cannot reach the data
  address the producer offers (producer:50052) nor its socket; a container that asks for
  grpc; a container without the volume that asks for shm.

Every load's bytes are compared with what was parked (SHA-256 of the whole payload).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest

from kvpark.client import KVConsumer

from .conftest import FETCH_TOKEN
from .stack import Stack

pytestmark = [pytest.mark.compose, pytest.mark.timeout(600)]
KiB = 1024
CHUNKS = 8
CHUNK_BYTES = 256 * KiB
TOTAL = CHUNKS * CHUNK_BYTES
SHM_SOCKET = "/run/kvpark/shm.sock"
DATA_ADDRESS = "producer:50052"


def park_in_container(stack: Stack, *ids: str) -> list[dict[str, Any]]:
    """Parks the same random payload under each id from a `same-host` container (parker.py);
    returns its events. KeepAlive intents first: starting a container takes longer than the
    test producer's 2 s lease, and the loads come from further containers."""
    with KVConsumer(stack.target, token=FETCH_TOKEN, timeout=10) as kv:
        kv.extend_leases(list(ids), 120)
    events = stack.run_tool(
        "same-host", "/kvpark-tests/parker.py", *ids,
        "--chunks", str(CHUNKS), "--chunk-bytes", str(CHUNK_BYTES),
    )  # fmt: skip
    parked = [e for e in events if e["event"] == "parked"]
    assert [e["kv_request_id"] for e in parked] == list(ids), events
    return parked


def load_args(kid: str, *extra: str) -> list[str]:
    return [kid, "--chunks", str(CHUNKS), "--buffer-bytes", str(TOTAL), *extra]


def assert_loaded(result: dict[str, Any], transport: str, sha256: str) -> None:
    assert result["ok"] and result["path"] == "remote", result
    assert result["chunks_loaded"] == CHUNKS and result["bytes"] == TOTAL, result
    assert result["transport"] == transport, result
    assert result["sha256"] == sha256, "the loaded bytes differ from the parked ones"


def test_park_over_shm_then_load_over_tcp_and_shm(producer: Stack) -> None:
    stamp = time.time_ns()
    over_tcp, over_shm = f"tcp-{stamp}", f"shm-{stamp}"
    parked = park_in_container(producer, over_tcp, over_shm)

    for event in parked:
        assert event["ok"], event
        assert event["transport"] == "shm", event  # by reference from the lent memfd
        assert event["chunks_parked"] == CHUNKS and event["bytes_parked"] == TOTAL, event
        assert event["transports"] == ["shm", "tcp", "grpc"], event
        assert event["producer"] == "producer:50051", event  # KVPARK_ADVERTISE_ADDRESS
    sha256 = parked[0]["sha256"]

    # Another container, without the volume: the data port.
    tcp = producer.run_loader(*load_args(over_tcp))
    assert_loaded(tcp, "tcp", sha256)

    # The producer's neighbour loading into a buffer it lent: shared memory both ways.
    shm = producer.run_loader(*load_args(over_shm, "--shared"), service="same-host")
    assert_loaded(shm, "shm", sha256)
    print(
        f"parked 2 x {TOTAL // KiB} KiB over shm; loaded over tcp in "
        f"{tcp['elapsed_s'] * 1000:.1f} ms, over shm in {shm['elapsed_s'] * 1000:.1f} ms"
    )


def test_who_cannot_use_the_data_plane_loads_over_grpc(producer: Stack) -> None:
    stamp = time.time_ns()
    from_host, forced, no_socket = f"host-{stamp}", f"forced-{stamp}", f"nosock-{stamp}"
    parked = park_in_container(producer, from_host, forced, no_socket)
    assert all(e["ok"] and e["transport"] == "shm" for e in parked), parked
    sha256 = parked[0]["sha256"]

    # The host: the producer offers producer:50052 (a name only the compose network knows,
    # and a port not published) and a socket on a volume the host does not mount. The TCP
    # path fails before its first byte, so the load goes on over the gRPC stream.
    with KVConsumer(producer.target, token=FETCH_TOKEN, timeout=10) as kv:
        info = kv.server_info()
        assert (info.data_address, info.data_tls, info.shm_socket) == (
            DATA_ADDRESS,
            False,
            SHM_SOCKET,
        )
        result = kv.load(from_host, num_chunks=CHUNKS)
    assert result.ok and result.chunks_loaded == CHUNKS, result
    assert result.transport == "grpc", result
    assert hashlib.sha256(result.data).hexdigest() == sha256

    # A decode container that could use the data port but is told not to.
    assert_loaded(producer.run_loader(*load_args(forced, "--transport", "grpc")), "grpc", sha256)

    # A container without the volume asking for shared memory: no socket there, so gRPC.
    nosock = producer.run_loader(*load_args(no_socket, "--transport", "shm", "--shared"))
    assert_loaded(nosock, "grpc", sha256)
