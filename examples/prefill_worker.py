"""Demo prefill worker: runs the reference model on the demo's prompts and parks their KV.

For each request it prefills the prompt with examples/reference_model.py into a block-major
float16 cache and parks the KV with `KVParker`, chunk c being token positions [64c, 64c + 64)
of every layer, K and V (`kvpark.layout`, docs/kv-layout.md).

The cache lives in shared memory (`SharedKV`): a buffer from `parker.shared_buffer`, which the
parker lends the producer over its shm socket the first time a park uses it. A park then names
each chunk by its offset in that buffer and the producer copies it from there into its pool:
the KV never travels as gRPC payload. That needs the producer's socket (in the compose demo a
volume the two containers share, in Kubernetes an emptyDir of the pod); where it cannot be
reached, the same chunks go inline over the gRPC stream, and each park's `transport` says which
way it went.

- ``on-time``: streamed while the prefill runs. Chunk c is parked as soon as the model
  finished it (the model's `on_chunk` hook), by a worker thread, while chunk c + 1 is computed.
  Each chunk is a batch of its own that declares the prompt's chunk count, visible once its
  commit arrives; the decode worker waits until all of them are.
- ``partial``: the first half of the chunks is committed in one batch that declares the
  prompt's chunk count; the batch with the second half is then cut off, as if the prefill
  worker had been preempted. The producer undoes a batch that ends without its commit, so only
  the first half is ever visible, and the decode worker loads that prefix and recomputes the
  rest.
- ``late`` and ``queued``: prefilled, then parked in one `park()` call.

A prefill worker is a long-running service, so after parking this one waits until it is
stopped (SIGTERM/SIGINT) and exits 0. `DEMO_EXIT_AFTER_PARK=true` makes it exit right away
instead (one-shot runs in tests). With `DEMO_EXPECT_TRANSPORT` set, a park that took another
transport makes it exit 1 at once (in the compose demo that stops the stack, and `up` fails).
Settings: see demo_common.py. examples/park_with_stubs.py parks with nothing but the generated
stubs, as a client in another language would.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
from demo_common import (
    Settings,
    demo_model,
    kv_fingerprint,
    offered_transports,
    partial_prefix,
    prompt,
    request_ids,
)
from reference_model import ReferenceModel

from kvpark import KVParker, ParkResult, ProducerInfo, Timeout, TransportError
from kvpark.layout import KVLayout

CONNECT_TIMEOUT_S = 30.0
PARK_TIMEOUT_S = 30.0


class Preempted(Exception):
    """Stands in for whatever stops a prefill worker half-way (preemption, OOM, a crash)."""


def say(text: str) -> None:
    print(f"prefill-worker: {text}", flush=True)


def connect(parker: KVParker) -> ProducerInfo:
    # Compose starts us once the producer is healthy, but a restart may race.
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return parker.server_info(timeout=2.0)
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class SharedKV:
    """One request's block-major KV cache in a shared buffer, cut so that every chunk is one
    contiguous range of that buffer: what a park by reference needs.

    Chunk c of a block-major cache is block c, one range, when it is full. A partial last
    chunk is 2·L runs of its block (the head of each layer's K and V rows), so `chunk` packs
    it once, in the canonical order, into a chunk-sized area behind the cache in the same
    buffer; it then parks by reference like the others. (A chunk given as several buffers
    would make the parker copy the whole park into a staging buffer first.)

    The demo makes one buffer per request and keeps it until the parker closes; an engine
    would keep its whole KV cache in a few such buffers for its lifetime.
    """

    def __init__(self, parker: KVParker, layout: KVLayout, num_tokens: int) -> None:
        self.layout = layout
        shape = (layout.num_chunks(num_tokens), *layout.block_shape)
        cache_nbytes = int(np.prod(shape)) * layout.dtype.itemsize
        if hasattr(os, "memfd_create"):
            memory = parker.shared_buffer(cache_nbytes + layout.full_chunk_nbytes)
        else:  # not Linux: no shared memory, the parks go inline over gRPC
            memory = np.zeros(cache_nbytes + layout.full_chunk_nbytes, dtype=np.uint8)
        # A fresh memfd reads as zeros, like the zeroed cache the model expects.
        self.cache = memory[:cache_nbytes].view(layout.dtype).reshape(shape)
        self._packed = memory[cache_nbytes:]
        self.kv = layout.block_major(self.cache, num_tokens)

    def chunk(self, chunk_id: int) -> memoryview:
        """Chunk `chunk_id` as one range of the shared buffer (packing a partial one)."""
        parts = self.layout.chunk_parts(self.kv, chunk_id)
        if len(parts) == 1:
            return parts[0]
        pos = 0
        for part in parts:
            self._packed[pos : pos + len(part)] = np.frombuffer(part, dtype=np.uint8)
            pos += len(part)
        return self._packed[:pos].data

    def chunks(self, chunk_ids: range) -> dict[int, memoryview]:
        return {c: self.chunk(c) for c in chunk_ids}


def park_streamed(
    parker: KVParker, model: ReferenceModel, kid: str, tokens: npt.NDArray[np.int64]
) -> list[ParkResult]:
    """Prefills and parks at once: each chunk leaves while the next one is computed."""
    kv = SharedKV(parker, model.layout, len(tokens))
    total = model.layout.num_chunks(len(tokens))
    named = kv_fingerprint(model, tokens)
    parks: list[Future[ParkResult]] = []
    # One sender thread: chunks are parked in order, and the model (numpy releases the GIL in
    # its matrix products) computes the next chunk meanwhile.
    with ThreadPoolExecutor(1, thread_name_prefix="park") as sender:

        def on_chunk(chunk_id: int) -> None:
            # The chunk is final in the cache (later steps never write it again), so the
            # producer may copy it while the model goes on.
            chunk = {chunk_id: kv.chunk(chunk_id)}
            parks.append(
                sender.submit(parker.park, kid, chunk, total_chunks=total, fingerprint=named)
            )

        model.prefill(tokens, kv.cache, on_chunk=on_chunk)
        return [park.result() for park in parks]


def park_prefix_then_preempted(
    parker: KVParker, model: ReferenceModel, kid: str, tokens: npt.NDArray[np.int64]
) -> list[ParkResult]:
    """Commits the first half of the chunks; the batch with the rest is cut off."""
    layout = model.layout
    kv = SharedKV(parker, layout, len(tokens))
    model.prefill(tokens, kv.cache)
    total = layout.num_chunks(len(tokens))
    prefix = partial_prefix(total)
    # total_chunks tells the producer (and a Lookup) how many chunks the id will have.
    named = kv_fingerprint(model, tokens)
    first = parker.park(kid, kv.chunks(range(prefix)), total_chunks=total, fingerprint=named)
    if not first.ok:
        return [first]
    try:
        # A streamed batch (`parker.batch`) sends each chunk as it is put: one in the parker's
        # shared buffer (the chunks here, on Linux) goes by reference, the producer copying it
        # from that buffer; any other goes inline over the gRPC stream.
        with parker.batch(kid, total_chunks=total, fingerprint=named) as rest:
            rest.put(prefix, kv.chunk(prefix))
            # An exception inside the block: no commit is sent, the call is cancelled, and the
            # producer drops what this batch sent.
            raise Preempted(f"preempted after sending chunk {prefix} of {total}")
    except Preempted:
        pass
    return [first]


def park_whole(
    parker: KVParker, model: ReferenceModel, kid: str, tokens: npt.NDArray[np.int64]
) -> list[ParkResult]:
    """Prefills, then parks every chunk in one call."""
    layout = model.layout
    kv = SharedKV(parker, layout, len(tokens))
    model.prefill(tokens, kv.cache)
    chunks = kv.chunks(range(layout.num_chunks(len(tokens))))
    return [parker.park(kid, chunks, fingerprint=kv_fingerprint(model, tokens))]


Park = Callable[[KVParker, ReferenceModel, str, npt.NDArray[np.int64]], list[ParkResult]]


PARK: dict[str, tuple[Park, str]] = {
    "on-time": (park_streamed, "streamed chunk by chunk during its prefill"),
    "partial": (park_prefix_then_preempted, "the batch with the rest was cut off and undone"),
    "late": (park_whole, "parked after its prefill"),
    "queued": (park_whole, "parked after its prefill"),
}


def main() -> int:
    settings = Settings.from_env()
    stop = threading.Event()
    # PID 1 in a container gets no default signal handling: without these, `docker stop`
    # would wait out its grace period and then SIGKILL.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    model = demo_model()
    layout = model.layout
    with KVParker(
        settings.target,
        timeout=Timeout(total_s=PARK_TIMEOUT_S),
        token=settings.park_token,
        credentials=settings.credentials(),
        # Park goes over shared memory or the gRPC stream, never tcp.
        transport="auto" if settings.transport == "tcp" else settings.transport,
        shm_socket=settings.shm_socket,
    ) as parker:
        info = connect(parker)
        say(
            f"producer {settings.target} epoch {info.producer_epoch:016x}, "
            f"lease {info.unbound_store_timeout_s:g}s, offers {offered_transports(info)}"
        )
        for name, kid in request_ids(info.producer_epoch).items():
            tokens = prompt(name, model.config.vocab_size)
            park, how = PARK[name]
            started = time.perf_counter()
            results = park(parker, model, kid, tokens)
            took = time.perf_counter() - started
            failed = [r for r in results if not r.ok]
            if failed:
                say(f"park {kid} failed: {failed[0].reason} {failed[0].detail}")
                return 1
            result = results[-1]  # the id's totals after its last batch
            via = sorted({r.transport for r in results})
            total = layout.num_chunks(len(tokens))
            say(
                f"parked {name:8s} {kid}: {result.chunks_parked} of {total} chunks "
                f"({len(tokens)} tokens, {result.bytes_parked / 1024:.1f} KiB) via "
                f"{'+'.join(via)} in {len(results)} park{'s' if len(results) > 1 else ''}, "
                f"{how}, {took * 1000:.0f} ms (lease {result.lease_remaining_s:.1f}s)"
            )
            expected = settings.expect_transport
            if expected is not None and via != [expected]:
                say(
                    f"UNEXPECTED: {name} was parked via {'+'.join(via)}, not {expected} "
                    "(DEMO_EXPECT_TRANSPORT)"
                )
                return 1
    if os.environ.get("DEMO_EXIT_AFTER_PARK", "").lower() in ("1", "true", "yes"):
        return 0
    say("done parking; idle until stopped")
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
