"""A random-weight Kyutai-STT-style checkpoint in the real layout, for CPU tests of `knowledge.stt_kyutai`.

Layout as published Kyutai STT repos are read by moshi's `CheckpointInfo`: `config.json` whose non-file
keys are `LMModel` kwargs, with `model_type: "stt"`, `stt_config` and `lm_gen_config`; an LM with no
depformer (`dep_q=0`, text out only) fed all 32 Mimi codebooks, every stream undelayed (`delays` = 33
zeros); four 6-way extra heads (the semantic-VAD heads of stt-1b-en_fr); the Mimi weights and the
SentencePiece model under the names config.json gives. Small dims; Mimi is our tiny one with its
quantizer widened back to 32 codebooks; the tokenizer is the tiny one (ids 0-3 reserved, 3 = padding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from moshi.models import loaders
from safetensors.torch import save_file

from engine.presets import TINY_TEXT_CARD, tiny_mimi_config
from engine.tiny_checkpoint import train_tiny_tokenizer

STT_N_Q = 32  # Kyutai STT reads every Mimi codebook

TINY_STT_LM_KWARGS: dict[str, Any] = {
    "dim": 64,
    "text_card": TINY_TEXT_CARD,
    "existing_text_padding_id": 3,
    "n_q": STT_N_Q,
    "dep_q": 0,
    "card": 64,  # = tiny Mimi bins
    "num_heads": 4,
    "num_layers": 2,
    "hidden_scale": 2,
    "causal": True,
    "layer_scale": None,
    "context": 32,  # small so the KV ring buffer wraps within a short test call
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "extra_heads_num_heads": 4,
    "extra_heads_dim": 6,
    "conditioners": {},
    "cross_attention": False,
    "delays": [0] * (STT_N_Q + 1),
}

# A short delay and prefix (in seconds) so tests see text soon; the real repos give their own.
TINY_STT_CONFIG = {"audio_delay_seconds": 0.24, "audio_silence_prefix_seconds": 0.16}

FILES = {
    "moshi_name": "model.safetensors",
    "mimi_name": "mimi.safetensors",
    "tokenizer_name": "tokenizer.model",
    "mimi_config_name": "mimi_config.json",
}


def tiny_stt_mimi_config() -> dict[str, Any]:
    cfg = tiny_mimi_config()
    cfg["quantizer"]["n_q"] = STT_N_Q
    return cfg


def _randomize_codebooks(mimi: torch.nn.Module, scale: float = 0.2) -> None:
    """An untrained Mimi's codebooks are all zeros (filled by k-means in training), so every frame would
    encode to code 0 and the LM would never see the audio: give them random centroids instead."""
    with torch.no_grad():
        for name, buf in mimi.named_buffers():
            if name.endswith("_codebook.embedding_sum"):
                buf.normal_(0.0, scale)
            elif name.endswith("_codebook._initialized"):
                buf.fill_(1.0)


def make_tiny_stt_checkpoint(directory: str | Path, seed: int = 4321) -> Path:
    """Write config.json, LM + Mimi safetensors, mimi_config.json and tokenizer.model into `directory`."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    lm = loaders.get_moshi_lm(None, lm_kwargs=TINY_STT_LM_KWARGS, device="cpu", dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, str(out / FILES["moshi_name"]))
    mimi_cfg = tiny_stt_mimi_config()
    mimi = loaders.get_mimi(None, mimi_cfg, device="cpu", num_codebooks=STT_N_Q)
    _randomize_codebooks(mimi)
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(out / FILES["mimi_name"]))
    (out / FILES["mimi_config_name"]).write_text(json.dumps(mimi_cfg, indent=1))
    (out / FILES["tokenizer_name"]).write_bytes(train_tiny_tokenizer())
    config = dict(TINY_STT_LM_KWARGS) | FILES | {
        "model_type": "stt",
        "stt_config": dict(TINY_STT_CONFIG),
        "lm_gen_config": {"temp": 0.0, "temp_text": 0.0, "top_k": 250, "top_k_text": 50},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
