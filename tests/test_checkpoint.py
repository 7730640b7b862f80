"""Loading through the real loader, and each bad-checkpoint error."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import CheckpointError, load_kame
from engine.model import KameLM
from engine.presets import TINY_LM_KWARGS


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_tiny_checkpoint_loads_with_oracle_embedding(tiny_checkpoint: Path) -> None:
    bundle = load_kame(str(tiny_checkpoint))
    lm = bundle.lm
    assert isinstance(lm, KameLM)
    assert not lm.training
    card, dim = TINY_LM_KWARGS["text_card"], TINY_LM_KWARGS["dim"]
    assert tuple(lm.oracle_emb.weight.shape) == (card + 1, dim)
    saved = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert torch.equal(lm.oracle_emb.weight, saved["oracle_emb.weight"])
    assert not torch.equal(lm.oracle_emb.weight, lm.text_emb.weight)
    assert lm.oracle_start_token_id == card
    assert bundle.tokenizer.vocab_size() <= card
    assert bundle.tokenizer.id_to_piece(3) == "<pad>"  # 3 = Moshi's text padding, never a word
    assert bundle.mimi.num_codebooks == 8
    assert bundle.mimi.frame_size == 1920


def test_context_override_caps_kv_cache(tiny_checkpoint: Path) -> None:
    bundle = load_kame(str(tiny_checkpoint), context=16)
    assert bundle.lm.transformer.layers[0].self_attn.context == 16


def test_missing_file_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "mimi.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing mimi\.safetensors"):
        load_kame(str(ckpt))


def test_shape_mismatch_names_tensor_and_both_shapes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    state = load_file(str(ckpt / "model.safetensors"))
    state["oracle_emb.weight"] = torch.zeros(10, 7)
    save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_kame(str(ckpt))
    msg = str(err.value)
    assert "oracle_emb.weight" in msg and "(10, 7)" in msg and f"({TINY_LM_KWARGS['text_card'] + 1}, 64)" in msg


def test_config_that_does_not_match_weights(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["num_layers"] = 3  # the file has 2 layers
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing .*transformer\.layers\.2"):
        load_kame(str(ckpt))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"moshi_name": 5}, "names its lm file 5: not a file name inside the checkpoint"),
        ({"mimi_name": "../../elsewhere/mimi.safetensors"}, "not a file name inside the checkpoint"),
        ({"tokenizer_name": "/etc/passwd"}, "not a file name inside the checkpoint"),
        ({"lm_gen_config": ["temp", 0.8]}, "lm_gen_config must be a JSON object"),
        ({"dim": "wide"}, r"config.json of .* LM setting"),
    ],
)
def test_a_hostile_config_is_refused_in_one_line(
    tiny_checkpoint: Path, tmp_path: Path, change: dict, says: str
) -> None:
    """A downloaded checkpoint's config.json with values of the wrong type gave a traceback (TypeError,
    AttributeError), and file names could point out of the checkpoint (review, session 26)."""
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(CheckpointError, match=says):
        load_kame(str(ckpt))


def test_plain_moshi_checkpoint_gets_text_emb_copied(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    state = load_file(str(ckpt / "model.safetensors"))
    del state["oracle_emb.weight"]
    save_file(state, str(ckpt / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        lm = load_kame(str(ckpt)).lm
    assert "no oracle_emb" in caplog.text
    assert torch.equal(lm.oracle_emb.weight, lm.text_emb.weight)
    assert lm.oracle_emb.weight.data_ptr() != lm.text_emb.weight.data_ptr()


def test_unexpected_key_is_rejected(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    state = load_file(str(ckpt / "model.safetensors"))
    state["stray.weight"] = torch.zeros(2)
    save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected \['stray\.weight'\]"):
        load_kame(str(ckpt))


def test_no_network_and_no_local_copy_says_what_to_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    import huggingface_hub.constants as hfc

    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(CheckpointError) as err:
        load_kame("SakanaAI/kame")
    msg = str(err.value)
    assert "SakanaAI/kame" in msg and "--checkpoint DIR" in msg and "download" in msg
    assert "Traceback" not in msg


def test_neither_dir_nor_repo_id(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither a checkpoint directory"):
        load_kame(str(tmp_path / "does" / "not" / "exist"))


def test_corrupt_weights_file(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read LM weights"):
        load_kame(str(ckpt))


def test_random_checkpoint_builds_the_named_size_without_files() -> None:
    """`random:SIZE` (capacity tests before real weights arrive) builds the architecture with a tokenizer."""
    bundle = load_kame("random:tiny")
    assert bundle.source == "random:tiny" and bundle.lm.oracle_emb.weight.shape == bundle.lm.text_emb.weight.shape
    assert bundle.tokenizer.vocab_size() <= bundle.lm.text_card
    with pytest.raises(CheckpointError, match="unknown size"):
        load_kame("random:moshi-70b")


def test_tiny_codec_codes_follow_the_input_and_the_audio_follows_the_codes(tiny_checkpoint: Path) -> None:
    """A fresh Mimi's codebooks are all zero (every frame is code 0, every code sounds the same); the tiny
    checkpoint's are fitted, so an audio-path bug or audio crossing between rows can show in the tests."""
    from engine.tiny_codec import speech_like

    mimi = load_kame(str(tiny_checkpoint)).mimi
    with torch.no_grad():
        a, b = (mimi.encode(torch.from_numpy(speech_like(2.0, seed))[None, None]) for seed in (11, 12))
        assert a.shape == (1, 8, 25)
        assert not torch.equal(a, b)  # different callers, different codes
        for codes in (a, b):
            assert all(len(torch.unique(codes[0, k])) > 5 for k in range(8))  # every codebook is in use
        out_a, out_b = mimi.decode(a), mimi.decode(b)
    assert out_a.abs().max() > 0 and not torch.allclose(out_a, out_b, atol=1e-3)  # the decoder follows the codes
