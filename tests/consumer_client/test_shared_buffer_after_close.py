"""`shared_buffer` on a closed client raises ClientClosedError: a client's close ends the
shared buffers it made, and one made afterwards would be ended by nothing but the garbage
collector (a memfd and its memory held until then)."""

from __future__ import annotations

import pytest

from kvpark import AsyncKVConsumer, AsyncKVParker, ClientClosedError, KVConsumer, KVParker


@pytest.mark.parametrize("client_type", [KVConsumer, KVParker])
def test_a_closed_sync_client_makes_no_shared_buffer(client_type: type) -> None:
    client = client_type("127.0.0.1:1")
    client.shared_buffer(4096)  # open: made, and closed with the client
    client.close()
    with pytest.raises(ClientClosedError):
        client.shared_buffer(4096)


@pytest.mark.parametrize("client_type", [AsyncKVConsumer, AsyncKVParker])
async def test_a_closed_async_client_makes_no_shared_buffer(client_type: type) -> None:
    client = client_type("127.0.0.1:1")
    client.shared_buffer(4096)
    await client.aclose()
    with pytest.raises(ClientClosedError):
        client.shared_buffer(4096)
