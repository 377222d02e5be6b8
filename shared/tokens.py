"""The bearer token's form, one rule for the producer's configuration and every client.

A token travels as a gRPC metadata value ("Bearer <token>"), which must be printable ASCII: any
other character (a UTF-8 byte-order mark from an editor, a trailing carriage return, a
non-ASCII letter) fails every call locally with INTERNAL "Invalid metadata" instead of failing
where the token is given. Spaces are refused too: "Bearer <token>" is split at the first one.
"""

from __future__ import annotations

from typing import TypeGuard

TOKEN_EXPECTED = "a non-empty token of printable ASCII characters (0x21-0x7E, no spaces)"


def is_valid_token(text: object) -> TypeGuard[str]:
    return isinstance(text, str) and bool(text) and all("!" <= ch <= "~" for ch in text)
