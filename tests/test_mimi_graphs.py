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


def test_a_batch_that_fails_half_way_leaves_the_model_as_it_found_it(tiny_bundle) -> None:
    # compile_tick refuses the mode after streaming, the quantizer's graphs and all were entered.
    with pytest.raises(ValueError, match="compile mode"):
        KameBatch(tiny_bundle.lm, tiny_bundle.mimi, 2, SamplingConfig(), compile_mode="bogus")
    assert tiny_bundle.lm._streaming_state is None and tiny_bundle.mimi._streaming_state is None
    assert not quantizer_is_graphed(tiny_bundle.mimi)
    batch = KameBatch(tiny_bundle.lm, tiny_bundle.mimi, 3, SamplingConfig())  # the next one starts clean
    try:
        _step(batch, np.random.default_rng(1))
    finally:
        batch.close()


def test_graphs_found_in_place_are_replaced_for_the_batch_and_given_back_after(tiny_bundle) -> None:
    # Graphs left by a batch that failed half way were captured at its size: the next batch must not adopt
    # them (on a GPU it would feed them its own shape and fail), and a holder's are its own again after.
    mimi = tiny_bundle.mimi
    with mimi.streaming(1):
        outer = graph_quantizer(mimi)
        left = vars(mimi.quantizer)["encode"]
        inner = graph_quantizer(mimi)
        assert vars(mimi.quantizer)["encode"] is not left
        assert vars(mimi.quantizer)["encode"].func.__func__ is type(mimi.quantizer).encode  # the method, not a graph
        inner.close()
        assert vars(mimi.quantizer)["encode"] is left
        outer.close()
    assert not quantizer_is_graphed(mimi) and "decode" not in vars(mimi.quantizer)


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
def test_graphed_quantizer_gives_the_eager_codes_and_latents_on_cuda(codebooks: int) -> None:
    torch.manual_seed(0)
    mimi = loaders.get_mimi(None, mimi_config_for("moshi-7b"), device="cuda", num_codebooks=codebooks)
    quantizer = mimi.quantizer
    # A fresh Mimi's codebooks are all zero, and a random encoder gives every frame the same latent: random
    # centroids and random latents, so every frame has codes of its own and a stale replay (the previous
    # frame's input, the capture's output) shows.
    for module in quantizer.modules():
        if hasattr(module, "embedding_sum") and hasattr(module, "cluster_usage"):
            module.embedding_sum.normal_()
            module.cluster_usage.fill_(1.0)
            module.register_buffer("_embedding", None, persistent=False)
    latents = torch.randn(12, 3, quantizer.rvq_first.input_proj.in_channels, 1, device="cuda")

    def run(graphed: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        codes, back = [], []
        with torch.no_grad(), ExitStack() as stack:
            if graphed:
                stack.enter_context(graph_quantizer(mimi))
            for latent in latents:
                c = quantizer.encode(latent)
                codes.append(c.clone())  # a graph's output is overwritten by its next replay
                back.append(quantizer.decode(c).clone())
            if graphed:
                assert vars(quantizer)["encode"]._graph is not None  # it did capture, and replayed the rest
                assert vars(quantizer)["decode"]._graph is not None
        return codes, back

    eager_codes, eager_back = run(graphed=False)
    graphed_codes, graphed_back = run(graphed=True)
    assert len({tuple(c.flatten().tolist()) for c in eager_codes}) == len(latents)  # every frame its own codes
    for e, g in zip(eager_codes, graphed_codes, strict=True):
        assert torch.equal(e, g)
    for e, g in zip(eager_back, graphed_back, strict=True):
        torch.testing.assert_close(g, e)
