"""Validation of `kv_request_id`, the key both sides and the router share, and the range of
chunk ids under it.

The rule (docs/protocol.md): a UTF-8 string of 1-256 bytes with no control characters (C0,
DEL, C1) and no lone surrogates. Checked at every entry point (producer handlers, client
calls) so that a bad id is a clear INVALID_ARGUMENT / ValueError instead of a record nobody
can name in a log line.
"""

from __future__ import annotations

import re

MAX_ID_BYTES = 256
# An id holds at most MAX_CHUNKS chunks (total_chunks is a uint32), so chunk ids run from 0 to
# MAX_CHUNKS - 1 = 2**32 - 2: a total fixed as the highest committed id + 1 always fits its
# field, and 2**32 - 1 stays free for the data connection's end frame (kvpark.tcp_frames).
MAX_CHUNKS = 2**32 - 1
# Unicode categories Cc (control characters: C0, DEL, C1) and Cs (lone surrogates, not UTF-8),
# as one character class: checking 10k ids per KeepAlive must not hold the event loop.
_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def id_problem(kv_request_id: object) -> str | None:
    """Returns what is wrong with `kv_request_id`, or None when it is valid."""
    if not isinstance(kv_request_id, str):
        return f"kv_request_id must be a string, got {type(kv_request_id).__name__}"
    if not kv_request_id:
        return "kv_request_id is empty"
    size = len(kv_request_id.encode("utf-8", errors="surrogatepass"))
    if size > MAX_ID_BYTES:
        return f"kv_request_id is {size} bytes, more than {MAX_ID_BYTES}"
    bad = _FORBIDDEN.search(kv_request_id)
    if bad is not None:
        return f"kv_request_id contains control character {bad.group()!r}"
    return None


def check_id(kv_request_id: object) -> str:
    """Returns the id unchanged, or raises ValueError saying what is wrong with it."""
    problem = id_problem(kv_request_id)
    if problem is not None:
        raise ValueError(problem)
    assert isinstance(kv_request_id, str)
    return kv_request_id


def printable_id(kv_request_id: str, limit: int = 80) -> str:
    """A log-safe rendering: repr (escapes anything odd) cut to `limit` characters."""
    text = repr(kv_request_id)
    return text if len(text) <= limit else text[: limit - 3] + "..."
