"""Fingerprints: what a request's KV cache was computed from, named so both sides can compare.

An id names where the KV is; it does not say what the KV is. A router that reuses a request id,
a retried request with another prompt, or a decode worker on another model version after a
rolling deploy would each load KV that passes every checksum and still decodes garbage. A
prefill worker parks its KV with a fingerprint of what it computed it from; the decode worker
computes the same fingerprint from its own request and model and passes it to the load, and
the producer hands out the chunks only when the two match (docs/protocol.md, Fingerprints).

The contract carries 0-64 opaque bytes, so any scheme fits. `fingerprint()` is the one both
kvpark clients offer: BLAKE2b-128 over the model's name, the prompt's token ids and whatever
else decides the KV (the KV layout, a LoRA adapter, a rope scaling), each length-prefixed, so
no two different inputs share an encoding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

MAX_FINGERPRINT_BYTES = 64
_PERSON = b"kvpark-kv-fp-v1"  # the encoding's version: a new encoding gets a new one


def fingerprint(model: str, token_ids: Iterable[int], *extra: str | bytes) -> bytes:
    """16 bytes naming the KV that `model` computes for `token_ids` (and `extra`, e.g. the
    KV layout's description or an adapter's name): equal inputs give equal fingerprints, on
    any host and in any process."""
    if not isinstance(model, str) or not model:
        raise ValueError("model: expected the model's name, a non-empty string")
    tokens = _token_array(token_ids)
    digest = hashlib.blake2b(digest_size=16, person=_PERSON)
    _add(digest, model.encode("utf-8"))
    _add(digest, tokens.astype("<i8").tobytes())
    for item in extra:
        _add(digest, item.encode("utf-8") if isinstance(item, str) else bytes(item))
    return digest.digest()


def _token_array(token_ids: Iterable[int]) -> np.ndarray:
    """The token ids as int64, refusing what would hash like another prompt's tokens (a float
    truncated, True taken for 1) or not fit."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype.kind in "iu" and token_ids.ndim == 1:
        if token_ids.dtype.kind == "u" and token_ids.size and token_ids.max() > 2**63 - 1:
            raise ValueError("token_ids: an id beyond int64")
        return token_ids.astype(np.int64)
    tokens = list(token_ids)
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise ValueError(f"token_ids: expected ints, got {token!r}")
    try:
        return np.array(tokens, dtype=np.int64)
    except OverflowError:
        raise ValueError("token_ids: an id beyond int64") from None


def _add(digest: hashlib.blake2b, field: bytes) -> None:
    digest.update(len(field).to_bytes(8, "little"))
    digest.update(field)


def fingerprint_problem(value: object) -> str | None:
    """What is wrong with a fingerprint given to a park or a load, or None."""
    if not isinstance(value, bytes | bytearray | memoryview):
        return f"expected bytes, got {type(value).__name__}"
    if len(value) > MAX_FINGERPRINT_BYTES:
        return f"at most {MAX_FINGERPRINT_BYTES} bytes, got {len(value)}"
    return None


def shown(value: bytes) -> str:
    """A fingerprint as a log line names it: its first 8 bytes in hex, or "none"."""
    if not value:
        return "none"
    return value[:8].hex() + ("…" if len(value) > 8 else "")
