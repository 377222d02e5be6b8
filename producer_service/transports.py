"""How a bound Fetch's bytes leave the producer: the three transports, one state machine.

The servicer asks the lot for ready chunks exactly as for the gRPC stream; only the last step
differs. `GrpcStream` writes each chunk as a message of the call. `TcpStream` writes batches of
frames to the consumer's data connection (kvpark.tcp_frames) from a worker thread, straight
from the pool's memoryviews. `ShmStream` copies batches from the pool into the buffer the
consumer lent (kvpark.producer.shm_lending) on a worker thread, then tells the consumer where
each chunk landed. Copies and socket writes release the GIL and run on the data threads
(data_threads.py), so the event loop keeps answering control calls while bytes move.

A batch is what the lot has ready at once: one thread hop per batch rather than per chunk.
For gRPC and shm, up to BATCH_BYTES and BATCH_CHUNKS. For TCP, every ready chunk up to
WHOLE_BATCH_CHUNKS (`whole_batches`): its write shares its thread by itself, giving way to
other jobs after SHARE_BYTES, so a TCP Fetch alone pays one hop rather than one per batch. A
batch's views stay valid while it is written: the lot frees a bound id's memory only when the
whole producer shuts down, and no other id's data goes there meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvpark import wire
from kvpark.pb import kvpark_pb2 as pb
from kvpark.tcp_frames import END_CHUNK_ID, FrameWriter

from .data_threads import DataThreads
from .lot import ReadyChunk

# Bytes handed to one worker-thread call. Each batch costs about 1 ms beyond its bytes (the
# thread hop, plus a ChunksPlaced write for shm), so 64 MiB fetches 12-14% faster than 16 MiB
# on tcp and shm (docs/performance.md); still small enough (~25 ms of copying or sending) that
# a cancel or a stall is noticed between batches.
BATCH_BYTES = 64 * 1024 * 1024
# A Fetch's first batch is smaller, so that its first chunks are placed (and a caller's
# on_chunk runs) after ~1 ms of copying rather than ~16 ms; each next batch is BATCH_GROWTH
# times larger, up to BATCH_BYTES: two batches more per Fetch than without the ramp.
FIRST_BATCH_BYTES = 4 * 1024 * 1024
BATCH_GROWTH = 4
# ... and at most this many chunks, so that the batch's ChunksPlaced (~20 bytes per chunk) stays
# far below any client's message limit (64 KiB above its max_chunk_bytes) however small the
# chunks: an id may hold as many chunks as the pool has pages.
BATCH_CHUNKS = 1024
# The most a TCP write sends while other jobs wait for a data thread, before it goes back in
# the queue behind them: a 64 MiB batch's worth, so they wait no longer than they would behind
# a batch of the other transports. Alone, it sends everything in one job: each hop back to the
# event loop and to a thread again took ~1 ms in which the socket drained, and a 580 MB fetch
# in one job ran 0.96x raw TCP where 64 MiB batches ran 0.80x (docs/performance.md).
SHARE_BYTES = BATCH_BYTES
# ... and a whole batch still stops at this many chunks: gathering it costs the event loop a
# lot call per chunk (~10 us), and an id may hold as many chunks as the pool has pages.
WHOLE_BATCH_CHUNKS = 16 * 1024
# How long a TCP write waits for room on a full socket before it gives its thread back: well
# above the pauses of a consumer that reads (so a transfer rarely leaves its thread), well
# below anything another transfer would notice waiting for a thread.
WRITE_PAUSE_S = 0.02
# Ends a transfer on a kept connection (kvpark.tcp_frames).
_END_FRAME: tuple[int, int, Sequence[memoryview]] = (END_CHUNK_ID, 0, ())


class Stalled(Exception):
    """The consumer took nothing for fetch_stall_timeout_s."""


class CutShort(Exception):
    """The batch stopped short because the producer is stopping (`Destination.cut_short`):
    `chunks` of it, from the first, reached the consumer whole."""

    def __init__(self, chunks: int) -> None:
        super().__init__(f"{chunks} chunks of the batch sent before it was cut short")
        self.chunks = chunks


class Destination(Protocol):
    transport: pb.Transport
    # True: a batch may be every ready chunk (the destination shares its thread by itself).
    whole_batches: bool
    # Chunk bytes handed to the consumer so far (written, placed), also of a batch cut off.
    sent_bytes: int

    async def send(self, chunks: Sequence[ReadyChunk], *, last: bool = False) -> None:
        """Sends a batch; `last`: no chunk of this Fetch follows it."""

    async def finish(self) -> None:
        """The Fetch ended (before its TransferDone): close or hand back what it used."""

    def close(self) -> None:
        """The Fetch is over, however it ended; idempotent."""

    def cut_short(self) -> None:
        """The shutdown grace is over: a batch being sent stops as soon as it safely can and
        its `send` raises CutShort, so that the Fetch's TransferDone goes out before the
        server cancels the call. A batch can take far longer than the server gives its calls
        to end (a whole id over TCP; 64 MiB over gRPC, to a consumer that reads slowly)."""


async def write_watched(
    context: Any, message: bytes, stall_s: float, on_stall: Callable[[], None]
) -> None:
    """Writes a message of the Fetch call. A write waits while the consumer's flow-control
    window is shut; one that reads nothing for stall_s loses its id (`on_stall`), so it does
    not stay bound for the life of the consumer's connection. The write itself is not
    cancelled: grpc core cannot take back a message it holds, and a cancelled send can leave
    the stream stuck. It ends when the consumer reads or its connection goes."""
    watchdog = asyncio.get_running_loop().call_later(stall_s, on_stall)
    try:
        await context.write(message)
    finally:
        watchdog.cancel()


class GrpcStream:
    """Chunks as messages of the Fetch call itself."""

    transport = pb.TRANSPORT_GRPC
    whole_batches = False

    def __init__(self, context: Any, stall_s: float, on_stall: Callable[[], None]) -> None:
        self._context = context
        self._stall_s = stall_s
        self._on_stall = on_stall
        self._cut_off = False
        self._cut_short = False
        self.sent_bytes = 0

    def _stalled(self) -> None:
        self._cut_off = True
        self._on_stall()

    async def send(self, chunks: Sequence[ReadyChunk], *, last: bool = False) -> None:
        for written, step in enumerate(chunks):
            if self._cut_off:
                # The watchdog gave the id back while an earlier write of this batch waited:
                # a Release and a new Park may since have put another id's bytes in these
                # pages, so not one more view of the batch is read.
                raise Stalled
            if self._cut_short:
                # Between two messages: a write cannot be taken back, so the one under way
                # when the grace ended went out whole, and the stream stays well formed.
                raise CutShort(written)
            frame = wire.encode_fetch_chunk(step.chunk_id, step.crc32c, step.views)
            await write_watched(self._context, frame, self._stall_s, self._stalled)
            self.sent_bytes += step.nbytes

    async def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    def cut_short(self) -> None:
        self._cut_short = True


class TcpStream:
    """Frames on the consumer's data connection, written from a worker thread.

    A thread writes only while the consumer makes room: once the socket has been full for
    WRITE_PAUSE_S, the thread gives up its turn and the event loop waits for the socket to
    take bytes again (or for the stall bound), then hands the rest of the batch to a thread
    again. So consumers that stop reading, however many, never hold the data threads that
    other fetches and shm parks need; a consumer that reads keeps a thread as long as it does.

    With `keep` (the consumer keeps its data connections), a Fetch that ends writes the end
    frame and hands the connection to `keep` (the data listener, which waits for the next
    ticket on it) instead of closing it. A Fetch cut off mid-frame (cancel, stall, a failed
    write, the end of the shutdown grace) always closes: only a connection at a frame boundary
    can carry another transfer.
    """

    transport = pb.TRANSPORT_TCP
    whole_batches = True

    def __init__(
        self,
        sock: socket.socket,
        stall_s: float,
        threads: DataThreads,
        keep: Callable[[socket.socket], None] | None = None,
    ) -> None:
        sock.settimeout(WRITE_PAUSE_S)
        self._sock = sock
        self._stall_s = stall_s
        self._threads = threads
        self._keep = keep
        self._handed_back = False
        self.sent_bytes = 0
        self._ended = False  # the end frame went out with the last batch
        # A write that did not finish (stall, cancel, error) may have stopped inside a frame:
        # the connection can then never carry an end frame or another transfer.
        self._broken = False
        self._cut_short = False
        # Set while a write waits for room on the full socket (`_writable`); `cut_short`
        # ends that wait.
        self._room: asyncio.Future[None] | None = None

    async def send(self, chunks: Sequence[ReadyChunk], *, last: bool = False) -> None:
        frames = [(c.chunk_id, c.crc32c, c.views) for c in chunks]
        # The end frame goes out with the last batch, in the same thread job: one hop fewer
        # per Fetch. It only marks the connection free again; the TransferDone still says how
        # the Fetch ended.
        end = last and self._keep is not None
        await self._write(FrameWriter([*frames, _END_FRAME] if end else frames))
        self._ended = end

    async def finish(self) -> None:
        if self._keep is None or self._broken or self._cut_short:
            self.close()
            return
        if not self._ended:  # the Fetch ended short of its last chunk (e.g. WAIT_TIMEOUT)
            try:
                await self._write(FrameWriter([_END_FRAME]))
            except (Stalled, CutShort, OSError):
                self.close()  # the consumer sees the connection end, not the end frame
                return
        self._handed_back = True
        self._keep(self._sock)

    async def _write(self, writer: FrameWriter) -> None:
        loop = asyncio.get_running_loop()
        progress_at, sent = loop.time(), 0
        self._broken = True  # until every frame of `writer` is out
        try:
            while not self._cut_short and not await self._threads.run(
                writer.write, self._sock, self._give_way, interrupt=self._interrupt
            ):
                if writer.sent_bytes > sent:
                    progress_at, sent = loop.time(), writer.sent_bytes
                if writer.gave_way:
                    continue  # back in the queue, behind the jobs that waited
                # The stall bound counts from the last byte the consumer took, not per attempt.
                left_s = progress_at + self._stall_s - loop.time()
                if left_s <= 0 or not await self._writable(loop, left_s):
                    raise Stalled
        except OSError:
            if not self._cut_short:
                raise
            # `cut_short` shut the socket down under the thread's send: expected.
        finally:
            self.sent_bytes += writer.payload_bytes
        if self._cut_short:
            raise CutShort(writer.frames_written)
        self._broken = False

    async def _writable(self, loop: asyncio.AbstractEventLoop, within_s: float) -> bool:
        """Whether the socket takes bytes again within `within_s` (waited on the event loop,
        no thread held)."""
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        fd = self._sock.fileno()
        loop.add_writer(fd, wake)
        self._room = ready
        try:
            async with asyncio.timeout(within_s):
                await ready
            return True
        except TimeoutError:
            return False
        finally:
            self._room = None
            loop.remove_writer(fd)

    def _give_way(self, sent: int) -> bool:
        return sent >= SHARE_BYTES and self._threads.waiting() > 0

    def _interrupt(self) -> None:
        """The Fetch was cancelled or cut short mid-write: a send blocked on a full socket
        fails at once instead of at the end of its pause, and the consumer sees the connection
        end."""
        with contextlib.suppress(OSError):
            # The plain socket's shutdown, also for TLS: ssl.SSLSocket.shutdown first drops
            # its SSL object, and a data thread's `send` in between would go out unencrypted.
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    def close(self) -> None:
        if not self._handed_back:
            self._sock.close()

    def cut_short(self) -> None:
        """Stops a write at once, mid-frame if need be: the consumer sees its data connection
        end, and the TransferDone on the call says why. A connection already handed back (at
        a frame boundary, to wait for its next ticket) is left alone."""
        self._cut_short = True
        if self._handed_back:
            return
        self._interrupt()  # a thread's send fails at once
        if self._room is not None and not self._room.done():
            self._room.set_result(None)  # a wait for room ends at once


class ShmStream:
    """Copies into the consumer's lent buffer, back to back from an offset, then one small
    ChunksPlaced message per batch on the call, naming where each chunk landed."""

    transport = pb.TRANSPORT_SHM
    whole_batches = False

    def __init__(
        self,
        context: Any,
        target: memoryview,
        *,
        limit: int,
        threads: DataThreads,
        stall_s: float,
        on_stall: Callable[[], None],
    ) -> None:
        self._context = context
        self._threads = threads
        self._stall_s = stall_s
        self._on_stall = on_stall
        # The lent range, as an array over the producer's mapping: while it lives the mapping
        # cannot be closed (an exported buffer), so `close` drops it.
        self._target: npt.NDArray[np.uint8] | None = np.frombuffer(target, dtype=np.uint8)
        self._pos = 0
        self._limit = limit
        self.sent_bytes = 0

    @property
    def room_left(self) -> int:
        """Bytes of the lent range no chunk has been placed in yet."""
        return self._limit - self._pos

    def fitting(self, chunks: Sequence[ReadyChunk]) -> int:
        """How many of `chunks`, from the first, fit in the rest of the lent range."""
        pos = self._pos
        for count, step in enumerate(chunks):
            pos += step.nbytes
            if pos > self._limit:
                return count
        return len(chunks)

    async def send(self, chunks: Sequence[ReadyChunk], *, last: bool = False) -> None:
        start = self._pos
        await self._threads.run(self._copy, chunks, start)
        placed = pb.ChunksPlaced()
        pos = start
        for step in chunks:
            placed.chunks.add(
                chunk_id=step.chunk_id, crc32c=step.crc32c, offset=pos, nbytes=step.nbytes
            )
            pos += step.nbytes
        message = pb.FetchResponse(placed=placed).SerializeToString()
        await write_watched(self._context, message, self._stall_s, self._on_stall)
        self.sent_bytes += pos - start
        self._pos = pos

    async def finish(self) -> None:
        pass

    def _copy(self, chunks: Sequence[ReadyChunk], pos: int) -> None:
        target = self._target
        assert target is not None, "copy after close"
        for step in chunks:
            for view in step.views:
                n = len(view)
                # numpy copies with the GIL released: the event loop runs meanwhile.
                np.copyto(target[pos : pos + n], np.frombuffer(view, dtype=np.uint8))
                pos += n

    def close(self) -> None:
        # A Fetch that ends with an error (OUT_OF_RANGE, a stall) leaves its frame, and so this
        # stream, alive in the traceback's reference cycle until the cyclic GC runs; the array
        # must not keep the lend's mapping (and its descriptor) open that long once the client
        # released the lend.
        self._target = None

    def cut_short(self) -> None:
        # Nothing to stop: a batch is one copy of at most BATCH_BYTES (tens of ms) and one
        # small message, over by itself long before the server cancels its calls.
        pass
