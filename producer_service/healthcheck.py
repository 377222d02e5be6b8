"""Container health probe for the producer.

Asks the producer's standard ``grpc.health.v1`` service whether it is SERVING and exits 0 if it
is, 1 otherwise (NOT_SERVING while shutting down, unreachable, timed out, ...), printing one line.
Used by the image's ``HEALTHCHECK`` and by compose::

    python -m kvpark.producer.healthcheck [--target 127.0.0.1:50051] [--timeout 2] [--service NAME]
        [--tls] [--ca-file PEM] [--server-name NAME] [--client-cert PEM --client-key PEM]

Without ``--target`` the probe dials the producer's health port, ``KVPARK_HEALTH_LISTEN``, when
that is set: plaintext, and outside the gRPC port's connection cap, so a producer whose
connections are all taken still passes (see health_listener.py). Else it dials ``KVPARK_LISTEN``
(a wildcard host such as ``0.0.0.0`` or ``[::]`` is probed on loopback), else
``127.0.0.1:50051``. The probe reads those variables, not the producer's whole configuration: a
probe must not call a serving producer unhealthy for settings it cannot see (flags) or for a
check that is the producer's to make. A producer whose addresses come from flags or a
``KVPARK_CONFIG`` file needs ``--target``.

Health is served without tokens, so none is needed. A producer serving TLS needs a TLS probe
on its gRPC port (the health port is always plaintext):
``--tls`` (implied by ``--ca-file``, and by ``KVPARK_TLS_CERT_FILE`` in the environment, whose
certificate is then trusted by default: right for a self-signed one), ``--server-name`` when the
certificate does not name the probed host, and a client certificate when the producer requires
one (mTLS, ``tls_client_ca_file``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvpark.address import Address

from .config_values import seconds_argument

DEFAULT_TARGET = "127.0.0.1:50051"


def default_target(listen: str | None) -> str:
    """The address to probe for a producer listening on ``listen`` (``host:port``)."""
    if not listen:
        return DEFAULT_TARGET
    try:
        return str(Address.parse(listen).dialable())
    except ValueError:
        return DEFAULT_TARGET


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def check(
    target: str,
    timeout: float,
    service: str = "",
    *,
    tls: bool = False,
    ca_file: str | None = None,
    server_name: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
) -> tuple[bool, str]:
    """Run one health Check; return (serving, one-line message)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    what = service or "server"
    options: list[tuple[str, str]] = []
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    try:
        if tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(ca_file),
                private_key=_read(client_key),
                certificate_chain=_read(client_cert),
            )
            channel = grpc.secure_channel(target, creds, options=options)
        else:
            channel = grpc.insecure_channel(target)
    except OSError as exc:
        return False, f"unhealthy: {target} ({what}): cannot read TLS file: {exc}"
    try:
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        name = code.name if code is not None else type(exc).__name__
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return False, f"unhealthy: {target} ({what}): {name}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status == health_pb2.HealthCheckResponse.SERVING:
        return True, f"healthy: {target} ({what}): {status}"
    return False, f"unhealthy: {target} ({what}): {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpark.producer.healthcheck",
        description="Exit 0 if the producer's grpc.health.v1 service answers SERVING, else 1.",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="host:port to probe (default: KVPARK_HEALTH_LISTEN in plaintext, else "
        f"KVPARK_LISTEN, else {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout",
        type=seconds_argument,
        default=2.0,
        help="deadline of the check in seconds (default 2)",
    )
    parser.add_argument(
        "--service", default="", help="service name to ask about (default: the whole server)"
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="probe over TLS (implied by --ca-file or KVPARK_TLS_CERT_FILE in the environment)",
    )
    parser.add_argument(
        "--ca-file",
        default=None,
        help="PEM roots to verify the producer with (default with KVPARK_TLS_CERT_FILE: that "
        "certificate; else the system roots)",
    )
    parser.add_argument(
        "--server-name", default=None, help="name expected in the producer's certificate"
    )
    parser.add_argument("--client-cert", default=None, help="PEM client certificate (mTLS)")
    parser.add_argument("--client-key", default=None, help="PEM key of --client-cert")
    args = parser.parse_args(argv)
    if bool(args.client_cert) != bool(args.client_key):
        parser.error("--client-cert and --client-key go together")
    health_listen = os.environ.get("KVPARK_HEALTH_LISTEN")
    env_cert = os.environ.get("KVPARK_TLS_CERT_FILE") or None
    tls_flags = bool(args.tls or args.ca_file or args.client_cert)
    if args.target is None and health_listen:
        if tls_flags or args.server_name:
            parser.error(
                "the health port (KVPARK_HEALTH_LISTEN) is plaintext: TLS options need "
                "--target, the producer's gRPC port"
            )
        target, tls = default_target(health_listen), False
    else:
        target = args.target or default_target(os.environ.get("KVPARK_LISTEN"))
        tls = tls_flags or env_cert is not None
    ca_file = args.ca_file or (env_cert if tls else None)
    ok, message = check(
        target,
        args.timeout,
        args.service,
        tls=tls,
        ca_file=ca_file,
        server_name=args.server_name,
        client_cert=args.client_cert,
        client_key=args.client_key,
    )
    print(message, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
