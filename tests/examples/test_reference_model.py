"""The reference model: a prefill resumed from any loaded prefix of chunks is bitwise a full one.

For each prompt and every split k (0..number of chunks), the first k chunks of a full
prefill's cache are copied, as kvpark would move them (canonical bytes out of the source's
parts, into the fresh cache's parts), and the prefill resumes at chunk k: logits, KV and the
greedily generated tokens must equal the full run's bit for bit. A corrupted chunk must show in
the KV computed after it, or the equality checks could not fail.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from conftest import ROOT

GENERATED = 6


def _load_example() -> ModuleType:
    # examples/ is not a package and not installed: load the file itself.
    path = ROOT / "examples" / "reference_model.py"
    spec = importlib.util.spec_from_file_location("reference_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


reference_model = _load_example()


@pytest.fixture(scope="module")
def model() -> Any:
    return reference_model.ReferenceModel(seed=7)


def copy_chunks(model: Any, source: Any, target: Any, num_tokens: int, k: int) -> None:
    """Moves chunks 0..k-1 the way a park + load does: bytes out, bytes in."""
    layout = model.layout
    parked = [
        b"".join(bytes(p) for p in parts)
        for parts in layout.chunk_buffers(layout.block_major(source, num_tokens), range(k))
    ]
    place = layout.destination(layout.block_major(target, num_tokens))
    for chunk, payload in enumerate(parked):
        offset = 0
        for part in place(chunk, len(payload)):
            part[:] = payload[offset : offset + part.nbytes]
            offset += part.nbytes


def raw(array: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    return array.reshape(-1).view(np.uint8)


@pytest.mark.parametrize("length", [130, 256, 511])
def test_resume_from_every_split_is_bitwise_a_full_prefill(model: Any, length: int) -> None:
    prompt = np.random.default_rng(length).integers(0, model.config.vocab_size, length)
    capacity = length + GENERATED - 1
    full = model.new_cache(capacity)
    full_logits = model.prefill(prompt, full)
    full_tokens = model.generate(prompt, full, GENERATED)
    chunks = model.layout.num_chunks(length)
    assert chunks == -(-length // model.config.tokens_per_chunk)
    # Not a degenerate model: the continuation varies.
    assert len(set(full_tokens)) > 1

    for k in range(chunks + 1):
        resumed = model.new_cache(capacity)
        copy_chunks(model, full, resumed, length, k)
        logits = model.prefill(prompt, resumed, start_chunk=k)
        assert np.array_equal(raw(logits), raw(full_logits)), f"logits differ after k={k}"
        tokens = model.generate(prompt, resumed, GENERATED, start_chunk=k)
        assert tokens == full_tokens, f"tokens differ after k={k}"
        assert np.array_equal(raw(resumed), raw(full)), f"KV differs after k={k}"


def test_a_corrupted_loaded_chunk_changes_the_kv_after_it(model: Any) -> None:
    length, k = 256, 2
    layout = model.layout
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, length)
    full = model.new_cache(length)
    model.prefill(prompt, full)
    resumed = model.new_cache(length)
    copy_chunks(model, full, resumed, length, k)
    # Chunk 0's first bytes are layer 0's keys of position 0; flip the sign byte of one of
    # them that is far from zero (-0.0 == 0.0 would change nothing).
    first = layout.chunk_parts(layout.block_major(resumed, length), 0)[0]
    keys = np.frombuffer(first, dtype=np.float16, count=layout.num_kv_heads * layout.head_dim)
    element = int(np.argmax(np.abs(keys)))
    sign_byte = 2 * element + (1 if sys.byteorder == "little" else 0)
    first[sign_byte] ^= 0x80

    model.prefill(prompt, resumed, start_chunk=k)
    source = layout.block_major(full, length)
    target = layout.block_major(resumed, length)

    def chunk_bytes(cache: Any, chunk: int) -> bytes:
        return b"".join(bytes(p) for p in layout.chunk_parts(cache, chunk))

    assert chunk_bytes(target, 0) != chunk_bytes(source, 0)
    assert chunk_bytes(target, 1) == chunk_bytes(source, 1)
    for chunk in range(k, layout.num_chunks(length)):
        assert chunk_bytes(target, chunk) != chunk_bytes(source, chunk), chunk


def test_on_chunk_sees_each_chunk_final_as_soon_as_it_is_done(model: Any) -> None:
    """What a prefill worker that parks chunk c from the hook relies on: c's KV is complete
    when the hook runs, and no later step writes it again."""
    length = 200
    layout = model.layout
    prompt = np.random.default_rng(2).integers(0, model.config.vocab_size, length)
    cache = model.new_cache(length)
    kv = layout.block_major(cache, length)
    seen: dict[int, bytes] = {}

    def on_chunk(chunk: int) -> None:
        assert chunk == len(seen), "chunks out of order"
        seen[chunk] = b"".join(bytes(p) for p in layout.chunk_parts(kv, chunk))

    model.prefill(prompt, cache, on_chunk=on_chunk)
    assert list(seen) == list(range(layout.num_chunks(length)))
    for chunk, data in seen.items():
        assert data == b"".join(bytes(p) for p in layout.chunk_parts(kv, chunk)), chunk


def test_bad_calls_are_refused(model: Any) -> None:
    prompt = np.arange(100) % model.config.vocab_size
    cache = model.new_cache(100)
    with pytest.raises(ValueError, match=r"start_chunk 3 is outside 0..2"):
        model.prefill(prompt, cache, start_chunk=3)
    with pytest.raises(ValueError, match="dtype float32"):
        model.prefill(prompt, cache.astype(np.float32))
    with pytest.raises(ValueError, match="2 blocks; 129 tokens need 3"):
        model.generate(prompt, cache, 30)
    with pytest.raises(ValueError, match="token ids"):
        model.prefill(prompt + model.config.vocab_size, cache)


def test_generate_fits_exactly_max_positions() -> None:
    """generate uses len(prompt) + n - 1 positions: the last token it returns is never fed
    back, so a prompt that fills every position still yields one token, and a call one
    position beyond is refused with the count it needed."""
    small = reference_model.ReferenceModel(reference_model.ModelConfig(max_positions=128), seed=7)
    full = np.arange(128) % small.config.vocab_size
    cache = small.new_cache(128)
    logits = small.prefill(full, cache)
    assert small.generate(full, small.new_cache(128), 1) == [int(np.argmax(logits))]
    # Positions 0..127 exactly: 121 of the prompt, 7 of the tokens fed back.
    assert len(small.generate(full[:121], small.new_cache(128), 8)) == 8
    # A cache with room for it, so that the refusal is max_positions', not the cache's.
    with pytest.raises(ValueError, match="need 129 positions, beyond 128"):
        small.generate(full[:121], small.new_cache(129), 9)
