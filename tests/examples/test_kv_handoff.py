"""Real KV through a real producer: a prefill's cache parked, a prefix loaded, the rest
recomputed, and the result bitwise a local full prefill.

The reference model (examples/reference_model.py) prefills a prompt into a block-major float16
cache; its chunks are parked with `KVParker` as gather lists of views into that cache
(`layout.chunk_buffers`), and loaded by `KVConsumer` straight into another cache's blocks
(`layout.destination`, a scatter list for a partial last chunk). For every split point k the
producer holds only chunks 0..k-1 of the prompt's n: the load streams those, then ends
WAIT_TIMEOUT on chunk k (or succeeds when k = n), and the model prefills from chunk k. The KV
and the greedily generated tokens must equal a local full prefill's bit for bit.

Fresh caches are filled with a NaN sentinel (0x7E7E as float16): a chunk the model computed
from, but that was never written, would turn its KV into NaNs and break the equality, and the
corruption tests assert that a chunk whose CRC32C failed is still all sentinel when the model
takes over.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from conftest import (
    ROOT,
    ProducerProcess,
    example,
    process_producer,
    wait_for,
)

from kvpark import KVConsumer, KVParker, LoadPath, Reason, State

pytestmark = pytest.mark.timeout(120)

GENERATED = 6
# How long a load waits for a chunk the producer does not have: the missing tail of a split.
CHUNK_WAIT_S = 0.1
SENTINEL = 0x7E  # every byte; 0x7E7E is a float16 NaN
FETCH_METHOD = "/kvpark.v1.KVProducer/Fetch"


reference_model = example("reference_model")
park_with_stubs = example("park_with_stubs")


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProducerProcess]:
    with process_producer(tmp_path_factory.mktemp("producer")) as p:
        yield p


@pytest.fixture(scope="module")
def model() -> Any:
    return reference_model.ReferenceModel(seed=11)


def new_id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:12]}"


def sentinel_cache(model: Any, num_tokens: int) -> npt.NDArray[np.float16]:
    cache: npt.NDArray[np.float16] = model.new_cache(num_tokens)
    cache.view(np.uint8).fill(SENTINEL)
    return cache


def chunk_bytes(layout: Any, cache: Any, chunk: int) -> bytes:
    return b"".join(bytes(part) for part in layout.chunk_parts(cache, chunk))


def kv_bytes(model: Any, cache: npt.NDArray[Any], num_tokens: int) -> bytes:
    """Every position 0..num_tokens-1 of a cache, in the canonical order."""
    layout = model.layout
    kv = layout.block_major(cache, num_tokens)
    return b"".join(chunk_bytes(layout, kv, c) for c in range(layout.num_chunks(num_tokens)))


def untouched(layout: Any, cache: Any, chunk: int) -> bool:
    return all(set(bytes(part)) == {SENTINEL} for part in layout.chunk_parts(cache, chunk))


def full_prefill(model: Any, length: int, seed: int) -> tuple[Any, npt.NDArray[Any], list[int]]:
    """A prompt, its cache after a local full prefill + decoding, and the generated tokens."""
    prompt = np.random.default_rng(seed).integers(0, model.config.vocab_size, length)
    cache = model.new_cache(length + GENERATED - 1)
    tokens = model.generate(prompt, cache, GENERATED)
    return prompt, cache, tokens


@pytest.mark.parametrize("length", [130, 256, 500])
def test_loaded_prefix_plus_recompute_is_a_full_prefill_at_every_split(
    producer: ProducerProcess, model: Any, length: int
) -> None:
    layout = model.layout
    prompt, full, expected_tokens = full_prefill(model, length, seed=length)
    n = layout.num_chunks(length)
    capacity = length + GENERATED - 1
    source = layout.block_major(full, length)
    expected_kv = kv_bytes(model, full, capacity)

    with (
        KVParker(producer.target, timeout=10) as parker,
        KVConsumer(producer.target, timeout=10) as consumer,
    ):
        for k in range(n + 1):
            kid = new_id(f"split-{length}-{k}")
            if k:  # the producer has the first k chunks of n
                parked = parker.park(kid, layout.chunk_buffers(source, range(k)), total_chunks=n)
                assert parked.ok and parked.chunks_parked == k, parked
            cache = sentinel_cache(model, capacity)
            target = layout.block_major(cache, length)

            def prefill_from(first: int, cache: Any = cache, target: Any = target) -> list[int]:
                # What the model is handed: the loaded prefix, intact, and nothing past it.
                for c in range(n):
                    if c < first:
                        assert chunk_bytes(layout, target, c) == chunk_bytes(layout, source, c)
                    else:
                        assert untouched(layout, target, c), f"chunk {c} was written"
                tokens: list[int] = model.generate(prompt, cache, GENERATED, start_chunk=first)
                return tokens

            report = consumer.load_or_recompute(
                kid,
                num_chunks=n,
                into=layout.destination(target),
                wait_timeout_s=CHUNK_WAIT_S,
                recompute=prefill_from,
            )
            result = report.result
            assert result.chunks_loaded == k, (k, result)
            assert result.bytes == sum(layout.chunk_nbytes(c, length) for c in range(k))
            if k == n:
                assert report.path is LoadPath.REMOTE and report.recomputed_from is None
                tokens = prefill_from(n)  # the first token's logits: the last chunk once more
            else:
                assert report.path is (LoadPath.PARTIAL if k else LoadPath.RECOMPUTE), result
                assert report.reason is Reason.WAIT_TIMEOUT, result
                assert report.recomputed_from == k
                tokens = report.recompute_value
            assert tokens == expected_tokens, f"tokens differ after loading {k} of {n}"
            assert kv_bytes(model, cache, capacity) == expected_kv, f"KV differs, k={k}"


def test_chunks_parked_while_the_prefill_runs(producer: ProducerProcess, model: Any) -> None:
    """`parker.batch` sends chunk c from the model's on_chunk hook while c + 1 is computed."""
    layout = model.layout
    length = 333
    prompt, full, expected_tokens = full_prefill(model, length, seed=3)
    n = layout.num_chunks(length)
    kid = new_id("streamed")
    cache = model.new_cache(length)
    kv = layout.block_major(cache, length)
    sent: list[int] = []

    def park_chunk(c: int) -> None:
        assert batch.put(c, layout.chunk_parts(kv, c))
        sent.append(c)

    with KVParker(producer.target, timeout=10) as parker:
        with parker.batch(kid, total_chunks=n, batch_bytes=layout.kv_nbytes(length)) as batch:
            model.prefill(prompt, cache, on_chunk=park_chunk)
    assert sent == list(range(n))
    assert batch.result is not None and batch.result.ok, batch.result
    assert batch.result.chunks_parked == n

    loaded = sentinel_cache(model, length + GENERATED - 1)
    with KVConsumer(producer.target, timeout=10) as consumer:
        result = consumer.load(
            kid, num_chunks=n, into=layout.destination(layout.block_major(loaded, length))
        )
    assert result.ok and result.path is LoadPath.REMOTE, result
    assert model.generate(prompt, loaded, GENERATED, start_chunk=n) == expected_tokens
    assert kv_bytes(model, loaded, length + GENERATED - 1) == kv_bytes(
        model, full, length + GENERATED - 1
    )


def test_paged_caches_on_both_sides(producer: ProducerProcess, model: Any) -> None:
    """Parked from one paged cache (gather lists of 2·L runs), a prefix loaded into another
    paged cache with other blocks (`chunk_buffers`: scatter lists), then resumed."""
    layout, cfg = model.layout, model.config
    length = 300
    prompt, full, expected_tokens = full_prefill(model, length, seed=5)
    n = layout.num_chunks(length)
    source = layout.block_major(full, length)

    def paged(table: list[int]) -> Any:
        shape = (2, 12, cfg.tokens_per_chunk, cfg.num_kv_heads, cfg.head_dim)
        layers = [np.full(shape, np.nan, dtype=np.float16) for _ in range(cfg.num_layers)]
        return layout.paged(layers, block_table=table, num_tokens=length)

    def copy(src: Any, dst: Any, chunk: int) -> None:
        data = memoryview(chunk_bytes(layout, src, chunk))
        for part in layout.chunk_parts(dst, chunk):
            part[:] = data[: len(part)]
            data = data[len(part) :]
        assert not data

    prefill_side = paged([6, 2, 9, 0, 4])
    for c in range(n):
        copy(source, prefill_side, c)
    kid = new_id("paged")
    with KVParker(producer.target, timeout=10) as parker:
        parked = parker.park(kid, layout.chunk_buffers(prefill_side, range(n)))
    assert parked.ok and parked.chunks_parked == n, parked

    k = 3
    decode_side = paged([3, 8, 1, 10, 5])
    with KVConsumer(producer.target, timeout=10) as consumer:
        result = consumer.load(
            kid, chunk_ids=range(k), into=layout.chunk_buffers(decode_side, range(k))
        )
    assert result.ok and result.chunks_loaded == k, result
    for c in range(k):
        assert chunk_bytes(layout, decode_side, c) == chunk_bytes(layout, source, c)

    # The reference model computes over a block-major cache: stage the loaded blocks into one.
    cache = sentinel_cache(model, length + GENERATED - 1)
    staged = layout.block_major(cache, length)
    for c in range(k):
        copy(decode_side, staged, c)
    assert model.generate(prompt, cache, GENERATED, start_chunk=k) == expected_tokens
    assert kv_bytes(model, cache, length + GENERATED - 1) == kv_bytes(
        model, full, length + GENERATED - 1
    )


def test_a_flipped_byte_in_a_parked_chunk_is_refused(producer: ProducerProcess, model: Any) -> None:
    """A Park chunk whose bytes no longer match its CRC32C (flipped between the prefill's
    memory and the wire): the producer refuses the batch CHECKSUM_MISMATCH and keeps nothing,
    so no decode worker can ever load it."""
    layout = model.layout
    length = 200
    _, full, _ = full_prefill(model, length, seed=9)
    source = layout.block_major(full, length)
    chunks = [chunk_bytes(layout, source, c) for c in range(layout.num_chunks(length))]
    kid = new_id("bad-crc")
    messages = park_with_stubs.park_messages(kid, chunks)
    damaged = bytearray(messages[2].chunk.data)  # chunk 1, after the header and chunk 0
    damaged[1000] ^= 0x10
    messages[2].chunk.data = bytes(damaged)

    with park_with_stubs.open_channel(producer.target, layout.full_chunk_nbytes) as channel:
        reply = park_with_stubs.park(channel, messages)
    pb = park_with_stubs.pb
    assert reply.status == pb.STATUS_FAILED, reply
    assert reply.reason == pb.REASON_CHECKSUM_MISMATCH, reply

    with KVConsumer(producer.target, timeout=10) as consumer:
        status = consumer.lookup([kid])[0]
        assert status.state is not State.PARKED and status.chunks_parked == 0, status
        result = consumer.load(kid, num_chunks=len(chunks), wait_timeout_s=CHUNK_WAIT_S)
    assert not result.ok and result.chunks_loaded == 0, result


class FlipLastByteOfChunk(grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Corrupts one chunk in transit: flips the last byte of the `index`-th chunk message of
    every Fetch (Chunk.data is the message's last field, so that byte is payload)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.flipped = 0

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        call = continuation(details, request)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        return _Flipping(call, self) if method == FETCH_METHOD else call


class _Flipping:
    """The Fetch call with one message changed; everything else (cancel, code, ...) is the
    call's own."""

    def __init__(self, call: Any, owner: FlipLastByteOfChunk) -> None:
        self._call = call
        self._owner = owner
        self._chunks = 0

    def __iter__(self) -> _Flipping:
        return self

    def __next__(self) -> bytes:
        raw: bytes = next(self._call)
        if raw[:1] == b"\x0a":  # FetchResponse.chunk: field 1, length-delimited
            if self._chunks == self._owner.index:
                raw = raw[:-1] + bytes([raw[-1] ^ 0x01])
                self._owner.flipped += 1
            self._chunks += 1
        return raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


def test_a_chunk_corrupted_in_transit_never_reaches_the_model(
    producer: ProducerProcess, model: Any
) -> None:
    """One byte of chunk 3 flipped on its way to the consumer: the load ends
    CHECKSUM_MISMATCH with chunks 0..2 loaded; chunk 3 was never placed (its destination was
    never even asked for), so the model starts from intact KV and recomputes from chunk 3."""
    layout = model.layout
    length, bad = 450, 3
    prompt, full, expected_tokens = full_prefill(model, length, seed=13)
    n = layout.num_chunks(length)
    capacity = length + GENERATED - 1
    source = layout.block_major(full, length)
    kid = new_id("in-transit")
    with KVParker(producer.target, timeout=10) as parker:
        assert parker.park(kid, layout.chunk_buffers(source, range(n))).ok

    cache = sentinel_cache(model, capacity)
    target = layout.block_major(cache, length)
    place = layout.destination(target)
    asked: list[int] = []

    def destination(chunk_id: int, nbytes: int) -> Any:
        asked.append(chunk_id)
        return place(chunk_id, nbytes)

    def prefill_from(first: int) -> list[int]:
        for c in range(n):
            if c < first:
                assert chunk_bytes(layout, target, c) == chunk_bytes(layout, source, c)
            else:
                assert untouched(layout, target, c), f"chunk {c} was written"
        tokens: list[int] = model.generate(prompt, cache, GENERATED, start_chunk=first)
        return tokens

    flip = FlipLastByteOfChunk(bad)
    with KVConsumer(producer.target, timeout=10, interceptors=[flip]) as consumer:
        report = consumer.load_or_recompute(
            kid, num_chunks=n, into=destination, recompute=prefill_from
        )
    assert flip.flipped == 1
    assert report.reason is Reason.CHECKSUM_MISMATCH, report.result
    assert report.path is LoadPath.PARTIAL and report.result.chunks_loaded == bad
    assert report.recomputed_from == bad and asked == list(range(bad))
    assert report.recompute_value == expected_tokens
    assert kv_bytes(model, cache, capacity) == kv_bytes(model, full, capacity)

    # The producer's copy is intact, and still there: PARKED again when the cancel reached it
    # mid-stream, or DELIVERED and unconfirmed when it had sent every chunk already; either way
    # a Fetch without the corruption gets every chunk.
    with KVConsumer(producer.target, timeout=10) as consumer:
        wait_for(
            lambda: consumer.lookup([kid])[0].state in (State.PARKED, State.DELIVERED),
            10,
            "the id to be fetchable again",
        )
        again = sentinel_cache(model, capacity)
        result = consumer.load(
            kid, num_chunks=n, into=layout.destination(layout.block_major(again, length))
        )
    assert result.ok, result
    assert kv_bytes(model, again, length) == kv_bytes(model, full, length)


def test_park_with_stubs_example_parks_kv_a_decode_worker_resumes_from(
    producer: ProducerProcess, tmp_path: Path
) -> None:
    """examples/park_with_stubs.py, run as a script: header, chunks with CRC32C, commit, with
    nothing but the generated stubs; the KV it parked loads into the reference model's cache
    and decodes exactly as a local full prefill."""
    import subprocess

    kid, length = new_id("stubs"), 150
    script = ROOT / "examples" / "park_with_stubs.py"
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, str(script), "--target", producer.target, "--id", kid,
         "--tokens", str(length), "--seed", "4"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"-> header kv_request_id='{kid}' total_chunks=3 ")
    assert [line.split()[1] for line in lines if line.startswith("->")] == [
        "header", "chunk", "chunk", "chunk", "commit",
    ]  # fmt: skip
    assert lines[-3].startswith("-> commit chunks=3 bytes=153600")
    assert lines[-1].startswith("<- STATUS_OK chunks_parked=3 bytes_parked=153600")
    assert time.monotonic() - started < 30

    model = reference_model.ReferenceModel(seed=4)
    layout = model.layout
    prompt = np.random.default_rng(5).integers(0, model.config.vocab_size, length)
    full = model.new_cache(length + GENERATED - 1)
    expected = model.generate(prompt, full, GENERATED)
    cache = sentinel_cache(model, length + GENERATED - 1)
    with KVConsumer(producer.target, timeout=10) as consumer:
        result = consumer.load(
            kid, num_chunks=3, into=layout.destination(layout.block_major(cache, length))
        )
    assert result.ok, result
    assert model.generate(prompt, cache, GENERATED, start_chunk=3) == expected
    assert kv_bytes(model, cache, length + GENERATED - 1) == kv_bytes(
        model, full, length + GENERATED - 1
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [("no commit", "REASON_NOT_COMMITTED"), ("commit miscounts", "REASON_COMMIT_MISMATCH")],
)
def test_park_with_stubs_batches_need_their_commit(
    producer: ProducerProcess, change: str, reason: str
) -> None:
    """What the example's docstring says of the commit: without it, or with counts that
    differ from what was sent, the batch is undone."""
    kid = new_id("commit")
    chunks = [bytes([i]) * 4096 for i in range(3)]
    messages = park_with_stubs.park_messages(kid, chunks)
    if change == "no commit":
        messages.pop()
    else:
        messages[-1].commit.bytes -= 1
    pb = park_with_stubs.pb
    with park_with_stubs.open_channel(producer.target, 4096) as channel:
        reply = park_with_stubs.park(channel, messages, timeout_s=10)
    assert reply.status == pb.STATUS_FAILED and pb.FailureReason.Name(reply.reason) == reason
    with KVConsumer(producer.target, timeout=10) as consumer:
        assert consumer.lookup([kid])[0].chunks_parked == 0
