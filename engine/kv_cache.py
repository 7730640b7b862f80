"""8-bit KV caches for the main transformer (`--kv-dtype int8|fp8`): what limits calls per GPU is KV
memory (1.57 GB a call at context 3000 in bf16 for the 7B model), so storing K and V in one byte per
value about halves it.

`QuantizedRingKVCache` is moshi's `RingKVCache` with its values stored as 8-bit codes plus one scale per
(row, head, position): int8 (absmax / 127, symmetric) or fp8 e4m3 (absmax / 448). moshi's own ring
bookkeeping (write indexes, positions, per-row offsets under the exec mask, resets) is reused unchanged:
the parent class's cache holds the scales (head dim 1), and the codes are written at the same indexes
(`InPlaceRingKVCache`, moshi's ring written with `index_put_`, which torch.compile keeps in place).
Attention reads the codes directly (`quantized_attention`, `QuantizedKVAttention`): dequantizing the
whole window to bf16 each step and handing it to SDPA would move 2.5 times the bytes of a bf16 cache
(read the codes, write bf16, read it again), and at 64 calls a step is bound by those bytes. Written as
plain products and sums, torch.compile fuses the dequantization into the two reductions on a GPU, so a
step reads one byte per cached value; on CPU it runs eagerly, the same arithmetic.

The depformer's caches (a few steps deep) stay as they are; so does everything with `--kv-dtype auto`,
which keeps the step token for token equal to the official code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from einops import rearrange
from moshi.modules.transformer import (
    KVCacheResult,
    RingKVCache,
    StreamingMultiheadAttention,
    apply_weights_per_step,
)

KV_DTYPES = ("auto", "int8", "fp8")
_FP8 = torch.float8_e4m3fn
_QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest code magnitude of each format


def _ring_slots(indexes: torch.Tensor, batch: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors for the (row, head, position) of each written value: `indexes` is [B or 1, T], the
    ring positions moshi computes (one row for all when the ring ignores the exec mask)."""
    device = indexes.device
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1)
    return b, h, indexes.view(indexes.shape[0], 1, -1)


class InPlaceRingKVCache(RingKVCache):
    """moshi's `RingKVCache`, writing with `index_put_` where moshi uses `scatter_`: the same values in the
    same slots, and the same bookkeeping. Why: under torch.compile a `scatter_` into the ring becomes an
    out-of-place scatter plus a copy of the whole ring back into it (inductor makes `index_put` in place,
    not `scatter`), every layer, every tick. At batch 1, context 3000, that copy was 1.45 ms of an H200's
    tick (32 × 45 µs, `triton_poi_fused_copy_`; docs/benchmarks.md, session 23) and most of why the
    compiled main transformer ran slower than eager. Used by the compiled tick (engine/compiled_step.py)
    and under the 8-bit caches; `--compile off` keeps moshi's own class."""

    def _write(self, indexes: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        B, H, _T, _D = k.shape
        b, h, t = _ring_slots(indexes, B, H)
        kv = torch.arange(2, device=k.device).view(2, 1, 1, 1)
        # [2, B, H, T] slots of the [2, B, H, S, D] ring, each taking a D-vector.
        self.cache.index_put_((kv, b[None], h[None], t[None]), torch.stack([k, v]).to(self.cache.dtype))

    def complete(self, k: torch.Tensor, v: torch.Tensor, exec_mask: torch.Tensor) -> KVCacheResult:
        # moshi's RingKVCache.complete with the write above; the rest as it is there.
        assert k.shape[:-1] == v.shape[:-1], (k.shape, v.shape)
        B, H, T, D = k.shape
        assert T > 0
        indexes = torch.arange(T, device=self.end_offset.device, dtype=self.end_offset.dtype)
        indexes = (indexes + self.end_offset.view(-1, 1)) % self.capacity
        self._write(indexes, k, v)
        slots = torch.arange(self.capacity, device=self.end_offset.device, dtype=torch.long)
        last_offset = self.end_offset.view(-1, 1) + T - 1  # where the last value was written
        delta = slots - last_offset % self.capacity
        positions = torch.where(delta <= 0, last_offset + delta, last_offset + delta - self.capacity)
        if self.respect_exec_mask:
            self.end_offset[:] = torch.where(exec_mask, self.end_offset + T, self.end_offset)
        else:
            self.end_offset.add_(T)
        invalid = slots >= self.end_offset.view(-1, 1)
        positions = torch.where(invalid, torch.full_like(positions, -1), positions)
        return KVCacheResult(self.cache[0], self.cache[1], positions)


def write_in_place(transformer: torch.nn.Module) -> int:
    """Swaps every moshi `RingKVCache` of `transformer`'s streaming self-attention for `InPlaceRingKVCache`
    (the same tensors: nothing is copied or allocated). Call with it streaming. Returns how many."""
    count = 0
    for module in transformer.modules():
        state = getattr(module, "_streaming_state", None)
        cache = getattr(state, "kv_cache", None)
        if type(cache) is RingKVCache:
            cache.__class__ = InPlaceRingKVCache
            count += 1
    return count


class QuantizedRingKVCache(InPlaceRingKVCache):
    def __init__(
        self, kind: str, batch_size: int, num_heads: int, dim_per_head: int, capacity: int,
        respect_exec_mask: bool, device: torch.device, dtype: torch.dtype,
    ) -> None:
        if kind not in _QMAX:
            raise ValueError(f"unknown 8-bit KV format {kind!r}; expected int8 or fp8")
        # The parent's cache [2, B, H, T, 1] holds the scales, in float32: a bf16 scale would add an
        # error as large as int8's own step.
        super().__init__(batch_size, num_heads, 1, capacity, respect_exec_mask, device, torch.float32)
        self.kind = kind
        self.compute_dtype = dtype
        # fp8 codes are kept as their bytes (uint8): scatter and index_copy are not implemented for float8
        # on every device.
        code_dtype = torch.int8 if kind == "int8" else torch.uint8
        self.k_codes = torch.zeros((batch_size, num_heads, capacity, dim_per_head), device=device, dtype=code_dtype)
        # V transposed, [B, H, D, S]: the weighted sum over positions then reduces along contiguous bytes
        # (0.66 against 0.79 ms a layer at 64 calls on an H100, docs/benchmarks.md); the price is a strided
        # write of one position a step.
        self.v_codes_t = torch.zeros((batch_size, num_heads, dim_per_head, capacity), device=device, dtype=code_dtype)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float()
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / _QMAX[self.kind]
        y = x / scale
        if self.kind == "int8":
            return y.round_().clamp_(-127, 127).to(torch.int8), scale
        return y.to(_FP8).view(torch.uint8), scale

    def store(self, k: torch.Tensor, v: torch.Tensor, exec_mask: torch.Tensor) -> _Stored:
        """Writes this step's K and V (as codes and scales) into the ring; returns the whole window."""
        B, H, T, D = k.shape
        # The write indexes, as the parent computes them, before it advances the offsets.
        idx = (torch.arange(T, device=self.end_offset.device) + self.end_offset.view(-1, 1)) % self.capacity
        (qk, sk), (qv, sv) = self._quantize(k), self._quantize(v)
        # index_put_, in place under torch.compile too (InPlaceRingKVCache); V's codes are [B, H, D, S], and
        # v_codes_t[b, h, :, t] is [B, H, T, D] (advanced indexes first), the shape of qv.
        b, h, t = _ring_slots(idx, B, H)
        self.k_codes.index_put_((b, h, t), qk)
        self.v_codes_t[b, h, :, t] = qv
        scales = super().complete(sk, sv, exec_mask)  # writes the scales, advances, gives positions
        return _Stored(self.k_codes, scales.keys, self.v_codes_t, scales.values, scales.positions)

    def complete(self, k: torch.Tensor, v: torch.Tensor, exec_mask: torch.Tensor) -> KVCacheResult:
        """moshi's interface, for a caller that wants plain K and V: the window dequantized."""
        s = self.store(k, v, exec_mask)
        dtype = self.compute_dtype
        keys = _decode(s.k_codes, self.kind, dtype) * s.k_scales.to(dtype)
        values = _decode(s.v_codes_t, self.kind, dtype).transpose(-1, -2) * s.v_scales.to(dtype)
        return KVCacheResult(keys, values, s.positions)


class _Stored(NamedTuple):
    """The window after a step: K codes [B, H, S, D], V codes transposed [B, H, D, S], float32 scales
    [B, H, S, 1] for each, and the position of each slot [B, S] (-1: empty)."""

    k_codes: torch.Tensor
    k_scales: torch.Tensor
    v_codes_t: torch.Tensor
    v_scales: torch.Tensor
    positions: torch.Tensor


def _decode(codes: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    return (codes.view(_FP8) if kind == "fp8" else codes).to(dtype)


def quantized_attention(
    q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, v_codes_t: torch.Tensor,
    v_scales: torch.Tensor, allowed: torch.Tensor, kind: str,
) -> torch.Tensor:
    """softmax(q·Kᵀ/√d)·V over an 8-bit window, as SDPA with a boolean mask computes it.

    q [B, H, Tq, D]; K codes [B, H, S, D]; V codes transposed [B, H, D, S]; scales [B, H, S, 1]; allowed
    [B, 1, Tq, S]. Per-position scales come out of the sums (q·(s·k) = s·(q·k)), so the codes are read
    once, as they are, in float32 sums, each along its contiguous last dimension.
    """
    dim = q.shape[-1]
    k = _decode(k_codes, kind, torch.float32)
    v_t = _decode(v_codes_t, kind, torch.float32)
    scores = (q.float().unsqueeze(-2) * k.unsqueeze(2)).sum(-1)  # [B, H, Tq, S]
    scores = scores * (k_scales.squeeze(-1).unsqueeze(2) / math.sqrt(dim))
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    weights = weights * v_scales.squeeze(-1).unsqueeze(2)
    out = (weights.unsqueeze(-2) * v_t.unsqueeze(2)).sum(-1)  # [B, H, Tq, D]
    return out.to(q.dtype)


_compiled: Callable[..., torch.Tensor] | None = None


@torch.compiler.disable
def _attend_cuda(*args: object) -> torch.Tensor:
    # Kept out of an enclosing `--compile` graph (a deliberate break there, free inside a CUDA graph): it
    # would inline this function and lose the autotuning, 2.37 ms a layer at 64 calls instead of 0.79.
    global _compiled
    if _compiled is None:
        # Autotuned (13-28 s per shape at warm-up): on an H100 at 64 calls and context 3000, 0.79 ms a layer
        # against 2.37 with the default kernels and 1.04 for bf16 SDPA (docs/benchmarks.md).
        _compiled = torch.compile(quantized_attention, fullgraph=True, dynamic=False, mode="max-autotune-no-cudagraphs")
    return _compiled(*args)


def _attend(*args: object) -> torch.Tensor:
    """`quantized_attention`, compiled on CUDA (first use, per shape: the frame loop's warm-up pays it);
    eager on CPU, where compiling it alone costs tens of seconds for no gain."""
    q = args[0]
    assert isinstance(q, torch.Tensor)
    if q.device.type != "cuda":
        return quantized_attention(*args)  # type: ignore[arg-type]
    return _attend_cuda(*args)


class QuantizedKVAttention(StreamingMultiheadAttention):
    """The main transformer's self-attention over a `QuantizedRingKVCache`: moshi's streaming forward
    with the cache write and SDPA replaced by `store` + `quantized_attention`. Any other state (not
    streaming, or a plain cache after a later `streaming()` with `--kv-dtype auto`) takes moshi's path."""

    kv_dtype: str = "auto"

    def _init_streaming_state(self, batch_size: int):  # type: ignore[no-untyped-def]
        state = super()._init_streaming_state(batch_size)
        old = state.kv_cache
        if self.kv_dtype != "auto" and old is not None:
            # One layer's cache in the compute dtype lives until here, never all of them at once.
            _two, B, H, T, D = old.cache.shape
            state.kv_cache = QuantizedRingKVCache(
                self.kv_dtype, B, H, D, old.capacity, old.respect_exec_mask, old.cache.device, old.cache.dtype
            )
        return state

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        state = self._streaming_state
        if (state is None or not isinstance(state.kv_cache, QuantizedRingKVCache) or self.cross_attention
                or self.kv_repeat != 1 or not self.causal):
            return super().forward(query, key, value)
        T = query.shape[1]
        offset, offset_cpu = state.offset, state.offset_cpu
        projected = apply_weights_per_step(self.in_projs, self.weights_per_step_schedule, query, offset_cpu)
        q, k, v = rearrange(projected, "b t (p h d) -> p b h t d", p=3, h=self.num_heads)
        if self.rope:
            q, k = self.rope(q, k, offset, time_before_heads=False)
        stored = state.kv_cache.store(k, v, state.exec_mask)
        # The mask exactly as moshi builds it.
        pos_k = stored.positions[:, None]
        pos_q = offset.view(-1, 1, 1) + torch.arange(T, device=q.device, dtype=torch.long).view(-1, 1)
        delta = pos_q - pos_k
        allowed = (pos_k >= 0) & (delta >= 0)
        if self.context is not None:
            allowed = allowed & (delta < self.context)
        x = _attend(q, stored.k_codes, stored.k_scales, stored.v_codes_t, stored.v_scales, allowed[:, None],
                    state.kv_cache.kind)
        x = rearrange(x, "b h t d -> b t (h d)")
        x = apply_weights_per_step(self.out_projs, self.weights_per_step_schedule, x, offset_cpu)
        state.offset[:] = torch.where(state.exec_mask, state.offset + T, state.offset)
        state.offset_cpu += T
        return x


def bytes_per_value(kv_dtype: str, compute_dtype: torch.dtype, dim_per_head: int) -> float:
    """KV memory per cached value (K or V element), scales included."""
    if kv_dtype == "auto":
        return torch.finfo(compute_dtype).bits / 8
    return 1.0 + 4.0 / dim_per_head


def kv_cache_bytes(lm: torch.nn.Module, batch: int, kv_dtype: str = "auto") -> int:
    """The main transformer's KV cache for `batch` calls: layers x (K and V) x batch x heads x context x
    head_dim x bytes per value."""
    layers = lm.transformer.layers  # type: ignore[union-attr]
    attn = layers[0].self_attn
    heads, dim = attn.num_heads, attn.embed_dim
    per_value = bytes_per_value(kv_dtype, lm.dtype, dim // heads)  # type: ignore[arg-type]
    return int(len(layers) * 2 * batch * heads * attn.context * (dim // heads) * per_value)


def set_kv_dtype(transformer: torch.nn.Module, kind: str) -> int:
    """Makes `transformer`'s self-attention layers keep their KV caches in `kind` from their next
    `streaming()` on (call it before entering streaming: swapping caches after would first allocate them
    all in the compute dtype, the memory this is meant to save). "auto" restores moshi's own caches.
    Returns how many layers it set."""
    if kind not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kind!r}; expected one of {', '.join(KV_DTYPES)}")
    count = 0
    for module in transformer.modules():
        if not isinstance(module, StreamingMultiheadAttention) or module.cross_attention:
            continue
        if module._streaming_state is not None:
            raise RuntimeError("set_kv_dtype must be called before streaming() is entered")
        if type(module) is StreamingMultiheadAttention:
            if kind == "auto":  # never switched: moshi's own class, untouched
                count += 1
                continue
            module.__class__ = QuantizedKVAttention
        assert isinstance(module, QuantizedKVAttention)
        module.kv_dtype = kind
        count += 1
    return count
