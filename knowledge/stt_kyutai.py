"""`--stt kyutai`: Kyutai's streaming STT (delayed-streams-modeling) through the `moshi` package, one
batch row per call, all calls stepped together like the KAME front-end.

A Kyutai STT model is a moshi `LMModel` with no depformer (`dep_q=0`, text out only) that reads all of
Mimi's codebooks (`n_q=32`, every stream undelayed). Each 80 ms frame: Mimi encodes it, the LM takes one
step and emits one text token, which describes the audio `stt_config.audio_delay_seconds` earlier (0.5 s
for stt-1b-en_fr, 2.5 s for stt-2.6b-en). Tokens are SentencePiece pieces; 3 is padding and 0 the
end-of-padding word boundary (both carry no text). The 1B model can carry extra heads; head 2's class-0
probability is its semantic end-of-turn signal.

What is verified and what is assumed (public sources read, no real weights here):
- verified from moshi 0.2.13's code: `CheckpointInfo` pops `model_type`, `stt_config`, `lm_gen_config` and
  the file names, the rest are `LMModel` kwargs; `get_mimi` uses `max(dep_q, n_q - dep_q)` codebooks;
  with `dep_q=0` there is no depformer and `LMGen.step` returns `[B, 1, 1]` text tokens, -2 for rows that
  did not execute; `step_with_extra_heads` softmaxes each extra head over `[B, 1, dim]`.
- verified from delayed-streams-modeling (`scripts/stt_from_file_pytorch.py`, the Rust `asr.rs`): greedy
  decoding, `audio_silence_prefix_seconds` of silence before the audio, text ids 0 and 3 are not words.
- read in third-party code, not checked against the weights: stt-2.6b-en's config.json (n_q 32, dep_q 0,
  33 zero delays, text_card 4000, delay 2.5 s, prefix 1.0 s, no extra heads); stt-1b-en_fr's delay 0.5 s;
  the end-of-turn head is `extra_heads[2]`, class 0, threshold 0.5, near 1 in silence before any speech
  (so it only counts once the utterance has words); and that the PyTorch stt-1b-en_fr weights may lack
  the extra heads (then finals come from the no-new-word gap alone).

Design:
- `KyutaiSttEngine` owns Mimi + `LMGen(support_out_of_sync=True, use_sampling=False)` in streaming mode
  for `max_streams` rows and one thread that ticks every 80 ms, right after each tick of the KAME engine
  when one runs in this process (`follow`: on one GPU the two then take turns instead of running into
  each other's frames), else on its own clock. A clock, not frame arrival, drives it:
  calls' frames reach the engine at jittered times through the back-end's thread pool, and stepping per
  arrival would cost one whole-batch step per call per frame. Each tick steps once for every row that
  has a frame; a row without one sits out (exec mask off) instead of holding the batch. A row whose
  backlog grows past `catchup_backlog_frames` (a stalled tick) gets extra steps in the same tick, at
  most `max_steps_per_tick`. An idle engine does not touch the model once its free rows are primed.
- Rows are primed while free: a row no call holds is reset and fed its `audio_silence_prefix_seconds`
  of silence one frame a tick, riding the steps the other rows take anyway (a batch step computes every
  row), its tokens dropped. A call then joins a primed row with no backlog. Fed in the call, the prefix
  (13 frames for stt-2.6b-en) made each join a catch-up of whole-batch steps: a burst of call starts ran
  4 steps a tick for seconds, and the KAME engine sharing the GPU missed its frames and turned calls
  away (H100, docs/benchmarks.md section 4). A call that finds no primed row takes the most primed one
  and its remaining prefix frames. At start the warm-up primes every row. A failed step pauses priming
  until a step works (a call's), or for `PRIMING_RETRY_S`.
- A row's reset is per row (moshi resets KV caches, conv state and offsets in place); a call leaves by
  simply not executing; -2 rows are never decoded. Batch shape never changes, so CUDA graphs stay valid.
- Finals: when the end-of-turn head fires, the final waits `audio_delay_seconds` more steps so the last
  words (which lag the audio) are in it; fallback, and the only rule without heads: no new word for
  `final_gap_s` (0.8 s) of the row's audio; also `max_utterance_s`, and `flush()`.
- `feed()` never waits for the model: it queues frames and returns what was produced since the last
  call, so results reach the back-end with the next frame (<= 80 ms later on a live phone stream).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from moshi.models import loaders
from moshi.models.lm import LMGen
from moshi.utils import compile as moshi_compile
from safetensors import SafetensorError

from engine.checkpoint import CheckpointError, resolve_checkpoint
from engine.interface import FRAME_SAMPLES, FRAME_SECONDS
from engine.mimi_graphs import graph_quantizer
from engine.ticker import FrameTicker

from . import metrics
from .stt import SttResult
from .stt_random import RANDOM_PREFIX, random_stt_info

if TYPE_CHECKING:
    from .stt_process import SttProcess

log = logging.getLogger(__name__)

UNGENERATED = -2  # moshi's "this row produced nothing"
TEXT_PADDING, END_OF_PADDING = 3, 0  # Kyutai STT text ids that carry no text
DEFAULT_CHECKPOINT = "kyutai/stt-1b-en_fr"
# Priming paused by a failed step is tried again after this long without a call's step to re-arm it: a transient
# fault on an idle node would otherwise leave every row unprimed for the next burst of calls (the catch-up that
# priming removes), where a GPU that stays broken costs one failed step this often.
PRIMING_RETRY_S = 30.0


class SttCapacityError(RuntimeError):
    """Every row of the shared Kyutai STT engine is taken by a call."""


@dataclass(frozen=True)
class KyutaiSttOptions:
    end_of_turn_head: int = 2  # index into the model's extra heads; class 0 = "turn is over"
    end_of_turn_threshold: float = 0.5
    final_gap_s: float = 0.8  # no new word for this long (of the row's audio): final
    max_utterance_s: float = 30.0
    max_backlog_s: float = 4.0  # frames queued beyond this are dropped, oldest first
    catchup_backlog_frames: int = 3
    # Each catch-up step is a whole-batch step on the GPU the KAME engine ticks on: on an H100 at 48 seats
    # with stt-2.6b-en, 4 a tick for a second or two made the engine miss its 80 ms frames and turn calls
    # away (docs/benchmarks.md, section 4). 2 catches up one frame a tick after a stall at half that load.
    max_steps_per_tick: int = 2
    warmup_steps: int = 2  # on CUDA the second step captures the graphs

    def __post_init__(self) -> None:
        if self.max_steps_per_tick < 1:  # 0 would never step: every call's transcript silent
            raise ValueError(f"max_steps_per_tick must be >= 1 (got {self.max_steps_per_tick})")


def _frames(seconds: float) -> int:
    return max(0, math.ceil(round(seconds / FRAME_SECONDS, 6)))


class TranscriptAssembler:
    """One row's text: tokens in, partials (the current utterance so far) and finals out. Pure logic."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        vocab_size: int,
        *,
        delay_steps: int,
        gap_steps: int,
        max_steps: int,
        eot_threshold: float | None,
    ) -> None:
        self._decode = decode
        self._vocab = vocab_size
        self.delay_steps = delay_steps
        self.gap_steps = max(1, gap_steps)
        self.max_steps = max(1, max_steps)
        self.eot_threshold = eot_threshold
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self._since_word = 0
        self._utt_steps = 0
        self._final_in: int | None = None  # steps until the end-of-turn final
        self._partial = ""

    def step(self, token: int, eot_prob: float | None = None) -> list[SttResult]:
        if token < 0:  # UNGENERATED: the row did not run this step
            return []
        out: list[SttResult] = []
        if TEXT_PADDING < token < self._vocab:
            self.tokens.append(token)
            self._since_word = 0
            text = self._text()
            if text != self._partial:
                self._partial = text
                out.append(SttResult(text, final=False))
        else:
            self._since_word += 1
        if not self.tokens:
            return out
        self._utt_steps += 1
        if self.eot_threshold is not None and eot_prob is not None:
            if eot_prob < self.eot_threshold:
                self._final_in = None  # talking (again)
            elif self._final_in is None:
                self._final_in = self.delay_steps  # the last words are still `delay` steps behind
        end_of_turn = False
        if self._final_in is not None:
            end_of_turn = self._final_in <= 0
            self._final_in -= 1
        if end_of_turn or self._since_word >= self.gap_steps or self._utt_steps >= self.max_steps:
            out.extend(self.flush())
        return out

    def flush(self) -> list[SttResult]:
        if not self.tokens:
            return []
        text = self._text()
        self.reset()
        return [SttResult(text, final=True)]

    def _text(self) -> str:
        return " ".join(self._decode(self.tokens).split())


@dataclass
class _Row:
    lease: int
    assembler: TranscriptAssembler
    inbox: deque[np.ndarray] = field(default_factory=deque)
    outbox: list[SttResult] = field(default_factory=list)
    needs_reset: bool = True
    resets: int = 0  # a step whose frame went in before a reset must not put its token in the new utterance
    prefix_queued: int = 0  # silence-prefix frames still at the head of the inbox (not the call's audio)
    steps: int = 0
    dropped_frames: int = 0
    failure: str | None = None


@dataclass(frozen=True)
class SttStep:
    """What one batched step produced (for tests and benchmarks)."""

    tokens: np.ndarray  # [B] int64, UNGENERATED where the row did not execute
    executed: np.ndarray  # [B] bool
    end_of_turn: np.ndarray | None  # [B] float32 probabilities, None if the model has no such head


class KyutaiSttEngine:
    """Mimi + Kyutai STT LM for `max_streams` calls, stepped as one batch by its own thread."""

    def __init__(
        self,
        source: str,
        device: torch.device | str | None = None,
        max_streams: int = 16,
        dtype: torch.dtype | None = None,
        *,
        options: KyutaiSttOptions | None = None,
        revision: str | None = None,
        start: bool = True,
    ) -> None:
        if max_streams < 1:
            raise ValueError("max_streams must be >= 1")
        self.options = opts = options or KyutaiSttOptions()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.batch_size = B = max_streams
        self.source = source
        info = _load_info(source, revision)
        self.stt_config = dict(info.stt_config)
        if self.device.type != "cuda":
            # As in KameBatch: moshi's lazy torch.compile costs tens of seconds per shape on CPU for no gain.
            moshi_compile._compile_disabled = True
        try:
            self.mimi = info.get_mimi(device=self.device)
            self.lm = info.get_moshi(device=self.device, dtype=dtype)
            self.tokenizer = info.get_text_tokenizer()
        except (RuntimeError, OSError, KeyError, TypeError, ValueError, SafetensorError) as e:
            first = " ".join(str(e).strip().splitlines()[:3])
            raise CheckpointError(
                f"Kyutai STT checkpoint {source} does not load: {type(e).__name__}: {first}"
            ) from None
        if self.lm.dep_q != 0:
            raise CheckpointError(f"{source} is not a Kyutai STT model: dep_q={self.lm.dep_q} (an STT LM has 0)")
        self.lm_gen = LMGen(self.lm, use_sampling=False, support_out_of_sync=True)
        self.has_end_of_turn = len(self.lm.extra_heads) > opts.end_of_turn_head
        self.delay_steps = _frames(float(self.stt_config.get("audio_delay_seconds", 0.0)))
        self.prefix_frames = _frames(float(self.stt_config.get("audio_silence_prefix_seconds", 0.0)))
        self._max_backlog = max(1, _frames(opts.max_backlog_s)) + self.prefix_frames
        self._vocab = self.tokenizer.vocab_size()

        self._stack = ExitStack()
        self._stack.enter_context(self.lm_gen.streaming(B))
        self._stack.enter_context(self.mimi.streaming(B))
        # Its 32 codebooks' launches as one graph: 359 of the encode's 379 (engine/mimi_graphs.py).
        self._stack.enter_context(graph_quantizer(self.mimi))
        pin = self.device.type == "cuda"
        self._pcm_in = torch.zeros(B, 1, FRAME_SAMPLES, dtype=torch.float32, pin_memory=pin)
        self._rows: list[_Row | None] = [None] * B
        # Free rows' priming (see the module's design): silence frames still to step, and whether the row's
        # model state must be reset first (a call left it, or a step failed).
        self._prime_left = [self.prefix_frames] * B
        self._prime_reset = [True] * B
        # Priming rides on a sound model only: after a failed step it waits for a step that works (a call's),
        # or an idle engine with a broken GPU would fail a whole-batch step every tick, for ever.
        self._priming = True
        self._priming_failed_at = 0.0  # monotonic time of the failure that paused it
        self._leases = 0
        # Reentrant: a subclass may act under it around these methods (the STT process's child tags each row's
        # results with the row's epoch, atomically with their drain and reset).
        self._lock = threading.RLock()
        self._model_lock = threading.Lock()  # one step at a time (thread vs. direct callers)
        self._ticker = FrameTicker("kyutai-stt", self._tick_logged)
        self._closed = False
        self.steps = 0
        self.last_step_s = 0.0
        # As the metrics count them: a process of its own forwards these to the one that is scraped.
        self.dropped_frames_total = 0
        self.catchup_steps_total = 0
        log.info(
            "Kyutai STT %s on %s: %d rows, text delay %d frames, prefix %d frames, end-of-turn head: %s, "
            "catch-up to %d steps a tick", source, self.device, B, self.delay_steps, self.prefix_frames,
            self.has_end_of_turn, opts.max_steps_per_tick,
        )
        if start:
            self.start()

    # ---- rows (any thread) ----

    @property
    def free_rows(self) -> int:
        with self._lock:
            return sum(r is None for r in self._rows)

    def open_stream(self) -> KyutaiStreamingSTT:
        """A `StreamingSTT` bound to a free row (`SttCapacityError` if there is none)."""
        row, lease = self._acquire()
        return KyutaiStreamingSTT(self, row, lease)

    def _new_assembler(self) -> TranscriptAssembler:
        opts = self.options
        return TranscriptAssembler(
            lambda ids: self.tokenizer.decode(ids),
            self._vocab,
            delay_steps=self.delay_steps,
            gap_steps=_frames(opts.final_gap_s),
            max_steps=_frames(opts.max_utterance_s),
            eot_threshold=opts.end_of_turn_threshold if self.has_end_of_turn else None,
        )

    def _acquire(self) -> tuple[int, int]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the Kyutai STT engine is closed")
            free = [i for i, row in enumerate(self._rows) if row is None]
            if free:
                # The most primed free row: a primed one adds no backlog, so no catch-up steps.
                index = min(free, key=lambda i: (self._prime_reset[i], self._prime_left[i]))
                self._leases += 1
                new = _Row(self._leases, self._new_assembler(), needs_reset=self._prime_reset[index],
                           prefix_queued=self._prime_left[index])  # fmt: skip
                new.inbox.extend(np.zeros(FRAME_SAMPLES, np.float32) for _ in range(self._prime_left[index]))
                self._prime_left[index], self._prime_reset[index] = 0, False
                self._rows[index] = new
                return index, new.lease
        raise SttCapacityError(
            f"all {self.batch_size} Kyutai STT rows are busy (one per call): raise KAME_STT_MAX_STREAMS "
            f"(now {self.batch_size}) or take fewer calls"
        )

    def _row(self, index: int, lease: int) -> _Row:
        row = self._rows[index]
        if row is None or row.lease != lease:
            raise RuntimeError(f"Kyutai STT row {index} is no longer held by this stream")
        if row.failure is not None:
            raise RuntimeError(f"Kyutai STT engine step failed: {row.failure}")
        return row

    def _push(self, index: int, lease: int, frames: np.ndarray) -> None:  # [n, FRAME_SAMPLES]
        with self._lock:
            row = self._row(index, lease)
            row.inbox.extend(frames)
            while len(row.inbox) > self._max_backlog:  # the engine fell behind: keep the newest audio
                row.inbox.popleft()
                row.prefix_queued = max(0, row.prefix_queued - 1)
                row.dropped_frames += 1
                self.dropped_frames_total += 1
                metrics.STT_DROPPED_FRAMES.inc()
                if row.dropped_frames in (1, 100) or row.dropped_frames % 1000 == 0:
                    log.warning("Kyutai STT row %d lagging: %d frames dropped", index, row.dropped_frames)

    def _drain(self, index: int, lease: int) -> list[SttResult]:
        with self._lock:
            row = self._row(index, lease)
            out, row.outbox = row.outbox, []
            return out

    def _flush(self, index: int, lease: int) -> list[SttResult]:
        with self._lock:
            row = self._row(index, lease)
            out, row.outbox = row.outbox, []
            return out + row.assembler.flush()

    def _reset(self, index: int, lease: int) -> None:
        with self._lock:
            row = self._row(index, lease)
            row.inbox.clear()
            row.inbox.extend(np.zeros(FRAME_SAMPLES, np.float32) for _ in range(self.prefix_frames))
            row.prefix_queued = self.prefix_frames
            row.outbox.clear()
            row.assembler.reset()
            row.needs_reset = True
            row.resets += 1

    def _release(self, index: int, lease: int) -> None:
        with self._lock:
            row = self._rows[index]
            if row is not None and row.lease == lease:
                self._rows[index] = None  # free: reset and primed again on the next steps
                self._prime_left[index], self._prime_reset[index] = self.prefix_frames, True

    # ---- the model ----

    @torch.no_grad()
    def step(self) -> SttStep | None:
        """One batched step for every row with a queued frame; None (model untouched) if none has one."""
        B = self.batch_size
        pcm = np.zeros((B, FRAME_SAMPLES), dtype=np.float32)
        active = np.zeros(B, dtype=bool)
        reset = np.zeros(B, dtype=bool)
        leases = [0] * B
        resets = [0] * B
        silence = np.zeros(B, dtype=bool)  # a call's row stepping its silence prefix: its token is not the call's
        with self._model_lock:
            with self._lock:
                if not self._priming and time.monotonic() - self._priming_failed_at > PRIMING_RETRY_S:
                    self._priming = True
                for index, row in enumerate(self._rows):
                    if row is None:
                        if self._priming and self._prime_left[index] > 0:  # priming: silence, tokens dropped
                            active[index] = True
                            self._prime_left[index] -= 1
                            reset[index], self._prime_reset[index] = self._prime_reset[index], False
                        continue
                    if not row.inbox or row.failure is not None:
                        continue
                    pcm[index] = row.inbox.popleft()
                    silence[index] = row.prefix_queued > 0
                    row.prefix_queued = max(0, row.prefix_queued - 1)
                    active[index] = True
                    leases[index], resets[index] = row.lease, row.resets
                    if row.needs_reset:
                        reset[index], row.needs_reset = True, False
            if not active.any():
                return None
            started = time.perf_counter()
            try:
                tokens, eot = self._model_step(pcm, active, reset)
            except Exception as exc:
                self._fail(active, leases, exc)
                raise
            self.last_step_s = time.perf_counter() - started
            metrics.STT_STEP_SECONDS.observe(self.last_step_s)
            self.steps += 1
            with self._lock:
                self._priming = True
                for index, row in enumerate(self._rows):
                    if row is None or not active[index] or (row.lease, row.resets) != (leases[index], resets[index]):
                        continue  # left or reset during the step: its output is dropped
                    row.steps += 1
                    if silence[index]:
                        # Dropped, as a free row's priming drops them: a call that joins a row half primed, or
                        # resets its own, hears what a call on a fully primed row hears.
                        continue
                    prob = float(eot[index]) if eot is not None else None
                    row.outbox.extend(row.assembler.step(int(tokens[index]), prob))
        return SttStep(tokens=tokens, executed=active, end_of_turn=eot)

    def _model_step(
        self, pcm: np.ndarray, active: np.ndarray, reset: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        if reset.any():
            mask = torch.from_numpy(reset).to(self.device)
            self.lm_gen.reset_streaming(mask)
            self.mimi.reset_streaming(mask)
        exec_mask = torch.from_numpy(active).to(self.device)
        self.lm_gen.set_exec_mask(exec_mask)
        self.mimi.set_exec_mask(exec_mask)
        self._pcm_in[:, 0].copy_(torch.from_numpy(pcm))
        codes = self.mimi.encode(self._pcm_in.to(self.device, non_blocking=True))  # [B, n_q, 1]
        result = self.lm_gen.step_with_extra_heads(codes)
        assert result is not None  # support_out_of_sync never returns None
        out, heads = result
        text = out[:, 0, 0]  # moshi wrote UNGENERATED for rows that did not execute
        columns = [text[:, None].float()]
        if self.has_end_of_turn:
            columns.append(heads[self.options.end_of_turn_head][:, 0, :1].float())
        packed = torch.cat(columns, dim=1).cpu().numpy()  # one device->host copy per step
        tokens = packed[:, 0].astype(np.int64)
        tokens[~active] = UNGENERATED
        eot = None
        if self.has_end_of_turn:
            eot = packed[:, 1].astype(np.float32)
            eot[~active] = np.nan
        return tokens, eot

    def _fail(self, active: np.ndarray, leases: list[int], exc: Exception) -> None:
        """A failed step leaves model state unknown: its rows report the error and get reset on reuse."""
        with self._lock:
            self._priming, self._priming_failed_at = False, time.monotonic()
            for index, row in enumerate(self._rows):
                if not active[index]:
                    continue
                if row is None:  # a free row priming: start its priming over
                    self._prime_left[index], self._prime_reset[index] = self.prefix_frames, True
                elif leases[index] == 0:
                    # Taken by a call while the step primed it: none of the call's audio went through the
                    # model, so the row starts over (reset, the whole prefix) rather than failing the call,
                    # which would lose its first second or more of speech.
                    stepped = self.prefix_frames - row.prefix_queued
                    row.inbox.extendleft(np.zeros(FRAME_SAMPLES, np.float32) for _ in range(stepped))
                    row.prefix_queued, row.needs_reset = self.prefix_frames, True
                elif row.lease == leases[index]:  # its call's audio was in the step
                    row.failure = f"{type(exc).__name__}: {exc}"

    def backlog(self) -> int:
        with self._lock:
            # A failed row is never stepped again: counted, its inbox would buy catch-up steps every tick.
            return max((len(r.inbox) for r in self._rows if r is not None and r.failure is None), default=0)

    def tick(self) -> int:
        """One 80 ms tick: a step, plus catch-up steps while some row is behind. Returns the steps run."""
        steps = 0
        while steps < self.options.max_steps_per_tick:
            if steps and self.backlog() <= self.options.catchup_backlog_frames:
                break
            if self.step() is None:
                break
            steps += 1
        if steps > 1:
            self.catchup_steps_total += steps - 1
            metrics.STT_CATCHUP_STEPS.inc(steps - 1)
        return steps

    def warmup(self, steps: int | None = None) -> None:
        """Step every row a few times on silence (first steps are slow; on CUDA this captures graphs)."""
        n = self.options.warmup_steps if steps is None else steps
        if n <= 0:
            return
        B = self.batch_size
        everyone = torch.ones(B, dtype=torch.bool, device=self.device)
        silence = np.zeros((B, FRAME_SAMPLES), np.float32)
        with self._model_lock, torch.no_grad():
            for i in range(n):
                self._model_step(silence, np.ones(B, bool), np.full(B, i == 0))
            self.lm_gen.reset_streaming(everyone)
            self.mimi.reset_streaming(everyone)
            with self._lock:
                fresh = [i for i, row in enumerate(self._rows) if row is None]
                for i in fresh:
                    self._prime_left[i], self._prime_reset[i] = self.prefix_frames, False
        for _ in range(self.prefix_frames):  # prime every free row now, before the first call
            self.step()

    def start(self) -> None:
        if self._ticker.running:
            return
        self.warmup()
        self._ticker.start()

    def follow(self, pace: threading.Event | None) -> None:
        """Step right after each KAME engine tick (`pace`, set by the engine) instead of on this engine's own
        clock: on one GPU, the STT's steps then fall between the engine's ticks, not inside them."""
        self._ticker.follow(pace)
        log.info("Kyutai STT steps %s", "after each KAME engine tick" if pace is not None else "on its own clock")

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._ticker.stop()
        with self._model_lock:
            self._stack.close()

    def _tick_logged(self) -> None:
        try:
            self.tick()
        except Exception:
            log.exception("Kyutai STT step failed; its calls' STT objects will report it")


class WholeFrames:
    """A call's audio cut into whole 80 ms frames: what is short of one waits for the next piece."""

    def __init__(self) -> None:
        self._carry = np.zeros(0, np.float32)

    def cut(self, pcm24k: np.ndarray) -> np.ndarray:
        """[n, FRAME_SAMPLES] float32 (n may be 0), a copy: never a view of the caller's buffer."""
        x = np.asarray(pcm24k, dtype=np.float32).reshape(-1)
        buf = np.concatenate([self._carry, x]) if self._carry.size else x
        n = buf.size // FRAME_SAMPLES
        self._carry = buf[n * FRAME_SAMPLES :].copy()
        return buf[: n * FRAME_SAMPLES].reshape(n, FRAME_SAMPLES).copy()

    def reset(self) -> None:
        self._carry = np.zeros(0, np.float32)


class KyutaiStreamingSTT:
    """One call's `StreamingSTT` on a row of a shared `KyutaiSttEngine`, or of the engine in the STT's own process
    (knowledge/stt_process.py's `SttProcess`, whose rows are also named by the child they live in)."""

    def __init__(
        self, engine: KyutaiSttEngine | SttProcess, row: int, lease: int, generation: int | None = None
    ) -> None:
        self.engine = engine
        self.row = row
        self._key = (row, lease) if generation is None else (generation, row, lease)  # how the engine names the row
        self._frames = WholeFrames()
        self._closed = False

    def feed(self, pcm24k: np.ndarray) -> list[SttResult]:
        self._check_open()
        frames = self._frames.cut(pcm24k)
        if len(frames):
            self.engine._push(*self._key, frames)  # type: ignore[call-arg]
        return self.engine._drain(*self._key)  # type: ignore[call-arg]

    def flush(self) -> list[SttResult]:
        """The current utterance's final now (text still `audio_delay_seconds` behind is not in it)."""
        self._check_open()
        return self.engine._flush(*self._key)  # type: ignore[call-arg]

    def reset(self) -> None:
        self._check_open()
        self._frames.reset()
        self.engine._reset(*self._key)  # type: ignore[call-arg]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine._release(*self._key)  # type: ignore[call-arg]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KyutaiStreamingSTT used after close()")


def _load_info(source: str, revision: str | None) -> loaders.CheckpointInfo:
    """Resolve like our KAME checkpoints (local dir or HF repo id), then hand moshi a `CheckpointInfo`;
    `random:SIZE` builds the named layout with random weights (knowledge/stt_random.py)."""
    if source.startswith(RANDOM_PREFIX):
        return random_stt_info(source)
    try:
        files = resolve_checkpoint(source, revision, use_copy="point KAME_STT_CHECKPOINT at DIR (or use "
                                   "--stt pocketsphinx, which needs no download)")
    except CheckpointError as e:
        raise CheckpointError(f"Kyutai STT checkpoint (KAME_STT_CHECKPOINT={source}): {e}") from None
    config = files.config
    model_type = config.get("model_type", "moshi")
    if model_type != "stt":
        raise CheckpointError(f"{source} is not a Kyutai STT checkpoint: config.json has model_type {model_type!r}")
    return loaders.CheckpointInfo(
        moshi_weights=files.lm_weights,
        mimi_weights=files.mimi_weights,
        tokenizer=files.tokenizer,
        lm_config=files.lm_kwargs,
        raw_config=config,
        mimi_config=files.mimi_config,
        model_type=model_type,
        lm_gen_config=files.lm_gen_config,
        stt_config=dict(config.get("stt_config", {})),
        model_id=dict(config.get("model_id", {})),
    )


_SHARED: KyutaiSttEngine | None = None
_SHARED_LOCK = threading.Lock()


def engine_from_env(env: Mapping[str, str] | None = None, rows: int | None = None) -> KyutaiSttEngine:
    """KAME_STT_CHECKPOINT (repo id or dir), KAME_STT_DEVICE (default cuda if available), KAME_STT_MAX_STREAMS
    (else `rows`: one per call the engine seats, so the 17th call of 64 is not left without a transcript;
    else 16), KAME_STT_MAX_STEPS_PER_TICK (catch-up: whole-batch steps a tick may take, 1-8, default 2)."""
    source, device, max_streams, options = settings_from_env(env, rows)
    return KyutaiSttEngine(source, device=device, max_streams=max_streams, options=options)


def settings_from_env(
    env: Mapping[str, str] | None = None, rows: int | None = None
) -> tuple[str, str | None, int, KyutaiSttOptions]:
    """`engine_from_env`'s settings, parsed: (checkpoint, device, rows, options). ValueError names the variable
    (serve checks them at start, in one line, not as a traceback at the back-end's first load)."""
    env = os.environ if env is None else env
    source = env.get("KAME_STT_CHECKPOINT") or DEFAULT_CHECKPOINT
    device = env.get("KAME_STT_DEVICE") or None
    raw = env.get("KAME_STT_MAX_STREAMS") or str(rows or 16)
    try:
        max_streams = int(raw)
    except ValueError:
        max_streams = 0
    if max_streams < 1:
        raise ValueError(f"KAME_STT_MAX_STREAMS must be an integer of at least 1, got {raw!r}")
    options = KyutaiSttOptions()
    raw = env.get("KAME_STT_MAX_STEPS_PER_TICK") or str(options.max_steps_per_tick)
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if not 1 <= steps <= 8:
        raise ValueError(f"KAME_STT_MAX_STEPS_PER_TICK must be an integer from 1 to 8, got {raw!r}")
    return source, device, max_streams, dataclasses.replace(options, max_steps_per_tick=steps)


def close_shared_engine() -> None:
    """Stop the process-wide engine (its thread, its model), if one was built: at the back-end's shutdown.
    Blocks up to a tick: call it from a worker thread."""
    global _SHARED
    with _SHARED_LOCK:
        engine, _SHARED = _SHARED, None
    if engine is not None:
        engine.close()


def shared_engine(rows: int | None = None) -> KyutaiSttEngine:
    """The process-wide engine, built from the environment (and `rows`) on first use."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = engine_from_env(rows=rows)
        return _SHARED

