"""KVLayout: chunk sizes, and parts that cover exactly each chunk's canonical bytes in both the
block-major and the paged cache layout.

The expected bytes come from the definition, not from the module: chunk c of a request's KV
held as one dense [L, 2, num_tokens, H, D] array is `dense[:, :, c*T : c*T + n].tobytes()`.
The caches are filled (and read) with plain numpy indexing, independently of the parts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpark.layout import BlockMajorKVCache, KVLayout, PagedKVCache

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint16]


def dense_kv(layout: KVLayout, num_tokens: int, seed: int) -> npt.NDArray[Any]:
    """A request's KV as one dense [L, 2, num_tokens, H, D] array of distinct-ish values."""
    rng = np.random.default_rng(seed)
    shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    if layout.dtype.kind == "f":
        return rng.standard_normal(shape).astype(layout.dtype)
    info = np.iinfo(layout.dtype)
    return rng.integers(info.min, info.max, shape, endpoint=True).astype(layout.dtype)


def canonical(dense: npt.NDArray[Any], layout: KVLayout, chunk: int) -> bytes:
    span = layout.chunk_tokens(chunk, dense.shape[2])
    return dense[:, :, span.start : span.stop].tobytes()


def block_major_from(dense: npt.NDArray[Any], layout: KVLayout, spare: int = 0) -> Any:
    num_tokens = dense.shape[2]
    array = np.zeros((layout.num_chunks(num_tokens) + spare, *layout.block_shape), layout.dtype)
    for chunk in range(layout.num_chunks(num_tokens)):
        span = layout.chunk_tokens(chunk, num_tokens)
        array[chunk, :, :, : len(span)] = dense[:, :, span.start : span.stop]
    return array


def paged_from(
    dense: npt.NDArray[Any], layout: KVLayout, table: list[int], num_blocks: int
) -> list[npt.NDArray[Any]]:
    num_tokens = dense.shape[2]
    row = (layout.tokens_per_chunk, layout.num_kv_heads, layout.head_dim)
    layers = [np.zeros((2, num_blocks, *row), layout.dtype) for _ in range(layout.num_layers)]
    for chunk in range(layout.num_chunks(num_tokens)):
        span = layout.chunk_tokens(chunk, num_tokens)
        for index, layer in enumerate(layers):
            layer[:, table[chunk], : len(span)] = dense[index, :, span.start : span.stop]
    return layers


def scatter(payload: bytes, parts: list[memoryview]) -> None:
    """What a load does with one chunk's payload and its scatter list."""
    assert sum(part.nbytes for part in parts) == len(payload)
    offset = 0
    for part in parts:
        part[:] = payload[offset : offset + part.nbytes]
        offset += part.nbytes


def joined(parts: list[memoryview]) -> bytes:
    return b"".join(bytes(part) for part in parts)


def same_bytes(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=np.float16, tokens_per_chunk=5)


# --------------------------------------------------------------------------------- sizes
def test_sizes_of_a_small_layout() -> None:
    layout = LAYOUT
    assert layout.row_nbytes == 2 * 4 * 2
    assert layout.token_nbytes == 2 * 3 * 2 * 4 * 2 == 96
    assert layout.full_chunk_nbytes == 5 * 96
    assert layout.block_shape == (3, 2, 5, 2, 4)
    assert [layout.num_chunks(n) for n in (0, 1, 4, 5, 6, 10, 11)] == [0, 1, 1, 1, 2, 2, 3]
    assert [layout.chunk_tokens(c, 11) for c in range(3)] == [
        range(0, 5),
        range(5, 10),
        range(10, 11),
    ]
    assert [layout.chunk_nbytes(c, 11) for c in range(3)] == [480, 480, 96]
    assert layout.kv_nbytes(11) == 11 * 96
    assert layout.chunk_nbytes(1, 10) == 480  # an exact multiple has no partial chunk


def test_layout_is_a_frozen_value() -> None:
    again = KVLayout(3, 2, 4, "float16", 5)
    assert again == LAYOUT and hash(again) == hash(LAYOUT)
    assert again.dtype == np.dtype(np.float16)
    assert KVLayout(3, 2, 4, np.float32, 5) != LAYOUT
    with pytest.raises(dataclasses.FrozenInstanceError):
        LAYOUT.tokens_per_chunk = 7  # type: ignore[misc]


@given(
    tokens_per_chunk=st.integers(1, 100),
    num_tokens=st.integers(0, 1000),
)
def test_chunks_tile_the_tokens(tokens_per_chunk: int, num_tokens: int) -> None:
    layout = KVLayout(2, 1, 8, np.float16, tokens_per_chunk)
    chunks = layout.num_chunks(num_tokens)
    spans = [layout.chunk_tokens(c, num_tokens) for c in range(chunks)]
    assert [t for span in spans for t in span] == list(range(num_tokens))
    assert all(len(span) == tokens_per_chunk for span in spans[:-1])
    assert sum(layout.chunk_nbytes(c, num_tokens) for c in range(chunks)) == layout.kv_nbytes(
        num_tokens
    )
    with pytest.raises(ValueError, match="past the last chunk"):
        layout.chunk_tokens(chunks, num_tokens)


# ------------------------------------------------------------------------- parts and bytes
@st.composite
def cases(draw: st.DrawFn) -> tuple[KVLayout, int, list[int], int, int]:
    layout = KVLayout(
        num_layers=draw(st.integers(1, 4)),
        num_kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, 8)),
        dtype=draw(st.sampled_from(DTYPES)),
        tokens_per_chunk=draw(st.integers(1, 8)),
    )
    num_tokens = draw(st.integers(0, 40))
    chunks = layout.num_chunks(num_tokens)
    num_blocks = chunks + draw(st.integers(0, 3))
    table = draw(st.permutations(range(num_blocks)))[:chunks]
    return layout, num_tokens, list(table), num_blocks, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_parts_are_the_canonical_bytes_in_both_layouts(
    case: tuple[KVLayout, int, list[int], int, int],
) -> None:
    layout, num_tokens, table, num_blocks, seed = case
    dense = dense_kv(layout, num_tokens, seed)
    block = layout.block_major(block_major_from(dense, layout, spare=1), num_tokens)
    paged = layout.paged(paged_from(dense, layout, table, num_blocks), table, num_tokens)
    chunks = layout.num_chunks(num_tokens)
    for chunk in range(chunks):
        expected = canonical(dense, layout, chunk)
        assert len(expected) == layout.chunk_nbytes(chunk, num_tokens)
        block_parts = layout.chunk_parts(block, chunk)
        paged_parts = layout.chunk_parts(paged, chunk)
        assert joined(block_parts) == expected
        assert joined(paged_parts) == expected
        full = len(layout.chunk_tokens(chunk, num_tokens)) == layout.tokens_per_chunk
        assert len(block_parts) == (1 if full else 2 * layout.num_layers)
        assert len(paged_parts) == 2 * layout.num_layers
        for part in (*block_parts, *paged_parts):
            assert part.format == "B" and not part.readonly and part.c_contiguous
    buffers = layout.chunk_buffers(paged, range(chunks))
    assert [joined(parts) for parts in buffers] == [
        canonical(dense, layout, c) for c in range(chunks)
    ]


@settings(max_examples=150, deadline=None)
@given(cases())
def test_writing_through_parts_fills_exactly_the_chunk(
    case: tuple[KVLayout, int, list[int], int, int],
) -> None:
    layout, num_tokens, table, num_blocks, seed = case
    dense = dense_kv(layout, num_tokens, seed)
    chunks = layout.num_chunks(num_tokens)
    # Loads into zeroed caches through the parts; the result must be byte for byte what plain
    # indexing puts there: every chunk byte lands in place, and nothing else is touched.
    array = np.zeros((chunks + 1, *layout.block_shape), layout.dtype)
    row = (layout.tokens_per_chunk, layout.num_kv_heads, layout.head_dim)
    layers = [np.zeros((2, num_blocks, *row), layout.dtype) for _ in range(layout.num_layers)]
    block = layout.block_major(array, num_tokens)
    paged = layout.paged(layers, table, num_tokens)
    into_block = layout.destination(block)
    into_paged = layout.chunk_buffers(paged, range(chunks))
    for chunk in range(chunks):
        payload = canonical(dense, layout, chunk)
        scatter(payload, into_block(chunk, len(payload)))
        scatter(payload, into_paged[chunk])
    assert same_bytes(array, block_major_from(dense, layout, spare=1))
    for got, want in zip(layers, paged_from(dense, layout, table, num_blocks), strict=True):
        assert same_bytes(got, want)


def test_a_chunk_parked_from_block_major_loads_into_paged_and_back() -> None:
    layout = KVLayout(4, 2, 8, np.float16, 16)
    num_tokens = 50
    dense = dense_kv(layout, num_tokens, seed=3)
    source = layout.block_major(block_major_from(dense, layout), num_tokens)
    chunks = layout.num_chunks(num_tokens)
    parked = [joined(parts) for parts in layout.chunk_buffers(source, range(chunks))]

    row = (16, 2, 8)
    layers = [np.zeros((2, 9, *row), np.float16) for _ in range(4)]
    paged = layout.paged(layers, np.array([8, 0, 5, 2], dtype=np.int32), num_tokens)
    place = layout.destination(paged)
    for chunk, payload in enumerate(parked):
        scatter(payload, place(chunk, len(payload)))
    for index, layer in enumerate(layers):
        loaded = np.concatenate([layer[:, b] for b in (8, 0, 5, 2)], axis=1)[:, :num_tokens]
        assert same_bytes(loaded, dense[index])

    back = layout.block_major(layout.new_block_major(num_tokens), num_tokens)
    for chunk, parts in enumerate(layout.chunk_buffers(paged, range(chunks))):
        scatter(joined(parts), layout.chunk_parts(back, chunk))
    assert same_bytes(back.array, source.array)


def test_destination_refuses_a_chunk_of_another_size() -> None:
    cache = LAYOUT.block_major(LAYOUT.new_block_major(11), 11)
    place = LAYOUT.destination(cache)
    assert sum(p.nbytes for p in place(2, 96)) == 96
    with pytest.raises(ValueError, match=r"chunk 2 is 480 bytes; .* 1 tokens x 96 bytes = 96"):
        place(2, 480)
    with pytest.raises(ValueError, match="chunk 0 is 96 bytes"):
        place(0, 96)
    with pytest.raises(ValueError, match="chunk 3 is past the last chunk"):
        place(3, 96)


def test_no_tokens_is_no_chunks() -> None:
    cache = LAYOUT.block_major(np.zeros((0, *LAYOUT.block_shape), np.float16), 0)
    assert LAYOUT.chunk_buffers(cache, range(LAYOUT.num_chunks(0))) == []
    with pytest.raises(ValueError, match="past the last chunk"):
        LAYOUT.chunk_parts(cache, 0)


# --------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers must be positive, got 0"),
        ({"num_kv_heads": -1}, "num_kv_heads must be positive"),
        ({"head_dim": 2.0}, "head_dim must be an integer, got float"),
        ({"tokens_per_chunk": True}, "tokens_per_chunk must be an integer, got bool"),
        ({"dtype": object}, "plain numeric type"),
        ({"dtype": [("a", "f2")]}, "plain numeric type"),
        ({"dtype": ">f2" if np.little_endian else "<f2"}, "byte order"),
        ({"dtype": "not-a-dtype"}, "dtype"),
        ({"dtype": None}, "plain numeric type, got None"),
        ({"dtype": "S4"}, "plain numeric type"),
        ({"dtype": "U1"}, "plain numeric type"),
        ({"dtype": "M8[s]"}, "plain numeric type"),
        ({"dtype": "V8"}, "plain numeric type"),
    ],
)
def test_bad_layouts_are_refused(kwargs: dict[str, Any], message: str) -> None:
    args = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 4,
        "dtype": np.float16,
        "tokens_per_chunk": 4,
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        KVLayout(**args)


def _read_only(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.setflags(write=False)
    return array


GOOD_BLOCKS = (3, *LAYOUT.block_shape)


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros(GOOD_BLOCKS, np.float32), "cache has dtype float32; the layout's is float16"),
        (np.zeros((3, 3, 2, 5, 2, 5), np.float16), r"shape \[3, 3, 2, 5, 2, 5\]; .*\[\*, 3, 2, 5"),
        (np.zeros(LAYOUT.block_shape, np.float16), r"shape \[3, 2, 5, 2, 4\]"),
        (np.zeros((3, 3, 2, 5, 4, 2), np.float16).swapaxes(4, 5), "not C-contiguous"),
        (_read_only(np.zeros(GOOD_BLOCKS, np.float16)), "read-only"),
        (np.zeros((2, *LAYOUT.block_shape), np.float16), "cache has 2 blocks; 11 tokens need 3"),
        (bytearray(3 * LAYOUT.full_chunk_nbytes), "must be a numpy array, got bytearray"),
    ],
)
def test_bad_block_major_caches_are_refused(array: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LAYOUT.block_major(array, 11)


def _layers(count: int = 3, blocks: int = 4, dtype: Any = np.float16) -> list[Any]:
    return [np.zeros((2, blocks, 5, 2, 4), dtype) for _ in range(count)]


def _overlapping_layers() -> list[Any]:
    """Three layers, the last two views of one buffer a few elements apart."""
    size = 2 * 4 * 5 * 2 * 4
    buffer = np.zeros(size + 8, np.float16)
    return [_layers(1)[0], buffer[:size].reshape(2, 4, 5, 2, 4), buffer[8:].reshape(2, 4, 5, 2, 4)]


_ONE_LAYER = _layers(1)[0]


@pytest.mark.parametrize(
    ("layers", "table", "message"),
    [
        (_layers(2), [0, 1, 2], "layers holds 2 arrays; the layout has 3"),
        (np.zeros((3, 2, 4, 5, 2, 4), np.float16), [0, 1, 2], "sequence of per-layer arrays"),
        (_layers(dtype=np.float32), [0, 1, 2], r"layers\[0\] has dtype float32"),
        (
            [*_layers(2), np.zeros((2, 5, 5, 2, 4), np.float16)],
            [0, 1, 2],
            r"layers\[2\] has shape \[2, 5, 5, 2, 4\]; the layout needs \[2, 4, 5, 2, 4\]",
        ),
        (
            [np.zeros((4, 2, 5, 2, 4), np.float16).swapaxes(0, 1), *_layers(2)],
            [0, 1, 2],
            r"layers\[0\] is not C-contiguous",
        ),
        ([np.zeros((3, 4, 5, 2, 4), np.float16)] * 3, [0, 1, 2], r"shape \[3, 4, 5, 2, 4\]"),
        (_layers(), [0, 1], "block_table has 2 entries; 11 tokens need 3"),
        (_layers(), [0, 4, 1], r"block_table\[1\] = 4 is outside the caches' 4 blocks"),
        (_layers(), [0, -1, 1], r"block_table\[1\] = -1"),
        (_layers(), [2, 0, 2], "maps two chunks to one block"),
        (_layers(), [0, 1.0, 2], "integer block ids"),
        ([_ONE_LAYER, *_layers(1), _ONE_LAYER], [0, 1, 2], r"layers\[0\] and layers\[2\] share"),
        (_overlapping_layers(), [0, 1, 2], r"layers\[1\] and layers\[2\] share memory"),
    ],
)
def test_bad_paged_caches_are_refused(layers: Any, table: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LAYOUT.paged(layers, table, 11)


def test_only_spare_blocks_may_repeat_in_the_table() -> None:
    # Entries past the request's chunks are not its blocks (an engine's table is often longer).
    paged = LAYOUT.paged(_layers(), [2, 0, 1, 1, 1], 11)
    assert len(LAYOUT.chunk_parts(paged, 2)) == 6


def test_caches_of_another_layout_or_raw_arrays_are_refused() -> None:
    other = KVLayout(3, 2, 4, np.float16, 6)
    cache = other.block_major(other.new_block_major(11), 11)
    with pytest.raises(ValueError, match="cache was described with"):
        LAYOUT.chunk_parts(cache, 0)
    with pytest.raises(ValueError, match="cache must be a BlockMajorKVCache or PagedKVCache"):
        LAYOUT.chunk_parts(LAYOUT.new_block_major(11), 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache was described with"):
        LAYOUT.destination(cache)
    assert isinstance(cache, BlockMajorKVCache)
    assert not isinstance(cache, PagedKVCache)


def test_views_are_built_directly_too_and_show_no_array() -> None:
    cache = BlockMajorKVCache(LAYOUT, LAYOUT.new_block_major(11), 11)
    assert ", array=" not in repr(cache)
    with pytest.raises(ValueError, match="num_tokens must not be negative"):
        BlockMajorKVCache(LAYOUT, LAYOUT.new_block_major(11), -1)
    paged = PagedKVCache(LAYOUT, _layers(), (0, 1, 2), 11)
    assert ", layers=" not in repr(paged)
