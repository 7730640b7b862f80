"""Model sizes: the full Moshi-7B layout KAME uses, and a tiny one with the same stream layout."""

from __future__ import annotations

import copy
from typing import Any

from moshi.models import loaders

# 8 Moshi audio streams + 8 user audio streams (n_q=16, dep_q=8), delays as Moshi: text and each
# first codebook undelayed, the other codebooks one step late.
_DELAYS = [0] + [0] + [1] * 7 + [0] + [1] * 7

TINY_TEXT_CARD = 256

TINY_LM_KWARGS: dict[str, Any] = {
    "dim": 64,
    "text_card": TINY_TEXT_CARD,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "dep_q": 8,
    "card": 64,
    "num_heads": 4,
    "num_layers": 2,
    "hidden_scale": 2,
    "causal": True,
    "layer_scale": None,
    "context": 64,  # small so the KV ring buffer wraps within a short test call
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 32,
    "depformer_dim_feedforward": 64,
    "depformer_num_heads": 2,
    "depformer_num_layers": 1,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": _DELAYS,
}


def tiny_mimi_config() -> dict[str, Any]:
    """moshi's Mimi with the widths shrunk; keeps 24 kHz, 1920-sample frames, 12.5 Hz."""
    cfg = copy.deepcopy(loaders._mimi_config)
    cfg["seanet"].update({"n_filters": 8, "dimension": 64})
    cfg["transformer"].update(
        {"d_model": 64, "num_heads": 2, "num_layers": 1, "dim_feedforward": 128,
         "input_dimension": 64, "output_dimensions": [64]}
    )
    cfg["quantizer"].update(
        {"dimension": 32, "bins": TINY_LM_KWARGS["card"], "n_q": 8, "input_dimension": 64, "output_dimension": 64}
    )
    return cfg


def moshi_7b_lm_kwargs() -> dict[str, Any]:
    return copy.deepcopy(loaders._lm_kwargs)


SIZES = ("tiny", "moshi-7b")


def lm_kwargs_for(size: str) -> dict[str, Any]:
    if size == "tiny":
        return copy.deepcopy(TINY_LM_KWARGS)
    if size == "moshi-7b":
        return moshi_7b_lm_kwargs()
    raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")


def mimi_config_for(size: str) -> dict[str, Any] | None:
    return tiny_mimi_config() if size == "tiny" else None  # None = moshi's default Mimi
