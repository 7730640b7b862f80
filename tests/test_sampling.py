"""The front-end samples with the checkpoint's own `lm_gen_config`, and the command line overrides it."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import pytest

from engine.checkpoint import CheckpointError
from engine.sampling import SamplingConfig, SamplingOverrides
from engine.service import LocalEngine
from kame_phone.app import add_engine_arguments, engine_config_from_args
from kame_phone.env_flags import resolve_env_defaults

from .test_frame_loop import _caller_audio


def _with_lm_gen_config(tiny_checkpoint: Path, tmp_path: Path, lm_gen_config: dict) -> Path:
    ckpt = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"lm_gen_config": lm_gen_config}))
    return ckpt


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--max-calls", "1", "--no-engine-process", *argv])
    resolve_env_defaults(args)
    return args


def test_checkpoint_values_then_command_line_overrides() -> None:
    ckpt = {"temp": 0.5, "top_k_text": 7, "cfg_coef": 1.0}
    assert SamplingOverrides().resolve({}) == SamplingConfig()  # moshi LMGen's defaults
    assert SamplingOverrides().resolve(ckpt) == SamplingConfig(temp=0.5, top_k_text=7)
    assert SamplingOverrides(temp=0.9, top_k=40).resolve(ckpt) == SamplingConfig(temp=0.9, top_k=40, top_k_text=7)
    assert SamplingOverrides(greedy=True).resolve({"use_sampling": True}).use_sampling is False
    assert SamplingOverrides().resolve({"use_sampling": False}).describe() == "greedy (argmax)"


@pytest.mark.parametrize(("key", "value"), [("temp", "hot"), ("top_k", 2.5), ("top_k_text", 0), ("temp_text", -1),
                                            ("use_sampling", "yes"), ("top_k", True)])
def test_a_bad_checkpoint_value_is_refused_with_its_key(key: str, value: object) -> None:
    with pytest.raises(CheckpointError, match=rf"lm_gen_config\.{key} must be"):
        SamplingOverrides().resolve({key: value})


def test_bad_command_line_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--temp", "-0.1"], ["--top-k", "0"], ["--temp-text", "nan"]):
        with pytest.raises(SystemExit):
            _args(*argv)
    assert "must be" in capsys.readouterr().err


def _text_tokens(engine: LocalEngine, frames: int = 24) -> list[int]:
    loop = engine.frame_loop
    row = loop.join("A", None)
    loop.set_oracle(row, "A", 1, "Thank you for calling.", complete=True)
    tokens = []
    for pcm in _caller_audio(3, frames):
        loop.push_audio(row, "A", pcm)
        tokens += [out.token for _, out in loop.tick()]
    return tokens


async def test_the_checkpoints_sampling_drives_the_model(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """top_k 1 in the checkpoint makes sampling pick the argmax: the same tokens as --greedy. With
    moshi's defaults (what the checkpoint's settings used to lose to) or --top-k overrides, they differ."""
    ckpt = _with_lm_gen_config(tiny_checkpoint, tmp_path, {"top_k": 1, "top_k_text": 1, "temp": 0.6})
    greedy = await LocalEngine.load(engine_config_from_args(_args("--checkpoint", str(ckpt), "--greedy")))
    assert greedy.frame_loop.sampling == SamplingConfig(use_sampling=False, top_k=1, top_k_text=1, temp=0.6)
    from_checkpoint = await LocalEngine.load(engine_config_from_args(_args("--checkpoint", str(ckpt))))
    lm_gen = from_checkpoint.frame_loop.batch.lm_gen
    assert (lm_gen.use_sampling, lm_gen.temp, lm_gen.temp_text, lm_gen.top_k, lm_gen.top_k_text) == (
        True, 0.6, 0.7, 1, 1)
    overridden = await LocalEngine.load(
        engine_config_from_args(_args("--checkpoint", str(ckpt), "--top-k", "250", "--top-k-text", "250",
                                      "--temp-text", "2"))
    )
    want = _text_tokens(greedy)
    assert _text_tokens(from_checkpoint) == want
    assert _text_tokens(overridden) != want
    # The values in force are logged once, at start.
    with caplog.at_level(logging.INFO, logger="engine.service"):
        await from_checkpoint.start()
        await from_checkpoint.stop()
    (line,) = [r.getMessage() for r in caplog.records if "sampling:" in r.getMessage()]
    assert "temp=0.6 top_k=1 (audio), temp_text=0.7 top_k_text=1 (text)" in line


@pytest.mark.parametrize("engine_process", [False, True])
def test_a_bad_lm_gen_config_stops_serve_with_one_line(
    tiny_checkpoint: Path, tmp_path: Path, engine_process: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from kame_phone.cli import main

    ckpt = _with_lm_gen_config(tiny_checkpoint, tmp_path, {"temp": "hot"})
    argv = ["serve", "--insecure-dev", "--port", "0", "--device", "cpu", "--checkpoint", str(ckpt),
            "--stt", "none", "--llm", "none", "--engine-process" if engine_process else "--no-engine-process"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line == "kame-phone: config.json lm_gen_config.temp must be a number >= 0, not 'hot'"


def test_sampling_in_force_is_known_for_an_engine_process(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The engine process resolves it against the checkpoint it loaded and reports it back."""
    from engine.frame_loop_process import ChildSpec, FrameLoopProcess

    ckpt = _with_lm_gen_config(tiny_checkpoint, tmp_path, {"temp_text": 0.4})
    loop = FrameLoopProcess(ChildSpec(str(ckpt), "cpu", 1, None, SamplingOverrides(top_k=9), 0.0, 4))
    loop.start(warmup_ticks=1)
    try:
        assert loop.sampling == SamplingConfig(temp_text=0.4, top_k=9)
    finally:
        loop.stop()
