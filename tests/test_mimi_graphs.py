"""Mimi's quantizer in CUDA graphs (engine/mimi_graphs.py): for the life of one batch, and the same codes."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
from moshi.models import loaders
from moshi.utils.compile import CUDAGraphed

from engine.batch import KameBatch
from engine.mimi_graphs import graph_quantizer, quantizer_eager, quantizer_is_graphed
from engine.presets import mimi_config_for
from engine.sampling import SamplingConfig
from knowledge.stt_kyutai import KyutaiSttEngine
from knowledge.tiny_stt_checkpoint import make_tiny_stt_checkpoint


def _step(batch: KameBatch, rng: np.random.Generator) -> None:
    B = batch.batch_size
    batch.step((rng.standard_normal((B, 1920)) * 0.05).astype(np.float32), np.ones(B, bool), np.full(B, 3))


def test_a_batch_graphs_its_quantizer_while_it_streams_and_the_next_batch_size_gets_its_own(tiny_bundle) -> None:
    # On a GPU a graph is captured at one shape: a bench that runs batch 1, then 48 on the same model must
    # get fresh graphs, or batch 48 would feed a batch-1 graph and fail.
    rng = np.random.default_rng(0)
    mimi = tiny_bundle.mimi
    first = KameBatch(tiny_bundle.lm, mimi, 2, SamplingConfig())
    assert quantizer_is_graphed(mimi)
    graphs = dict(vars(mimi.quantizer))
    for _ in range(3):
        _step(first, rng)
    first.close()
    assert not quantizer_is_graphed(mimi)
    assert "encode" not in vars(mimi.quantizer)  # the class's own methods again

    second = KameBatch(tiny_bundle.lm, mimi, 3, SamplingConfig())
    try:
        assert quantizer_is_graphed(mimi)
        assert vars(mimi.quantizer)["encode"] is not graphs["encode"]
        for _ in range(3):
            _step(second, rng)
    finally:
        second.close()


def test_graphs_already_in_place_are_left_to_whoever_made_them(tiny_bundle) -> None:
    mimi = tiny_bundle.mimi
    with mimi.streaming(1), graph_quantizer(mimi):
        outer = vars(mimi.quantizer)["encode"]
        graph_quantizer(mimi).close()  # an inner one: neither replaces nor removes the outer graphs
        assert vars(mimi.quantizer)["encode"] is outer
    assert not quantizer_is_graphed(mimi)


def test_a_benchmark_can_run_the_quantizer_eager_for_a_while(tiny_bundle) -> None:
    mimi = tiny_bundle.mimi
    with mimi.streaming(1), graph_quantizer(mimi):
        graphs = dict(vars(mimi.quantizer))
        with quantizer_eager(mimi):
            assert not quantizer_is_graphed(mimi)
            mimi.encode(torch.zeros(1, 1, 1920))  # the class's methods answer
        assert vars(mimi.quantizer)["encode"] is graphs["encode"]  # the same graphs (captured ones kept)


def test_the_stt_engine_graphs_its_quantizer_until_it_closes(tmp_path: Path) -> None:
    engine = KyutaiSttEngine(str(make_tiny_stt_checkpoint(tmp_path)), "cpu", 2, start=False)
    try:
        assert quantizer_is_graphed(engine.mimi)
        assert isinstance(vars(engine.mimi.quantizer)["decode"], CUDAGraphed)
    finally:
        engine.close()
    assert not quantizer_is_graphed(engine.mimi)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the GPU box)")
@pytest.mark.parametrize("codebooks", [8, 32])  # the engine's Mimi, Kyutai STT's
def test_graphed_quantizer_gives_the_eager_codes_and_audio_on_cuda(codebooks: int) -> None:
    torch.manual_seed(0)
    mimi = loaders.get_mimi(None, mimi_config_for("moshi-7b"), device="cuda", num_codebooks=codebooks)
    frames = torch.randn(12, 3, 1, 1920, device="cuda") * 0.1

    def run(graphed: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # moshi's own graphs (encoder, decoder, transformers) in both runs: only the quantizer's differ.
        codes, pcm = [], []
        with torch.no_grad(), mimi.streaming(3), ExitStack() as stack:
            if graphed:
                stack.enter_context(graph_quantizer(mimi))
            for frame in frames:
                c = mimi.encode(frame)
                codes.append(c.clone())  # a graph's output is overwritten by its next replay
                pcm.append(mimi.decode(c).clone())
            if graphed:
                assert vars(mimi.quantizer)["encode"]._graph is not None  # it did capture and replay
        return codes, pcm

    eager_codes, eager_pcm = run(graphed=False)
    graphed_codes, graphed_pcm = run(graphed=True)
    for e, g in zip(eager_codes, graphed_codes, strict=True):
        assert torch.equal(e, g)
    for e, g in zip(eager_pcm, graphed_pcm, strict=True):
        torch.testing.assert_close(g, e)
