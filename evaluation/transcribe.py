"""What the bot said: its reply audio (8 kHz, as the caller heard it) as words with start times.

`--asr pocketsphinx` is offline (the default); `--asr openai` is any OpenAI-compatible
`/v1/audio/transcriptions` (e.g. a Whisper server), asked for word timestamps when it has them.
"""

from __future__ import annotations

import io
import multiprocessing
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
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

    def close(self) -> None:
        """Frees what it started (worker processes); called once, when the run ends."""
        ...


_FILLER = re.compile(r"^(<.*>|\[.*\])$")  # <s>, </s>, <sil>, [NOISE]: not words
_VARIANT = re.compile(r"\(\d+\)$")  # the(2): a pronunciation variant of "the"


class PocketsphinxTranscriber:
    """pocketsphinx's US English model at 16 kHz (the reply is upsampled), with its second pass on:
    slower than the service's streaming settings, a little more accurate.

    It decodes in worker processes. pocketsphinx holds the GIL while it decodes, and its second pass runs
    over the whole reply at once (0.6 s for 25 s of speech on a fast core, several seconds on a slow box).
    In eval's own process that froze the calls still in flight: they missed their 20 ms packets, and one
    caller took 10.9 s from the TwiML to the socket, past the service's reservation (refused as replayed)."""

    name = "pocketsphinx"

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, workers)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # transcribe() is called from several threads at once

    def describe(self) -> str:
        return self.name

    def transcribe(self, pcm8k: np.ndarray) -> Transcript:
        """Blocks the calling thread (not the GIL) until a worker has decoded `pcm8k`."""
        if len(pcm8k) == 0:
            return Transcript("")
        pool = self._workers()
        try:
            return pool.submit(_decode_here, np.asarray(pcm8k, dtype=np.int16)).result()
        except BrokenProcessPool:
            with self._lock:  # the next reply gets new workers; this one is the question's error
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise AsrError("the pocketsphinx worker process died while transcribing") from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _workers(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn: the parent runs threads (the caller's loop, other transcriptions); a fork could copy a
                # lock held mid-operation.
                self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
            return self._pool


_PIECE_BYTES = 16000 * 2 // 5  # 0.2 s of 16 kHz 16-bit audio: fed as the reports so far were decoded
_FRAMES_PER_S = 100
_decoder: Any = None  # a worker process's own decoder (one per process: they are not thread-safe)


def _decode_here(pcm8k: np.ndarray) -> Transcript:
    """In a worker process: one reply, decoded."""
    global _decoder
    if _decoder is None:
        import pocketsphinx

        _decoder = pocketsphinx.Decoder(samprate=16000, loglevel="ERROR")
    x = resample_poly(np.asarray(pcm8k, dtype=np.float32) / 32768.0, 2, 1)
    raw = (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    _decoder.start_utt()
    for i in range(0, len(raw), _PIECE_BYTES):
        _decoder.process_raw(raw[i : i + _PIECE_BYTES], full_utt=False)
    _decoder.end_utt()
    words = [
        Word(_VARIANT.sub("", s.word), s.start_frame / _FRAMES_PER_S)
        for s in _decoder.seg()
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

    def close(self) -> None:
        pass  # a client per reply: nothing kept

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
