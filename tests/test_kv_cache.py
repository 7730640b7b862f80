"""8-bit KV caches (`--kv-dtype int8|fp8`, engine/kv_cache.py): moshi's ring bookkeeping kept exactly, values
within each format's rounding, attention over the codes equal to SDPA over the dequantized window, every
main-transformer layer switched (and back with auto), the accuracy measurement, and a real call served with it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from moshi.modules.transformer import RingKVCache, StreamingMultiheadAttention

from engine.batch import KameBatch
from engine.checkpoint import load_kame
from engine.interface import FRAME_SAMPLES
from engine.kv_cache import (
    InPlaceRingKVCache,
    QuantizedKVAttention,
    QuantizedRingKVCache,
    _Stored,
    kv_cache_bytes,
    quantized_attention,
    set_kv_dtype,
)
from engine.quant_accuracy import _inputs, _run, measure
from engine.sampling import SamplingConfig
from kame_phone.cli import main
from telephony.sim_caller import simulate_call

from .phone_fixtures import running_phone

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn


def _decoded(codes: torch.Tensor, kind: str) -> torch.Tensor:
    return (codes.view(FP8) if kind == "fp8" else codes).float()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_8bit_ring_keeps_moshis_positions_and_rounds_within_the_format(kind: str) -> None:
    torch.manual_seed(0)
    B, H, D, capacity = 3, 2, 16, 24
    plain = RingKVCache(B, H, D, capacity, True, CPU, torch.float32)
    eight = QuantizedRingKVCache(kind, B, H, D, capacity, True, CPU, torch.float32)
    rng = np.random.default_rng(1)
    for step in range(70):  # past two wraps of the ring
        if step == 40:  # a new call on row 1
            reset = torch.tensor([False, True, False])
            plain.reset(reset)
            eight.reset(reset)
        exec_mask = torch.from_numpy(rng.random(B) > 0.2)  # rows skip steps, as moshi's exec mask makes them
        k = torch.randn(B, H, 1, D) * torch.rand(B, H, 1, 1) * 4
        v = torch.randn(B, H, 1, D)
        want = plain.complete(k, v, exec_mask)
        got = eight.complete(k, v, exec_mask)
        assert torch.equal(got.positions, want.positions)
        filled = (want.positions >= 0)[:, None, :, None]
        for x, y in ((want.keys, got.keys), (want.values, got.values)):
            absmax = x.abs().amax(-1, keepdim=True)
            bound = absmax / 254 if kind == "int8" else x.abs() / 16 + absmax / 448 * 2**-9
            assert bool(((y - x).abs() <= bound + 1e-6)[filled.expand_as(x)].all()), step
    assert eight.k_codes.dtype == eight.v_codes_t.dtype == (torch.int8 if kind == "int8" else torch.uint8)
    assert eight.v_codes_t.shape == (B, H, D, capacity)  # V transposed: the weighted sum reads along positions
    assert eight.cache.dtype == torch.float32 and eight.cache.shape[-1] == 1  # the scales, one per vector


@pytest.mark.parametrize("T", [1, 3])  # a step, and a block of frames at once
@pytest.mark.parametrize("respect_exec_mask", [True, False])
@pytest.mark.parametrize("kind", ["bf16-style", "int8"])
def test_the_in_place_ring_writes_what_moshis_ring_writes(kind: str, respect_exec_mask: bool, T: int) -> None:
    torch.manual_seed(3)
    B, H, D, capacity = 3, 2, 8, 11
    ref = RingKVCache(B, H, D, capacity, respect_exec_mask, CPU, torch.float32)
    if kind == "int8":
        ours: RingKVCache = QuantizedRingKVCache("int8", B, H, D, capacity, respect_exec_mask, CPU, torch.float32)
        twin = QuantizedRingKVCache("int8", B, H, D, capacity, respect_exec_mask, CPU, torch.float32)
        twin.__class__ = _ScatterQuantizedRing  # the same codes written with moshi's scatter_, as before
    else:
        ours = InPlaceRingKVCache(B, H, D, capacity, respect_exec_mask, CPU, torch.float32)
    rng = np.random.default_rng(4)
    for step in range(40):  # past three wraps
        if step == 17 and respect_exec_mask:  # (moshi resets per row only in that mode)
            reset = torch.tensor([False, True, True])
            for cache in (ref, ours) + ((twin,) if kind == "int8" else ()):
                cache.reset(reset)
        exec_mask = torch.from_numpy(rng.random(B) > 0.25)
        k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
        want, got = ref.complete(k, v, exec_mask), ours.complete(k, v, exec_mask)
        assert torch.equal(got.positions, want.positions) and torch.equal(ours.end_offset, ref.end_offset)
        if kind == "int8":
            twin.complete(k, v, exec_mask)
            for name in ("k_codes", "v_codes_t", "cache"):
                assert torch.equal(getattr(ours, name), getattr(twin, name)), (step, name)
        else:
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values), step


class _ScatterQuantizedRing(QuantizedRingKVCache):
    """The 8-bit ring's write as it was before session 23 (scatter_ / index_copy_), for comparison."""

    def store(self, k, v, exec_mask):  # type: ignore[no-untyped-def]
        B, H, T, D = k.shape
        idx = (torch.arange(T) + self.end_offset.view(-1, 1)) % self.capacity
        (qk, sk), (qv, sv) = self._quantize(k), self._quantize(v)
        if self.respect_exec_mask:
            self.k_codes.scatter_(2, idx.view(B, 1, T, 1).expand(-1, H, T, D), qk)
            self.v_codes_t.scatter_(3, idx.view(B, 1, 1, T).expand(-1, H, D, T), qv.transpose(-1, -2))
        else:
            self.k_codes.index_copy_(2, idx[0], qk)
            self.v_codes_t.index_copy_(3, idx[0], qv.transpose(-1, -2))
        scales = RingKVCache.complete(self, sk, sv, exec_mask)
        return _Stored(self.k_codes, scales.keys, self.v_codes_t, scales.values, scales.positions)


def test_compiled_the_in_place_ring_does_not_copy_itself() -> None:
    """What the class is for: torch.compile (inductor, here its CPU code) writes one step into the ring
    without a pass over the whole ring. moshi's scatter_ compiles to a scatter into a copy and a copy back."""
    from torch._inductor.utils import run_and_get_code

    B, H, D, capacity = 3, 5, 8, 67  # a ring of 3 * 5 * 67 * 8 = 8040 values a side
    ring = InPlaceRingKVCache(B, H, D, capacity, True, CPU, torch.float32)
    k, v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)

    def write(k: torch.Tensor, v: torch.Tensor, exec_mask: torch.Tensor) -> torch.Tensor:
        return ring.complete(k, v, exec_mask).positions  # the window itself is not read

    torch._dynamo.reset()
    try:
        _, code = run_and_get_code(torch.compile(write, dynamic=False), k, v, torch.ones(B, dtype=torch.bool))
    finally:
        torch._dynamo.reset()
    # The loops' bounds in inductor's C++ (`x0<static_cast<int64_t>(8040L)` is a pass over one side of the
    # ring, as moshi's ring compiles to here): none may cover even one row's side of the ring.
    bounds = [int(n) for n in re.findall(r"<\s*static_cast<int64_t>\((\d+)L\)", "\n".join(code))]
    assert bounds, "inductor's C++ changed shape: this test reads its loop bounds"
    assert max(bounds) < H * capacity * D, sorted(set(bounds))
    assert torch.equal(ring.cache[0][:, :, 0:1], k) and torch.equal(ring.cache[1][:, :, 0:1], v)  # it did write


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("tq", [1, 3])
def test_attention_over_the_codes_is_sdpa_over_the_dequantized_window(kind: str, tq: int) -> None:
    torch.manual_seed(2)
    B, H, S, D = 2, 4, 40, 32
    if kind == "int8":
        k_codes = torch.randint(-127, 128, (B, H, S, D), dtype=torch.int8)
        v_codes = torch.randint(-127, 128, (B, H, S, D), dtype=torch.int8)
    else:
        k_codes = (torch.randn(B, H, S, D) * 100).to(FP8).view(torch.uint8)
        v_codes = (torch.randn(B, H, S, D) * 100).to(FP8).view(torch.uint8)
    k_scales, v_scales = torch.rand(B, H, S, 1) / 50, torch.rand(B, H, S, 1) / 50
    q = torch.randn(B, H, tq, D)
    allowed = torch.rand(B, 1, tq, S) > 0.3
    allowed[..., 0] = True  # never a fully masked row
    got = quantized_attention(q, k_codes, k_scales, v_codes.transpose(-1, -2), v_scales, allowed, kind)
    want = F.scaled_dot_product_attention(
        q, _decoded(k_codes, kind) * k_scales, _decoded(v_codes, kind) * v_scales, allowed
    )
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    # The mask matters: a slot it hides does not count.
    hidden = ~allowed[0, 0, 0]
    if hidden.any():
        v2 = v_codes.clone()
        v2[0, :, hidden] = 0
        again = quantized_attention(q, k_codes, k_scales, v2.transpose(-1, -2), v_scales, allowed, kind)
        assert torch.allclose(again[0, :, 0], got[0, :, 0], atol=1e-6)


def _kv_caches(module: torch.nn.Module) -> list[object]:
    return [m._streaming_state.kv_cache for m in module.modules()
            if hasattr(m, "_streaming_state") and getattr(m._streaming_state, "kv_cache", None) is not None]


def _greedy_tokens(batch: KameBatch, steps: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    active = np.ones(batch.batch_size, dtype=bool)
    batch.reset_rows(active)
    out = []
    for _ in range(steps):
        pcm = (0.1 * rng.standard_normal((batch.batch_size, FRAME_SAMPLES))).astype(np.float32)
        step = batch.step(pcm, active, rng.integers(4, 200, size=batch.batch_size))
        out.append(np.concatenate([step.text[:, None], step.codes], axis=1))
    return np.stack(out)


def test_kv_dtype_switches_every_main_layer_and_auto_switches_back(
    tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    greedy = SamplingConfig(use_sampling=False)
    fresh = load_kame(str(tiny_checkpoint))
    baseline = KameBatch(fresh.lm, fresh.mimi, 2, greedy)
    # auto, the default, leaves moshi's attention as it is: the step the official code runs.
    assert all(type(layer.self_attn) is StreamingMultiheadAttention for layer in fresh.lm.transformer.layers)
    want = _greedy_tokens(baseline, 12)
    baseline.close()

    bundle = load_kame(str(tiny_checkpoint))
    layers = len(bundle.lm.transformer.layers)
    with caplog.at_level(logging.INFO, logger="engine.batch"):
        eight = KameBatch(bundle.lm, bundle.mimi, 2, greedy, kv_dtype="int8")
    # The operator sees what the cache takes: tiny's 2 layers x K,V x 2 calls x 4 heads x 64 x 16 x (1 + 4/16) B.
    assert "KV cache int8 0.00 GB (2 slots at context 64 frames)" in caplog.text
    assert eight.memory.kv_cache_bytes == kv_cache_bytes(bundle.lm, 2, "int8") and eight.memory.weights_dtype == "auto"
    assert kv_cache_bytes(bundle.lm, 2, "int8") == 2 * 2 * 2 * 4 * 64 * 16 * 1.25
    main_caches = _kv_caches(bundle.lm.transformer)
    assert len(main_caches) == layers and all(isinstance(c, QuantizedRingKVCache) for c in main_caches)
    assert all(isinstance(m.self_attn, QuantizedKVAttention) for m in bundle.lm.transformer.layers)
    depformer = [m for m in bundle.lm.depformer.modules() if isinstance(m, StreamingMultiheadAttention)]
    assert depformer and all(type(m) is StreamingMultiheadAttention for m in depformer)  # left as it is
    with pytest.raises(RuntimeError, match="before streaming"):
        set_kv_dtype(bundle.lm.transformer, "fp8")
    _greedy_tokens(eight, 12)  # runs
    eight.close()

    # The same modules, back to moshi's own caches: token for token what a model never switched gives.
    again = KameBatch(bundle.lm, bundle.mimi, 2, greedy, kv_dtype="auto")
    assert all(type(c) is RingKVCache for c in _kv_caches(bundle.lm.transformer))
    assert np.array_equal(_greedy_tokens(again, 12), want)
    again.close()
    with pytest.raises(ValueError, match="unknown KV dtype"):
        set_kv_dtype(bundle.lm.transformer, "int4")


def test_accuracy_is_measured_against_the_models_own_cache(tiny_checkpoint: Path, tmp_path: Path) -> None:
    bundle = load_kame(str(tiny_checkpoint))
    same = measure(bundle.lm, bundle.mimi, ["auto"], steps=40, log=lambda _line: None)[0]
    # The baseline is deterministic, so any difference below is the cache's.
    assert same.token_agreement == 1.0 and same.first_divergence_step is None and same.logit_max_abs_err == 0.0
    assert same.forced_text_top1 == same.forced_audio_top1 == 1.0
    assert same.forced_text_max_abs_err == same.forced_text_rel_err == same.forced_audio_rel_err == 0.0
    # Each variant's result is handed on as it is measured (the bench writes its JSON then: a GPU call cut
    # short by its time limit keeps what it measured).
    seen: list[list[str]] = []
    measure(bundle.lm, bundle.mimi, ["auto", "int8"], steps=5, log=lambda _line: None,
            on_result=lambda rs: seen.append([r.kv_dtype for r in rs]))
    assert seen == [["auto"], ["auto", "int8"]]

    out = tmp_path / "kv.json"
    # The checkpoint's own weights (the figure to take for a real model), past its 64-frame ring's wrap.
    assert main(["bench", "kv", "--checkpoint", str(tiny_checkpoint), "--steps", "80", "--weights-dtype", "auto",
                 "--json", str(out)]) == 0
    results = {r["kv_dtype"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"int8", "fp8"}
    for kind, r in results.items():
        assert r["steps"] == 80 and r["batch"] == 2
        assert 0.0 <= r["token_agreement"] <= 1.0 and 0.0 <= r["text_agreement"] <= 1.0
        # Close, not equal: the logits move by about the format's rounding, until a token flips.
        assert 0.0 < r["logit_rel_err"] < 0.1, (kind, r)
        # Teacher-forced over all 80 steps, past the wrap: the variant's own picks mostly agree, its logits
        # stay close (the mean below the worst step).
        assert 0.8 < r["forced_text_top1"] <= 1.0 and 0.8 < r["forced_audio_top1"] <= 1.0, (kind, r)
        assert 0.0 < r["forced_text_rel_err_mean"] <= r["forced_text_rel_err"] < 0.1, (kind, r)
        assert 0.0 < r["forced_audio_rel_err_mean"] <= r["forced_audio_rel_err"] < 0.1, (kind, r)
    assert main(["bench", "kv", "--kv-dtype", "int4"]) == 2


def test_teacher_forcing_feeds_the_reference_tokens(tiny_checkpoint: Path) -> None:
    """The teacher-forced run is only comparable if it really sees the reference's history: an fp8 cache
    flips a free run's tokens at once, yet forced it returns the reference's tokens at every step, while
    its own logits (recorded before forcing) still differ."""
    bundle = load_kame(str(tiny_checkpoint))
    pcm, oracle = _inputs(bundle.lm, 2, 30, seed=1)
    ref = _run(bundle.lm, bundle.mimi, "auto", pcm, oracle)
    free = _run(bundle.lm, bundle.mimi, "fp8", pcm, oracle)
    forced = _run(bundle.lm, bundle.mimi, "fp8", pcm, oracle, force=ref)
    assert not np.array_equal(free.tokens, ref.tokens)
    assert np.array_equal(forced.tokens, ref.tokens)
    assert len(forced.logits) == 30 and len(forced.audio_logits) == bundle.lm.dep_q
    assert all(len(cb) == 30 for cb in forced.audio_logits)
    assert any(not torch.equal(a, b) for a, b in zip(ref.logits, forced.logits, strict=True))


def test_engine_bench_reports_its_kv_dtype(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--size", "tiny", "--batch", "2", "--ticks", "3", "--warmup", "1",
                 "--device", "cpu", "--kv-dtype", "fp8", "--json", str(out)]) == 0
    auto = tmp_path / "auto.json"
    assert main(["bench", "engine", "--size", "tiny", "--batch", "2", "--ticks", "3", "--warmup", "1",
                 "--device", "cpu", "--json", str(auto)]) == 0
    report, plain = json.loads(out.read_text()), json.loads(auto.read_text())
    assert report["kv_dtype"] == "fp8" and plain["kv_dtype"] == "auto"
    # One byte and a float32 scale per head-dim vector, against the tiny model's float32 (4 bytes): 5/16 at
    # its head dim of 16; (1 + 4/128)/2 against bf16 at full size.
    ratio = report["results"][0]["kv_cache_gb"] / plain["results"][0]["kv_cache_gb"]
    assert 0.25 < ratio <= 0.32, ratio


async def test_a_phone_call_on_an_int8_kv_cache(tiny_checkpoint: Path, question_wav: Path) -> None:
    async with running_phone(tiny_checkpoint, kv_dtype="int8") as phone:
        caches = _kv_caches(phone.engine.frame_loop.batch.lm.transformer)
        assert caches and all(isinstance(c, QuantizedRingKVCache) for c in caches)
        report = await simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base,
                                     hold_after=1.0)
    assert report.outcome == "completed", report.errors
    assert report.bot_seconds_received > 0.6 * report.call_seconds  # in real time, on the 8-bit cache
    assert report.first_audio_latency_s is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel is CUDA-only")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_compiled_kernel_matches_the_eager_one_on_a_gpu(kind: str) -> None:
    from engine.kv_cache import _attend

    dev = torch.device("cuda")
    B, H, S, D = 4, 8, 300, 128
    cache = QuantizedRingKVCache(kind, B, H, D, S, True, dev, torch.bfloat16)
    k, v = torch.randn(2, B, H, S, D, device=dev, dtype=torch.bfloat16)
    stored = cache.store(k, v, torch.ones(B, dtype=torch.bool, device=dev))
    q = torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16)
    allowed = torch.ones(B, 1, 1, S, dtype=torch.bool, device=dev)
    got = _attend(q, *stored[:4], allowed, kind).float()
    want = quantized_attention(q, *stored[:4], allowed, kind).float()
    assert torch.allclose(got, want, atol=2e-3, rtol=1e-2)
    assert math.isfinite(float(got.abs().max()))
