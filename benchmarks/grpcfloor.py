"""The gRPC floor: what grpcio itself reaches on this machine, with no kvpark code in the path.

kvpark's fetch is built on grpcio, so raw TCP alone does not say how much of the gap is kvpark's
and how much the transport's. The floor is the same transfer with everything of kvpark taken
out: a helper process (`python -m benchmarks.grpcfloor PATTERN_BYTES`, the allocator environment
of every helper) runs a minimal `grpc.aio` server — one generic service, identity
(de)serializers, no protobuf, no framing, no CRC, no pool — and this process receives with a
sync channel configured like a `KVConsumer`'s, copying each message into a preallocated numpy
array as the fetch does. Methods of the service, requests and answers are plain bytes:

    Prepare  unary         "WINDOW NBYTES CHUNK": cuts that window of the benchmark pattern
                           (data.window, the same bytes the raw-TCP step moves) into `bytes`
                           messages of CHUNK bytes, kept until the next Prepare; answers their
                           count. Not timed: a producer holds its chunks before a fetch, too.
    Stream   unary-stream  the prepared request again: streams the prepared messages as they
                           are (no per-send copy in Python); any other request is refused.
    Late     unary-stream  exactly one small message, the server's `time.time()` at handler
                           entry: the late call of acceptfloor.py.
    Exchange unary-stream  two small messages, the shape of a TCP fetch's call (its DataOffer,
                           then its TransferDone): the per-call cost of callfloor.py.
    Session  stream-stream the same two messages for every request of one long call: what a
                           load would cost as one exchange on a call kept open (callfloor.py).

The server process prints `{"port": N}` when it listens and stops when its stdin closes.
`FloorClient.load` has the shape of clients.Loader (the prepared request stands for the id), so
transfer.py's byte checks and threaded batch apply to it unchanged.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from . import data
from .clients import Loaded
from .helper import JsonLineChild

SERVICE = "benchfloor.Floor"
PREPARE = f"/{SERVICE}/Prepare"
STREAM = f"/{SERVICE}/Stream"
LATE = f"/{SERVICE}/Late"
EXCHANGE = f"/{SERVICE}/Exchange"
SESSION = f"/{SERVICE}/Session"
# A fetch's DataOffer and TransferDone, as Exchange and Session answer each request.
OFFER, DONE = b"offer", b"done"
# Bounds the helper's start-up: it builds its copy of the pattern (about 2 s for 580 MB here).
READY_TIMEOUT_S = 60.0
# Cutting 580 MB into messages takes well under a second; this only bounds a server that hangs.
PREPARE_TIMEOUT_S = 120.0


def request_for(window_no: int, nbytes: int, chunk: int) -> str:
    """The request naming one window of the pattern cut into `chunk`-byte messages."""
    return f"{window_no} {nbytes} {chunk}"


# ============================================================================== server side
class _Floor:
    """The server's state: its copy of the pattern and the one prepared message set (replaced
    by each Prepare; a Stream already running keeps the list it started with)."""

    def __init__(self, source: data.U8) -> None:
        self._source = source
        self._prepared = b""
        self._messages: list[bytes] = []

    async def prepare(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        window_no, nbytes, chunk = (int(word) for word in request.split())
        self._messages = []  # drop the previous set first: its memory is reused for this one
        view = memoryview(data.window(self._source, window_no, nbytes))  # type: ignore[arg-type]
        self._messages = [bytes(view[i : i + chunk]) for i in range(0, nbytes, chunk)]
        self._prepared = request
        return str(len(self._messages)).encode()

    async def stream(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        if request != self._prepared:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{request!r} was not prepared (prepared: {self._prepared!r})",
            )
        for message in self._messages:
            yield message

    async def late(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield repr(time.time()).encode()

    async def exchange(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield OFFER
        yield DONE

    async def session(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield OFFER
            yield DONE

    def handler(self) -> grpc.GenericRpcHandler:
        # No (de)serializers: requests and messages are bytes as they are.
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Prepare": grpc.unary_unary_rpc_method_handler(self.prepare),
                "Stream": grpc.unary_stream_rpc_method_handler(self.stream),
                "Late": grpc.unary_stream_rpc_method_handler(self.late),
                "Exchange": grpc.unary_stream_rpc_method_handler(self.exchange),
                "Session": grpc.stream_stream_rpc_method_handler(self.session),
            },
        )


async def _serve(source: data.U8) -> None:
    floor = _Floor(source)
    server = grpc.aio.server()  # grpcio's defaults: the floor is what grpcio does by itself
    server.add_generic_rpc_handlers((floor.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    # The parent closes our stdin to stop us (helper.JsonLineChild.close); until then, serve.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(grace=1.0)


def serve_main(argv: Sequence[str]) -> int:
    asyncio.run(_serve(data.pattern(int(argv[0]))))
    return 0


class FloorServer:
    """The floor's server process, owned by this object. It starts at once and builds its
    pattern in the background; `ready()` waits for it to listen."""

    def __init__(self, pattern_bytes: int) -> None:
        self._child = JsonLineChild("grpcfloor", [str(pattern_bytes)])
        self._target: str | None = None

    @property
    def pid(self) -> int:
        return self._child.pid

    def ready(self) -> str:
        """The server's address, once it listens."""
        if self._target is None:
            port = self._child.answer(READY_TIMEOUT_S)["port"]
            self._target = f"127.0.0.1:{port}"
        return self._target

    def close(self) -> None:
        self._child.close()


# ============================================================================== client side
def consumer_channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """The options a `KVConsumer` opens its channel with by default — the floor must not
    differ from the product in transport settings — with its receive limit raised for
    `max_message_bytes`, as the client raises it after ServerInfo."""
    from kvpark.client._channel import ChannelSettings  # where the clients' options live

    settings = ChannelSettings.build(
        "floor",
        token=None,
        credentials=None,
        channel_options=(),
        interceptors=(),
        max_chunk_bytes=max_message_bytes,
    )
    return list(settings.options)


class FloorClient:
    """Receives the floor's streams on one sync channel (threads may share it)."""

    name = "bare grpcio (sync channel, KVConsumer's options)"

    def __init__(self, target: str, max_message_bytes: int) -> None:
        self._channel = grpc.insecure_channel(
            target, options=consumer_channel_options(max_message_bytes)
        )
        # No (de)serializers: bytes in, bytes out.
        self._prepare = self._channel.unary_unary(PREPARE)
        self._stream = self._channel.unary_stream(STREAM)

    def prepare(self, window_no: int, nbytes: int, chunk: int) -> tuple[str, int]:
        """Has the server cut that window into messages; returns (request, message count)."""
        request = request_for(window_no, nbytes, chunk)
        count = int(self._prepare(request.encode(), timeout=PREPARE_TIMEOUT_S))
        return request, count

    def load(self, kid: str, num_chunks: int, into: data.U8, timeout: float) -> Loaded:
        """Streams the prepared request `kid` into `into`, message after message, as the
        fetch places its chunks. Timed from the call to the last message."""
        view = memoryview(into)  # type: ignore[arg-type]
        pos = count = 0
        started = time.perf_counter()
        try:
            for message in self._stream(kid.encode(), timeout=timeout):
                view[pos : pos + len(message)] = message
                pos += len(message)
                count += 1
        except grpc.RpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
            return Loaded(False, reason, count, pos, time.perf_counter() - started)
        seconds = time.perf_counter() - started
        ok = count == num_chunks
        return Loaded(ok, "" if ok else "message count", count, pos, seconds)

    def close(self) -> None:
        self._channel.close()


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
