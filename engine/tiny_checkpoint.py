"""`kame-phone make-tiny-checkpoint DIR`: a random-weight KAME checkpoint in the real layout.

Tests, CI and the offline demo load it through the same loader as the real model. Small dims, the
Moshi stream layout (8 + 8 audio streams, text, oracle), a tiny Mimi whose codes follow the audio and
back (engine/tiny_codec.py), and a SentencePiece model trained on `engine/data/tiny_corpus.txt` with
ids 0-3 reserved like Moshi's tokenizer (3 = text padding).
"""

from __future__ import annotations

import io
import json
from importlib import resources
from pathlib import Path

import sentencepiece
import torch
from moshi.models import loaders
from safetensors.torch import save_file

from .model import KameLM
from .presets import TINY_LM_KWARGS, TINY_TEXT_CARD, tiny_mimi_config
from .tiny_codec import make_codec_responsive

FILES = {
    "moshi_name": "model.safetensors",
    "mimi_name": "mimi.safetensors",
    "tokenizer_name": "tokenizer.model",
    "mimi_config_name": "mimi_config.json",
}


def train_tiny_tokenizer(vocab_size: int = TINY_TEXT_CARD) -> bytes:
    corpus = resources.files("engine").joinpath("data/tiny_corpus.txt").read_text().splitlines()
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in corpus if line.strip()]),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3,  # 3 is Moshi's text padding id
        num_threads=1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return model.getvalue()


def make_tiny_checkpoint(directory: str | Path, seed: int = 1234) -> Path:
    """Write config.json, LM + Mimi safetensors, mimi_config.json and tokenizer.model into `directory`."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    lm = KameLM(device="cpu", dtype=torch.float32, **TINY_LM_KWARGS)
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, str(out / FILES["moshi_name"]))
    mimi_cfg = tiny_mimi_config()
    mimi = loaders.get_mimi(None, mimi_cfg, device="cpu")
    make_codec_responsive(mimi, seed=seed)  # else every frame is code 0 and every code sounds the same
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(out / FILES["mimi_name"]))
    (out / FILES["mimi_config_name"]).write_text(json.dumps(mimi_cfg, indent=1))
    (out / FILES["tokenizer_name"]).write_bytes(train_tiny_tokenizer())
    config = dict(TINY_LM_KWARGS) | FILES | {"model_type": "kame", "lm_gen_config": {}, "random_weights": True}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
