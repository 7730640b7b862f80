"""`LocalEngine`: the engine in this process, behind the `Engine`/`CallSession` boundary.

The frame loop runs in its own thread; this module bridges it to asyncio: each tick's audio for every call
hops onto the event loop as one `BotFrames` with one `call_soon_threadsafe`, each call's events through its
own queue, and nothing here ever waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from . import metrics
from .batch import KameBatch
from .checkpoint import KameBundle, load_kame
from .frame_loop import BEHIND_LATE_SHARE, BEHIND_WINDOW_S, HUNG_S, STALLED_S, FrameLoop, SlotOutput
from .frame_loop_process import ChildSpec, FrameLoopProcess
from .interface import (
    BotFrames,
    CallAction,
    CallerTranscript,
    CallSetup,
    EngineClosed,
    EngineNotice,
    EngineOutput,
    OracleUpdate,
    ToolUse,
)
from .log_sampler import LogSampler
from .queues import FreshCarry, put_dropping_oldest, with_carried_fresh
from .sampling import SamplingOverrides

log = logging.getLogger(__name__)


class CallBackendHooks(Protocol):
    """What the engine needs from one call's STT + LLM back-end (knowledge.backend.CallBackend)."""

    def feed_audio(self, pcm24k: np.ndarray) -> None: ...
    def feed_bot_text(self, piece: str) -> None: ...
    def action_failed(self, action: CallAction, result: str) -> None: ...
    async def start(self) -> None: ...
    async def aclose(self) -> None: ...


class BackendProvider(Protocol):
    """Opens a back-end per call (knowledge.backend.BackendServices); shared by every call of the engine."""

    def open_call(
        self,
        call_id: str,
        on_transcript: Callable[[str, bool, float], None],  # text, final, at (monotonic)
        on_oracle: Callable[[str, float | None, int, bool], None],  # draft text, triggered_at, candidate id, complete
        on_error: Callable[[str, str], None],  # kind, detail
        setup: CallSetup | None = None,
        on_tool: Callable[[ToolUse], None] | None = None,  # the agent's tool calls, for the edge
    ) -> CallBackendHooks: ...

    def follow_engine_ticks(self, pace: threading.Event) -> bool:
        """Pace the back-end's own GPU loop (a batched STT) by the engine's ticks: `pace` is set after each.
        False if it has none."""
        ...

    @property
    def ready(self) -> bool:
        """Whether it can serve a new call now (False while its STT's process is being restarted)."""
        ...

    @property
    def process_tick_signal(self) -> Any:
        """A `TickSignal` (engine/tick_signal.py) for the engine to set after each tick, in the process it ticks in,
        when the back-end's GPU loop runs in a process of its own (the STT's, which follows it there); else None."""
        ...

    async def aclose(self) -> None: ...


@dataclass
class EngineConfig:
    checkpoint: str = "SakanaAI/kame"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    max_calls: int = 8
    context: int | None = None  # KV window in frames (3000 = 240 s)
    kv_dtype: str = "auto"  # the main transformer's KV cache: auto (the model's dtype), int8 or fp8
    weights_dtype: str = "auto"  # the transformers' linear layers: auto (as loaded) or int8
    compile_mode: str = "off"  # torch.compile the LM step: off, default, max-autotune (engine/compiled_step.py)
    forced_delay_ms: float = 0.0
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)  # over the checkpoint's lm_gen_config
    warmup_ticks: int = 4
    max_queued_frames: int = 4
    # Run the frame loop and the model in a child process: the back-end and the phone edge then no longer
    # share this interpreter's GIL and scheduling with it (engine/frame_loop_process.py).
    engine_process: bool = False
    torch_threads: int = 0  # intra-op threads for the model; 0 leaves torch's default
    output_queue_events: int = 64  # per call: transcripts, oracle drafts and notices waiting for the edge
    frames_queue_ticks: int = 8  # ticks of audio (640 ms) waiting for the edge before the oldest is dropped


_CLOSED = object()
BACKEND_CLOSE_WAIT_S = 10.0  # at stop, for the calls' back-ends (their STT jobs, their LLM streams) to close
ABORT_WAIT_S = 15.0  # a start given up (SIGTERM while loading): its thread ends within a poll and a kill


class LocalCallSession:
    def __init__(self, engine: LocalEngine, call_id: str, row: int, queue_size: int) -> None:
        self.call_id = call_id
        self.row = row
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue(maxsize=queue_size)
        self._closed = False
        self._ended = False  # outputs() has ended: after the back-end's close (it may hear the last words)
        self._dropped = 0
        self.backend: CallBackendHooks | None = None

    # -- event loop --
    def _put(self, item: object) -> None:
        if self._closed:
            return
        if put_dropping_oldest(self._queue, item):
            self._dropped += 1
            if self._dropped in (1, 100, 1000):
                log.warning("call %s: output consumer is behind, %d outputs dropped", self.call_id, self._dropped)

    def _on_transcript(self, text: str, final: bool, at: float) -> None:
        if self._closed:  # a hung-up call's back-end, closing, ends the caller's last utterance: it is kept
            if final and text and not self._ended:
                put_dropping_oldest(self._queue, CallerTranscript(text=text, final=True, at=at))
            return
        if final and text:
            # A final with no partial before it (pocketsphinx gives one when a burst holds the words and the
            # silence after them) is a whole turn too: without its start, the forced delay was skipped after it.
            self._engine.frame_loop.caller_turn(self.row, self.call_id, speaking=True)
        self._engine.frame_loop.caller_turn(self.row, self.call_id, speaking=not final)
        self._put(CallerTranscript(text=text, final=final, at=at))

    def _on_oracle(self, text: str, triggered_at: float | None, candidate_id: int, complete: bool) -> None:
        if self._closed:
            return
        self._engine.frame_loop.set_oracle(self.row, self.call_id, candidate_id, text, triggered_at, complete=complete)
        self._put(OracleUpdate(text=text, at=time.monotonic(), candidate=candidate_id))

    def _on_tool(self, use: ToolUse) -> None:
        if self._closed:
            return
        self._put(use)

    def _on_reset(self) -> None:  # frame-loop thread
        self._loop.call_soon_threadsafe(self._on_notice, "reset", "the engine reset this call's model state")

    def _on_notice(self, kind: str, detail: str) -> None:
        self._put(EngineNotice(kind=kind, detail=detail))  # type: ignore[arg-type]

    # -- CallSession --
    def push_audio(self, pcm: np.ndarray) -> None:
        if self._closed:
            return
        # The frame as the engine took it (checked_frame: NaN and inf silenced, clipped) is what the STT hears too.
        pcm = self._engine.frame_loop.push_audio(self.row, self.call_id, pcm)
        if self.backend is not None:
            self.backend.feed_audio(pcm)

    def action_failed(self, action: CallAction, result: str) -> None:
        if not self._closed and self.backend is not None:
            self.backend.action_failed(action, result)

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        while True:
            item = await self._queue.get()
            if item is _CLOSED:
                return
            yield item  # type: ignore[misc]

    async def close(self) -> None:
        """Leave the engine at once: the seat is free for the next caller before this returns. The
        back-end finishes closing in the background (an STT job still running can take seconds)."""
        if self._closed:
            return
        self._closed = True
        self._engine._forget(self)
        while not self._queue.empty():
            self._queue.get_nowait()
        if self.backend is not None:  # outputs() ends once the back-end has closed (the caller's last final)
            self._engine._close_in_background(self.call_id, self.backend, then=self._end_outputs)
        else:
            self._end_outputs()

    def _end_outputs(self) -> None:
        self._ended = True
        put_dropping_oldest(self._queue, _CLOSED)


class LocalEngine:
    """The KAME engine: one frame loop (a thread here, or a child process with `engine_process`), many
    call slots, and each call's back-end in this process."""

    def __init__(
        self, bundle: KameBundle | None, config: EngineConfig, backend: BackendProvider | None = None
    ) -> None:
        self.config = config
        self.bundle = bundle  # None when the model lives in the engine process
        self.backend = backend
        self.frame_loop: FrameLoop | FrameLoopProcess
        process_signal = backend.process_tick_signal if backend is not None else None
        if config.engine_process:
            spec = ChildSpec(
                checkpoint=config.checkpoint,
                device=config.device,
                max_calls=config.max_calls,
                context=config.context,
                kv_dtype=config.kv_dtype,
                weights_dtype=config.weights_dtype,
                compile_mode=config.compile_mode,
                sampling=config.sampling,
                forced_delay_ms=config.forced_delay_ms,
                max_queued_frames=config.max_queued_frames,
                torch_threads=config.torch_threads,
            )
            # Set in the engine's process, the STT's process steps with no hop through this one.
            self.frame_loop = FrameLoopProcess(spec, on_tick=self._on_tick, on_death=self._on_engine_lost,
                                               tick_signal=process_signal)  # fmt: skip
        else:
            if bundle is None:
                raise ValueError("an in-process engine needs its loaded checkpoint")
            if config.torch_threads > 0:
                torch.set_num_threads(config.torch_threads)
            sampling = config.sampling.resolve(bundle.lm_gen_config)
            batch = KameBatch(bundle.lm, bundle.mimi, config.max_calls, sampling, kv_dtype=config.kv_dtype,
                              compile_mode=config.compile_mode)
            self.frame_loop = FrameLoop(
                batch,
                bundle.tokenizer,
                max_queued_frames=config.max_queued_frames,
                forced_delay_ms=config.forced_delay_ms,
                on_tick=self._on_tick,
            )
            self.frame_loop.on_broken = self._on_engine_lost
        self._sessions: dict[str, LocalCallSession] = {}
        self._sampled = LogSampler()  # a back-end failing every tick: a line a minute, not 12 a second
        self._ready = False
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._frames: asyncio.Queue[BotFrames | None] = asyncio.Queue(maxsize=config.frames_queue_ticks)
        self._fresh_carry = FreshCarry()
        self._frames_dropped = 0
        self._backend_closes: set[asyncio.Task[None]] = set()  # hung-up calls whose back-end is still closing
        self._behind = False  # the frame loop was falling behind when last asked
        self._hung = False  # said once
        self._ticked = threading.Event()  # set after each tick: the back-end's STT steps then (ticker.follow)
        # The same for an STT in a process of its own, when the frame loop is a thread of this one.
        self._process_signal = None if config.engine_process else process_signal

    @classmethod
    async def load(cls, config: EngineConfig, backend: BackendProvider | None = None) -> LocalEngine:
        """Load the checkpoint off the event loop (it takes seconds to minutes); with `engine_process` the
        engine process loads it in `start` instead."""
        if config.engine_process:
            return cls(None, config, backend)
        bundle = await asyncio.to_thread(load_kame, config.checkpoint, config.device, None, config.context,
                                         weights_dtype=config.weights_dtype)
        return cls(bundle, config, backend)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        starting = asyncio.ensure_future(asyncio.to_thread(self.frame_loop.start, self.config.warmup_ticks))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Stopped while loading (SIGTERM): the thread cannot be cancelled, so the loop is told to give up
            # (the engine process is killed), or the process would wait out the whole load before exiting. The
            # thread is waited for (it gives up within a poll): a `stop` racing it found the loop half torn down.
            self.frame_loop.abort_start()
            await asyncio.wait({starting}, timeout=ABORT_WAIT_S)
            if starting.done() and not starting.cancelled():
                starting.exception()  # (its EngineError is the expected end, not news)
            raise
        self._ready = True
        if self.backend is not None:
            self.backend.follow_engine_ticks(self._ticked)
        log.info("engine ready: %d call slots on %s; sampling: %s", self.max_calls, self.config.device,
                 self.frame_loop.sampling.describe() if self.frame_loop.sampling else "?")

    async def stop(self) -> None:
        self._closing = True
        self._ready = False
        for session in list(self._sessions.values()):
            await session.close()
        if self._backend_closes:
            # Bounded: a back-end waits for its STT's job in flight, which a hung GPU never finishes, and a node
            # that cannot stop is never restarted.
            _, pending = await asyncio.wait(set(self._backend_closes), timeout=BACKEND_CLOSE_WAIT_S)
            if pending:
                log.error("engine stop: %d calls' back-ends did not close within %.0f s; going on", len(pending),
                          BACKEND_CLOSE_WAIT_S)  # fmt: skip
        await asyncio.to_thread(self.frame_loop.stop)
        self._put_frames(None)
        if self.backend is not None:
            await self.backend.aclose()

    # ---- audio, one batch per tick ----

    def _on_tick(self, delivered: list[tuple[str, SlotOutput]], ended_at: float) -> None:  # frame-loop thread
        self._ticked.set()  # first: the GPU is free now, and the STT's step should start at once
        if self._process_signal is not None:
            self._process_signal.set()
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        outs = [out for _, out in delivered]
        frames = BotFrames(
            call_ids=tuple(call_id for call_id, _ in delivered),
            pcm=np.stack([out.pcm for out in outs]),
            texts=tuple(out.piece for out in outs),
            voiced=tuple(out.voiced for out in outs),
            indices=tuple(out.index for out in outs),
            fresh=tuple(out.fresh for out in outs),
            produced_at=ended_at,  # in the engine's process: the hop from there is part of the way out
        )
        loop.call_soon_threadsafe(self._deliver_frames, frames)

    def _deliver_frames(self, frames: BotFrames) -> None:
        self._put_frames(frames)  # first: one call's back-end failing below must not cost every call this tick
        for call_id, piece in zip(frames.call_ids, frames.texts, strict=True):
            session = self._sessions.get(call_id)
            if piece and session is not None and session.backend is not None:
                try:
                    session.backend.feed_bot_text(piece)  # the LLM's view of what the bot has said
                except Exception:
                    if n := self._sampled("feed_bot_text"):
                        log.exception("call %s: back-end failed on the bot's text (#%d); the call goes on", call_id, n)

    def _put_frames(self, item: BotFrames | None) -> None:
        if put_dropping_oldest(self._frames, item, self._fresh_carry.dropped_frames):
            self._frames_dropped += 1
            if self._frames_dropped in (1, 100, 1000) or self._frames_dropped % 10_000 == 0:
                log.warning("bot audio consumer is behind: %d ticks dropped", self._frames_dropped)

    async def bot_frames(self) -> AsyncIterator[BotFrames]:
        while (frames := await self._frames.get()) is not None:
            yield with_carried_fresh(frames, self._fresh_carry)

    @property
    def max_calls(self) -> int:
        return self.frame_loop.max_calls

    @property
    def free_slots(self) -> int:
        return 0 if self._closing or self._falling_behind() else self.frame_loop.free_slots

    @property
    def ready(self) -> bool:
        # An engine process that died takes its slots with it: not ready (readyz 503, no new calls). One
        # that cannot keep its 80 ms ticks takes no more calls: another would degrade every seated one. Nor does
        # one whose back-end cannot hear callers for now (its STT's process restarting): a deaf agent.
        backend_ready = self.backend is None or self.backend.ready
        return self._ready and self.frame_loop.alive and not self._falling_behind() and backend_ready

    def _falling_behind(self) -> bool:
        stats = self.frame_loop.stats
        stalled = stats.stalled_s()
        behind = stalled > STALLED_S or stats.falling_behind()
        if behind != self._behind:
            self._behind = behind
            metrics.ENGINE_FALLING_BEHIND.set(int(behind))
            if stalled > STALLED_S:
                log.error("engine stalled: calls seated and no tick for %.1f s (a hung tick: the device?); not "
                          "ready, no new calls", stalled)  # fmt: skip
            elif behind:
                log.warning("engine falling behind: over %.0f%% of its ticks in the last %.0f s missed their "
                            "80 ms frame; not ready, no new calls until it keeps time", 100 * BEHIND_LATE_SHARE,
                            BEHIND_WINDOW_S)
            else:
                log.info("engine keeps time again: ready")
        return behind

    @property
    def failed(self) -> bool:
        if self.frame_loop.died:
            return True
        hung = self.frame_loop.stats.stalled_s() > HUNG_S
        if hung and not self._hung:
            self._hung = True
            log.critical("engine hung: calls seated and no tick for over %.0f s; liveness failing: restart the "
                         "process", HUNG_S)  # fmt: skip
        return hung

    def _on_engine_lost(self) -> None:  # the pipe's reader thread, or the frame loop's
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._tell_engine_lost)

    def _tell_engine_lost(self) -> None:
        for session in list(self._sessions.values()):
            session._on_notice("engine_lost", "the engine died (its process, or every tick failing); this call's "
                               "model state is gone")

    async def open_call(self, call_id: str, setup: CallSetup | None = None) -> LocalCallSession:
        if self._closing or not self._ready:
            raise EngineClosed("engine is not serving")
        old = self._sessions.get(call_id)
        if old is not None:  # the same call reconnecting: the new stream replaces the old seat
            await old.close()
        session = LocalCallSession(self, call_id, row=-1, queue_size=self.config.output_queue_events)
        delay = setup.forced_delay_ms if setup is not None else None  # the agent's, if it has one
        session.row = self.frame_loop.join(call_id, None, session._on_reset, forced_delay_ms=delay)  # or EngineFull
        self._sessions[call_id] = session
        if self.backend is not None:
            backend = None
            try:
                backend = session.backend = self.backend.open_call(
                    call_id, session._on_transcript, session._on_oracle, session._on_notice, setup,
                    on_tool=session._on_tool,
                )
                await backend.start()
            except asyncio.CancelledError:
                await asyncio.shield(session.close())  # nobody will get this session: its seat goes back
                raise
            except Exception:
                # The call still gets the front-end alone; what the back-end started before failing is stopped.
                log.exception("call %s: back-end failed to start; front-end only", call_id)
                session.backend = None
                if backend is not None:
                    self._close_in_background(call_id, backend)
        return session

    def _close_in_background(
        self, call_id: str, backend: CallBackendHooks, then: Callable[[], None] | None = None
    ) -> None:
        async def close() -> None:
            try:
                await backend.aclose()
            except Exception:
                log.exception("call %s: back-end close failed", call_id)
            finally:
                if then is not None:
                    then()

        task = asyncio.create_task(close(), name=f"backend-close:{call_id}")
        self._backend_closes.add(task)
        task.add_done_callback(self._backend_closes.discard)

    def _forget(self, session: LocalCallSession) -> None:
        if self._sessions.get(session.call_id) is session:
            del self._sessions[session.call_id]
        self.frame_loop.leave(session.row, session.call_id)
