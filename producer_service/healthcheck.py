"""Container health probe for the producer.

Asks the producer's standard ``grpc.health.v1`` service whether it is SERVING and exits 0 if it
is, 1 otherwise (NOT_SERVING while shutting down, unreachable, timed out, ...), printing one line.
Used by the image's ``HEALTHCHECK`` and by compose::

    python -m kvpark.producer.healthcheck [--target 127.0.0.1:50051] [--timeout 2] [--service NAME]
        [--tls] [--ca-file PEM] [--server-name NAME] [--client-cert PEM --client-key PEM]

Without ``--target`` the address is the producer's ``listen``, read as the producer reads its
configuration: defaults < the JSON file of ``KVPARK_CONFIG`` < the ``KVPARK_<KEY>`` variables (a
wildcard host such as ``0.0.0.0`` or ``[::]`` is probed on loopback). The probe runs in the
producer's environment, so it finds what the producer found; only a producer started with
command-line flags (``kvpark-producer --listen ...``) listens elsewhere than it can tell: pass
``--target`` then. A configuration the producer would refuse is reported unhealthy.

Health is served without tokens, so none is needed. A producer serving TLS needs a TLS probe:
``--tls`` (implied by ``--ca-file``, and by a ``tls_cert_file`` in that configuration, whose
certificate is then trusted by default: right for a self-signed one), ``--server-name`` when the
certificate does not name the probed host, and a client certificate when the producer requires
one (mTLS, ``tls_client_ca_file``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .config_sources import load_config
from .config_values import ConfigError, seconds_argument


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
        help="host:port to probe (default: the producer's listen, from KVPARK_CONFIG and "
        "the KVPARK_ variables)",
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
        help="probe over TLS (implied by --ca-file or the producer's tls_cert_file)",
    )
    parser.add_argument(
        "--ca-file",
        default=None,
        help="PEM roots to verify the producer with (default with the producer's "
        "tls_cert_file: that certificate; else the system roots)",
    )
    parser.add_argument(
        "--server-name", default=None, help="name expected in the producer's certificate"
    )
    parser.add_argument("--client-cert", default=None, help="PEM client certificate (mTLS)")
    parser.add_argument("--client-key", default=None, help="PEM key of --client-cert")
    args = parser.parse_args(argv)
    if bool(args.client_cert) != bool(args.client_key):
        parser.error("--client-cert and --client-key go together")
    try:
        # The producer's own loading, flags aside: the probe is not given the producer's.
        config = load_config([], os.environ)
    except ConfigError as exc:
        print(f"unhealthy: the producer's configuration is invalid: {exc}", flush=True)
        return 1
    target = args.target or str(config.listen_address.dialable())
    server_cert = config.tls_cert_file
    tls = bool(args.tls or args.ca_file or args.client_cert or server_cert)
    ca_file = args.ca_file or (server_cert if tls else None)
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
