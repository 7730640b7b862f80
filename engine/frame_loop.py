"""The real-time 80 ms frame loop over a fixed set of call slots.

One thread owns the model. Each tick it takes one caller frame per active slot (silence and an underrun
if it is late: the loop never waits for one slow call), one oracle token per slot, steps the whole batch
once and hands each slot its 80 ms of audio and its text piece. Everything the asyncio side calls
(`join`, `leave`, `push_audio`, `set_oracle`, `caller_turn`) only touches small locked structures and
returns at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import sentencepiece

from . import metrics
from .batch import UNGENERATED, KameBatch, ModelMemory
from .interface import FRAME_SAMPLES, FRAME_SECONDS, EngineClosed, EngineError, EngineFull
from .oracle_buffer import OracleBuffer, tokenize_draft
from .sampling import SamplingConfig
from .ticker import FrameTicker

log = logging.getLogger(__name__)

_SILENCE = np.zeros(FRAME_SAMPLES, dtype=np.float32)


def publish_memory(memory: ModelMemory) -> None:
    """The model's memory as served, in this process's metrics (the one scraped)."""
    metrics.ENGINE_MODEL_BYTES.labels(part="weights").set(memory.weights_bytes)
    metrics.ENGINE_MODEL_BYTES.labels(part="kv_cache").set(memory.kv_cache_bytes)


class OracleFed(NamedTuple):
    """A candidate's boundary token went into its call's row (a NamedTuple: it crosses the engine-process pipe)."""

    call_id: str
    candidate: int
    fed_at: float  # monotonic
    lag: float  # from the transcript update that triggered its request (kame_oracle_lag_seconds)
    slot_wait: float  # from reaching the slot to being fed: the frame loop's share of the lag

    def observe(self) -> None:
        metrics.ORACLE_LAG_SECONDS.observe(self.lag)
        metrics.ORACLE_SLOT_WAIT_SECONDS.observe(self.slot_wait)


@dataclass(frozen=True, slots=True)
class SlotOutput:
    pcm: np.ndarray  # [FRAME_SAMPLES] float32
    token: int  # text token, UNGENERATED if none
    piece: str  # SentencePiece piece ('' for padding / none)
    voiced: bool  # real audio from the model (False: silence stands in)
    index: int  # frame number since the call joined
    oracle_token: int  # the oracle token this slot fed on this step
    held: bool  # muted by the forced response delay
    fresh: bool = False  # the slot's model state was (re)started at this step


def checked_frame(pcm: np.ndarray) -> np.ndarray:
    """One 80 ms frame of a caller's audio as the engine and its back-end take it: float32, FRAME_SAMPLES samples
    in [-1, 1]. The wrong shape, or integer samples (int16 would be 32767x too loud), are a ValueError; NaN, inf
    and samples out of range are silenced and clipped: they reach the Mimi encoder's attention cache, which a
    row's reset does not clear (it rewinds the offset), and the next call on the row was not heard for up to
    10 s; and the STT's state the same way."""
    if pcm.shape != (FRAME_SAMPLES,):
        raise ValueError(f"expected {FRAME_SAMPLES} samples, got {pcm.shape}")
    if not np.issubdtype(pcm.dtype, np.floating):
        raise ValueError(f"expected float samples in [-1, 1], got {pcm.dtype}")
    if not np.abs(pcm).max() <= 1.0:  # (False for a NaN too)
        pcm = np.clip(np.nan_to_num(pcm, nan=0.0), -1.0, 1.0)
    return pcm.astype(np.float32, copy=False)


SlotSink = Callable[[SlotOutput], None]
# (call id, output) of every slot in one tick, and when it ended (time.monotonic(): one clock for the whole
# machine, so an engine in a process of its own stamps it there, before the pipe to its parent)
TickSink = Callable[[list[tuple[str, SlotOutput]], float], None]
ResetHook = Callable[[], None]  # told that the slot's model state was reset (its audio queued downstream is stale)


@dataclass
class Slot:
    """One call's seat: its input queue, oracle cursor, timing and counters."""

    row: int
    call_id: str
    sink: SlotSink | None  # None: the loop's tick sink takes this slot's outputs with everyone else's
    oracle: OracleBuffer
    on_reset: ResetHook | None = None
    inbox: deque[np.ndarray] = field(default_factory=deque)
    needs_reset: bool = True
    got_audio: bool = False  # underruns count only once the caller's audio has started
    frames_out: int = 0
    underruns: int = 0
    overruns: int = 0
    standing_backlog: int = 0  # ticks in a row that left >= CATCHUP_BACKLOG caller frames queued
    # Mean power of the caller's last CATCHUP_FLOOR_FRAMES frames taken: its minimum is the line's noise floor.
    levels: deque[float] = field(default_factory=lambda: deque(maxlen=CATCHUP_FLOOR_FRAMES))
    catchups: int = 0
    # Forced response delay: muted while the caller speaks and until `release_at` ticks.
    caller_speaking: bool = False
    release_at: int = -1
    forced_delay_frames: int | None = None  # this call's own (its agent's); None: the loop's


# The caller's frames come in bursts after any stall on their way (a TCP retransmit, a GC pause, a slow
# hop), and a tick takes one: without a way back, a backlog once built delays everything the model hears
# for the rest of the call (a 500 ms stall left every later frame 240 ms late). One frame queued beyond the
# tick's own is the jitter cushion (arrival wobbles by milliseconds around the tick, so a steady one is
# normal and dropping it would trade a gap for a splice every second); a deeper backlog that stands for
# CATCHUP_AFTER_TICKS (about a second) loses its quietest queued frame if that is a pause (below
# CATCHUP_QUIET_DBFS, or near the caller's own noise floor: below), at most one a second; while the caller
# talks on without a pause, a word's frame is dropped only once the backlog has stood
# CATCHUP_FORCE_AFTER_TICKS (late hearing is the worse harm by then).
CATCHUP_BACKLOG = 2
CATCHUP_AFTER_TICKS = 12
CATCHUP_FORCE_AFTER_TICKS = 62  # ~5 s
CATCHUP_QUIET_DBFS = -40.0
# A pause is quiet relative to the caller's own line: on a noisy one (a speakerphone, a street) the pauses sit
# at the noise, above CATCHUP_QUIET_DBFS, so only the forced drop ran. Measured (flite speech through the real
# framer and loop, 500/1000 ms stalls at 100 positions, white noise under it): at -35 dBFS noise 1.5 of the 2
# frames dropped were a word's and the backlog took ~10 s to clear; at -40 dBFS 0.35 and ~6 s. So a queued
# frame is also a pause below the caller's noise floor (the quietest frame taken in the last
# CATCHUP_FLOOR_FRAMES) plus CATCHUP_FLOOR_MARGIN_DB, never looser than CATCHUP_QUIET_MAX_DBFS. With it:
# -35 dBFS 0.7-1.1 word frames, ~2.5 s; -40 dBFS none, ~3 s; clean speech and -45 dBFS noise unchanged.
CATCHUP_FLOOR_FRAMES = 75  # ~6 s, used once that much is heard: at ~3 s dense speech had no pause in the window
# and the floor rose into words (clean speech lost word frames).
CATCHUP_FLOOR_MARGIN_DB = 4.0  # 5-6 dB took faint word frames under -40 dBFS noise (0.5-0.7 per stall, more than
# before); 2-3 dB missed the pauses of noise whose level wanders (+-3 dB around -35 dBFS), where 4 dB cut the
# word frames dropped 1.3 -> 0.13 and the clearing time ~10 s -> ~4 s.
CATCHUP_QUIET_MAX_DBFS = -25.0  # however loud the floor, a frame this loud is never taken for a pause

# A node whose ticks miss their frame this often, over this window, is falling behind: every seated call
# is getting less than real time, so it stops taking calls until it keeps time again.
BEHIND_WINDOW_S = 2.0
BEHIND_MIN_TICKS = 10
BEHIND_LATE_SHARE = 0.2
# Ticks failing this many times in a row (2 s): the model or the device is not coming back (a sticky CUDA
# error). Failing ticks are fast, so the engine would otherwise look healthy and keep seating calls on silence.
BROKEN_AFTER_FAILED_TICKS = 25
# A loop with calls seated records a tick every 80 ms. None for this long: a tick is hung (a GPU hang, a
# deadlock), which no deadline miss is ever recorded for; the engine turns not ready (no new calls onto a
# dead loop), and after HUNG_S fails liveness so the orchestrator restarts it.
STALLED_S = 2.0
HUNG_S = 30.0


@dataclass
class LoopStats:
    ticks: int = 0
    deadline_misses: int = 0
    last_tick_s: float = 0.0
    tick_s: deque[float] = field(default_factory=lambda: deque(maxlen=2048))
    underruns: int = 0  # all slots, since start
    overruns: int = 0
    catchups: int = 0  # caller frames skipped to shrink a standing backlog, all slots, since start
    input_backlog: int = 0  # the last tick's deepest caller backlog (frames left queued after its take)
    recent: deque[tuple[float, bool]] = field(default_factory=lambda: deque(maxlen=64))  # (finished at, late)
    busy_since: float | None = None  # when calls were first seated since the loop was last empty
    # A stall the last call left behind: its calls hung up on a hung tick. Kept (and seating resumes from it)
    # until the loop shows it is alive (a tick recorded, or an idle one: `beat`); forgotten, a wedged engine
    # went back to taking calls each time it emptied, and never failed liveness on a quiet node.
    stall_from: float | None = None

    def seated(self, calls: int, now: float | None = None) -> None:
        """How many calls are seated now (from join and leave)."""
        now = time.monotonic() if now is None else now
        if calls == 0:
            if self.busy_since is not None and (stalled := self.stalled_s(now)) > STALLED_S:
                self.stall_from = now - stalled
            self.busy_since = None
        elif self.busy_since is None:
            self.busy_since = self.stall_from if self.stall_from is not None else now

    def beat(self) -> None:
        """The loop's thread went round without a call seated: not hung."""
        self.stall_from = None

    def stalled_s(self, now: float | None = None) -> float:
        """How long a loop with calls seated (or left stalled by its last ones) has recorded no tick: 0 while
        idle or ticking."""
        busy_since = self.busy_since if self.busy_since is not None else self.stall_from
        if busy_since is None:
            return 0.0
        now = time.monotonic() if now is None else now
        last = self.recent[-1][0] if self.recent else busy_since
        return max(0.0, now - max(last, busy_since))

    def record_tick(self, elapsed: float, late: bool, now: float | None = None) -> None:
        """One tick's wall time, and whether it missed its 80 ms deadline, into the stats and metrics."""
        self.stall_from = None
        self.ticks += 1
        self.last_tick_s = elapsed
        self.tick_s.append(elapsed)
        self.recent.append((time.monotonic() if now is None else now, late))
        metrics.ENGINE_TICK_SECONDS.observe(elapsed)
        if late:
            self.deadline_misses += 1
            metrics.ENGINE_DEADLINE_MISSES.inc()

    def falling_behind(self, now: float | None = None) -> bool:
        """More than a fifth of the last 2 s of ticks missed their frame. Time-based, so an engine that
        went idle (idle ticks are not recorded) is not held to its last busy seconds."""
        now = time.monotonic() if now is None else now
        window = [late for at, late in list(self.recent) if now - at <= BEHIND_WINDOW_S]
        return len(window) >= BEHIND_MIN_TICKS and sum(window) > BEHIND_LATE_SHARE * len(window)


class FrameLoop:
    def __init__(
        self,
        batch: KameBatch,
        tokenizer: sentencepiece.SentencePieceProcessor,
        *,
        max_queued_frames: int = 4,
        forced_delay_ms: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        on_tick: TickSink | None = None,
    ) -> None:
        self.batch = batch
        self.on_tick = on_tick
        self.tokenizer = tokenizer
        self.max_calls = batch.batch_size
        self.max_queued_frames = max_queued_frames
        self.forced_delay_frames = self._delay_frames(forced_delay_ms) or 0
        self.clock = clock
        self.stats = LoopStats()
        self._slots: list[Slot | None] = [None] * self.max_calls
        self._lock = threading.Lock()
        self._ticker = FrameTicker("kame-frame-loop", self.safe_tick, self._record_timing, clock)
        self._closed = False
        self._abort_start = threading.Event()
        self._failed_ticks = 0  # in a row
        self._ticking: list[Slot] = []  # the calls the tick under way steps (a failed one resets only those)
        self.broken: str | None = None  # why the loop gave up (BROKEN_AFTER_FAILED_TICKS); never cleared
        self.on_broken: Callable[[], None] | None = None  # from the loop's thread, once
        self._tick_no = 0
        self._idle = True  # the last tick had no call: it ran no model step and is not timed
        # (call id, candidate id, fed at, lag) for the last candidates whose boundary token was fed: the
        # raw samples behind kame_oracle_lag_seconds, for benchmarks and debugging.
        self.oracle_fed: deque[OracleFed] = deque(maxlen=10_000)
        self._vocab = tokenizer.vocab_size()
        self._silent_pieces = {batch.lm.text_padding_token_id, batch.lm.end_of_text_padding_id}
        metrics.ENGINE_SLOTS.set(self.max_calls)
        publish_memory(batch.memory)

    @property
    def sampling(self) -> SamplingConfig:
        return self.batch.sampling

    # ---- called from any thread (the asyncio side) ----

    @property
    def free_slots(self) -> int:
        with self._lock:
            return sum(s is None for s in self._slots)

    @property
    def alive(self) -> bool:
        """Its slots still exist and its ticks run (a child-process loop loses them when the process dies)."""
        return not self._closed and self.broken is None

    @property
    def died(self) -> bool:
        """Lost without being stopped: every tick failing (or, for a child-process loop, the process gone)."""
        return self.broken is not None

    def join(
        self, call_id: str, sink: SlotSink | None, on_reset: ResetHook | None = None,
        forced_delay_ms: float | None = None,
    ) -> int:
        """Seat a call; `forced_delay_ms` is its own forced response delay (None: the loop's)."""
        with self._lock:
            if self._closed or self.broken is not None:  # broken: its calls were told engine_lost already
                raise EngineClosed("engine is stopping" if self._closed else "engine is broken")
            for row, slot in enumerate(self._slots):
                if slot is None:
                    lm = self.batch.lm
                    oracle = OracleBuffer(lm.oracle_start_token_id, lm.text_padding_token_id)
                    self._slots[row] = Slot(row, call_id, sink, oracle, on_reset,
                                            forced_delay_frames=self._delay_frames(forced_delay_ms))
                    busy = self.max_calls - sum(s is None for s in self._slots)
                    metrics.ENGINE_SLOTS_BUSY.set(busy)
                    self.stats.seated(busy)
                    return row
        raise EngineFull(f"all {self.max_calls} call slots are busy")

    def leave(self, row: int, call_id: str) -> None:
        with self._lock:
            slot = self._slots[row]
            if slot is not None and slot.call_id == call_id:
                self._slots[row] = None  # its row sits out (exec mask off) until a new call resets it
            busy = self.max_calls - sum(s is None for s in self._slots)
            metrics.ENGINE_SLOTS_BUSY.set(busy)
            self.stats.seated(busy)

    def push_audio(self, row: int, call_id: str, pcm: np.ndarray) -> np.ndarray:
        """Queue one frame of the call's audio for its next tick; returns the frame as taken (`checked_frame`)."""
        pcm = checked_frame(pcm)
        with self._lock:
            slot = self._slots[row]
            if slot is None or slot.call_id != call_id:
                return pcm
            slot.got_audio = True
            slot.inbox.append(pcm)
            if len(slot.inbox) > self.max_queued_frames:
                # Audio faster than real time: drop the oldest frame so latency stays bounded.
                slot.inbox.popleft()
                slot.overruns += 1
                self.stats.overruns += 1
                metrics.ENGINE_OVERRUNS.inc()
        return pcm

    def set_oracle(
        self,
        row: int,
        call_id: str,
        candidate_id: int,
        text: str,
        triggered_at: float | None = None,
        *,
        complete: bool,
    ) -> list[int]:
        """Make `text` (a whole draft, tokenized as a whole) the slot's newest oracle candidate.

        `complete`: the draft's stream has ended, so its last word is settled too (until then it is held
        back: engine/oracle_buffer.py). `triggered_at` (this loop's clock) is when the transcript update
        behind it arrived: the oracle lag is measured from there to the tick that feeds the candidate's
        boundary token. Returns the draft's tokens.
        """
        draft = tokenize_draft(self.tokenizer, text, complete)
        with self._lock:
            slot = self._slots[row]
            if slot is not None and slot.call_id == call_id:
                slot.oracle.set_candidate(candidate_id, draft, triggered_at, now=self.clock())
        return draft.tokens

    def caller_turn(self, row: int, call_id: str, speaking: bool) -> None:
        """The caller started (True) or ended (False) a turn: drives the forced response delay."""
        with self._lock:
            slot = self._slots[row]
            if slot is None or slot.call_id != call_id:
                return
            if speaking:
                slot.caller_speaking = True
            elif slot.caller_speaking:
                slot.caller_speaking = False
                slot.release_at = self._tick_no + self._slot_delay(slot)

    # ---- the tick ----

    @staticmethod
    def _delay_frames(forced_delay_ms: float | None) -> int | None:
        return None if forced_delay_ms is None else math.ceil(forced_delay_ms / (FRAME_SECONDS * 1000))

    def _slot_delay(self, slot: Slot) -> int:
        return self.forced_delay_frames if slot.forced_delay_frames is None else slot.forced_delay_frames

    def _held(self, slot: Slot) -> bool:
        if not self._slot_delay(slot):
            return False
        return slot.caller_speaking or self._tick_no < slot.release_at

    def _catch_up(self, slot: Slot) -> None:
        """After the tick's take (under the lock): a backlog standing past the jitter cushion loses its
        quietest queued frame once that is a pause between words (or, after CATCHUP_FORCE_AFTER_TICKS, anyway)."""
        if len(slot.inbox) < CATCHUP_BACKLOG:
            slot.standing_backlog = 0
            return
        slot.standing_backlog += 1
        if slot.standing_backlog < CATCHUP_AFTER_TICKS:
            return
        power = [float(np.square(frame).mean()) for frame in slot.inbox]
        quietest = int(np.argmin(power))
        threshold = CATCHUP_QUIET_DBFS
        if len(slot.levels) == CATCHUP_FLOOR_FRAMES:
            floor = 10 * math.log10(max(min(slot.levels), 1e-12))
            threshold = min(CATCHUP_QUIET_MAX_DBFS, max(threshold, floor + CATCHUP_FLOOR_MARGIN_DB))
        quiet = 10 * math.log10(max(power[quietest], 1e-12)) < threshold
        if not quiet and slot.standing_backlog < CATCHUP_FORCE_AFTER_TICKS:
            return  # the caller is talking: wait for a pause
        del slot.inbox[quietest]
        slot.standing_backlog = 0
        slot.catchups += 1
        self.stats.catchups += 1
        metrics.ENGINE_INPUT_CATCHUPS.inc()

    def tick(self) -> list[tuple[Slot, SlotOutput]]:
        """One synchronous engine step for every active slot. Returns what was delivered."""
        B = self.max_calls
        pcm = np.zeros((B, FRAME_SAMPLES), dtype=np.float32)
        active = np.zeros(B, dtype=bool)
        reset = np.zeros(B, dtype=bool)
        oracle = np.full(B, self.batch.lm.text_padding_token_id, dtype=np.int64)
        held = np.zeros(B, dtype=bool)
        backlog = 0
        with self._lock:
            slots = list(self._slots)
            self._ticking = [slot for slot in slots if slot is not None]
            self._idle = all(slot is None for slot in slots)
            if self._idle:  # nobody seated: no model step (an idle engine stays near 0 % CPU)
                self._tick_no += 1
                self.stats.input_backlog = 0
                metrics.ENGINE_INPUT_BACKLOG.set(0)
                return []
            for row, slot in enumerate(slots):
                if slot is None:
                    continue
                active[row] = True
                if slot.needs_reset:
                    reset[row] = True
                    slot.needs_reset = False
                if slot.inbox:
                    frame = slot.inbox.popleft()
                    pcm[row] = frame
                    slot.levels.append(float(np.dot(frame, frame)) / FRAME_SAMPLES)
                    self._catch_up(slot)
                    backlog = max(backlog, len(slot.inbox))
                elif slot.got_audio:
                    slot.underruns += 1
                    self.stats.underruns += 1
                    metrics.ENGINE_UNDERRUNS.inc()
                held[row] = self._held(slot)
            self._tick_no += 1
            self.stats.input_backlog = backlog
        metrics.ENGINE_INPUT_BACKLOG.set(backlog)

        def take_oracle() -> np.ndarray:
            """The oracle token of every row, read by the batch right before the LM step."""
            with self._lock:
                for row, slot in enumerate(slots):
                    if slot is None or held[row]:  # while held the oracle waits: padding, cursor unmoved
                        continue
                    oracle[row] = slot.oracle.next_token()
                    if slot.oracle.lag_from is not None and oracle[row] == slot.oracle.start_token:
                        now = self.clock()
                        queued = slot.oracle.queued_at if slot.oracle.queued_at is not None else now
                        lag, wait = max(0.0, now - slot.oracle.lag_from), max(0.0, now - queued)
                        fed = OracleFed(slot.call_id, slot.oracle.candidate_id, now, lag, wait)
                        fed.observe()
                        self.oracle_fed.append(fed)
                        slot.oracle.lag_from = None
            return oracle

        self.batch.reset_rows(reset)
        result = self.batch.step(pcm, active, take_oracle)
        delivered = []
        for row, slot in enumerate(slots):
            if slot is None:
                continue
            token = int(result.text[row])
            voiced = bool(result.voiced[row]) and not held[row]
            out = SlotOutput(
                pcm=result.pcm[row] if voiced else _SILENCE,
                token=token,
                piece=self._piece(token) if not held[row] else "",
                voiced=voiced,
                index=slot.frames_out,
                oracle_token=int(oracle[row]),
                held=bool(held[row]),
                fresh=bool(reset[row]),
            )
            slot.frames_out += 1
            if slot.sink is not None:
                try:
                    slot.sink(out)
                except Exception:  # a broken consumer must not stop the other calls
                    log.exception("call %s: output sink failed", slot.call_id)
            delivered.append((slot, out))
        if self.on_tick is not None and delivered:
            try:
                self.on_tick([(slot.call_id, out) for slot, out in delivered], time.monotonic())
            except Exception:
                log.exception("tick sink failed")
        return delivered

    def _piece(self, token: int) -> str:
        if token == UNGENERATED or token in self._silent_pieces or not 0 <= token < self._vocab:
            return ""
        return self.tokenizer.id_to_piece(token)

    def safe_tick(self) -> bool:
        """`tick`, but a failure resets every slot instead of killing the loop. False if it failed."""
        try:
            self.tick()
            self._failed_ticks = 0
            return True
        except Exception as e:
            self._failed_ticks += 1
            n = self._failed_ticks
            if n <= 3 or n % 100 == 0:  # a device that fails every 80 ms must not flood the log
                log.exception("engine tick failed (%d in a row); resetting every slot", n)
            if n == BROKEN_AFTER_FAILED_TICKS:
                self._break(f"{n} ticks failed in a row, the last with {type(e).__name__}: {str(e)[:200]}")
            with self._lock:
                # The calls the failed tick stepped, still seated: one that joined meanwhile was not touched
                # (its row resets on its first tick anyway), and clearing its oracle wiped its greeting.
                current = {id(slot) for slot in self._slots if slot is not None}
                slots = [slot for slot in self._ticking if id(slot) in current]
                for slot in slots:
                    slot.needs_reset = True
                    slot.oracle.clear()
            for slot in slots:
                if slot.on_reset is not None:
                    try:
                        slot.on_reset()
                    except Exception:
                        log.exception("call %s: reset hook failed", slot.call_id)
            return False

    def _break(self, why: str) -> None:
        self.broken = why
        metrics.ENGINE_SLOTS.set(0)  # no seats on a loop that gave up: capacity alerts must not count them
        log.critical("engine broken: %s; not ready, liveness failing, its calls ended: restart the process", why)
        if self.on_broken is not None:
            self.on_broken()

    # ---- the real-time thread ----

    def warmup(self, ticks: int = 4) -> None:
        """Run every row a few times (first calls are slow; on CUDA this captures the graphs), then clear."""
        B = self.max_calls
        everyone = np.ones(B, dtype=bool)
        self.batch.reset_rows(everyone)
        pad = np.full(B, self.batch.lm.text_padding_token_id, dtype=np.int64)
        t0 = time.monotonic()
        for _ in range(ticks):
            if self._abort_start.is_set():  # between ticks: one under way cannot be interrupted
                raise EngineError("the engine was stopped while warming up")
            self.batch.step(np.zeros((B, FRAME_SAMPLES), dtype=np.float32), everyone, pad)
        self.batch.reset_rows(everyone)
        # With --compile this is where start-up goes (minutes for the 7B step on a cold compile cache).
        log.info("engine warm-up: %d ticks in %.1f s (compile %s)", ticks, time.monotonic() - t0,
                 self.batch.compile_mode)

    def abort_start(self) -> None:
        """From any thread: a `start` under way gives up at its next warm-up tick (nothing to kill in process;
        a compiling tick runs to its end) and raises EngineError, and never starts ticking."""
        self._abort_start.set()

    def start(self, warmup_ticks: int = 4) -> None:
        if self._ticker.running:
            return
        self.warmup(warmup_ticks)
        with self._lock:
            # A stop (or an abort) while the warm-up ran: the ticker started after it ticked a stopped engine
            # for good (no one left to stop it).
            if self._closed or self._abort_start.is_set():
                raise EngineError("the engine was stopped while warming up")
            self._ticker.start()

    def stop(self) -> None:
        with self._lock:
            self._closed = True
        self._abort_start.set()  # a start still warming up gives up too
        self._ticker.stop()
        metrics.ENGINE_SLOTS.set(0)  # no seats once stopped

    def _record_timing(self, elapsed: float, late: bool) -> None:
        if not self._idle:
            self.stats.record_tick(elapsed, late)
        else:
            self.stats.beat()
