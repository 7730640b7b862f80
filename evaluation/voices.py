"""The caller's voice: a question as speech, from flite (offline, the default) or an OpenAI-compatible
`/v1/audio/speech`. Audio comes back as mono float32 and its rate; the caller puts it on the line
(8 kHz mu-law) itself."""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from telephony.sim_playout import read_wav, write_wav


class VoiceError(RuntimeError):
    """The TTS could not speak a question; the message says why, without secrets."""


class Voice(Protocol):
    name: str

    def speak(self, text: str) -> tuple[np.ndarray, int]: ...


@dataclass(frozen=True)
class FliteVoice:
    """Debian's flite, voice `rms`: speech pocketsphinx (and the service's STT) transcribes well."""

    voice: str = "rms"
    name: str = "flite"

    def speak(self, text: str) -> tuple[np.ndarray, int]:
        flite = shutil.which("flite")
        if flite is None:
            raise VoiceError("--tts flite needs Debian's flite: apt-get install flite")
        with tempfile.TemporaryDirectory(prefix="kame-eval-tts-") as tmp:
            out = Path(tmp) / "q.wav"
            done = subprocess.run([flite, "-voice", self.voice, "-t", text, "-o", str(out)], capture_output=True)
            if done.returncode != 0 or not out.is_file():
                raise VoiceError(f"flite failed: {done.stderr.decode(errors='replace').strip()[:200]}")
            return read_wav(out)


@dataclass(frozen=True)
class OpenAIVoice:
    """Any OpenAI-compatible speech endpoint; asks for WAV so no decoder is needed here."""

    base_url: str | None
    api_key: str | None
    model: str = "gpt-4o-mini-tts"
    voice: str = "alloy"
    name: str = "openai"

    def speak(self, text: str) -> tuple[np.ndarray, int]:
        import openai

        client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=3, timeout=60)
        try:
            resp = client.audio.speech.create(model=self.model, voice=self.voice, input=text, response_format="wav")
            data = resp.read()
        except openai.OpenAIError as exc:
            raise VoiceError(f"--tts openai failed: {type(exc).__name__}: {str(exc)[:200]}") from None
        finally:
            client.close()
        try:
            return read_wav_bytes(data)
        except (wave.Error, EOFError, ValueError) as exc:
            raise VoiceError(f"--tts openai did not answer a 16-bit WAV: {exc}") from None


def read_wav_bytes(data: bytes) -> tuple[np.ndarray, int]:
    return read_wav(io.BytesIO(data))


def write_float_wav(path: Path, audio: np.ndarray, rate: int) -> None:
    """Mono float audio in [-1, 1] as a 16-bit WAV (the phone simulator's writer)."""
    write_wav(path, (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2"), rate)
