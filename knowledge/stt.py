"""Streaming speech-to-text for the back-end: a small sync interface plus a pocketsphinx implementation.

`StreamingSTT.feed` is CPU-bound and synchronous: the back-end calls it from a worker thread, never on
the event loop, and never from two threads at once for the same object.

Pocketsphinx 5.1.1 facts (checked here) that shape `PocketsphinxSTT`:
- it decodes 16 kHz only, so the engine's 24 kHz frames are resampled with a stateful soxr stream,
  which returns nothing for the first chunk(s): empty output must never reach `process_raw`;
- a fresh decoder starts from a generic cepstral mean and gets the first utterance badly wrong, so
  every decoder starts from `TELEPHONE_CMN`, a mean measured on phone-band speech;
- a `Decoder` loads ~40 MB of models in ~0.3 s and holds ~90 MB, so decoders are pooled per process
  and reused across calls instead of being built per call;
- pocketsphinx 5.1.1's bindings hold the GIL while decoding: threads interleave STT work with the
  event loop but do not run it in parallel.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

Decoder = Any  # pocketsphinx.Decoder; imported lazily so that `--stt none` never loads pocketsphinx
INPUT_RATE = 24_000  # the engine's (Mimi's) rate
DECODER_RATE = 16_000  # the only rate the en-US acoustic model supports

# Cepstral mean of the en-US model's features on phone-band speech: the average, over four flite voices
# (rms, awb, slt, kal), of a decoder's live mean after ten utterances sent through the phone path (8 kHz
# mu-law, up to 24 kHz, then this module). With pocketsphinx's generic start value the first utterance
# of a fresh decoder came out as "my new jon era pull you about my order"; from this one, as "my name is
# john and i am calling about my order". Live CMN keeps adapting it within each call.
TELEPHONE_CMN = "46.16,30.39,-26.00,49.33,-18.13,1.04,17.83,-25.32,15.98,-12.63,3.04,12.08,-12.27"


@dataclass(frozen=True, slots=True)
class SttResult:
    text: str  # the whole hypothesis of the current utterance (not a delta)
    final: bool  # True: the utterance ended; the next result starts a new one


class SttUnavailable(RuntimeError):
    """The STT cannot take a call now but will shortly (its process is being restarted): try again soon, not after
    a backoff sized for a model that keeps failing."""


class StreamingSTT(Protocol):
    def feed(self, pcm24k: np.ndarray) -> list[SttResult]:
        """Take float32 mono 24 kHz audio (any length); return partials (when the hypothesis changed)
        and finals (when an utterance ended), in order."""
        ...

    def flush(self) -> list[SttResult]:
        """End the current utterance now (end of call): returns its final, if any."""
        ...

    def reset(self) -> None:
        """Drop the current utterance and buffered audio; the next `feed` starts fresh."""
        ...

    def close(self) -> None:
        """Release resources (a pooled decoder goes back to its pool). Idempotent."""
        ...


class NullSTT:
    """`--stt none`: hears nothing."""

    def feed(self, pcm24k: np.ndarray) -> list[SttResult]:
        return []

    def flush(self) -> list[SttResult]:
        return []

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class DecoderPool:
    """Process-wide pool of idle pocketsphinx decoders: built once, reused across calls."""

    def __init__(self, max_idle: int = 8, **decoder_kwargs: object) -> None:
        self.max_idle = max_idle
        # fwdflat off: the final then comes from the same tree search as the partials (so it agrees
        # with them) and `end_utt` takes a few ms instead of ~250 ms of GIL-holding second pass.
        # maxhmmpf/maxwpf cap the search per 10 ms frame: on 20 phone-path flite utterances (4 voices)
        # streaming cost fell from RTF ~0.3 to ~0.13 on one core for a WER of 15.9% instead of 14.1%.
        self._kwargs: dict[str, object] = {
            "fwdflat": False,
            "maxhmmpf": 3000,
            "maxwpf": 10,
            "loglevel": "ERROR",
            **decoder_kwargs,
        }
        self._idle: list[Decoder] = []
        self._lock = threading.Lock()
        self.created = 0

    def acquire(self, cmninit: str = TELEPHONE_CMN) -> Decoder:
        with self._lock:
            decoder = self._idle.pop() if self._idle else None
        if decoder is None:
            decoder = self._create(cmninit)
        else:
            decoder.set_cmn(cmninit)  # every call starts from the same, warm mean
        return decoder

    def release(self, decoder: Decoder) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(decoder)

    def prewarm(self, n: int, cmninit: str = TELEPHONE_CMN) -> None:
        """Build up to `n` idle decoders now (blocking, ~0.3 s each): call at start-up, off the loop."""
        with self._lock:
            missing = min(n, self.max_idle) - len(self._idle)
        for _ in range(missing):
            self.release(self._create(cmninit))

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def _create(self, cmninit: str) -> Decoder:
        import pocketsphinx

        decoder = pocketsphinx.Decoder(cmninit=cmninit, **self._kwargs)
        with self._lock:
            self.created += 1
        return decoder


DECODER_POOL = DecoderPool()


@dataclass(frozen=True, slots=True)
class PocketsphinxConfig:
    vad_mode: int = 2  # pocketsphinx Vad aggressiveness, 0 (loose) .. 3 (strict)
    onset_s: float = 0.09  # this much continuous speech opens an utterance
    hangover_s: float = 0.6  # this much non-speech closes it (-> final)
    preroll_s: float = 0.3  # audio kept before the onset so the first phone is not cut
    max_utterance_s: float = 20.0  # force a final on endless speech (or noise the VAD calls speech)
    cmninit: str = TELEPHONE_CMN


@dataclass
class _Utterance:
    """Segmentation state of one PocketsphinxSTT."""

    active: bool = False
    speech_run: int = 0  # consecutive speech VAD frames while idle
    silence_run: int = 0  # consecutive non-speech VAD frames inside the utterance
    frames: int = 0  # VAD frames in the utterance so far
    last_partial: str = ""
    preroll: deque[bytes] = field(default_factory=deque)


class PocketsphinxSTT:
    """Streaming pocketsphinx: VAD-segmented utterances, partials while speaking, a final after silence."""

    VAD_FRAME_S = 0.03
    MAX_DECODE_BYTES = DECODER_RATE // 10 * 2  # 0.1 s of int16

    def __init__(self, config: PocketsphinxConfig | None = None, pool: DecoderPool | None = None) -> None:
        from pocketsphinx import Vad

        self.config = cfg = config or PocketsphinxConfig()
        self._pool = pool or DECODER_POOL
        self._vad = Vad(cfg.vad_mode, DECODER_RATE, self.VAD_FRAME_S)
        self._frame_bytes: int = self._vad.frame_bytes
        frame_s = self._vad.frame_length
        self._onset_frames = max(1, round(cfg.onset_s / frame_s))
        self._hangover_frames = max(1, round(cfg.hangover_s / frame_s))
        self._max_frames = max(1, round(cfg.max_utterance_s / frame_s))
        self._preroll_frames = max(self._onset_frames, round(cfg.preroll_s / frame_s))
        self._decoder: Decoder | None = None  # acquired on first use, in the worker thread (it may take 0.3 s)
        self._broken = False  # after an exception the decoder is not trusted back into the pool
        self._closed = False
        self._reset_stream()

    # --- StreamingSTT -------------------------------------------------------------------------------
    def feed(self, pcm24k: np.ndarray) -> list[SttResult]:
        x = np.asarray(pcm24k, dtype=np.float32).reshape(-1)
        if x.size == 0:
            return []
        return self._guarded(lambda: self._take(self._resampler.resample_chunk(x)))

    def flush(self) -> list[SttResult]:
        def run() -> list[SttResult]:
            tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            out = self._take(tail)
            if self._utt.active:
                decoder = self._get_decoder()
                self._decode(decoder, self._pending)
                out.extend(self._end_utterance(decoder))
            self._reset_stream()  # a drained soxr stream cannot take more input
            return out

        return self._guarded(run)

    def reset(self) -> None:
        if self._utt.active and self._decoder is not None:
            self._guarded(lambda: self._end_utterance(self._decoder))
        self._reset_stream()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        decoder, self._decoder = self._decoder, None
        if decoder is None:
            return
        if self._utt.active and not self._broken:
            try:
                decoder.end_utt()
            except Exception:  # a decoder that cannot end its utterance is not pooled
                log.warning("pocketsphinx end_utt failed while closing; decoder dropped", exc_info=True)
                return
        if not self._broken:
            self._pool.release(decoder)

    # --- internals ---------------------------------------------------------------------------------
    def _guarded(self, fn: Callable[[], list[SttResult]]) -> list[SttResult]:
        assert not self._closed, "PocketsphinxSTT used after close()"
        try:
            return fn()
        except Exception:
            self._broken = True
            raise

    def _reset_stream(self) -> None:
        import soxr

        self._resampler = soxr.ResampleStream(INPUT_RATE, DECODER_RATE, 1, dtype="float32")
        self._pending = bytearray()  # 16 kHz int16 not yet cut into VAD frames
        self._utt = _Utterance(preroll=deque(maxlen=self._preroll_frames))

    def _get_decoder(self) -> Decoder:
        if self._decoder is None:
            self._decoder = self._pool.acquire(self.config.cmninit)
        return self._decoder

    def _take(self, pcm16k: np.ndarray) -> list[SttResult]:
        """Cut new 16 kHz audio into VAD frames, open/close utterances, decode, report."""
        if pcm16k.size:  # soxr's first chunks come back empty
            self._pending += (np.clip(pcm16k, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        decoder = self._get_decoder()
        utt, fb = self._utt, self._frame_bytes
        out: list[SttResult] = []
        to_decode = bytearray()  # decoded once per feed, not per VAD frame: fewer calls, one hyp()
        while len(self._pending) >= fb:
            frame = bytes(self._pending[:fb])
            del self._pending[:fb]
            speech = self._vad.is_speech(frame)
            if not utt.active:
                utt.preroll.append(frame)
                utt.speech_run = utt.speech_run + 1 if speech else 0
                if utt.speech_run >= self._onset_frames:
                    decoder.start_utt()
                    utt.active, utt.silence_run, utt.frames = True, 0, len(utt.preroll)
                    to_decode += b"".join(utt.preroll)
                    utt.preroll.clear()
                continue
            to_decode += frame
            utt.frames += 1
            utt.silence_run = 0 if speech else utt.silence_run + 1
            if utt.silence_run >= self._hangover_frames or utt.frames >= self._max_frames:
                self._decode(decoder, to_decode)
                to_decode.clear()
                out.extend(self._end_utterance(decoder))
        if utt.active and to_decode:
            self._decode(decoder, to_decode)
            text = _hypothesis(decoder)
            if text and text != utt.last_partial:
                utt.last_partial = text
                out.append(SttResult(text, final=False))
        return out

    def _decode(self, decoder: Decoder, pcm: bytes | bytearray) -> None:
        # pocketsphinx holds the GIL for the whole call: slices of <= 0.1 s bound how long the event loop
        # and the engine's frame thread can be kept waiting when a backlog is decoded at once.
        for start in range(0, len(pcm), self.MAX_DECODE_BYTES):
            decoder.process_raw(bytes(pcm[start : start + self.MAX_DECODE_BYTES]), False, False)

    def _end_utterance(self, decoder: Decoder) -> list[SttResult]:
        decoder.end_utt()
        text = _hypothesis(decoder)
        utt = self._utt
        had_partial = bool(utt.last_partial)
        utt.active, utt.speech_run, utt.silence_run, utt.frames, utt.last_partial = False, 0, 0, 0, ""
        utt.preroll.clear()
        # An empty final is still reported after partials, so listeners drop the stale partial.
        return [SttResult(text, final=True)] if text or had_partial else []


def _hypothesis(decoder: Decoder) -> str:
    hyp = decoder.hyp()
    return " ".join(hyp.hypstr.split()) if hyp is not None else ""


def make_stt(
    kind: str, config: PocketsphinxConfig | None = None, rows: int | None = None
) -> Callable[[], StreamingSTT]:
    """A factory of per-call STT objects for `--stt {pocketsphinx,none,kyutai}`.

    `kyutai` loads the process-wide batched engine now (KAME_STT_CHECKPOINT, default kyutai/stt-1b-en_fr;
    KAME_STT_DEVICE, default cuda if available; KAME_STT_MAX_STREAMS rows, else `rows`, the calls the
    engine seats, else 16), so a missing checkpoint fails at start-up with a `CheckpointError`; each call
    then takes one row of it.
    """
    if kind == "pocketsphinx":
        import pocketsphinx  # noqa: F401  (fail at start-up, not on the first call)

        return lambda: PocketsphinxSTT(config)
    if kind == "none":
        return NullSTT
    if kind == "kyutai":
        from .stt_kyutai import shared_engine  # torch + moshi: imported only for this kind

        return shared_engine(rows).open_stream
    raise ValueError(f"unknown STT kind {kind!r}: expected pocketsphinx, none or kyutai")
