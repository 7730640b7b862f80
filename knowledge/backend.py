"""KAME's back-end for one call: streaming STT of the caller + an LLM re-drafting the bot's reply.

Per call, three tasks on the event loop:
- the STT pump hands queued caller audio to the call's `StreamingSTT` in a worker thread (one shared
  `ThreadPoolExecutor` for all calls), one job at a time per call, and reports what it heard;
- the policy loop polls `OraclePolicy` every `poll_interval_s` and starts a new LLM request when told;
- at most one LLM request streams at a time: a new one cancels the one it supersedes.

Drafts (the cumulative text of the current request) go to `on_oracle`: the first at once, then at most
one per 80 ms frame (the engine feeds one oracle token per frame), and the whole answer at the end, marked
complete (until then the engine holds back the draft's unfinished last word). Each
request has its own `candidate_id` (also its `X-Request-Id`, `<call>-<candidate>`), so the engine knows
when a draft starts a new candidate rather than extending one.
Nothing here raises into the engine: STT and LLM failures are counted, logged and survived.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np

from engine.interface import FRAME_SECONDS, CallSetup, ToolUse

from . import metrics
from .agents import AgentDirectory, Agents
from .conversation import DEFAULT_SYSTEM_PROMPT, Conversation, ToolExchange, word_count
from .llm import LlmClient, LlmConfig, LlmError, ToolCallRequest
from .oracle_policy import OraclePolicy, OraclePolicyConfig, TriggerReason
from .stt import DECODER_POOL, StreamingSTT, SttResult, SttUnavailable, make_stt
from .tools import CallTools, HttpSession, ToolResult, parse_arguments

if TYPE_CHECKING:
    from .stt_process import SttProcess

log = logging.getLogger(__name__)
T = TypeVar("T")

TranscriptCallback = Callable[[str, bool, float], None]  # (text, final, at)
DRAFT_UPDATE_INTERVAL_S = 0.08  # a growing draft reaches the engine at most once per frame
# (draft text, triggered_at, candidate_id, complete). triggered_at: when the transcript update behind the LLM
# request came (the oracle lag's start); None for a line no request made (the greeting, a call action's line).
OracleCallback = Callable[[str, float | None, int, bool], None]
STT_UNAVAILABLE_RETRY_S = 0.5  # how often a call asks an STT that said it is coming back (SttUnavailable)
ErrorCallback = Callable[[Literal["stt_error", "llm_error"], str], None]  # (kind, detail)
ToolCallback = Callable[[ToolUse], None]
# What a tool call's result reads as in the history until it answers.
TOOL_PENDING = "pending: still running; its result comes in a later message. Do not call it again."
MAX_TOOL_ROUNDS = 3  # tool answers chained without the caller speaking: then the LLM must answer in words
# After a call action (transfer, hang-up) no new draft may replace its line while the edge carries it out.
# The edge ends the window early when the action fails (action_failed), and a done action ends the call; so
# this is a backstop, longer than the edge's worst case (telephony/media_session.py): the line played (at
# most 2 x (12 + 6 a word) frames, two 5 s mark waits and a 1 s pause: 23 s for the 10-word transfer line)
# and the REST request (11 s). At 15 s, a caller speaking in a slow transfer's last seconds could set the
# LLM talking over the hand-off (tests/test_agent_tools.py checks the sum).
ACTION_QUIET_S = 45.0


def _one_action(results: list[ToolResult]) -> list[ToolResult]:
    """One call action per answer: the first is carried out. The others are told as not done, in the history
    and to the edge: each said "requested", and the model believed a transfer made that never was."""
    first = next((r for r in results if r.action is not None), None)
    if first is None:
        return results
    return [r if r is first or r.action is None else
            replace(r, outcome="error", action=None, say="",
                    content=f"not done: {first.name} was asked for in the same answer, and one call action is "
                            "carried out at a time")
            for r in results]  # fmt: skip


def _tool_key(call: ToolCallRequest) -> tuple[str, str]:
    """A tool call's name and arguments, the arguments' formatting aside (two drafts asking the same)."""
    return call.name, _history_arguments(call.arguments, sort_keys=True)


def _history_arguments(arguments: str, sort_keys: bool = False) -> str:
    """Arguments as the history carries them: a JSON object's text, else "{}"."""
    parsed = parse_arguments(arguments)  # None past a few dozen levels: sorting them again could overflow
    if parsed is None:
        return "{}"
    return json.dumps(parsed, sort_keys=True) if sort_keys else (arguments or "{}")


@dataclass(frozen=True)
class BackendConfig:
    stt: str = "pocketsphinx"  # pocketsphinx | none | kyutai
    # Kyutai STT rows, one per call: the engine's seats (serve passes --max-calls). KAME_STT_MAX_STREAMS,
    # when set, wins; None and unset: 16.
    stt_rows: int | None = None
    # kyutai only: the STT's model and thread in a child process of its own (serve's --stt-process, on by
    # default), not beside the event loop (knowledge/stt_process.py).
    stt_process: bool = False
    llm_enabled: bool = True  # False: --llm none (STT only)
    llm_base_url: str | None = None
    llm_api_key: str = field(default="", repr=False)
    llm_model: str = "gpt-4.1"  # what the official server uses
    llm_timeout_s: float = 10.0
    llm_idle_timeout_s: float = 5.0  # after the first token (LlmConfig.idle_timeout_s)
    llm_max_tokens: int | None = 96
    # Threads for all calls' STT work. pocketsphinx holds the GIL while decoding, so more threads add no
    # throughput, only contention with the event loop (4 calls on 2 cores: loop stalls to ~75 ms with 1
    # thread, ~110-170 ms with 2). Raise it for an STT that releases the GIL or waits on the network.
    stt_threads: int = 1
    max_pending_audio_s: float = 10.0  # caller audio queued for a lagging STT before the oldest is dropped
    stt_restart_backoff_s: float = 1.0
    policy: OraclePolicyConfig = field(default_factory=OraclePolicyConfig)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> BackendConfig:
        """Read OPENAI_BASE_URL, OPENAI_API_KEY and KAME_LLM_MODEL; keyword overrides win."""
        env = os.environ if env is None else env
        base = cls()
        cfg = replace(
            base,
            llm_base_url=env.get("OPENAI_BASE_URL") or None,
            llm_api_key=env.get("OPENAI_API_KEY", "").strip(),  # a trailing newline failed every request
            llm_model=env.get("KAME_LLM_MODEL") or base.llm_model,
        )
        return replace(cfg, **overrides)  # type: ignore[arg-type]

    def llm_config(self) -> LlmConfig:
        return LlmConfig(
            model=self.llm_model,
            base_url=self.llm_base_url,
            api_key=self.llm_api_key,
            timeout_s=self.llm_timeout_s,
            idle_timeout_s=self.llm_idle_timeout_s,
            max_tokens=self.llm_max_tokens,
        )


class BackendServices:
    """What all calls of a process share: the STT factory and thread pool, and the LLM client."""

    def __init__(self, config: BackendConfig, agents: AgentDirectory | None = None, *, start_stt: bool = True) -> None:
        """`start_stt=False`: the STT's process is made but not started; `await start()` then starts it, and a
        start cancelled (SIGTERM while it loads) stops the child at once (serve's load_engine)."""
        self.config = config
        self.agents = agents or AgentDirectory(Agents.builtin())
        self.stt_process: SttProcess | None = None
        if config.stt == "kyutai" and config.stt_process:
            from .stt_process import SttChildSpec, SttProcess

            self.stt_process = SttProcess(SttChildSpec.from_env(config.stt_rows))
            if start_stt:
                self.stt_process.start()  # blocks while the child loads: built off the event loop
            self.stt_factory: Callable[[], StreamingSTT] = self.stt_process.open_stream
        else:
            self.stt_factory = make_stt(config.stt, rows=config.stt_rows)
        workers = config.stt_threads
        if self.stt_process is not None:
            # Its calls' work here is a pipe write or a wait for the child's answer (a call's start or end, up to
            # 5 s with the child stalled), both without the GIL: one thread a row, so no call's feed ever queues
            # behind another call's wait. (Threads are made only as calls need them.)
            workers = max(workers, self.stt_process.batch_size)
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kame-stt")
        self.llm = LlmClient(config.llm_config()) if config.llm_enabled else None
        self.tools_http = HttpSession()

    def open_call(
        self,
        call_id: str,
        on_transcript: TranscriptCallback,
        on_oracle: OracleCallback,
        on_error: ErrorCallback | None = None,
        setup: CallSetup | None = None,
        on_tool: ToolCallback | None = None,
    ) -> CallBackend:
        """A started-by-the-caller `CallBackend` (call `await start()`, later `await aclose()`), prompted
        as the call's agent (the one the edge chose; the agents in force now: a reload changes new calls)."""
        wanted = setup.agent if setup is not None else None
        agent = self.agents.agents.get(wanted)
        if wanted is not None and agent.name != wanted:  # the edge's agents file and ours differ (a reload)
            log.warning("call %s: agent %r is not in this process's agents file; answering as %r", call_id,
                        wanted, agent.name)  # fmt: skip
        return CallBackend(
            call_id,
            stt_factory=self.stt_factory,
            llm=self.llm,
            executor=self.executor,
            on_transcript=on_transcript,
            on_oracle=on_oracle,
            on_error=on_error,
            policy=self.config.policy,
            system_prompt=agent.system_prompt(self.config.system_prompt),
            greeting=agent.greeting,
            llm_model=agent.llm_model,
            tools=CallTools(agent, setup.actions if setup is not None else (), self.tools_http),
            on_tool=on_tool,
            max_pending_audio_s=self.config.max_pending_audio_s,
            stt_restart_backoff_s=self.config.stt_restart_backoff_s,
        )

    async def warm_up(self, calls: int) -> None:
        """Build the STT models for `calls` concurrent calls now, off the event loop (~0.3 s each),
        so the first calls do not wait for them."""
        if self.config.stt == "pocketsphinx":
            DECODER_POOL.max_idle = max(DECODER_POOL.max_idle, calls)
            await asyncio.get_running_loop().run_in_executor(self.executor, DECODER_POOL.prewarm, calls)

    @property
    def ready(self) -> bool:
        """False while the STT's own process is down (being restarted): a new call would not be heard."""
        return self.stt_process is None or self.stt_process.alive

    def follow_engine_ticks(self, pace: threading.Event) -> bool:
        """The batched Kyutai STT steps after each tick of the engine in this process (`pace`, set at each):
        the two share the GPU, and on unrelated clocks the STT's steps ran inside the engine's ticks. False:
        no such STT (pocketsphinx runs on the CPU, a decoder per call)."""
        if self.config.stt != "kyutai":
            return False
        if self.stt_process is not None:  # it follows `process_tick_signal`, set in the engine's process
            self.stt_process.follow(True)
            return True
        from .stt_kyutai import shared_engine

        shared_engine(self.config.stt_rows).follow(pace)
        return True

    @property
    def process_tick_signal(self) -> Any:
        """The STT process's pace (a TickSignal) for the engine to set after each tick, or None."""
        return self.stt_process.tick_signal if self.stt_process is not None else None

    async def start(self) -> None:
        """Starts the STT's process (a model load: seconds to minutes) off the event loop. Cancelled, the
        caller's `aclose` stops the child within a poll (its start gives up) instead of waiting out the load."""
        if self.stt_process is not None:
            await asyncio.to_thread(self.stt_process.start)

    async def aclose(self) -> None:
        if self.llm is not None:
            await self.llm.aclose()
        await self.tools_http.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.stt_process is not None:
            await asyncio.to_thread(self.stt_process.close)
        elif self.config.stt == "kyutai":  # its ticking thread and the model on the GPU, not left to the exit
            from .stt_kyutai import close_shared_engine

            await asyncio.to_thread(close_shared_engine)


class CallBackend:
    """The back-end of one call. Construct, `await start()`, feed it, `await aclose()`.

    `feed_audio` and `feed_bot_text` never block and may be called from any thread; the callbacks run
    on the event loop `start()` was awaited on.
    """

    def __init__(
        self,
        call_id: str,
        *,
        stt_factory: Callable[[], StreamingSTT],
        llm: LlmClient | None,
        executor: Executor,
        on_transcript: TranscriptCallback,
        on_oracle: OracleCallback,
        on_error: ErrorCallback | None = None,
        policy: OraclePolicyConfig | None = None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        greeting: str | None = None,
        llm_model: str | None = None,
        tools: CallTools | None = None,
        on_tool: ToolCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_pending_audio_s: float = 10.0,
        stt_restart_backoff_s: float = 1.0,
    ) -> None:
        self.call_id = call_id
        self._stt_factory = stt_factory
        self._llm = llm
        self._executor = executor
        self._on_transcript = on_transcript
        self._on_oracle = on_oracle
        self._on_error = on_error
        self._clock = clock
        self._restart_backoff_s = stt_restart_backoff_s
        self._stt_failures = 0  # consecutive
        self._stt_unavailable = False  # the last failure said the STT is coming back (its process restarting)
        self.conversation = Conversation(system_prompt=system_prompt)
        self._greeting = greeting
        self._llm_model = llm_model
        self._tools = tools
        self._on_tool = on_tool
        self._tool_rounds = 0  # tool answers since the caller last finished speaking
        self._tools_running: set[tuple[str, str]] = set()  # (name, arguments) of the tool calls under way
        # The exchange holding the last call action the LLM asked for, and its result's index: the edge may
        # report it failed.
        self._action_exchange: tuple[ToolExchange, int] | None = None
        self._quiet_until = 0.0  # no new LLM request before (a call action is under way)
        self.policy = OraclePolicy(policy)
        self._audio: deque[tuple[np.ndarray, float]] = deque()  # (frame, enqueued at)
        self._max_pending_frames = max(1, round(max_pending_audio_s / FRAME_SECONDS))
        self._dropped_frames = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._audio_ready: asyncio.Event | None = None
        self._stt: StreamingSTT | None = None
        self._stt_job: asyncio.Future[object] | None = None  # the in-flight worker job
        self._tasks: set[asyncio.Task[None]] = set()
        self._request: asyncio.Task[None] | None = None
        self._candidate_id = 0
        self._last_update_at: float | None = None  # when the last caller transcript arrived
        self._closed = False

    # --- engine-facing API -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._audio_ready = asyncio.Event()
        if self._greeting:
            # The call's first oracle candidate: the front-end says it at once, in its own voice; the LLM
            # sees it as the assistant's first turn.
            self._candidate_id += 1
            self.conversation.greet(self._greeting)
            # No request behind it: not an oracle lag (a greeting's ~0 s pulled the LLM's figure down).
            self._deliver_draft(self._greeting, None, self._candidate_id, complete=True)
        self._spawn(self._stt_pump(), "stt")
        if self._audio:  # fed before start()
            self._audio_ready.set()
        if self._llm is not None:
            self._spawn(self._policy_loop(), "policy")

    def feed_audio(self, frame: np.ndarray) -> None:
        """Queue one frame of caller audio (float32 mono 24 kHz). Never blocks."""
        if self._closed:
            return
        try:  # flat float32 here, so the pump's concatenate can never fail on a frame's shape or type
            frame = np.ravel(np.asarray(frame, dtype=np.float32))
        except (TypeError, ValueError):
            log.warning("call %s: a caller frame that is not audio was dropped", self.call_id)
            return
        self._audio.append((frame, self._clock()))
        if len(self._audio) > self._max_pending_frames:
            self._audio.popleft()  # the STT fell behind real time: keep the newest audio
            self._dropped_frames += 1
            metrics.STT_DROPPED_FRAMES.inc()
            if self._dropped_frames in (1, 100) or self._dropped_frames % 1000 == 0:
                log.warning("call %s: STT lagging, %d caller frames dropped", self.call_id, self._dropped_frames)
        self._call_on_loop(self._wake_stt)

    def feed_bot_text(self, piece: str) -> None:
        """Add the bot's text piece of one frame ('' for padding). Never blocks."""
        if piece and not self._closed:
            self._call_on_loop(self.conversation.bot_piece, piece)

    async def aclose(self) -> None:
        """Stop everything and release the STT. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        job = self._stt_job
        heard: list[SttResult] = []
        if job is not None:  # a cancelled await does not stop the worker thread: let it finish
            await asyncio.wait([job])
            if not job.cancelled() and job.exception() is None and isinstance(job.result(), list):
                heard += job.result()  # a feed the pump was cancelled waiting for: nobody handled it
            # (a late failure is moot once the call is over)
        stt, self._stt = self._stt, None
        if stt is not None and self._loop is not None:
            # The caller's last words: what is still queued, then the utterance ended now (a "...goodbye"
            # and an immediate hang-up has no trailing silence to close it).
            frames = [f for f, _ in self._audio]
            self._audio.clear()
            try:
                heard += await self._loop.run_in_executor(self._executor, self._last_words, stt, frames)
            except Exception:
                log.warning("call %s: flushing the STT failed", self.call_id, exc_info=True)
        for result in heard:  # to the conversation and on_transcript (no new LLM request: the call is over)
            self._handle_transcript(result, self._clock())
        if stt is not None and self._loop is not None:
            try:
                await self._loop.run_in_executor(self._executor, stt.close)
            except Exception:
                log.warning("call %s: closing the STT failed", self.call_id, exc_info=True)

    @staticmethod
    def _last_words(stt: StreamingSTT, frames: list[np.ndarray]) -> list[SttResult]:
        results = stt.feed(np.concatenate(frames)) if frames else []
        return results + stt.flush()

    # --- plumbing ----------------------------------------------------------------------------------
    def _deliver_draft(self, text: str, triggered_at: float | None, candidate_id: int, complete: bool = False) -> None:
        try:
            self._on_oracle(text, triggered_at, candidate_id, complete)
        except Exception:
            log.exception("call %s: on_oracle callback failed", self.call_id)

    def _spawn(self, coro, name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"{name}:{self.call_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._task_ended)
        return task

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        # The pump and the policy loop never end by themselves: one that died would leave the rest of the
        # call deaf (STT) or front-end only (LLM) without a word, were it not said here.
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("call %s: back-end task %s died", self.call_id, task.get_name(), exc_info=exc)

    def _call_on_loop(self, fn: Callable[..., None], *args: object) -> None:
        if self._loop is None or threading.get_ident() == self._loop_thread:
            fn(*args)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _wake_stt(self) -> None:
        if self._audio_ready is not None:
            self._audio_ready.set()

    def _report_error(self, kind: Literal["stt_error", "llm_error"], detail: str) -> None:
        if self._on_error is not None:
            try:
                self._on_error(kind, detail)
            except Exception:
                log.exception("call %s: on_error callback failed", self.call_id)

    # --- STT ---------------------------------------------------------------------------------------
    async def _in_worker(self, fn: Callable[[], T]) -> T:
        """Run STT work in the shared pool; one job at a time per call (the STT is not thread-safe)."""
        assert self._loop is not None
        job = self._loop.run_in_executor(self._executor, fn)
        self._stt_job = job
        # shield: cancelling the pump must not orphan a job that still uses the STT object
        result = await asyncio.shield(job)
        self._stt_job = None  # its result is the caller's now (aclose handles a job left unawaited)
        return result

    async def _stt_pump(self) -> None:
        assert self._audio_ready is not None
        while True:
            await self._audio_ready.wait()
            self._audio_ready.clear()
            frames = []
            with contextlib.suppress(IndexError):  # feed_audio on another thread may drop the oldest
                while self._audio:
                    frames.append(self._audio.popleft())
            if not frames:
                continue
            newest_at = frames[-1][1]
            pcm = np.concatenate([f for f, _ in frames]).astype(np.float32, copy=False)
            try:
                if self._stt is None:  # first audio, or after a failure (a factory may be slow)
                    await self._in_worker(self._create_stt)
                stt = self._stt
                assert stt is not None
                results = await self._in_worker(functools.partial(stt.feed, pcm))
                self._stt_failures, self._stt_unavailable = 0, False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._stt_failed(exc)
                continue
            for result in results:
                self._handle_transcript(result, newest_at)

    def _create_stt(self) -> None:
        # Assigned in the worker so that aclose() finds (and closes) an STT made while it was cancelling.
        self._stt = self._stt_factory()

    async def _stt_failed(self, exc: Exception) -> None:
        if isinstance(exc, SttUnavailable):
            # Coming back (the STT's process restarting, a minute for a large model on a GPU): asked again every
            # half second, at no cost, and told once, so the call hears again as soon as it is back, not up to a
            # 30 s backoff later, and 64 calls do not log twice a second each meanwhile.
            if not self._stt_unavailable:
                self._stt_unavailable = True
                metrics.STT_ERRORS.inc()
                log.error("call %s: STT unavailable, asking again until it is back: %s", self.call_id, exc)
                self._report_error("stt_error", f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(STT_UNAVAILABLE_RETRY_S)
            self._drop_pending_audio()
            return
        metrics.STT_ERRORS.inc()
        self._stt_failures += 1
        log.error("call %s: STT failed, restarting it: %s: %s", self.call_id, type(exc).__name__, exc)
        self._report_error("stt_error", f"{type(exc).__name__}: {exc}")
        old, self._stt = self._stt, None
        if old is not None:
            with contextlib.suppress(Exception):
                await self._in_worker(old.close)
        # What the caller said so far stays said: the pending partial becomes a final.
        if self.conversation.partial:
            self._handle_transcript(SttResult(self.conversation.partial, final=True), self._clock())
        # A model that keeps failing must not spin a core or flood the log: back off, doubling to 30 s.
        # (The exponent capped: 2 ** 1023 and up overflows a float, which killed the task after 1024 failures.)
        await asyncio.sleep(min(30.0, self._restart_backoff_s * 2 ** min(self._stt_failures - 1, 30)))
        self._drop_pending_audio()
        # The next frame makes a fresh STT.

    def _drop_pending_audio(self) -> None:
        # Audio from before the restart would arrive late and out of context: dropped, and counted as such.
        if self._audio:
            metrics.STT_DROPPED_FRAMES.inc(len(self._audio))
        self._audio.clear()

    def _handle_transcript(self, result: SttResult, newest_frame_at: float) -> None:
        now = self._clock()
        conv = self.conversation
        if result.final:
            conv.caller_final(result.text)
            if result.text.strip():  # an empty final (noise retracted) is not the caller speaking again
                self._tool_rounds = 0
            self.policy.on_final(word_count(result.text))
        else:
            conv.caller_partial(result.text)
            self.policy.on_partial(conv.pending_words)
        # An empty final (the STT retracted its partials) is still reported: the engine must learn that
        # the caller's turn ended.
        if result.text and not result.final:
            metrics.STT_PARTIAL_SECONDS.observe(max(0.0, now - newest_frame_at))
        self._last_update_at = now
        try:
            self._on_transcript(result.text, result.final, now)
        except Exception:
            log.exception("call %s: on_transcript callback failed", self.call_id)
        if self._llm is not None and self.policy.config.react_to_updates and not self._closed and not self._quiet(now):
            reason = self.policy.poll(now)
            if reason is not None:
                self._start_request(reason, now)

    # --- LLM ---------------------------------------------------------------------------------------
    async def _policy_loop(self) -> None:
        interval = self.policy.config.poll_interval_s
        while True:
            await asyncio.sleep(interval)
            now = self._clock()
            if self._quiet(now):
                continue  # the policy keeps what the caller said for when the action's window is over
            reason = self.policy.poll(now)
            if reason is not None:
                triggered_at = self._last_update_at or now
                if reason is TriggerReason.RETRY or triggered_at < self._quiet_until:
                    triggered_at = now  # words heard while a call action was under way are asked about now
                self._start_request(reason, triggered_at)

    def _quiet(self, now: float) -> bool:
        """A call action's line is being said: no draft may replace it. The policy is not even asked (asking
        counts as a request started: the caller's final would be spent on a request never made)."""
        return now < self._quiet_until

    def _start_request(self, reason: TriggerReason, triggered_at: float) -> None:
        assert self._llm is not None
        if self._quiet(self._clock()):
            return  # the line of a call action is being said: no draft may replace it (a tool's result)
        if self._request is not None:
            self._request.cancel()  # superseded: the newest draft always wins
        self._candidate_id += 1
        messages = self.conversation.messages()
        tools = self._tools.specs() if self._tools is not None and self._tool_rounds < MAX_TOOL_ROUNDS else []
        log.debug("call %s: LLM request %d (%s)", self.call_id, self._candidate_id, reason.value)
        request = self._stream_request(self._candidate_id, messages, triggered_at, tools)
        self._request = self._spawn(request, "llm")

    async def _stream_request(
        self, candidate_id: int, messages: list[dict[str, Any]], triggered_at: float, tools: list[dict[str, Any]]
    ) -> None:
        assert self._llm is not None
        # ORACLE_LAG_SECONDS is observed by the frame loop, when the candidate's first token is fed.
        sent_at: float | None = None
        latest: str | None = None  # the newest draft (it may be held back until a frame has passed)
        held: asyncio.TimerHandle | None = None  # sends a held-back draft once its frame has passed
        calls: list[ToolCallRequest] = []

        def send_held() -> None:
            nonlocal held, sent_at
            held = None
            if latest is not None and candidate_id == self._candidate_id and not self._closed:
                self._deliver_draft(latest, triggered_at, candidate_id)
                sent_at = self._clock()

        try:
            request_id = f"{self.call_id}-{candidate_id}"
            drafts_stream = self._llm.stream_draft(messages, call_id=self.call_id, request_id=request_id,
                                                   model=self._llm_model, tools=tools)  # fmt: skip
            async with contextlib.aclosing(drafts_stream) as drafts:
                async for text in drafts:
                    if candidate_id != self._candidate_id:
                        return  # superseded between two chunks (aclosing closes the HTTP stream)
                    if isinstance(text, ToolCallRequest):
                        calls.append(text)
                        continue
                    # The first draft goes at once (it is the lag that matters); growth at most once per
                    # frame: the engine feeds one token per 80 ms frame while an LLM streams several, and
                    # each update is a message to the engine and a re-tokenization of the whole draft.
                    latest, now = text, self._clock()
                    if held is not None:
                        held.cancel()  # this newer text goes (or is held) instead
                        held = None
                    if sent_at is None or now - sent_at >= DRAFT_UPDATE_INTERVAL_S:
                        self._deliver_draft(text, triggered_at, candidate_id)
                        sent_at = now
                    else:  # held, but only until its frame has passed: a stalling LLM must not keep it
                        delay = max(0.0, sent_at + DRAFT_UPDATE_INTERVAL_S - now)
                        held = asyncio.get_running_loop().call_later(delay, send_held)
            if held is not None:
                held.cancel()
                held = None
            # The end of the stream settles the last word (even if this text already went, incomplete).
            if latest is not None and candidate_id == self._candidate_id:
                self._deliver_draft(latest, triggered_at, candidate_id, complete=True)
        except LlmError as exc:  # counted and logged by the client
            if candidate_id == self._candidate_id:
                if latest is not None:  # what came before the failure is still the newest answer, and all of it
                    self._deliver_draft(latest, triggered_at, candidate_id, complete=True)
                # No retry once words went out: it would replay the answer from its first word.
                self.policy.on_failure(self._clock(), retry=latest is None, retry_after_s=exc.retry_after_s)
            self._report_error("llm_error", exc.kind)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, not a server problem: still never into the engine
            metrics.LLM_ERRORS.labels(kind="other").inc()
            log.exception("call %s: LLM request crashed", self.call_id)
            if candidate_id == self._candidate_id:
                self.policy.on_failure(self._clock(), retry=latest is None)
            self._report_error("llm_error", f"other: {type(exc).__name__}")
            return
        finally:
            if held is not None:  # superseded, cancelled (a newer request, a call action, the call's end)
                held.cancel()
        if candidate_id == self._candidate_id:
            self.policy.on_success()
            if calls and not tools:
                # None were offered (the tool rounds are spent, or the call has none): a model calling tools
                # anyway would otherwise chain requests without end while the caller is silent.
                log.info("call %s: %d tool call(s) the LLM made unoffered, dropped", self.call_id, len(calls))
                calls = []
            # A call identical to one still running is the same request seen again by a newer draft (the
            # caller's next words came before the tool answered): run once, not twice (a booking, a refund).
            # The same call twice in one answer (parallel duplicates, which some models emit) runs once too.
            seen, unique = set(self._tools_running), []
            for c in calls:
                if (key := _tool_key(c)) not in seen:
                    seen.add(key)
                    unique.append(c)
            calls = unique
            if calls:
                # Its own task: a newer request superseding this one must not cancel the tools' work.
                self._spawn(self._run_tools(calls), "tools")

    # --- tools -------------------------------------------------------------------------------------
    def action_failed(self, action: str, result: str) -> None:
        """The edge could not carry out the call action this call's LLM asked for (Twilio refused or did not
        answer): the caller heard "connecting you" and is still here. The history says it failed, the
        action's quiet window ends, and the LLM is asked again: it can tell the caller, not go quiet for
        ACTION_QUIET_S believing the call was handed on."""
        if self._closed:
            return
        what = "transfer to a person" if action == "transfer" else "hang-up"
        log.info("call %s: the %s failed at the phone edge (%s); the LLM is told", self.call_id, what, result)
        if self._action_exchange is not None:
            exchange, index = self._action_exchange
            self._action_exchange = None
            call_id, _ = exchange.results[index]
            exchange.results[index] = (call_id, f"failed: the {what} could not be made ({result}); the caller is "
                                                "still on the line: tell them")
        self._quiet_until = 0.0
        # A tool round like any other: a model retrying the failed action would otherwise chain "connecting
        # you" and a REST request without end while the caller waits.
        self._tool_rounds += 1
        if self._llm is not None and self.policy.ask_now(now := self._clock()):
            self._start_request(TriggerReason.TOOL_RESULT, now)

    async def _run_tools(self, calls: list[ToolCallRequest]) -> None:
        assert self._tools is not None
        tools = self._tools
        # Into the history before they run, with a placeholder result: drafts started meanwhile (the caller
        # goes on talking) see the call made. Arguments that are not a JSON object go in as {} (the raw text
        # stays in the record): vLLM parses every history call's arguments and refuses the request otherwise,
        # and every later request of the call carries this exchange. The name as run ("unknown" for one the
        # model made up): the API refuses a name outside [a-zA-Z0-9_-] in the history.
        exchange = ToolExchange(
            calls=[{"id": c.id, "type": "function",
                    "function": {"name": tools.name_for(c.name), "arguments": _history_arguments(c.arguments)}}
                   for c in calls],
            results=[(c.id, TOOL_PENDING) for c in calls],
        )  # fmt: skip
        self.conversation.tool_exchange(exchange)
        keys = [_tool_key(c) for c in calls]
        self._tools_running.update(keys)
        try:
            results: list[ToolResult] = await asyncio.gather(*(tools.run(c, call_id=self.call_id) for c in calls))
        finally:
            self._tools_running.difference_update(keys)
        results = _one_action(results)
        exchange.results = [(c.id, r.content) for c, r in zip(calls, results, strict=True)]
        for result in results:
            if self._on_tool is not None:
                use = ToolUse(result.name, result.arguments[:1000], result.outcome, result.action, result.say)
                try:
                    self._on_tool(use)
                except Exception:
                    log.exception("call %s: on_tool callback failed", self.call_id)
        action = next((r for r in results if r.action is not None), None)
        now = self._clock()
        if action is not None:
            self._action_exchange = (exchange, results.index(action))
            # The action's line is the newest candidate: said at once, and left alone while the edge acts.
            if self._request is not None:
                self._request.cancel()
            self._candidate_id += 1
            self._deliver_draft(action.say, None, self._candidate_id, complete=True)  # no request: no oracle lag
            self._quiet_until = now + ACTION_QUIET_S
            return
        self._tool_rounds += 1
        if self._quiet(now):
            # A call action's line is being said: asking now would spend the caller's words on a request never
            # made. The result is asked about with them once the window is over.
            self.policy.ask_later()
        elif self._llm is not None and not self._closed and self.policy.ask_now(now):
            self._start_request(TriggerReason.TOOL_RESULT, now)  # the result, in words
