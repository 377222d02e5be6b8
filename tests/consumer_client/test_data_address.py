"""Where a DataOffer's address points: a bare ":PORT" names the host the client dials for the
gRPC call (IPv6 in brackets); a full address is taken as it is; one that points nowhere is a
ValueError saying why (the load then falls back to the gRPC stream and leaves TCP out for a
while). The answer is cached per (offer, target), so a cached success must not hide a
different target's answer."""

from __future__ import annotations

import pytest

from kvpark.address import Address
from kvpark.client._tcp import data_address


@pytest.mark.parametrize(
    ("offered", "target", "expected"),
    [
        (":7000", "10.0.0.5:50051", Address("10.0.0.5", 7000)),
        (":7000", "dns:///kvpark-0.kvpark:50051", Address("kvpark-0.kvpark", 7000)),
        (":7000", "[::1]:50051", Address("::1", 7000)),
        ("10.1.2.3:7001", "10.0.0.5:50051", Address("10.1.2.3", 7001)),
        ("[fd00::2]:7001", "10.0.0.5:50051", Address("fd00::2", 7001)),
    ],
)
def test_the_offer_names_a_port_or_a_whole_address(
    offered: str, target: str, expected: Address
) -> None:
    assert data_address(offered, target) == expected
    assert data_address(offered, target) == expected  # and again, from the cache


def test_a_port_alone_takes_the_host_of_each_target() -> None:
    assert data_address(":7000", "10.0.0.5:1").host == "10.0.0.5"
    assert data_address(":7000", "10.0.0.6:1").host == "10.0.0.6"


@pytest.mark.parametrize(
    ("offered", "target", "why"),
    [
        (":7000", "unix:/run/kvpark.sock", "cannot tell the producer's host"),
        ("kvpark-0", "10.0.0.5:50051", "bad data address 'kvpark-0'"),
        ("::1:7000", "10.0.0.5:50051", "bad data address '::1:7000'"),
    ],
)
def test_an_offer_that_points_nowhere_says_why(offered: str, target: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        data_address(offered, target)
