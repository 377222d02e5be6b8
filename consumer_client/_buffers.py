"""Where a load's chunk payloads land: the caller's buffer, or one the result owns.

Layout rule (one rule, no per-chunk offsets to get wrong): chunks land back to back in the
order they were requested, starting at byte 0 of the destination. An engine whose chunks all
have the same size S asking for 0..N-1 thus finds chunk k at k·S. `LoadResult.chunk_offsets`
reports where each chunk landed either way.

`into` may be anything writable and C-contiguous with the buffer protocol (numpy array of any
dtype, bytearray, memoryview, mmap) or an object numpy can view without copying
(`__array_interface__`, e.g. `tensor.numpy()` of a CPU tensor). It is viewed as raw bytes; its
size bounds the load. A chunk that would run past its end is misuse (the engine sized the
buffer for KV of another shape): the Fetch is cancelled and `BufferTooSmallError` is raised.
(The producer streams eagerly and counts an id consumed once it has sent every chunk, so
whether the id survives for a retry depends on whether the cancel overtook the stream.)

Copies (performance-notes.md, lever 2): gRPC hands us each message as one `bytes` object;
`kvpark.wire` parses it into a memoryview of the payload without copying; the CRC32C is checked
on that view; then the payload is copied exactly once, by one memcpy, into `into`. Without
`into`, the received messages are kept (no copy) until the end and then copied once into a new
array of the exact total size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import BufferTooSmallError, UsageError

ByteArray = npt.NDArray[np.uint8]


def byte_view(into: Any) -> ByteArray:
    """`into` as a flat, writable uint8 array sharing its memory; UsageError if impossible."""
    if isinstance(into, np.ndarray):
        array = into
    else:
        try:
            view = memoryview(into)
        except TypeError:
            if not hasattr(into, "__array_interface__"):
                raise UsageError(
                    f"into: expected a writable buffer (numpy array, bytearray, memoryview), "
                    f"got {type(into).__name__}"
                ) from None
            array = np.asarray(into)
        else:
            if view.readonly:
                raise UsageError(f"into: the {type(into).__name__} is read-only")
            if not view.c_contiguous:
                raise UsageError("into: the buffer is not C-contiguous")
            array = np.frombuffer(view.cast("B"), dtype=np.uint8)
    if not array.flags.c_contiguous:
        raise UsageError("into: the array is not C-contiguous")
    if not array.flags.writeable:
        raise UsageError("into: the array is read-only")
    flat: ByteArray = array.reshape(-1).view(np.uint8)
    if flat.size == 0:
        raise UsageError("into: the buffer has no room (0 bytes)")
    return flat


class IntoBuffer:
    """The caller's buffer: each chunk is copied straight to its place, once."""

    def __init__(self, into: Any) -> None:
        self._array = byte_view(into)
        self._view = self._array.data  # a writable 1-D byte memoryview
        self.capacity: int | None = self._array.size
        self.nbytes = 0

    def place(self, data: memoryview, chunks_loaded: int) -> memoryview:
        """Copies one verified payload after the previous one; returns where it landed."""
        start = self.nbytes
        end = start + len(data)
        if end > self._array.size:
            raise BufferTooSmallError(
                f"into holds {self._array.size} bytes; chunk {chunks_loaded} needs bytes "
                f"{start}..{end} (chunks are placed back to back in request order)",
                needed=end,
                available=self._array.size,
                chunks_loaded=chunks_loaded,
                bytes_loaded=start,
            )
        self._view[start:end] = data  # the one copy
        self.nbytes = end
        return self._view[start:end]

    def array(self) -> ByteArray:
        return self._array[: self.nbytes]


class OwnedBuffer:
    """No `into`: keep the received payload views, copy them once into an exact-size array."""

    capacity: int | None = None

    def __init__(self) -> None:
        self._parts: list[memoryview] = []
        self.nbytes = 0

    def place(self, data: memoryview, chunks_loaded: int) -> memoryview:
        self._parts.append(data)
        self.nbytes += len(data)
        return data

    def array(self) -> ByteArray:
        out = np.empty(self.nbytes, dtype=np.uint8)
        view = out.data
        pos = 0
        for part in self._parts:
            view[pos : pos + len(part)] = part
            pos += len(part)
        self._parts.clear()  # let the received messages go
        return out


Destination = IntoBuffer | OwnedBuffer


def destination_for(into: Any) -> Destination:
    return OwnedBuffer() if into is None else IntoBuffer(into)
