"""The health port (`health_listen`): a loopback gRPC server answering health only, with
connections of its own. grpc counts every connection to the gRPC port against
`max_connections`, a probe's too, so without it a producer whose connections are all taken
fails its liveness probe and is restarted, losing every parked request."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack

import grpc
import pytest
from conftest import make_config, running_producer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpark.producer.config_values import ConfigError
from kvpark.producer.server import ProducerServer
from kvpark.producer.servicer import SERVICE_NAME


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}
    return subprocess.run(
        [sys.executable, "-m", "kvpark.producer.healthcheck", "--timeout", "3", *args],
        capture_output=True, text=True, timeout=60, env={**base, **(env or {})},
    )  # fmt: skip


def hold_connections(target: str, count: int) -> Iterator[grpc.Channel]:
    """`count` connected channels to `target`, each with a call answered (so its connection
    is up and counted), kept open until the caller's ExitStack closes them."""
    for _ in range(count):
        # A local subchannel pool each: channels of one process share connections otherwise.
        channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        yield channel


async def test_a_producer_with_every_connection_taken_passes_its_health_port_probe() -> None:
    async with running_producer(max_connections=2, health_listen="127.0.0.1:0") as server:
        health_env = {"KVPARK_HEALTH_LISTEN": f"127.0.0.1:{server.health_port}"}
        with ExitStack() as stack:
            for channel in await asyncio.to_thread(
                lambda: list(hold_connections(server.target, 2))
            ):
                stack.callback(channel.close)
            # The gRPC port takes no third connection, a probe's included.
            on_grpc_port = await asyncio.to_thread(probe, "--target", server.target)
            assert on_grpc_port.returncode == 1, on_grpc_port.stdout + on_grpc_port.stderr
            # The health port does: the probe's default when KVPARK_HEALTH_LISTEN is set.
            on_health_port = await asyncio.to_thread(probe, env=health_env)
            assert on_health_port.returncode == 0, on_health_port.stdout + on_health_port.stderr
            assert on_health_port.stdout.startswith(f"healthy: 127.0.0.1:{server.health_port} ")


async def test_the_health_port_serves_the_producers_health_and_nothing_else() -> None:
    async with running_producer(health_listen="127.0.0.1:0") as server:
        target = f"127.0.0.1:{server.health_port}"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # One health service for both ports: what the producer says, the port says.
            await server.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # No kvpark method is served there.
            info = channel.unary_unary("/kvpark.v1.KVProducer/GetServerInfo")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await info(b"", timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # Shut down, the health port is closed too.
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", server.health_port)) != 0


async def test_a_health_port_in_use_fails_the_start_naming_the_key_and_leaves_nothing() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ProducerServer(make_config(health_listen=f"127.0.0.1:{port}"))
        with pytest.raises(OSError, match=rf"health_listen: cannot bind '127.0.0.1:{port}'"):
            await server.start()
        assert server.port == 0  # the gRPC port was never bound


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"health_listen": "0.0.0.0:50053"}, "health_listen: '0.0.0.0:50053' is not a loopback"),
        ({"health_listen": "10.1.2.3:50053"}, "is not a loopback address"),
        (
            {"listen": "127.0.0.1:50051", "health_listen": "127.0.0.1:50051"},
            "health_listen ('127.0.0.1:50051') must not use the same address as listen",
        ),
        (
            {"metrics_listen": "127.0.0.1:9400", "health_listen": "127.0.0.1:9400"},
            "health_listen ('127.0.0.1:9400') must not use the same address as metrics_listen",
        ),
    ],
)
def test_a_health_port_that_is_exposed_or_shared_is_a_config_error(
    overrides: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match="health_listen") as refused:
        make_config(**overrides)
    assert message in str(refused.value)


def test_tls_options_without_a_target_are_refused_when_the_probe_dials_the_health_port() -> None:
    result = probe("--ca-file", "/certs/ca.pem", env={"KVPARK_HEALTH_LISTEN": "127.0.0.1:50053"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the health port (KVPARK_HEALTH_LISTEN) is plaintext" in result.stderr
