"""`--compile` (engine/compiled_step.py): the compiled tick gives the uncompiled tick's tokens, sampled and
seeded, through joins, idle rows and a reset, on moshi's bf16-style cache and on int8; nothing recompiles
once warm; the depformer that streams for the batch's life gives moshi's own step's tokens; the flag reaches
a real phone call.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo
from moshi.modules.transformer import RingKVCache
from moshi.utils import compile as moshi_compile

from engine.batch import KameBatch
from engine.checkpoint import load_kame
from engine.compiled_step import PersistentDepformerStep
from engine.interface import FRAME_SAMPLES
from engine.kv_cache import InPlaceRingKVCache
from engine.sampling import SamplingConfig
from kame_phone.cli import build_parser, main
from telephony.sim_caller import simulate_call

from .phone_fixtures import running_phone

SLOTS, TICKS = 3, 24


def _script(text_card: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Caller audio, oracle tokens and who is active each tick: row 2 idles every third tick (idle rows
    are the norm in a frame loop with free slots)."""
    rng = np.random.default_rng(3)
    pcm = (0.1 * rng.standard_normal((TICKS, SLOTS, FRAME_SAMPLES))).astype(np.float32)
    oracle = rng.integers(4, text_card, size=(TICKS, SLOTS))
    active = np.ones((TICKS, SLOTS), dtype=bool)
    active[::3, 2] = False
    return pcm, oracle, active


def _tokens(kb: KameBatch, warm: int = 0) -> np.ndarray:
    """Steps the script (a reset of row 1 halfway) with sampling seeded; ticks after `warm` must not
    recompile anything."""
    pcm, oracle, active = _script(kb.lm.text_card)
    torch.manual_seed(0)
    kb.reset_rows(np.ones(SLOTS, dtype=bool))
    out = []
    for t in range(TICKS):
        if t == TICKS // 2:
            kb.reset_rows(np.array([False, True, False]))  # a new call takes row 1
        with torch._dynamo.config.patch(error_on_recompile=t >= warm):
            r = kb.step(pcm[t], active[t], oracle[t])
        out.append(np.concatenate([r.text[:, None], r.codes, r.voiced[:, None]], axis=1))
    return np.stack(out)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path):  # type: ignore[no-untyped-def]
    return load_kame(str(tiny_checkpoint), "cpu", torch.float32)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_depformer_streaming_for_the_batchs_life_gives_moshis_tokens(tiny, kv_dtype: str) -> None:  # type: ignore[no-untyped-def]
    want = _run(tiny, kv_dtype, "off")
    kb = KameBatch(tiny.lm, tiny.mimi, SLOTS, SamplingConfig(), kv_dtype=kv_dtype)
    state = kb.lm_gen._streaming_state
    with ExitStack() as stack:
        state.graphed_depth.func = PersistentDepformerStep(kb.lm_gen, SLOTS, stack)  # uncompiled
        got = _tokens(kb)
        kb.close()
    # int8 is the case that catches a stale ring: an idle row's all-masked softmax leaves NaN in it.
    assert np.array_equal(got, want)


def _run(tiny, kv_dtype: str, compile_mode: str, warm: int = 0) -> np.ndarray:  # type: ignore[no-untyped-def]
    kb = KameBatch(tiny.lm, tiny.mimi, SLOTS, SamplingConfig(), kv_dtype=kv_dtype, compile_mode=compile_mode)
    # As on a GPU, where moshi compiles its norms, rotary embedding and gating itself, lazily (KameBatch
    # turns that off on CPU): the compiled tick must take them in as plain code all the same.
    disabled, moshi_compile._compile_disabled = moshi_compile._compile_disabled, compile_mode == "off"
    try:
        return _tokens(kb, warm)
    finally:
        moshi_compile._compile_disabled = disabled
        kb.close()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_compiled_tick_gives_the_same_tokens_and_never_recompiles(tiny, kv_dtype: str) -> None:  # type: ignore[no-untyped-def]
    want = _run(tiny, kv_dtype, "off")
    torch._dynamo.utils.counters.clear()
    # Warm after the first tick: joins, idle rows and the reset later on are all the same compiled code.
    got = _run(tiny, kv_dtype, "default", warm=1)
    assert np.array_equal(got, want)
    assert got[:, :, -1].any()  # voiced ticks were compared, not only silence
    # Whole graphs (main transformer, depformer steps, Mimi's encoder, decoder and two transformers: six
    # when nothing was compiled before; the other cache's run reuses all but the main transformer's).
    assert not torch._dynamo.utils.counters["graph_break"]
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 6
    # A second batch of the same shape reuses the compiled code (the frame loop's warm-up already paid).
    torch._dynamo.utils.counters.clear()
    assert np.array_equal(_run(tiny, kv_dtype, "default", warm=0), want)
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _main_rings(lm) -> list:  # type: ignore[no-untyped-def]
    return [m._streaming_state.kv_cache for m in lm.transformer.modules()
            if getattr(getattr(m, "_streaming_state", None), "kv_cache", None) is not None]


def test_the_compiled_main_transformer_writes_its_ring_in_place_and_off_keeps_moshis(tiny) -> None:  # type: ignore[no-untyped-def]
    """Compiled, moshi's scatter_ into the KV ring copies the whole ring each layer each tick (1.45 ms at
    batch 1 on an H200): the compiled main transformer's rings are InPlaceRingKVCache (the same tensors,
    written with index_put_; the token test above runs on them); `off`, the official step, keeps moshi's."""
    for mode, want in (("default", InPlaceRingKVCache), ("off", RingKVCache)):
        kb = KameBatch(tiny.lm, tiny.mimi, SLOTS, SamplingConfig(), compile_mode=mode)
        try:
            rings = _main_rings(tiny.lm)
            assert len(rings) == len(tiny.lm.transformer.layers) and {type(r) for r in rings} == {want}, mode
        finally:
            kb.close()


def test_all_but_the_main_transformer_compiled_gives_the_same_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    """`--compile default-no-main`: on the H100 the compiled main transformer was 2 ms slower than the official
    one while the compiled depformer was twice as fast; this mode keeps the main transformer's step as it is
    (its function behind the CUDA graph untouched) and compiles the rest."""
    kb = KameBatch(tiny.lm, tiny.mimi, SLOTS, SamplingConfig(), compile_mode="default-no-main")
    try:
        state = kb.lm_gen._streaming_state
        assert state.graphed_main.func == tiny.lm.forward_text  # the official step, not a compiled one
        assert isinstance(state.graphed_depth.func, PersistentDepformerStep)
        assert {type(c) for c in _main_rings(tiny.lm)} == {RingKVCache}  # and moshi's own ring write
    finally:
        kb.close()
    assert np.array_equal(_run(tiny, "auto", "default-no-main", warm=1), _run(tiny, "auto", "off"))


def test_the_compiled_tick_on_int8_weights_and_cache(tiny_checkpoint: Path) -> None:
    """The dense deployment's tick (`--weights-dtype int8 --kv-dtype int8 --compile default`): the int8
    matmul traces into the graphs (no break) and gives the uncompiled step's tokens."""
    eight = load_kame(str(tiny_checkpoint), "cpu", torch.float32, weights_dtype="int8")
    want = _run(eight, "int8", "off")
    torch._dynamo.utils.counters.clear()
    got = _run(eight, "int8", "default", warm=1)
    assert np.array_equal(got, want) and got[:, :, -1].any()
    assert not torch._dynamo.utils.counters["graph_break"]


def test_the_bench_refuses_an_unknown_compile_mode() -> None:  # serve's flag: tests/test_engine_flags.py
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "engine", "--compile", "fast"])


def test_the_engine_bench_splits_a_tick_into_phases(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "engine", "--size", "tiny", "--batch", "2", "--ticks", "5", "--warmup", "1",
                 "--device", "cpu", "--phases", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["compile_mode"] == "off"
    (result,) = report["results"]
    phases = result["phases_p50_ms"]
    assert set(phases) == {"encode", "main", "depformer", "decode", "other"}
    assert all(phases[p] > 0 for p in ("encode", "main", "depformer", "decode"))
    # "other" is each tick less its four phases: the phases were timed inside the ticks they belong to.
    assert phases["other"] >= 0


async def test_a_phone_call_on_the_compiled_tick(tiny_checkpoint: Path, question_wav: Path) -> None:
    async with running_phone(tiny_checkpoint, compile_mode="default") as phone:
        assert phone.engine.frame_loop.batch.compile_mode == "default"
        report = await simulate_call(phone.ws_url, question_wav, auth_token=phone.token, public_url=phone.base,
                                     hold_after=1.0)
    assert report.outcome == "completed", report.errors
    assert report.bot_seconds_received > 0.6 * report.call_seconds  # in real time
    assert report.first_audio_latency_s is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_compiled_tick_inside_cuda_graphs(tiny_checkpoint: Path, kv_dtype: str) -> None:
    """On a GPU the compiled functions are captured by moshi's CUDA graphs (one eager call, then capture,
    then replays), and with int8 the attention breaks out to its own compiled kernel inside the capture."""
    bundle = load_kame(str(tiny_checkpoint), "cuda", torch.float32)
    want = _run(bundle, kv_dtype, "off")
    got = _run(bundle, kv_dtype, "default", warm=1)  # the capture (second call) compiles nothing new
    # fp32 on both sides; fused reductions may round differently, so only the first ticks must agree exactly
    # (random weights make greedy-like decoding chaotic after a near tie).
    assert np.array_equal(got[:8], want[:8])
    assert (got == want).mean() > 0.5
