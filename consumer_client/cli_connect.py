"""Which producers a `kvpark` command talks to, and with which credentials.

Targets come from `--target` (repeatable, before or after the command), `--targets-file` (one
`host:port` per line) or, when neither is given, `KVPARK_TARGET` or the default. The token and
TLS files are read once into a `Connection`, which then opens clients for any number of
targets with the same credentials.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvpark.address import Address
from kvpark.producer.config_values import (
    TOKEN_EXPECTED,
    holds_pem,
    is_valid_token,
    seconds_argument,
)

from ._errors import UsageError
from ._sync import KVConsumer
from .cli_snapshot import SnapshotReader

TARGET_ENV = "KVPARK_TARGET"
TOKEN_ENV = "KVPARK_TOKEN"
DEFAULT_TARGET = "127.0.0.1:50051"


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
    """The `host:port` a client can dial in `text`, as `Address` writes it; ValueError saying
    what is wrong otherwise. `--target`, `KVPARK_TARGET` and `--targets-file` lines alike."""
    address = Address.parse(text)
    if address.port == 0:
        raise ValueError("port 0 cannot be dialed")
    return str(address)


def target_option(text: str) -> str:
    """argparse type of `--target`, which also checks the `KVPARK_TARGET` default."""
    try:
        return dialable_target(text)
    except ValueError as exc:
        # argparse checks the environment's value under the option's name: say where it is.
        origin = f" (the value of {TARGET_ENV})" if text == os.environ.get(TARGET_ENV) else ""
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}{origin}") from None


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
    """`host:port` per line; `#` starts a comment, blank lines are skipped. A line that is not
    an address is a UsageError naming the file and line."""
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
            raise UsageError(f"{path}:{number}: {exc}, got {entry!r}") from None
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
class Connection:
    """The token and TLS credentials of the connection options, read once for every target."""

    token: str | None = field(repr=False)
    credentials: grpc.ChannelCredentials | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Connection:
        token = _token(args)
        credentials = None
        # A client key names mTLS as much as its certificate does: alone it is a mistake to
        # report, not an option to drop.
        if bool(args.tls_cert) != bool(args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        if args.tls or args.tls_ca or args.tls_cert:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(args.tls_ca),
                private_key=_read_pem(args.tls_key),
                certificate_chain=_read_pem(args.tls_cert),
            )
        return cls(token, credentials)

    def consumer(self, target: str, **client_args: Any) -> KVConsumer:
        return KVConsumer(target, token=self.token, credentials=self.credentials, **client_args)

    def reader(self, target: str) -> SnapshotReader:
        return SnapshotReader.open(target, token=self.token, credentials=self.credentials)
