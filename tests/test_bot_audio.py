"""The bot's audio path: the engine's per-tick `BotFrames`, the batched 24 -> 8 kHz bank, the media template
and the fan-out that plays each row to its own call."""

from __future__ import annotations

import asyncio
import json
import wave
from pathlib import Path

import numpy as np
import pytest

from engine.interface import FRAME_SAMPLES, BotFrames
from kame_phone.media_bench import LoopbackEngine
from telephony.call_store import MemoryCallStore
from telephony.config import ServiceConfig
from telephony.resample import Downsampler24to8, DownsamplerBank
from telephony.server import MEDIA_PATH, ServerContext, ServiceHandle
from telephony.sim_caller import simulate_call
from telephony.twilio_messages import MediaMessageTemplate, media_message


def test_bank_equals_one_downsampler_per_stream_as_calls_come_and_go() -> None:
    rng = np.random.default_rng(7)
    bank = DownsamplerBank(capacity=2)  # grows twice below
    reference = {key: Downsampler24to8() for key in "abcde"}
    for tick in range(8):
        keys = [k for k in "abcde" if rng.random() < 0.8]  # a call missing from a tick keeps its history
        if tick == 4:  # call "b" ends; a new call under the same key starts from silence
            bank.forget("b")
            reference["b"] = Downsampler24to8()
        frames = (0.3 * rng.standard_normal((len(keys), FRAME_SAMPLES))).astype(np.float32)
        got = bank.process(keys, frames)
        want = np.stack([reference[k].process(row) for k, row in zip(keys, frames, strict=True)])
        assert got.shape == (len(keys), FRAME_SAMPLES // 3)
        np.testing.assert_allclose(got, want, atol=2e-6)
    assert len(bank) == 5


def test_bank_is_the_same_filter_so_aliases_stay_rejected() -> None:
    t = np.arange(10 * FRAME_SAMPLES) / 24_000
    tone = (0.5 * np.sin(2 * np.pi * 5_000 * t)).astype(np.float32)  # would alias to 3 kHz
    bank = DownsamplerBank()
    out = np.concatenate([bank.process(["x"], f[None])[0] for f in tone.reshape(-1, FRAME_SAMPLES)])
    level = 20 * np.log10(np.sqrt(np.mean(out[200:] ** 2)) / np.sqrt(np.mean(tone**2)))
    assert level < -60


def test_bank_refuses_frames_it_cannot_block() -> None:
    with pytest.raises(ValueError, match="multiples of 96"):
        DownsamplerBank().process(["x"], np.zeros((1, 100), np.float32))
    with pytest.raises(ValueError, match="2 keys for 1 frames"):
        DownsamplerBank().process(["x", "y"], np.zeros((1, 96), np.float32))


@pytest.mark.parametrize("sid", ["MZ" + "0" * 32, 'MZ"quoted\\sid', "MZü"])
def test_media_template_writes_exactly_media_message(sid: str) -> None:
    payload = bytes(range(256)) * 2
    rendered = MediaMessageTemplate(sid).render(payload).decode("utf-8")
    assert rendered == media_message(sid, payload)
    assert json.loads(rendered)["streamSid"] == sid


def test_bot_frames_rows_must_agree() -> None:
    pcm = np.zeros((2, FRAME_SAMPLES), np.float32)
    BotFrames(("a", "b"), pcm, ("", ""), (True, True), (0, 0), (False, False), 0.0)
    with pytest.raises(ValueError, match="disagree"):
        BotFrames(("a", "b"), pcm, ("",), (True, True), (0, 0), (False, False), 0.0)
    with pytest.raises(ValueError, match="disagree"):
        BotFrames(("a",), pcm, ("",), (True,), (0,), (False,), 0.0)


def _dominant_hz(path: Path) -> float:
    with wave.open(str(path)) as w:
        rate = w.getframerate()
        audio = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float64)
    audio = audio[rate // 2 :]  # past the first frames
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    return float(np.fft.rfftfreq(len(audio), 1 / rate)[int(np.argmax(spectrum))])


async def test_every_call_hears_its_own_row_of_the_tick(tmp_path: Path) -> None:
    """Three calls share each tick of an echoing engine: each must get back its own tone, not a neighbour's."""
    engine = LoopbackEngine(max_calls=4)
    token = "t" * 32
    ctx = ServerContext(ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token), MemoryCallStore(), engine)
    handle = await ServiceHandle(ctx).start()
    ws_url = handle.http_url.replace("http://", "ws://") + MEDIA_PATH
    tones = [400.0, 1000.0, 2200.0]
    t = np.arange(3 * 8000) / 8000
    try:
        reports = await asyncio.gather(
            *(
                simulate_call(
                    ws_url,
                    (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32),
                    auth_token=token,
                    public_url=None,
                    out_wav=tmp_path / f"{hz:.0f}.wav",
                    hold_after=0.5,
                )
                for hz in tones
            )
        )
    finally:
        await engine.stop()
        await handle.aclose()
    for hz, report in zip(tones, reports, strict=True):
        assert report.outcome == "completed", report.errors
        assert report.bot_seconds_received > 2.0
        assert abs(_dominant_hz(tmp_path / f"{hz:.0f}.wav") - hz) < 20, hz
