"""What the bot said: its reply audio (8 kHz, as the caller heard it) as words with start times.

`--asr pocketsphinx` is offline (the default); `--asr openai` is any OpenAI-compatible
`/v1/audio/transcriptions` (e.g. a Whisper server), asked for word timestamps when it has them.
"""

from __future__ import annotations

import io
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from scipy.signal import resample_poly

from telephony.sim_playout import RATE, write_wav


class AsrError(RuntimeError):
    """The ASR could not transcribe a reply; the message says why, without secrets."""


@dataclass(frozen=True, slots=True)
class Word:
    text: str
    start_s: float  # from the start of the transcribed audio


@dataclass(frozen=True)
class Transcript:
    text: str
    words: list[Word] = field(default_factory=list)  # empty when the ASR gives no timings

    @property
    def first_word_s(self) -> float | None:
        return self.words[0].start_s if self.words else None


class Transcriber(Protocol):
    name: str

    def transcribe(self, pcm8k: np.ndarray) -> Transcript: ...

    def describe(self) -> str:
        """What heard the replies, as the report records it (the model too: two models are two measurements)."""
        ...


_FILLER = re.compile(r"^(<.*>|\[.*\])$")  # <s>, </s>, <sil>, [NOISE]: not words
_VARIANT = re.compile(r"\(\d+\)$")  # the(2): a pronunciation variant of "the"


class PocketsphinxTranscriber:
    """pocketsphinx's US English model at 16 kHz (the reply is upsampled), with its second pass on:
    slower than the service's streaming settings, a little more accurate."""

    name = "pocketsphinx"
    FRAMES_PER_S = 100
    PIECE_BYTES = 16000 * 2 // 5  # 0.2 s of 16 kHz 16-bit audio

    def __init__(self) -> None:
        self._local = threading.local()  # a decoder per thread: they are not thread-safe

    def _decoder(self):  # type: ignore[no-untyped-def]
        d = getattr(self._local, "decoder", None)
        if d is None:
            import pocketsphinx

            d = self._local.decoder = pocketsphinx.Decoder(samprate=16000, loglevel="ERROR")
        return d

    def describe(self) -> str:
        return self.name

    def transcribe(self, pcm8k: np.ndarray) -> Transcript:
        if len(pcm8k) == 0:
            return Transcript("")
        x = resample_poly(np.asarray(pcm8k, dtype=np.float32) / 32768.0, 2, 1)
        raw = (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        d = self._decoder()
        d.start_utt()
        # In short pieces: pocketsphinx holds the GIL for a whole call, and one call over a 30 s reply took
        # 20-30 s on 2 cores, during which the calls still in flight stopped sending (the service ended them
        # as silent sockets). Pieces of 0.2 s bound that to the last pass (under 1 s seen).
        for i in range(0, len(raw), self.PIECE_BYTES):
            d.process_raw(raw[i : i + self.PIECE_BYTES], full_utt=False)
        d.end_utt()
        words = [
            Word(_VARIANT.sub("", s.word), s.start_frame / self.FRAMES_PER_S)
            for s in d.seg()
            if not _FILLER.match(s.word)
        ]
        return Transcript(" ".join(w.text for w in words), words)


# OpenAI's gpt-4o transcription models answer `json` or `text` only: asked for `verbose_json` (word timings, which
# whisper-1 and Whisper servers give) they refuse the request. Their replies are scored without a first-word time.
TEXT_ONLY_MODELS = ("gpt-4o",)
_UNTIMED: set[tuple[str | None, str]] = set()  # (base URL, model) found to refuse verbose_json in this run


@dataclass(frozen=True)
class OpenAITranscriber:
    base_url: str | None
    api_key: str | None
    model: str = "whisper-1"
    name: str = "openai"

    def describe(self) -> str:
        return f"{self.name}:{self.model}"

    def transcribe(self, pcm8k: np.ndarray) -> Transcript:
        import openai

        buf = io.BytesIO()
        write_wav(buf, np.asarray(pcm8k, dtype=np.int16), RATE)
        client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=3, timeout=120)
        timed = not self.model.startswith(TEXT_ONLY_MODELS) and (self.base_url, self.model) not in _UNTIMED
        try:
            try:
                resp = self._ask(client, buf.getvalue(), timed)
            except openai.BadRequestError as exc:
                if not timed or not ("response_format" in str(exc) or "timestamp" in str(exc)):
                    raise
                _UNTIMED.add((self.base_url, self.model))  # said once: its next replies are asked for json at once
                resp = self._ask(client, buf.getvalue(), timed=False)  # another model without word timings
        except openai.OpenAIError as exc:
            raise AsrError(f"--asr openai failed: {type(exc).__name__}: {str(exc)[:200]}") from None
        finally:
            client.close()
        text = (getattr(resp, "text", "") or "").strip()
        words = [Word(str(w.word).strip(), float(w.start)) for w in (getattr(resp, "words", None) or [])]
        return Transcript(text, words)

    def _ask(self, client: Any, wav: bytes, timed: bool) -> Any:
        extra: dict[str, Any] = {"response_format": "verbose_json", "timestamp_granularities": ["word"]} if timed else {
            "response_format": "json"}
        return client.audio.transcriptions.create(model=self.model, file=("reply.wav", wav, "audio/wav"), **extra)
