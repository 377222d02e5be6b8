"""host:port parsing in its one place: every address survives a round trip (IPv6 included),
and what is wrong with a bad one is said."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpark.address import Address


@given(
    host=st.one_of(
        st.ip_addresses().map(str),
        st.from_regex(r"[a-z]([a-z0-9-]{0,10}[a-z0-9])?(\.[a-z]{2,5}){0,2}", fullmatch=True),
    ),
    port=st.integers(0, 65535),
)
def test_every_address_survives_a_round_trip(host: str, port: int) -> None:
    address = Address(host, port)
    assert Address.parse(str(address)) == address
    if ":" in host:
        assert str(address).startswith("[")


@pytest.mark.parametrize(
    ("text", "loopback", "wildcard", "dial"),
    [
        ("127.0.0.1:5", True, False, "127.0.0.1:5"),
        ("localhost:5", True, False, "localhost:5"),
        ("[::1]:5", True, False, "[::1]:5"),
        ("[::ffff:127.0.0.1]:5", True, False, "[::ffff:127.0.0.1]:5"),
        ("0.0.0.0:5", False, True, "127.0.0.1:5"),
        ("[::]:5", False, True, "[::1]:5"),
        ("10.0.0.7:5", False, False, "10.0.0.7:5"),
        ("prefill-0.svc:5", False, False, "prefill-0.svc:5"),
    ],
)
def test_loopback_wildcard_and_dialable(
    text: str, loopback: bool, wildcard: bool, dial: str
) -> None:
    address = Address.parse(text)
    assert (address.is_loopback, address.is_wildcard) == (loopback, wildcard)
    assert str(address.dialable()) == dial
    assert address.dialable(port=7).port == 7


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("::1:5", "put IPv6 addresses in brackets"),
        ("[10.0.0.1]:5", "not an IPv6 address in brackets"),
        ("300.1.1.1:5", "not an IPv4 address"),
        ("host:70000", "port in 0-65535"),
        ("host", "HOST:PORT"),
        ("ho st:5", "HOST:PORT"),
        (":5", "HOST:PORT"),
    ],
)
def test_bad_addresses_say_what_is_wrong(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Address.parse(text)
