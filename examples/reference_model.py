"""A small decoder-only transformer in numpy whose prefill resumes from parked KV, bitwise.

What a decode worker does with kvpark, end to end, on a real model: a prefill worker computes
a prompt's KV cache and parks it in chunks; the decode worker loads the first k chunks (all of
them, or a prefix when the rest is gone) and recomputes only from chunk k on. This model has
the parts of a current LLM that matter for that (RMSNorm, rotary position embeddings,
grouped-query attention with fewer KV heads than query heads, a SwiGLU MLP), seeded weights, a
float16 KV cache in `kvpark.layout`'s block-major layout and float32 compute:

    model = ReferenceModel(ModelConfig(), seed=0)
    cache = model.new_cache(len(prompt) + 16)        # [blocks, L, 2, T, kv_heads, head_dim]
    logits = model.prefill(prompt, cache)            # or start_chunk=k after loading k chunks;
                                                     # on_chunk=f: f(c) once chunk c is done
    tokens = model.generate(prompt, cache, 16)       # prefill, then 16 greedy tokens

Why a resume is bitwise equal to a full prefill. The full prefill is itself chunked: step c
takes the prompt tokens of chunk c (positions s..e-1), and in every layer computes their
queries, keys and values, stores the keys and values into the cache as float16, then reads the
float16 keys and values of positions 0..e-1 back from the cache and attends over them. So step
c depends on nothing but chunk c's tokens and the cache bytes of chunks 0..c: no hidden state
crosses steps (a token's hidden state reaches later tokens only through its float16 K/V, which
is exactly what a chunk carries). A resume from chunk k, with chunks 0..k-1 loaded bit for bit,
then runs literally the same steps k..N-1 as the full prefill: the same code, on the same
input values, with the same array shapes (step c has the same query rows and key count in both
paths, including a partial last chunk), so numpy and the BLAS take the same kernels and sum in
the same order, and every float32 result, float16 store and therefore every later step is
identical. The logits come from the last chunk, so a prefill always computes at least that
one: with every chunk loaded it recomputes the last chunk, rewriting its KV with the same bits.
Decoding appends one position per step, the same one-row step after either prefill. What would
break it: computing a resumed chunk with another row count (with numpy's OpenBLAS here, a
one-row product goes to a matrix-vector kernel and differs from the same row of a 64-row
product in the last bits), attending over float32 keys kept from the computation instead of
the float16 ones read back, or running the two sides on different numpy/BLAS builds or CPU
kernels, where float32 rounding may differ: the property holds within one build on one kind of
CPU; across builds expect float16 rounding noise, not equality.

`python examples/reference_model.py` prints the model's size, times a 512-token prefill and
checks a resume from the middle against it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpark.layout import KVLayout

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the model; the defaults prefill 512 tokens in well under a second on 2 cores."""

    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 768
    vocab_size: int = 512
    tokens_per_chunk: int = 64
    max_positions: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")


@dataclass(frozen=True)
class _Layer:
    attn_norm: F32  # [d_model]
    w_qkv: F32  # [d_model, (heads + 2 kv_heads) * head_dim]: one matmul for Q, K and V
    w_o: F32  # [heads * head_dim, d_model]
    mlp_norm: F32  # [d_model]
    w_gate_up: F32  # [d_model, 2 d_ff]: SwiGLU's gate and up projections side by side
    w_down: F32  # [d_ff, d_model]


class ReferenceModel:
    """The model: seeded weights, and prefill / generate over a block-major float16 cache."""

    def __init__(self, config: ModelConfig | None = None, seed: int = 0) -> None:
        self.config = cfg = config or ModelConfig()
        self.layout = KVLayout(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=np.float16,
            tokens_per_chunk=cfg.tokens_per_chunk,
        )
        rng = np.random.default_rng(seed)

        def weight(*shape: int) -> F32:
            # Scaled by fan-in so activations keep unit size through the layers.
            return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[0]))

        def norm() -> F32:
            return (1.0 + 0.1 * rng.standard_normal(cfg.d_model)).astype(np.float32)

        d, hd = cfg.d_model, cfg.head_dim
        qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
        self.embed = rng.standard_normal((cfg.vocab_size, d), dtype=np.float32)
        self.layers = [
            _Layer(
                attn_norm=norm(),
                w_qkv=weight(d, qkv_width),
                w_o=weight(cfg.num_heads * hd, d),
                mlp_norm=norm(),
                w_gate_up=weight(d, 2 * cfg.d_ff),
                w_down=weight(cfg.d_ff, d),
            )
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = norm()
        self.w_out = weight(d, cfg.vocab_size)
        # One table for all positions, so a position's rotation never depends on which step
        # computes it.
        inv_freq = cfg.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        angles = np.outer(np.arange(cfg.max_positions, dtype=np.float64), inv_freq)
        self._cos = np.cos(angles).astype(np.float32)
        self._sin = np.sin(angles).astype(np.float32)

    @property
    def num_parameters(self) -> int:
        arrays = [self.embed, self.final_norm, self.w_out]
        for layer in self.layers:
            arrays += [layer.attn_norm, layer.w_qkv, layer.w_o]
            arrays += [layer.mlp_norm, layer.w_gate_up, layer.w_down]
        return sum(a.size for a in arrays)

    def new_cache(self, num_tokens: int) -> npt.NDArray[np.float16]:
        """A zeroed block-major float16 cache with room for `num_tokens` positions."""
        return self.layout.new_block_major(num_tokens)

    # --------------------------------------------------------------------------- inference
    def prefill(
        self,
        tokens: npt.ArrayLike,
        cache: npt.NDArray[Any],
        start_chunk: int = 0,
        on_chunk: Callable[[int], object] | None = None,
    ) -> F32:
        """Computes the KV of positions >= start_chunk x tokens_per_chunk into `cache`, which
        must already hold the positions before (chunks loaded from kvpark), and returns the
        last position's logits. start_chunk = number of chunks recomputes the last chunk.

        `on_chunk(c)` is called as soon as chunk c's KV is final in the cache (every layer, K
        and V; later steps never write it again), so a prefill worker can park chunk c while
        chunk c + 1 is computed."""
        prompt = self._tokens(tokens)
        self.layout.block_major(cache, len(prompt))  # checks dtype, shape and room
        chunks = self.layout.num_chunks(len(prompt))
        if not 0 <= start_chunk <= chunks:
            raise ValueError(f"start_chunk {start_chunk} is outside 0..{chunks}")
        hidden = np.empty(0, dtype=np.float32)
        for chunk in range(min(start_chunk, chunks - 1), chunks):
            span = self.layout.chunk_tokens(chunk, len(prompt))
            hidden = self._step(prompt[span.start : span.stop], span.start, cache)
            if on_chunk is not None:
                on_chunk(chunk)
        return self._logits(hidden)

    def generate(
        self, tokens: npt.ArrayLike, cache: npt.NDArray[Any], n: int, start_chunk: int = 0
    ) -> list[int]:
        """Prefills `tokens` (from `start_chunk`, see `prefill`), then decodes `n` tokens
        greedily; the cache needs room for len(tokens) + n - 1 positions."""
        prompt = self._tokens(tokens)
        if n < 0:
            raise ValueError(f"n must not be negative, got {n}")
        # The last generated token is never fed back: it takes no position.
        used = len(prompt) + max(n - 1, 0)
        self.layout.block_major(cache, used)
        if used > self.config.max_positions:
            raise ValueError(
                f"{len(prompt)} tokens and {n} generated need {used} positions, "
                f"beyond {self.config.max_positions}"
            )
        logits = self.prefill(prompt, cache, start_chunk)
        out: list[int] = []
        for position in range(len(prompt), len(prompt) + n):
            out.append(int(np.argmax(logits)))
            if len(out) < n:
                logits = self._logits(self._step(np.array(out[-1:]), position, cache))
        return out

    def _tokens(self, tokens: npt.ArrayLike) -> npt.NDArray[np.int64]:
        prompt = np.asarray(tokens)
        if prompt.ndim != 1 or prompt.size == 0 or prompt.dtype.kind not in "iu":
            raise ValueError("tokens must be a non-empty 1-D sequence of token ids")
        if prompt.min() < 0 or prompt.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        if prompt.size > self.config.max_positions:
            raise ValueError(f"{prompt.size} tokens exceed {self.config.max_positions}")
        return prompt.astype(np.int64)

    def _step(self, tokens: npt.NDArray[np.int64], start: int, cache: npt.NDArray[Any]) -> F32:
        """Positions start..start+n-1 (n = len(tokens), within one block): runs every layer,
        stores their K/V in `cache` and returns the last position's final hidden state."""
        cfg = self.config
        n, stop = len(tokens), start + len(tokens)
        hd, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        group = heads // kv_heads
        block, offset = divmod(start, cfg.tokens_per_chunk)
        blocks = -(-stop // cfg.tokens_per_chunk)
        cos, sin = self._cos[start:stop, None, :], self._sin[start:stop, None, :]
        # Query row i (position start+i) may see keys 0..start+i.
        future = np.arange(stop)[None, :] > np.arange(start, stop)[:, None]
        scale = np.float32(1.0 / np.sqrt(hd))
        x = self.embed[tokens]
        q_width, kv_width = heads * hd, kv_heads * hd
        for index, layer in enumerate(self.layers):
            qkv = _rms_norm(x, layer.attn_norm, cfg.norm_eps) @ layer.w_qkv
            q = _rope(qkv[:, :q_width].reshape(n, heads, hd), cos, sin)
            k = _rope(qkv[:, q_width : q_width + kv_width].reshape(n, kv_heads, hd), cos, sin)
            v = qkv[:, q_width + kv_width :].reshape(n, kv_heads, hd)
            cache[block, index, 0, offset : offset + n] = k
            cache[block, index, 1, offset : offset + n] = v
            # Attend over the float16 K/V as stored, never this step's float32 ones: a resumed
            # step only has the stored ones for earlier positions, and must see the same values.
            keys = _read(cache, blocks, index, 0, stop)  # [kv_heads, stop, hd]
            values = _read(cache, blocks, index, 1, stop)
            # Grouped-query attention: the `group` query heads of a KV head as one matrix.
            queries = np.ascontiguousarray(
                (q * scale).reshape(n, kv_heads, group, hd).transpose(1, 2, 0, 3)
            ).reshape(kv_heads, group * n, hd)
            scores = (queries @ keys.transpose(0, 2, 1)).reshape(kv_heads, group, n, stop)
            scores[:, :, future] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            attended = weights.reshape(kv_heads, group * n, stop) @ values
            merged = attended.reshape(kv_heads, group, n, hd).transpose(2, 0, 1, 3)
            x = x + merged.reshape(n, heads * hd) @ layer.w_o
            gate, up = np.split(_rms_norm(x, layer.mlp_norm, cfg.norm_eps) @ layer.w_gate_up, 2, 1)
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ layer.w_down
        result: F32 = x[-1]
        return result

    def _logits(self, hidden: F32) -> F32:
        cfg = self.config
        logits: F32 = _rms_norm(hidden[None, :], self.final_norm, cfg.norm_eps)[0] @ self.w_out
        return logits


def _rms_norm(x: F32, weight: F32, eps: float) -> F32:
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(mean_square + np.float32(eps)) * weight


def _rope(x: F32, cos: F32, sin: F32) -> F32:
    """Rotates the pairs (x[..., :half], x[..., half:]) by each position's angles."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def _read(cache: npt.NDArray[Any], blocks: int, layer: int, kv: int, stop: int) -> F32:
    """The float16 K (kv 0) or V (kv 1) of one layer, positions 0..stop-1, as float32
    [kv_heads, stop, head_dim]."""
    rows = cache[:blocks, layer, kv].astype(np.float32)  # [blocks, T, kv_heads, hd]
    flat = rows.reshape(-1, *rows.shape[2:])[:stop]
    return np.ascontiguousarray(flat.transpose(1, 0, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="prompt length (default 512)")
    parser.add_argument("--runs", type=int, default=5, help="timed prefills (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = ReferenceModel(seed=args.seed)
    cfg, layout = model.config, model.layout
    print(
        f"model: {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} KV heads of {cfg.head_dim}, d_ff {cfg.d_ff}, vocab "
        f"{cfg.vocab_size}, {model.num_parameters / 1e6:.2f} M parameters"
    )
    prompt = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size, args.tokens)
    chunks = layout.num_chunks(len(prompt))
    print(
        f"KV: float16, {layout.token_nbytes} bytes per token, {chunks} chunks of up to "
        f"{cfg.tokens_per_chunk} tokens ({layout.full_chunk_nbytes / 1024:.0f} KiB each)"
    )

    cache = model.new_cache(len(prompt) + 8)
    model.prefill(prompt, cache)  # warm-up: BLAS threads, page faults
    times = []
    for _ in range(args.runs):
        began = time.perf_counter()
        model.prefill(prompt, cache)
        times.append(time.perf_counter() - began)
    print(
        f"prefill of {len(prompt)} tokens: median {np.median(times) * 1e3:.1f} ms, "
        f"best {min(times) * 1e3:.1f} ms over {args.runs} runs"
    )

    full = model.new_cache(len(prompt) + 8)
    expected = model.generate(prompt, full, 8)
    k = chunks // 2
    resumed = model.new_cache(len(prompt) + 8)
    source = layout.block_major(full, len(prompt))
    target = layout.block_major(resumed, len(prompt))
    for chunk in range(k):  # what a load of the first k chunks does, minus the network
        for src, dst in zip(
            layout.chunk_parts(source, chunk), layout.chunk_parts(target, chunk), strict=True
        ):
            dst[:] = src
    began = time.perf_counter()
    tokens = model.generate(prompt, resumed, 8, start_chunk=k)
    took = time.perf_counter() - began
    same = np.array_equal(full.view(np.uint8), resumed.view(np.uint8))
    print(
        f"resume from chunk {k} of {chunks} + 8 tokens: {took * 1e3:.1f} ms; "
        f"KV bitwise equal: {same}; tokens equal: {tokens == expected} {tokens}"
    )
    if not same or tokens != expected:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
