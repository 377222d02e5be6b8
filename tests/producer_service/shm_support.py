"""Lending a shared buffer to a test producer's shm socket, for Parks by reference."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvpark.shm import PARK_ROLE, SharedBuffer, ShmLender

PAGE = 256 * 1024


@asynccontextmanager
async def lent(shm_socket: str, pages: int) -> AsyncIterator[tuple[SharedBuffer, str]]:
    """A shared buffer of `pages` pages lent to the producer for Park: (buffer, lend id)."""
    buffer = SharedBuffer(pages * PAGE)
    lender = ShmLender(shm_socket, None, 5.0)
    try:
        await asyncio.to_thread(lender.connect)
        yield buffer, await asyncio.to_thread(lender.lend, buffer, PARK_ROLE)
    finally:
        lender.close()
        buffer.close()
