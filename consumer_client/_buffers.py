"""Where a load's chunk payloads land: the caller's memory, or an array the result owns.

`into` takes one of four forms:

- nothing: the result owns a new array of exactly the loaded size;
- one writable buffer: chunks land back to back in the order they were requested, from byte 0
  (an engine whose chunks all have size S asking for 0..N-1 finds chunk k at k·S);
  `LoadResult.chunk_offsets` says where each landed either way;
- a sequence with one destination per requested chunk, in request order (a paged KV cache's
  blocks);
- a callable `(chunk_id, nbytes) -> destination`, asked once per chunk as it arrives.

A per-chunk destination is one writable buffer or a list of them, filled in order (a scatter
list: a chunk that is several pieces of a paged cache). Each byte is copied once, from the
received message into its place, after the chunk's CRC32C matched. A buffer is anything
writable and C-contiguous with the buffer protocol (numpy array of any dtype, bytearray,
memoryview, mmap) or an object numpy can view without copying (`__array_interface__`, e.g.
`tensor.numpy()` of a CPU tensor). A chunk that does not fit its destination, or does not fill
a destination of several buffers exactly, is misuse (the engine sized its cache for KV of
another shape or length): the Fetch is cancelled and `BufferTooSmallError` is raised.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import BufferTooSmallError, UsageError

ByteArray = npt.NDArray[np.uint8]
# One chunk's destination: a buffer, or a list of buffers filled in order.
ChunkDestination = Any
ChunkDestinationFn = Callable[[int, int], ChunkDestination]


def byte_view(into: Any, what: str = "into", *, writable: bool = True) -> ByteArray:
    """`into` as a flat uint8 array sharing its memory (writable unless told otherwise, for a
    buffer the library only reads); UsageError if impossible."""
    if isinstance(into, np.ndarray):
        array = into
    else:
        try:
            view = memoryview(into)
        except TypeError:
            if not hasattr(into, "__array_interface__"):
                expected = (
                    "a writable buffer (numpy array, bytearray, memoryview)"
                    if writable
                    else "a buffer (numpy array, bytes, bytearray, memoryview)"
                )
                got = type(into).__name__
                raise UsageError(f"{what}: expected {expected}, got {got}") from None
            array = np.asarray(into)
        else:
            if view.readonly and writable:
                raise UsageError(f"{what}: the {type(into).__name__} is read-only")
            if not view.c_contiguous:
                raise UsageError(f"{what}: the buffer is not C-contiguous")
            array = np.frombuffer(view.cast("B"), dtype=np.uint8)
    if array.dtype.hasobject:  # its bytes are pointers to Python objects, not data
        raise UsageError(f"{what}: an array of dtype {array.dtype} holds references, not bytes")
    if not array.flags.c_contiguous:
        raise UsageError(f"{what}: the array is not C-contiguous")
    if writable and not array.flags.writeable:
        raise UsageError(f"{what}: the array is read-only")
    flat: ByteArray = array.reshape(-1).view(np.uint8)
    return flat


def _parts(destination: ChunkDestination, what: str) -> list[memoryview]:
    """A per-chunk destination as writable byte views, in fill order."""
    if isinstance(destination, list | tuple):
        return [byte_view(d, f"{what}[{i}]").data for i, d in enumerate(destination)]
    return [byte_view(destination, what).data]


def _refuse_overlaps(checked: list[list[memoryview]]) -> None:
    """Refuses destinations that share memory (`[buffer] * n` is the usual slip): each chunk
    would overwrite the one before it, and the load would still verify every chunk as it
    landed and report success."""
    spans = sorted(
        (np.frombuffer(part, np.uint8).__array_interface__["data"][0], len(part), index)
        for index, parts in enumerate(checked)
        for part in parts
        if len(part)
    )
    for (start, size, first), (next_start, _, second) in itertools.pairwise(spans):
        if next_start < start + size:
            which = (
                f"parts of into[{first}]"
                if first == second
                else f"into[{first}] and into[{second}]"
            )
            raise UsageError(
                f"{which} share memory: each chunk needs memory of its own, or one chunk's "
                "bytes would overwrite another's"
            )


def _scatter(data: memoryview, parts: list[memoryview]) -> None:
    """Copies `data` across `parts` in order (the caller checked that it fits)."""
    pos = 0
    for part in parts:
        if pos >= len(data):
            break
        n = min(len(part), len(data) - pos)
        part[:n] = data[pos : pos + n]
        pos += n


class IntoBuffer:
    """The caller's one buffer: each chunk is copied straight to its place, back to back."""

    def __init__(self, into: Any) -> None:
        self._array = byte_view(into)
        if self._array.size == 0:
            raise UsageError("into: the buffer has no room (0 bytes)")
        self._view = self._array.data  # a writable 1-D byte memoryview
        self.capacity: int | None = self._array.size
        self.nbytes = 0

    @property
    def array_view(self) -> ByteArray:
        """The whole destination (for transports that can write into it directly)."""
        return self._array

    def parts_for(self, index: int, chunk_id: int, nbytes: int) -> list[memoryview]:
        """Where chunk `index` of `nbytes` goes: right after the previous one."""
        start = self.nbytes
        end = start + nbytes
        if end > self._array.size:
            raise BufferTooSmallError(
                f"into holds {self._array.size} bytes; chunk {chunk_id} needs bytes "
                f"{start}..{end} (chunks are placed back to back in request order)",
                needed=end,
                available=self._array.size,
                chunks_loaded=index,
                bytes_loaded=start,
            )
        return [self._view[start:end]]

    def landed(self, nbytes: int) -> None:
        self.nbytes += nbytes

    def place(self, data: memoryview, index: int, chunk_id: int) -> list[memoryview]:
        """Copies one verified payload after the previous one; returns where it landed."""
        (part,) = self.parts_for(index, chunk_id, len(data))
        part[:] = data  # the one copy
        self.landed(len(data))
        return [part]

    def array(self) -> ByteArray | None:
        return self._array[: self.nbytes]


class OwnedBuffer:
    """No `into`: keep the received payload views, copy them once into an exact-size array."""

    capacity: int | None = None

    def __init__(self) -> None:
        self._parts: list[memoryview] = []
        self.nbytes = 0

    def parts_for(self, index: int, chunk_id: int, nbytes: int) -> list[memoryview]:
        """A new buffer of the chunk's size (for transports that read into memory)."""
        return [memoryview(bytearray(nbytes))]

    def landed(self, nbytes: int) -> None:
        self.nbytes += nbytes

    def place(self, data: memoryview, index: int, chunk_id: int) -> list[memoryview]:
        self._parts.append(data)
        self.nbytes += len(data)
        return [data]

    def keep(self, parts: list[memoryview]) -> None:
        """Keeps a chunk read by `parts_for` (the payload views are ours already)."""
        self._parts.extend(parts)

    def array(self) -> ByteArray | None:
        out = np.empty(self.nbytes, dtype=np.uint8)
        view = out.data
        pos = 0
        for part in self._parts:
            view[pos : pos + len(part)] = part
            pos += len(part)
        self._parts.clear()  # let the received messages go
        return out


class ChunkBuffers:
    """One destination per chunk: from a sequence (by request order) or a callable (asked with
    the chunk id and its size). The result has no single array (`LoadResult.data` is None)."""

    def __init__(self, into: Sequence[ChunkDestination] | ChunkDestinationFn) -> None:
        self._sequence: Sequence[ChunkDestination] | None = None
        self._function: ChunkDestinationFn | None = None
        if callable(into):
            self._function = into
            self.capacity: int | None = None
        else:
            self._sequence = into
            if not into:
                raise UsageError("into: the sequence of chunk destinations is empty")
            # Checked now, so a bad entry is misuse before any byte moves.
            self._checked = [_parts(d, f"into[{i}]") for i, d in enumerate(into)]
            _refuse_overlaps(self._checked)
            self.capacity = sum(len(p) for parts in self._checked for p in parts)
        self.nbytes = 0

    def check_count(self, chunk_ids: Sequence[int] | None) -> None:
        """Refuses, before anything moves, a load of more chunks than the sequence has
        destinations: it could only end in BufferTooSmallError after the first ones landed."""
        sequence = self._sequence
        if sequence is not None and chunk_ids is not None and len(chunk_ids) > len(sequence):
            raise UsageError(
                f"into has {len(sequence)} chunk destinations for {len(chunk_ids)} chunks: "
                "one per chunk"
            )

    def parts_for(self, index: int, chunk_id: int, nbytes: int) -> list[memoryview]:
        """The chunk's destination, asked of the sequence or the callable: one buffer trimmed
        to `nbytes`, or several that `nbytes` fills exactly."""
        if self._function is not None:
            parts = _parts(self._function(chunk_id, nbytes), f"into({chunk_id}, {nbytes})")
        elif index < len(self._checked):
            parts = self._checked[index]
        else:
            raise BufferTooSmallError(
                f"into has {len(self._checked)} chunk destinations; chunk {chunk_id} is "
                f"number {index + 1}",
                needed=self.nbytes + nbytes,
                available=self.nbytes,
                chunks_loaded=index,
                bytes_loaded=self.nbytes,
            )
        room = sum(len(p) for p in parts)
        # Several parts are pieces of one chunk (each layer's K and V): a shorter chunk would
        # spill each piece's bytes into the one before it, so it must fill them exactly. One
        # buffer takes a chunk at its start, as the single-buffer form does.
        if room < nbytes or (len(parts) > 1 and room != nbytes):
            raise BufferTooSmallError(
                f"chunk {chunk_id} is {nbytes} bytes; its destination holds {room}"
                + ("" if room < nbytes else f" in {len(parts)} parts, which it must fill"),
                needed=nbytes,
                available=room,
                chunks_loaded=index,
                bytes_loaded=self.nbytes,
            )
        trimmed, left = [], nbytes
        for part in parts:
            if left <= 0:
                break
            trimmed.append(part[: min(len(part), left)])
            left -= len(trimmed[-1])
        return trimmed

    def landed(self, nbytes: int) -> None:
        self.nbytes += nbytes

    def place(self, data: memoryview, index: int, chunk_id: int) -> list[memoryview]:
        """Scatters one verified payload over its chunk's destination; returns the pieces."""
        parts = self.parts_for(index, chunk_id, len(data))
        _scatter(data, parts)  # the one copy
        self.landed(len(data))
        return parts

    def array(self) -> ByteArray | None:
        return None


Destination = IntoBuffer | OwnedBuffer | ChunkBuffers


def destination_for(into: Any) -> Destination:
    if into is None:
        return OwnedBuffer()
    if callable(into) or isinstance(into, list | tuple):
        return ChunkBuffers(into)
    return IntoBuffer(into)
