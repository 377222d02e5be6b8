"""Demo prefill worker: runs the reference model on the demo's prompts and parks their KV.

For each request it prefills the prompt with examples/reference_model.py into a block-major
float16 cache and parks the KV with `KVParker`, chunk c being token positions [64c, 64c + 64)
of every layer, K and V (`kvpark.layout`, docs/kv-layout.md). The chunks go out as views into
the cache (`layout.chunk_parts`: a gather list), never copied into a staging buffer first.

- ``on-time``: streamed while the prefill runs. `parker.batch` sends chunk c as soon as the
  model finished it (the model's `on_chunk` hook), while chunk c + 1 is computed; the batch is
  committed when the prefill is done, and only the commit makes it visible.
- ``partial``: the first half of the chunks is committed in one batch that declares the
  prompt's chunk count; the batch with the second half is then cut off, as if the prefill
  worker had been preempted. The producer undoes a batch that ends without its commit, so only
  the first half is ever visible, and the decode worker loads that prefix and recomputes the
  rest.
- ``late`` and ``queued``: prefilled, then parked in one `park()` call.

A prefill worker is a long-running service, so after parking this one waits until it is
stopped (SIGTERM/SIGINT) and exits 0. `DEMO_EXIT_AFTER_PARK=true` makes it exit right away
instead (one-shot runs in tests). Settings: see demo_common.py. examples/park_with_stubs.py
parks with nothing but the generated stubs, as a client in another language would.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import numpy.typing as npt
from demo_common import Settings, demo_model, partial_prefix, prompt, request_ids
from reference_model import ReferenceModel

from kvpark import KVParker, ParkResult, ProducerInfo, Timeout, TransportError

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


def park_streamed(
    parker: KVParker, model: ReferenceModel, kid: str, tokens: npt.NDArray[np.int64]
) -> ParkResult:
    """Prefills and parks at once: each chunk leaves while the next one is computed."""
    layout = model.layout
    cache = model.new_cache(len(tokens))
    kv = layout.block_major(cache, len(tokens))
    # Declaring the batch's size makes the producer reserve the pool before the first chunk
    # (or answer POOL_FULL before any compute is spent on sending).
    with parker.batch(
        kid,
        total_chunks=layout.num_chunks(len(tokens)),
        batch_bytes=layout.kv_nbytes(len(tokens)),
    ) as batch:
        # `put` returns False once the producer ended the batch (a refusal); the prefill
        # finishes anyway and `batch.result` says why.
        model.prefill(tokens, cache, on_chunk=lambda c: batch.put(c, layout.chunk_parts(kv, c)))
    assert batch.result is not None  # set by the clean exit's commit
    return batch.result


def park_prefix_then_preempted(
    parker: KVParker, model: ReferenceModel, kid: str, tokens: npt.NDArray[np.int64]
) -> ParkResult:
    """Commits the first half of the chunks; the batch with the rest is cut off."""
    layout = model.layout
    cache = model.new_cache(len(tokens))
    model.prefill(tokens, cache)
    kv = layout.block_major(cache, len(tokens))
    total = layout.num_chunks(len(tokens))
    prefix = partial_prefix(total)
    # total_chunks tells the producer (and a Lookup) how many chunks the id will have.
    first = parker.park(kid, layout.chunk_buffers(kv, range(prefix)), total_chunks=total)
    if not first.ok:
        return first
    try:
        with parker.batch(kid, total_chunks=total) as rest:
            rest.put(prefix, layout.chunk_parts(kv, prefix))
            # An exception inside the block: no commit is sent, the call is cancelled, and the
            # producer drops what this batch sent.
            raise Preempted(f"preempted after sending chunk {prefix} of {total}")
    except Preempted:
        pass
    return first


def park_whole(
    parker: KVParker, model: ReferenceModel, kid: str, tokens: npt.NDArray[np.int64]
) -> ParkResult:
    """Prefills, then parks every chunk in one call (one gather list per chunk)."""
    layout = model.layout
    cache = model.new_cache(len(tokens))
    model.prefill(tokens, cache)
    kv = layout.block_major(cache, len(tokens))
    return parker.park(kid, layout.chunk_buffers(kv, range(layout.num_chunks(len(tokens)))))


PARK = {
    "on-time": (park_streamed, "streamed during its prefill"),
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
    ) as parker:
        info = connect(parker)
        say(
            f"producer {settings.target} epoch {info.producer_epoch:016x}, "
            f"lease {info.unbound_store_timeout_s:g}s"
        )
        for name, kid in request_ids(info.producer_epoch).items():
            tokens = prompt(name, model.config.vocab_size)
            park, how = PARK[name]
            started = time.perf_counter()
            result = park(parker, model, kid, tokens)
            took = time.perf_counter() - started
            if not result.ok:
                say(f"park {kid} failed: {result.reason} {result.detail}")
                return 1
            total = layout.num_chunks(len(tokens))
            say(
                f"parked {name:8s} {kid}: {result.chunks_parked} of {total} chunks "
                f"({len(tokens)} tokens, {result.bytes_parked / 1024:.1f} KiB), {how}, "
                f"{took * 1000:.0f} ms (lease {result.lease_remaining_s:.1f}s)"
            )
    if os.environ.get("DEMO_EXIT_AFTER_PARK", "").lower() in ("1", "true", "yes"):
        return 0
    say("done parking; idle until stopped")
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
