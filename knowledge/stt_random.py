"""Kyutai STT with random weights in the real layout: `KAME_STT_CHECKPOINT=random:stt-2.6b-en`.

For capacity tests of a GPU node before the weights are there (issue 15's whole-node figure): the STT's
work on the GPU (Mimi encode of every call's audio, one LM step a frame for the whole batch) has the
shape of the real model's, and speed does not depend on the weights' values; the transcripts are noise.
`random:tiny` is the tests' small model (knowledge/tiny_stt_checkpoint.py's layout) without its files.

stt-2.6b-en's layout, as Hugging Face transformers' KyutaiSpeechToTextConfig defaults describe it (they
are that model's): dim 2048, 48 layers, 32 heads, a SiLU-gated FFN of 11264 (hidden_scale 4.125 in
moshi's terms), a 375-frame attention window, 4001 text ids (text_card 4000), 2048 audio bins, 32
codebooks read undelayed, no depformer; its stt_config (2.5 s text delay, 1 s silence prefix) as
knowledge/stt_kyutai.py records it. Mimi is moshi's default (full-size) codec. One change: the text
vocabulary is the tiny test tokenizer's 256 ids, not 4000 (0.6 % of the weights), so that what the random
model says decodes to words and drives the LLM and oracle path as a caller's speech would; with 4000 ids
most of its tokens fall past the tokenizer and a whole-node run saw no LLM request at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import sentencepiece
from moshi.models import loaders

from engine.checkpoint import CheckpointError
from engine.presets import TINY_TEXT_CARD
from engine.tiny_checkpoint import train_tiny_tokenizer

from .tiny_stt_checkpoint import STT_N_Q, TINY_STT_CONFIG, TINY_STT_LM_KWARGS, tiny_stt_mimi_config

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"

STT_2B6_LM_KWARGS: dict[str, Any] = {
    "dim": 2048,
    "text_card": TINY_TEXT_CARD,  # stt-2.6b-en: 4000 (see above)
    "existing_text_padding_id": 3,
    "n_q": STT_N_Q,
    "dep_q": 0,
    "card": 2048,
    "num_heads": 32,
    "num_layers": 48,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 375,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "conditioners": {},
    "cross_attention": False,
    "delays": [0] * (STT_N_Q + 1),
}


@dataclass(frozen=True)
class _Size:
    lm_kwargs: dict[str, Any]
    mimi_config: dict[str, Any] | None  # None: moshi's default Mimi
    stt_config: dict[str, float]


SIZES = {
    "stt-2.6b-en": _Size(STT_2B6_LM_KWARGS, None, {"audio_delay_seconds": 2.5, "audio_silence_prefix_seconds": 1.0}),
    "tiny": _Size(TINY_STT_LM_KWARGS, tiny_stt_mimi_config(), dict(TINY_STT_CONFIG)),
}


class _RandomInfo(loaders.CheckpointInfo):
    """moshi's CheckpointInfo with no files: LM and Mimi built uninitialised (random), the tokenizer in memory."""

    def get_text_tokenizer(self) -> sentencepiece.SentencePieceProcessor:
        return sentencepiece.SentencePieceProcessor(model_proto=train_tiny_tokenizer())


def random_stt_info(source: str) -> loaders.CheckpointInfo:
    name = source.removeprefix(RANDOM_PREFIX)
    size = SIZES.get(name)
    if size is None:
        raise CheckpointError(f"KAME_STT_CHECKPOINT={source}: unknown size; choose one of "
                              f"{', '.join(RANDOM_PREFIX + s for s in SIZES)}")
    log.warning("STT checkpoint %s: RANDOM WEIGHTS, for capacity tests only; transcripts are noise", source)
    return _RandomInfo(
        moshi_weights=None,  # type: ignore[arg-type]
        mimi_weights=None,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        lm_config=dict(size.lm_kwargs),
        raw_config={"model_type": "stt", "stt_config": dict(size.stt_config)},
        mimi_config=size.mimi_config,
        model_type="stt",
        lm_gen_config={},
        stt_config=dict(size.stt_config),
        model_id={},
    )
