"""Authenticated transport: tokens by role, TLS and mTLS, the non-loopback rule, and logs that
never carry tokens or payload bytes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from conftest import channel_options, park_requests, running_producer, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tls_certs import make_certs

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer.logs import JsonFormatter
from kvpark.producer.open_streams import OPEN_STREAMS

PARK_TOKEN = "park-secret-7f3a9c"
FETCH_TOKEN = "fetch-secret-1b2d4e"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def call_code(coro) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        result = await coro
        if hasattr(result, "__aiter__"):
            [m async for m in result]
    except grpc.aio.AioRpcError as err:
        assert "secret-id" not in (err.details() or ""), "an auth answer leaked the id"
        return err.code()
    return grpc.StatusCode.OK


async def test_tokens_by_role() -> None:
    async with running_producer(park_token=PARK_TOKEN, fetch_token=FETCH_TOKEN) as server:
        async with grpc.aio.insecure_channel(server.target, options=channel_options()) as ch:
            stub = pb_grpc.KVProducerStub(ch)

            def park(md):  # type: ignore[no-untyped-def]
                return stub.Park(iter(park_requests("secret-id", {0: b"x"}, total=1)), metadata=md)

            async def fetch(md):  # type: ignore[no-untyped-def]
                return [
                    m
                    async for m in stub.Fetch(
                        pb.FetchRequest(kv_request_id="secret-id"), metadata=md
                    )
                ]

            lookup = pb.LookupRequest(kv_request_ids=["secret-id"])
            # Missing or unknown token: UNAUTHENTICATED. The other role's token: PERMISSION_DENIED.
            assert await call_code(park(())) == grpc.StatusCode.UNAUTHENTICATED
            assert await call_code(park(bearer("nope"))) == grpc.StatusCode.UNAUTHENTICATED
            assert (
                await call_code(park((("authorization", PARK_TOKEN),)))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            assert await call_code(park(bearer(FETCH_TOKEN))) == grpc.StatusCode.PERMISSION_DENIED
            assert server.pool.statistics().used_bytes == 0  # nothing stored by refused parks
            assert await call_code(park(bearer(PARK_TOKEN))) == grpc.StatusCode.OK

            assert await call_code(fetch(())) == grpc.StatusCode.UNAUTHENTICATED
            assert await call_code(fetch(bearer(PARK_TOKEN))) == grpc.StatusCode.PERMISSION_DENIED
            assert (
                await call_code(stub.Lookup(lookup, metadata=bearer(PARK_TOKEN)))
                == grpc.StatusCode.PERMISSION_DENIED
            )
            assert (
                await call_code(stub.KeepAlive(pb.KeepAliveRequest(kv_request_ids=["secret-id"])))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            release = pb.ReleaseRequest(kv_request_id="secret-id")
            assert (
                await call_code(stub.Release(release, metadata=bearer(FETCH_TOKEN)))
                == grpc.StatusCode.PERMISSION_DENIED
            )
            # The id is untouched by all those refusals, and the right token fetches it.
            msgs = await fetch(bearer(FETCH_TOKEN))
            assert msgs[0].chunk.data == b"x" and msgs[-1].done.status == pb.STATUS_OK

            # Server info takes either role's token; health and reflection stay open.
            info = pb.GetServerInfoRequest()
            assert await call_code(stub.GetServerInfo(info)) == grpc.StatusCode.UNAUTHENTICATED
            assert (
                await call_code(stub.GetServerInfo(info, metadata=bearer(FETCH_TOKEN)))
                == grpc.StatusCode.OK
            )
            assert (
                await call_code(stub.GetServerInfo(info, metadata=bearer(PARK_TOKEN)))
                == grpc.StatusCode.OK
            )
            health = health_pb2_grpc.HealthStub(ch)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_open_health_and_reflection_streams_cannot_take_the_token_holders_calls() -> None:
    """Health Watch streams need no token and last as long as their caller likes. Thirty of
    them against a server that serves 24 calls at once: only OPEN_STREAMS run, the rest are
    refused RESOURCE_EXHAUSTED, and the token holder's calls and the probes' Check still get
    through. Without the bound the streams took every call slot."""
    async with running_producer(
        park_token=PARK_TOKEN, fetch_token=FETCH_TOKEN, max_concurrent_rpcs=24
    ) as server:
        async with grpc.aio.insecure_channel(server.target, options=channel_options()) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            watches = [health.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(30)]
            try:
                outcomes = []
                for watch in watches:
                    try:
                        first = await watch.read()
                        outcomes.append(first.status == health_pb2.HealthCheckResponse.SERVING)
                    except grpc.aio.AioRpcError as err:
                        outcomes.append(err.code())
                assert outcomes.count(True) == OPEN_STREAMS
                assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 30 - OPEN_STREAMS
                # Reflection streams count against the same bound.
                assert await reflection_code(ch) == grpc.StatusCode.RESOURCE_EXHAUSTED
                stub = pb_grpc.KVProducerStub(ch)
                info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=bearer(FETCH_TOKEN))
                assert await call_code(info) == grpc.StatusCode.OK
                check = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert check.status == health_pb2.HealthCheckResponse.SERVING
            finally:
                for watch in watches:
                    watch.cancel()

            # The ended streams free their places: OPEN_STREAMS new ones run again.
            async def all_run_again() -> bool:
                again = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(OPEN_STREAMS)]
                try:
                    return all([await call_code(w.read()) == grpc.StatusCode.OK for w in again])
                finally:
                    for watch in again:
                        watch.cancel()

            for _ in range(200):  # the cancels reach the server soon after
                if await all_run_again():
                    break
            else:
                raise AssertionError("the cancelled streams never gave their places back")
            assert await reflection_code(ch) == grpc.StatusCode.OK


async def reflection_code(channel: grpc.aio.Channel) -> grpc.StatusCode:
    """How a server reflection stream listing the services ends."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    stream = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    return await call_code(stream.read())


async def test_the_fetch_role_confirms_its_deliveries_and_gives_nothing_up() -> None:
    """Release by the fetch token: confirming a delivery it received works, giving an id up
    (no delivery_id) is PERMISSION_DENIED, and a delivery id it did not receive confirms
    nothing."""
    async with running_producer(park_token=PARK_TOKEN, fetch_token=FETCH_TOKEN) as server:
        async with grpc.aio.insecure_channel(server.target, options=channel_options()) as ch:
            stub = pb_grpc.KVProducerStub(ch)
            for kid in ("mine", "other"):
                reply = await stub.Park(
                    iter(park_requests(kid, {0: b"kv"}, total=1)), metadata=bearer(PARK_TOKEN)
                )
                assert reply.status == pb.STATUS_OK
            fetched = [
                m
                async for m in stub.Fetch(
                    pb.FetchRequest(kv_request_id="mine"), metadata=bearer(FETCH_TOKEN)
                )
            ]
            delivery = fetched[-1].done.delivery_id
            give_up = stub.Release(
                pb.ReleaseRequest(kv_request_id="other"), metadata=bearer(FETCH_TOKEN)
            )
            assert await call_code(give_up) == grpc.StatusCode.PERMISSION_DENIED
            wrong = await stub.Release(
                pb.ReleaseRequest(kv_request_id="mine", delivery_id=delivery ^ 1),
                metadata=bearer(FETCH_TOKEN),
            )
            assert (wrong.status, wrong.reason) == (pb.STATUS_FAILED, pb.REASON_UNKNOWN_ID)
            assert server.lot.lookup(["mine"])[0].state == pb.STATE_DELIVERED
            confirmed = await stub.Release(
                pb.ReleaseRequest(kv_request_id="mine", delivery_id=delivery),
                metadata=bearer(FETCH_TOKEN),
            )
            assert confirmed.status == pb.STATUS_OK
            states = server.lot.lookup(["mine", "other"])
            assert [(s.state, s.reason) for s in states] == [
                (pb.STATE_TOMBSTONED, pb.REASON_ALREADY_CONSUMED),
                (pb.STATE_PARKED, pb.REASON_UNSPECIFIED),
            ]
            # The park role may still give an id up.
            released = await stub.Release(
                pb.ReleaseRequest(kv_request_id="other"), metadata=bearer(PARK_TOKEN)
            )
            assert released.status == pb.STATUS_OK


async def test_refused_calls_are_logged_once_per_peer_and_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvpark")
    async with running_producer(park_token=PARK_TOKEN, fetch_token=FETCH_TOKEN) as server:
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb_grpc.KVProducerStub(ch)
            for _ in range(5):  # one peer (one channel), well within the 10 s window
                lookup = stub.Lookup(pb.LookupRequest(kv_request_ids=["a"]), metadata=bearer("x"))
                assert await call_code(lookup) == grpc.StatusCode.UNAUTHENTICATED
        logged = [r for r in caplog.records if r.getMessage() == "call refused"]
        suppressed = server.metrics.registry.get_sample_value(
            "kvpark_suppressed_warnings_total", {"kind": "auth"}
        )
        assert (len(logged), suppressed) == (1, 4)


async def test_role_without_token_is_open() -> None:
    async with running_producer(park_token=PARK_TOKEN) as server:
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb_grpc.KVProducerStub(ch)
            lookup = pb.LookupRequest(kv_request_ids=["a"])
            assert await call_code(stub.Lookup(lookup)) == grpc.StatusCode.OK
            release = pb.ReleaseRequest(kv_request_id="a")
            assert await call_code(stub.Release(release)) == grpc.StatusCode.UNAUTHENTICATED


HALF_PROTECTED = "only one role has a token"


@pytest.mark.parametrize(
    ("tokens", "open_methods"),
    [
        ({"fetch_token": FETCH_TOKEN}, "Park, Release, GetServerInfo"),
        ({"park_token": PARK_TOKEN}, "Fetch, KeepAlive, Lookup, GetServerInfo"),
    ],
)
async def test_one_token_on_an_exposed_listen_warns_which_methods_are_open(
    caplog: pytest.LogCaptureFixture, tokens: dict[str, str], open_methods: str
) -> None:
    caplog.set_level(logging.WARNING, logger="kvpark")
    async with running_producer(listen="0.0.0.0:0", **tokens) as server:
        warnings = [r.getMessage() for r in caplog.records if HALF_PROTECTED in r.getMessage()]
        assert len(warnings) == 1 and f": {open_methods} answer anyone" in warnings[0]
        # The warning tells the truth: the first method it names answers without a token.
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb_grpc.KVProducerStub(ch)
            tokenless = (
                stub.Release(pb.ReleaseRequest(kv_request_id="a"))
                if open_methods.startswith("Park")
                else stub.Lookup(pb.LookupRequest(kv_request_ids=["a"]))
            )
            assert await call_code(tokenless) == grpc.StatusCode.OK


@pytest.mark.parametrize(
    "overrides",
    [
        {"listen": "0.0.0.0:0", "park_token": PARK_TOKEN, "fetch_token": FETCH_TOKEN},
        {"listen": "127.0.0.1:0", "fetch_token": FETCH_TOKEN},  # loopback: only this host
    ],
)
async def test_no_half_protection_warning_when_nothing_is_exposed(
    caplog: pytest.LogCaptureFixture, overrides: dict[str, str]
) -> None:
    caplog.set_level(logging.WARNING, logger="kvpark")
    async with running_producer(**overrides):
        assert not [r for r in caplog.records if HALF_PROTECTED in r.getMessage()]


async def test_no_half_protection_warning_when_client_certificates_are_required(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    certs = make_certs(tmp_path)
    caplog.set_level(logging.WARNING, logger="kvpark")
    async with running_producer(
        listen="0.0.0.0:0",
        fetch_token=FETCH_TOKEN,
        tls_cert_file=str(certs.server_cert),
        tls_key_file=str(certs.server_key),
        tls_client_ca_file=str(certs.ca),
    ):
        assert not [r for r in caplog.records if HALF_PROTECTED in r.getMessage()]


async def test_tls_and_mtls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    ca = certs.ca.read_bytes()
    async with running_producer(
        tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.server_key)
    ) as server:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        async with grpc.aio.secure_channel(f"localhost:{server.port}", creds) as ch:
            info = await pb_grpc.KVProducerStub(ch).GetServerInfo(pb.GetServerInfoRequest())
            assert info.producer_epoch == server.epoch
        async with grpc.aio.insecure_channel(server.target) as ch:  # plaintext is refused
            code = await call_code(
                pb_grpc.KVProducerStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
            )
            assert code == grpc.StatusCode.UNAVAILABLE

    async with running_producer(
        tls_cert_file=str(certs.server_cert),
        tls_key_file=str(certs.server_key),
        tls_client_ca_file=str(certs.ca),
    ) as server:
        without_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        async with grpc.aio.secure_channel(f"localhost:{server.port}", without_cert) as ch:
            code = await call_code(
                pb_grpc.KVProducerStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
            )
            assert code == grpc.StatusCode.UNAVAILABLE
        with_cert = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=certs.client_key.read_bytes(),
            certificate_chain=certs.client_cert.read_bytes(),
        )
        async with grpc.aio.secure_channel(f"localhost:{server.port}", with_cert) as ch:
            stub = pb_grpc.KVProducerStub(ch)
            assert (
                await stub.Park(iter(park_requests("t", {0: b"tls"}, total=1)))
            ).status == pb.STATUS_OK
            msgs = [m async for m in stub.Fetch(pb.FetchRequest(kv_request_id="t"))]
            assert msgs[0].chunk.data == b"tls"


def run_producer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "producer_service", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_non_loopback_without_protection_refused_at_start() -> None:
    result = run_producer("--listen", "0.0.0.0:0", "--metrics-listen", "")
    assert result.returncode == 2
    assert "listen" in result.stderr and "allow_insecure" in result.stderr


def test_allow_insecure_starts_and_warns(producer_process) -> None:  # type: ignore[no-untyped-def]
    # Bound to a wildcard address but only probed over loopback.
    producer = producer_process(allow_insecure="true")
    producer.proc.terminate()
    output = producer.output()
    assert producer.proc.returncode == 0
    assert "neither TLS nor tokens" not in output  # loopback listen: nothing to warn about

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producer_service",
            "--listen",
            f"0.0.0.0:{port}",
            "--metrics-listen",
            "",
            "--allow-insecure",
            "--pool-bytes",
            "16MiB",
            "--max-chunk-bytes",
            "1MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=20)
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0
    assert "neither TLS nor tokens" in output


async def test_logs_never_carry_tokens_or_payload(caplog: pytest.LogCaptureFixture) -> None:
    marker = b"PAYLOAD-MARKER-" + os.urandom(8).hex().encode()
    caplog.set_level(logging.DEBUG, logger="kvpark")
    async with running_producer(
        park_token=PARK_TOKEN, fetch_token=FETCH_TOKEN, unbound_store_timeout_s=0.2
    ) as server:
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb_grpc.KVProducerStub(ch)
            await stub.Park(
                iter(park_requests("logged", {0: marker}, total=1)), metadata=bearer(PARK_TOKEN)
            )
            wrong = stub.Park(
                iter(park_requests("logged", {0: marker}, total=1)),
                metadata=bearer("wrong-" + PARK_TOKEN),
            )
            assert await call_code(wrong) == grpc.StatusCode.UNAUTHENTICATED

            await wait_until(lambda: server.lot.statistics().reaped_total == 1)
            for _ in range(3):
                [
                    m
                    async for m in stub.Fetch(
                        pb.FetchRequest(kv_request_id="logged"), metadata=bearer(FETCH_TOKEN)
                    )
                ]
            await stub.Park(
                iter(park_requests("logged", {0: marker}, total=1)), metadata=bearer(PARK_TOKEN)
            )
    formatter = JsonFormatter()
    lines = [formatter.format(r) for r in caplog.records]
    text = "\n".join(lines)
    assert any("call refused" in line and "UNAUTHENTICATED" in line for line in lines)
    late = [json.loads(line) for line in lines if "late fetch" in line]
    assert (
        late[0]["id"] == "'logged'" and late[0]["reason"] == "REASON_REAPED" and "peer" in late[0]
    )
    assert PARK_TOKEN not in text and FETCH_TOKEN not in text
    assert marker.decode() not in text
