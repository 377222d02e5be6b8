"""How an engine's KV cache maps onto kvpark chunks, as views into the engine's own memory.

kvpark moves opaque chunks; an engine has a KV cache of some shape. `KVLayout` describes the
cache (layers, KV heads, head size, dtype, tokens per chunk) and cuts a request's KV into
chunks: chunk c holds token positions [c·T, (c+1)·T) of every layer, K and V, so "the first k
chunks" is a token prefix of the whole model, which is what a decode worker that recomputes
only the missing tail needs. The last chunk of a prompt may hold fewer than T tokens. For a
cache array the layout gives each chunk's bytes as a list of writable memoryviews into that
array ("parts", no copy), which the kvpark clients take per chunk as a gather list when parking
and as a scatter list when loading.

Every layout yields the same bytes for a chunk, in one canonical order: for layer 0..L-1, K
then V, the chunk's n tokens as an [n, num_kv_heads, head_dim] C-order array of `dtype`
(native byte order). With the request's KV as one dense [L, 2, num_tokens, H, D] array that is
`dense[:, :, c*T:c*T+n].tobytes()`. A chunk parked from one layout can thus be loaded into
another. Two cache layouts are built in:

- block-major (`BlockMajorKVCache`): one array [num_blocks, L, 2, T, H, D], block c holding
  chunk c. A full chunk is one contiguous part; a partial last chunk, whose n tokens fill the
  head of each (layer, K/V) row of its block, is 2·L parts.

      layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype=np.float16,
                        tokens_per_chunk=64)
      cache = layout.new_block_major(num_tokens=300)
      ...  # the engine writes positions 0..299 into cache[c, layer, 0 (K) / 1 (V), t]
      kv = layout.block_major(cache, num_tokens=300)
      parker.park(kid, layout.chunk_buffers(kv, range(layout.num_chunks(300))))

- paged, as vLLM's flash-attention backend keeps it (`PagedKVCache`): per layer one tensor
  [2, num_blocks, block_size, H, D] shared by all requests, and per request a block table
  mapping its logical block c (= chunk c, block_size == T) to a physical block id. A chunk is
  2·L parts, one [n, H, D] run per (layer, K/V).

      kv = layout.paged(kv_caches, block_table=[7, 3, 12], num_tokens=150)
      consumer.load(kid, num_chunks=3, into=layout.destination(kv))

docs/kv-layout.md maps other engine layouts onto the canonical order.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

# One chunk's bytes: views into the cache, in the canonical order; together exactly the chunk.
Parts = list[memoryview]
# What the clients call per arriving chunk when loading: (chunk_id, nbytes) -> where it goes.
Placer = Callable[[int, int], Parts]


def _positive(name: str, value: object) -> int:
    # bool is an int subclass; `True` layers is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {value}")
    return int(value)


@dataclass(frozen=True, init=False)
class KVLayout:
    """The shape of a model's KV cache and its cut into chunks of `tokens_per_chunk` positions.

    K and V are both stored, for every layer; `dtype` is the cache's element type (for
    bfloat16, which numpy lacks, use a 2-byte stand-in such as np.uint16 and view the engine's
    tensors as that: kvpark only moves bytes, and the layout only checks sizes)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype[Any]
    tokens_per_chunk: int

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: npt.DTypeLike,
        tokens_per_chunk: int,
    ) -> None:
        try:
            resolved = np.dtype(dtype)
        except TypeError as exc:
            raise ValueError(f"dtype: {exc}") from None
        if dtype is None:
            # np.dtype(None) is float64: a missing dtype, not a choice.
            raise ValueError("dtype must be a plain numeric type, got None")
        # Booleans, integers, floats and complex only: bytes, text, datetimes, objects and
        # void (raw, structured or sub-array) are not a cache's elements.
        if resolved.kind not in "biufc":
            raise ValueError(f"dtype must be a plain numeric type, got {resolved}")
        if resolved.itemsize == 0:
            raise ValueError(f"dtype {resolved} has no fixed size")
        if not resolved.isnative:
            # Chunks are raw native-order bytes; a byte-swapped cache would park foreign bytes.
            raise ValueError(f"dtype {resolved.str} is not in the machine's byte order")
        # Frozen: the dataclass's own __setattr__ refuses, so set through object's.
        object.__setattr__(self, "num_layers", _positive("num_layers", num_layers))
        object.__setattr__(self, "num_kv_heads", _positive("num_kv_heads", num_kv_heads))
        object.__setattr__(self, "head_dim", _positive("head_dim", head_dim))
        object.__setattr__(self, "dtype", resolved)
        object.__setattr__(
            self, "tokens_per_chunk", _positive("tokens_per_chunk", tokens_per_chunk)
        )

    # ------------------------------------------------------------------------------- sizes
    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block-major block: [num_layers, 2 (K, V), tokens_per_chunk, heads, head_dim]."""
        return (self.num_layers, 2, self.tokens_per_chunk, self.num_kv_heads, self.head_dim)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token position in one layer's K (or V): heads x head_dim elements."""
        return self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def token_nbytes(self) -> int:
        """Bytes of one token position across the whole model: every layer, K and V."""
        return 2 * self.num_layers * self.row_nbytes

    @property
    def full_chunk_nbytes(self) -> int:
        """Bytes of a chunk holding all `tokens_per_chunk` positions."""
        return self.tokens_per_chunk * self.token_nbytes

    def num_chunks(self, num_tokens: int) -> int:
        """Chunks that hold `num_tokens` positions (the last one possibly partial)."""
        tokens = _count("num_tokens", num_tokens)
        return -(-tokens // self.tokens_per_chunk)

    def chunk_tokens(self, chunk_id: int, num_tokens: int) -> range:
        """The token positions chunk `chunk_id` holds in a request of `num_tokens` tokens."""
        chunks = self.num_chunks(num_tokens)
        chunk = _count("chunk_id", chunk_id)
        if chunk >= chunks:
            raise ValueError(
                f"chunk {chunk} is past the last chunk: {num_tokens} tokens make {chunks} "
                f"chunks of up to {self.tokens_per_chunk} tokens"
            )
        start = chunk * self.tokens_per_chunk
        return range(start, min(start + self.tokens_per_chunk, num_tokens))

    def chunk_nbytes(self, chunk_id: int, num_tokens: int) -> int:
        """Bytes of chunk `chunk_id` in a request of `num_tokens` tokens."""
        return len(self.chunk_tokens(chunk_id, num_tokens)) * self.token_nbytes

    def kv_nbytes(self, num_tokens: int) -> int:
        """Bytes of all chunks of a request of `num_tokens` tokens."""
        return _count("num_tokens", num_tokens) * self.token_nbytes

    # ------------------------------------------------------------------------------ caches
    def new_block_major(self, num_tokens: int) -> npt.NDArray[Any]:
        """A zeroed block-major cache with room for `num_tokens` positions."""
        blocks = self.num_chunks(num_tokens)
        return np.zeros((blocks, *self.block_shape), dtype=self.dtype)

    def block_major(self, array: npt.NDArray[Any], num_tokens: int) -> BlockMajorKVCache:
        """The first `num_tokens` positions of a block-major cache array, checked."""
        return BlockMajorKVCache(self, array, num_tokens)

    def paged(
        self,
        layers: Sequence[npt.NDArray[Any]],
        block_table: Sequence[int] | npt.NDArray[np.integer[Any]],
        num_tokens: int,
    ) -> PagedKVCache:
        """One request's `num_tokens` positions in paged per-layer caches, checked."""
        return PagedKVCache(self, layers, block_table, num_tokens)

    def chunk_parts(self, cache: KVCache, chunk_id: int) -> Parts:
        """Chunk `chunk_id` of `cache` as writable byte views, in the canonical order."""
        return self._own(cache).chunk_parts(chunk_id)

    def chunk_buffers(self, cache: KVCache, chunk_ids: Iterable[int]) -> list[Parts]:
        """`chunk_parts` of each of `chunk_ids`, in that order: what `park` takes, and the
        sequence form of `load(..., into=)` for the same chunk ids."""
        own = self._own(cache)
        return [own.chunk_parts(chunk) for chunk in chunk_ids]

    def destination(self, cache: KVCache) -> Placer:
        """The callable form of `load(..., into=)`: `(chunk_id, nbytes)` -> that chunk's parts
        in `cache`. Raises ValueError when `nbytes` is not the chunk's size in this layout (the
        chunk was parked from KV of another shape or length)."""
        own = self._own(cache)

        def place(chunk_id: int, nbytes: int) -> Parts:
            expected = self.chunk_nbytes(chunk_id, own.num_tokens)
            if nbytes != expected:
                raise ValueError(
                    f"chunk {chunk_id} is {nbytes} bytes; this layout holds "
                    f"{len(self.chunk_tokens(chunk_id, own.num_tokens))} tokens x "
                    f"{self.token_nbytes} bytes = {expected} bytes there"
                )
            return own.chunk_parts(chunk_id)

        return place

    def _own(self, cache: KVCache) -> KVCache:
        if not isinstance(cache, BlockMajorKVCache | PagedKVCache):
            raise ValueError(
                f"cache must be a BlockMajorKVCache or PagedKVCache (layout.block_major(...), "
                f"layout.paged(...)), got {type(cache).__name__}"
            )
        if cache.layout != self:
            raise ValueError(f"cache was described with {cache.layout}, not {self}")
        return cache


def _bytes_of(piece: npt.NDArray[Any]) -> memoryview:
    # A flat uint8 view of a C-contiguous piece: format "B", one byte per index, writable,
    # whatever the element type.
    return piece.reshape(-1).view(np.uint8).data


def _check_array(
    what: str, array: object, layout: KVLayout, shape: tuple[int | None, ...]
) -> npt.NDArray[Any]:
    """`array` if it is a writable C-contiguous array of `layout.dtype` and of `shape` (None:
    any size there); ValueError naming the first thing that is wrong otherwise."""
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{what} must be a numpy array, got {type(array).__name__}")
    if array.dtype != layout.dtype:
        raise ValueError(f"{what} has dtype {array.dtype}; the layout's is {layout.dtype}")
    wanted = "[" + ", ".join("*" if size is None else str(size) for size in shape) + "]"
    if array.ndim != len(shape) or any(
        size is not None and size != actual for size, actual in zip(shape, array.shape, strict=True)
    ):
        raise ValueError(f"{what} has shape {list(array.shape)}; the layout needs {wanted}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous (a transposed or strided view?)")
    if not array.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return array


# eq=False: views compare (and hash) by identity; comparing the arrays' contents is not meant.
@dataclass(frozen=True, eq=False)
class BlockMajorKVCache:
    """A request's first `num_tokens` positions in a block-major array
    [num_blocks, L, 2, T, H, D]: block c holds chunk c, so chunk c is the contiguous `array[c]`
    (its first n tokens of each (layer, K/V) row when the chunk is partial)."""

    layout: KVLayout
    array: npt.NDArray[Any] = field(repr=False)
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        object.__setattr__(self, "num_tokens", _count("num_tokens", self.num_tokens))
        array = _check_array("cache", self.array, self.layout, (None, *self.layout.block_shape))
        chunks = self.layout.num_chunks(self.num_tokens)
        if array.shape[0] < chunks:
            raise ValueError(
                f"cache has {array.shape[0]} blocks; {self.num_tokens} tokens need {chunks}"
            )

    def chunk_parts(self, chunk_id: int) -> Parts:
        """Chunk `chunk_id` as writable byte views into `array`, in the canonical order."""
        tokens = len(self.layout.chunk_tokens(chunk_id, self.num_tokens))
        block = self.array[chunk_id]
        if tokens == self.layout.tokens_per_chunk:
            return [_bytes_of(block)]
        return [
            _bytes_of(block[layer, kv, :tokens])
            for layer in range(self.layout.num_layers)
            for kv in (0, 1)
        ]


@dataclass(frozen=True, eq=False)
class PagedKVCache:
    """A request's first `num_tokens` positions in paged caches, as vLLM's flash-attention
    backend keeps them: per layer one array [2, num_blocks, T, H, D] (K at [0], V at [1]) shared
    by all requests, and the request's `block_table` mapping its logical block c (chunk c) to a
    physical block. Chunk c is 2·L parts: `layers[l][kv, block_table[c], :n]` for each layer l,
    K then V."""

    layout: KVLayout
    layers: Sequence[npt.NDArray[Any]] = field(repr=False)
    block_table: Sequence[int] | npt.NDArray[np.integer[Any]]
    num_tokens: int
    _table: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layout = self.layout
        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
        object.__setattr__(self, "num_tokens", _count("num_tokens", self.num_tokens))
        if isinstance(self.layers, np.ndarray) or not isinstance(self.layers, Sequence):
            raise ValueError("layers must be a sequence of per-layer arrays, one per layer")
        if len(self.layers) != layout.num_layers:
            raise ValueError(
                f"layers holds {len(self.layers)} arrays; the layout has {layout.num_layers}"
            )
        num_blocks: int | None = None
        for index, layer in enumerate(self.layers):
            row = (layout.tokens_per_chunk, layout.num_kv_heads, layout.head_dim)
            array = _check_array(f"layers[{index}]", layer, layout, (2, num_blocks, *row))
            num_blocks = array.shape[1]
            for other in range(index):
                # Layers in one memory would overwrite each other's KV on load.
                if np.shares_memory(array, self.layers[other]):
                    raise ValueError(f"layers[{other}] and layers[{index}] share memory")
        object.__setattr__(self, "layers", tuple(self.layers))
        assert num_blocks is not None
        try:
            table = tuple(operator.index(block) for block in self.block_table)
        except TypeError:
            raise ValueError("block_table must be a sequence of integer block ids") from None
        chunks = layout.num_chunks(self.num_tokens)
        if len(table) < chunks:
            raise ValueError(
                f"block_table has {len(table)} entries; {self.num_tokens} tokens need {chunks}"
            )
        used = table[:chunks]
        for logical, block in enumerate(used):
            if not 0 <= block < num_blocks:
                raise ValueError(
                    f"block_table[{logical}] = {block} is outside the caches' {num_blocks} blocks"
                )
        if len(set(used)) != len(used):
            # Two chunks in one block would overwrite each other on load.
            raise ValueError(f"block_table maps two chunks to one block: {list(used)}")
        object.__setattr__(self, "_table", used)

    def chunk_parts(self, chunk_id: int) -> Parts:
        """Chunk `chunk_id` as writable byte views into the layers, in the canonical order."""
        tokens = len(self.layout.chunk_tokens(chunk_id, self.num_tokens))
        block = self._table[chunk_id]
        return [_bytes_of(layer[kv, block, :tokens]) for layer in self.layers for kv in (0, 1)]


# A request's KV in an engine's cache, as the layout's methods take it.
KVCache = BlockMajorKVCache | PagedKVCache
