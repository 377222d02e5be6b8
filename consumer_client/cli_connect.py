"""Which producers a `kvpark` command talks to, and with which credentials.

Targets come from `--target` (repeatable, before or after the command), `--targets-file` (one
target per line) or, when neither is given, `KVPARK_TARGET` or the default; each is a
`host:port` or a gRPC target, as the client library takes them. The token and
TLS files are read once into a `Connection`, which then opens clients for any number of
targets with the same credentials. The TLS options alone are a `ClientTls`, which every client
the CLI builds takes (`kvpark bench` too, with tokens of its own): the gRPC channel's
credentials, the TCP data connection's `ssl.SSLContext` made from the same files, and the name
both check the producer's certificate against (`--tls-server-name`).
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvpark.producer.config_values import holds_pem, seconds_argument
from kvpark.tokens import TOKEN_EXPECTED, is_valid_token

from ._channel import target_problem
from ._errors import UsageError
from ._sync import KVConsumer
from .cli_snapshot import SnapshotReader

TARGET_ENV = "KVPARK_TARGET"
TOKEN_ENV = "KVPARK_TOKEN"
DEFAULT_TARGET = "127.0.0.1:50051"
# The channel option naming the host the producer's certificate must carry instead of the
# target's; the client's TCP data connection checks the same name.
SERVER_NAME_OPTION = "grpc.ssl_target_name_override"


class TargetOption(argparse.Action):
    """`--target`: the last one given is `args.target` (what single-producer commands use), and
    every one given is collected in `list_dest`. The parser before the command and the one after
    it collect into different lists because argparse copies the command's namespace over the
    top one, which would drop the targets given before the command."""

    def __init__(self, *args: Any, list_dest: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.list_dest = list_dest

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
        option_string: str | None = None,
    ) -> None:  # fmt: skip
        setattr(namespace, self.dest, values)
        # `kvpark bench` measures its own producer unless an operator names one.
        namespace.target_given = True
        setattr(namespace, self.list_dest, [*getattr(namespace, self.list_dest, []), values])


def positive_seconds(text: str) -> float:
    """argparse type of `--rpc-timeout` and the other durations: seconds as the producer takes
    them, > 0 and at most a week (longer deadlines overflow and end at once)."""
    return seconds_argument(text)


def dialable_target(text: str) -> str:
    """The target in `text` without the spaces around it, checked by the client library's own
    rule (`target_problem`): the CLI takes every target a `KVConsumer` takes (a Compose v1
    name such as `kvpark_producer_1:50051`, a fully qualified name ending in a dot, a gRPC
    target such as `dns:///host:port`) and refuses the ones it refuses, with the library's
    message, which names the value. ValueError otherwise. `--target`, `KVPARK_TARGET` and
    `--targets-file` lines alike."""
    target = text.strip()
    problem = target_problem(target)
    if problem is not None:
        raise ValueError(problem)
    return target


def target_option(text: str) -> str:
    """argparse type of `--target`, which also checks the `KVPARK_TARGET` default."""
    try:
        return dialable_target(text)
    except ValueError as exc:
        # argparse checks the environment's value under the option's name: say where it is.
        origin = f" (the value of {TARGET_ENV})" if text == os.environ.get(TARGET_ENV) else ""
        raise argparse.ArgumentTypeError(f"{exc}{origin}") from None


def given_targets(args: argparse.Namespace) -> list[str]:
    """The `--target`s given, before and after the command, in order."""
    return [*getattr(args, "targets_before", []), *getattr(args, "targets_after", [])]


def targets_of(args: argparse.Namespace) -> list[str]:
    """Every target a command asks, in the order given, each once: the `--target`s, then the
    lines of `--targets-file`; `args.target` (environment or default) when neither was given."""
    targets = given_targets(args)
    targets_file: Path | None = getattr(args, "targets_file", None)
    if targets_file is not None:
        targets += read_targets_file(targets_file)
    if not targets:
        return [args.target]
    return list(dict.fromkeys(targets))


def read_targets_file(path: Path) -> list[str]:
    """A target (`host:port`) per line; `#` starts a comment, blank lines are skipped. A line
    that is not a target is a UsageError naming the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text") from None
    targets: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            targets.append(dialable_target(entry))
        except ValueError as exc:
            raise UsageError(f"{path}:{number}: {exc}") from None
    if not targets:
        raise UsageError(f"{path}: no targets in it (one host:port per line)")
    return targets


def _read(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _read_pem(path: Path | None) -> bytes | None:
    """A TLS file's bytes; one without a PEM block is named here, where grpc would only fail
    the handshake ("Failed to create security handshaker")."""
    data = _read(path)
    if data is not None and not holds_pem(data):
        raise UsageError(f"{path}: holds no PEM block (expected a PEM certificate or key)")
    return data


def server_name_option(text: str) -> str:
    """argparse type of `--tls-server-name`: one host name (or IP address) as a certificate
    names it."""
    if not text or any(c.isspace() or not c.isprintable() for c in text):
        raise argparse.ArgumentTypeError(
            f"expected a host name the producer's certificate names, got {text!r}"
        )
    return text


def _refuse_encrypted_key(key: Path) -> Callable[[], bytes]:
    """The `password` callback of `load_cert_chain`: called only for an encrypted key, which
    OpenSSL would otherwise ask for on the terminal (and grpc cannot read at all)."""

    def refuse() -> bytes:
        raise UsageError(f"{key}: the key is encrypted (expected an unencrypted PEM key)")

    return refuse


def _data_tls(
    ca_path: Path | None, ca: bytes | None, cert: Path | None, key: Path | None
) -> ssl.SSLContext:
    """The TCP data connection's TLS, from the files the gRPC channel's credentials come from:
    the CA (the system's roots without one) and the client certificate for mTLS. A file the
    channel would only fail on at the handshake is a usage error here, as `_read_pem`'s are."""
    # With a CA only it is trusted, as grpc's credentials trust only it; without one, the
    # system's roots. PEM is ASCII: what else a bundle holds sits outside its blocks.
    cadata = None if ca is None else ca.decode("ascii", errors="ignore")
    try:
        context = ssl.create_default_context(cadata=cadata)
    except ssl.SSLError as exc:
        raise UsageError(
            f"{ca_path}: holds no usable CA certificate ({exc.reason or exc})"
        ) from None
    if cert is not None and key is not None:
        try:
            context.load_cert_chain(cert, key, password=_refuse_encrypted_key(key))
        except ssl.SSLError as exc:  # an OSError too: before the one for unreadable files
            raise UsageError(
                f"{cert}, {key}: not a client certificate and its key ({exc.reason or exc})"
            ) from None
        except OSError as exc:
            raise UsageError(f"cannot read {exc.filename or cert}: {exc.strerror}") from None
    return context


def _token(args: argparse.Namespace) -> str | None:
    """`--token-file`'s token, else `KVPARK_TOKEN`'s (empty: none), as gRPC metadata takes it.
    Token values never appear in a message."""
    token_bytes = _read(args.token_file)
    if token_bytes is None:
        token = os.environ.get(TOKEN_ENV) or None
        origin = TOKEN_ENV
    else:
        try:
            token = token_bytes.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise UsageError(f"{args.token_file}: the token is not UTF-8 text") from None
        if not token:
            raise UsageError(f"{args.token_file}: the token file is empty")
        origin = str(args.token_file)
    if token is not None and not is_valid_token(token):
        raise UsageError(f"{origin}: expected {TOKEN_EXPECTED} (value not shown)")
    return token


@dataclass(frozen=True)
class ClientTls:
    """The TLS options, read once: what each client the CLI builds is given. All None for
    plaintext."""

    credentials: grpc.ChannelCredentials | None = None
    # The TCP data connection's own TLS: without it a consumer on a TLS channel never offers
    # TCP, and its loads go over the gRPC stream.
    data_tls: ssl.SSLContext | None = None
    server_name: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientTls:
        # A client key names mTLS as much as its certificate does: alone it is a mistake to
        # report, not an option to drop.
        if bool(args.tls_cert) != bool(args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        server_name: str | None = args.tls_server_name
        if not (args.tls or args.tls_ca or args.tls_cert):
            # A plaintext channel checks no certificate: the name would be silently unused.
            if server_name is not None:
                raise UsageError("--tls-server-name goes with TLS (--tls, --tls-ca or --tls-cert)")
            return cls()
        ca, key, cert = (_read_pem(path) for path in (args.tls_ca, args.tls_key, args.tls_cert))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        data_tls = _data_tls(args.tls_ca, ca, args.tls_cert, args.tls_key)
        return cls(credentials, data_tls, server_name)

    def channel_args(self) -> dict[str, Any]:
        """Keyword arguments of any client's channel (a `KVParker`'s, a reader's)."""
        options = ((SERVER_NAME_OPTION, self.server_name),) if self.server_name else ()
        return {"credentials": self.credentials, "channel_options": options}

    def consumer_args(self) -> dict[str, Any]:
        """Keyword arguments of a `KVConsumer`: its channel's, and its data connection's."""
        return {**self.channel_args(), "data_tls": self.data_tls}


@dataclass(frozen=True)
class Connection:
    """The token and TLS credentials of the connection options, read once for every target."""

    token: str | None = field(repr=False)
    tls: ClientTls

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Connection:
        token = _token(args)
        return cls(token, ClientTls.from_args(args))

    def consumer(self, target: str, **client_args: Any) -> KVConsumer:
        return KVConsumer(target, token=self.token, **self.tls.consumer_args(), **client_args)

    def reader(self, target: str) -> SnapshotReader:
        return SnapshotReader.open(target, token=self.token, **self.tls.channel_args())
