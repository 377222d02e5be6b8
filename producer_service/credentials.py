"""The producer's secrets, read from the files its configuration names: the load step.

`ProducerConfig` validates paths without touching the file system; this module reads them once,
at start-up (`load_credentials`), and turns every unreadable, empty or malformed file into one
`ConfigError` that names the key, like any other configuration mistake: the CLI prints it on
one line and exits 2. Token values never appear in a message.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

from kvpark.tokens import is_valid_token

from .config import ProducerConfig
from .config_values import ConfigError, holds_pem, show


class _EncryptedKeyError(Exception):
    """Raised by the password callback: the key file is encrypted."""


def _refuse_password() -> bytes:
    # Called by OpenSSL only for an encrypted key. Without a callback it would ask on the
    # terminal ("Enter PEM pass phrase:"), hanging a producer started from a shell, or fail
    # with a bare OSError without one; nothing could hand grpc the pass phrase anyway.
    raise _EncryptedKeyError


@dataclass(frozen=True, slots=True, repr=False)
class Credentials:
    """Bearer tokens by role (None: the role is open) and the TLS material in PEM."""

    park_token: str | None = None
    fetch_token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = field(default=None)
    tls_client_ca: bytes | None = None

    def __repr__(self) -> str:
        shown = {
            "park_token": self.park_token is not None,
            "fetch_token": self.fetch_token is not None,
            "tls": self.tls_cert is not None,
            "mtls": self.tls_client_ca is not None,
        }
        return f"Credentials({', '.join(f'{k}={v}' for k, v in shown.items())})"


def load_credentials(config: ProducerConfig) -> Credentials:
    """Reads the token and TLS files `config` names. Raises ConfigError naming the key."""
    park = config.park_token or _token_file("park_token_file", config.park_token_file)
    fetch = config.fetch_token or _token_file("fetch_token_file", config.fetch_token_file)
    if park is not None and park == fetch:
        # Roles are told apart by the token alone.
        raise ConfigError(
            "park_token and fetch_token must differ, or each role could call the other's "
            "RPCs (values not shown)",
            keys=("park_token", "fetch_token"),
        )
    credentials = Credentials(
        park_token=park,
        fetch_token=fetch,
        tls_cert=_pem_file("tls_cert_file", config.tls_cert_file),
        tls_key=_pem_file("tls_key_file", config.tls_key_file),
        tls_client_ca=_pem_file("tls_client_ca_file", config.tls_client_ca_file),
    )
    _check_tls_material(config)
    return credentials


def _check_tls_material(config: ProducerConfig) -> None:
    """Loads the certificate, its key and the client CA as a TLS server would: a file that is
    PEM but not a usable certificate or key, or a key that does not match its certificate, is
    refused here with the key named, rather than by grpc at bind time ("Failed to bind")."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    if config.tls_cert_file and config.tls_key_file:
        try:
            context.load_cert_chain(
                config.tls_cert_file, config.tls_key_file, password=_refuse_password
            )
        except _EncryptedKeyError:
            raise ConfigError(
                f"tls_key_file: encrypted private keys are not supported: "
                f"{show(config.tls_key_file)} asks for a pass phrase; give the key without "
                "one (e.g. `openssl pkey -in KEY -out PLAIN`) on a volume only the producer "
                "reads",
                keys=("tls_key_file",),
            ) from None
        except ssl.SSLError as exc:
            # OpenSSL names a mismatch (KEY_VALUES_MISMATCH); a file that holds no
            # certificate, or no key, it reports without a reason.
            reason = exc.reason or (
                "the certificate file holds no certificate or the key file no private key "
                "(are the two swapped?)"
            )
            raise ConfigError(
                f"tls_cert_file / tls_key_file: not a usable certificate and matching key "
                f"({show(config.tls_cert_file)}, {show(config.tls_key_file)}): {reason}",
                keys=("tls_cert_file", "tls_key_file"),
            ) from None
    if config.tls_client_ca_file:
        try:
            context.load_verify_locations(config.tls_client_ca_file)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"tls_client_ca_file: {show(config.tls_client_ca_file)} holds no usable CA "
                f"certificate: {exc.reason or exc}",  # a PEM that does not decode has no reason
                keys=("tls_client_ca_file",),
            ) from None


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{key}: not an existing file: {show(path)}", keys=(key,)) from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"{key}: cannot read {show(path)}: {reason}", keys=(key,)) from None


def _token_file(key: str, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        text = _read(key, path).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {show(path)} is not UTF-8 text", keys=(key,)) from None
    token = text.rstrip("\r\n")  # files written by `echo` or editors end with a newline
    if not token:
        raise ConfigError(f"{key}: token file {show(path)} is empty", keys=(key,))
    if not is_valid_token(token):
        # gRPC sends tokens as metadata, which must be printable ASCII.
        raise ConfigError(
            f"{key}: the token in {show(path)} holds a space or a character outside printable "
            "ASCII (0x21-0x7E; a byte-order mark counts too)",
            keys=(key,),
        )
    return token


def _pem_file(key: str, path: str | None) -> bytes | None:
    """A PEM file's bytes; a file that holds no PEM block is refused here, with the key named,
    rather than by grpc at bind time with a traceback."""
    if path is None:
        return None
    data = _read(key, path)
    if not holds_pem(data):
        raise ConfigError(f"{key}: {show(path)} holds no PEM block", keys=(key,))
    return data
