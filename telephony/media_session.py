"""One Twilio Media Streams WebSocket: caller audio to the engine, the bot's audio back, in real time.

Two tasks per stream, both owned here: the receive loop (this object's `run`) and the event pump that
records the engine's transcripts and oracle drafts for the call. The bot's audio comes from the server's
one `BotAudioFanout`, which encodes a whole engine tick for every call at once and hands each stream its
μ-law through `send_bot_audio` the moment the engine makes it. The engine ticks in real time, so Twilio's
playout queue stays a frame or two deep, until a stall releases frames as a burst: the queue keeps that
depth for good (both sides run at real time). `PlayoutClock` tracks it; the stream drains it through the
bot's pauses and clears it when the caller talks over stale speech.
Bad input is counted, logged with the call id and dropped; it never reaches another call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import WSCloseCode, WSMsgType, web

from engine.interface import (
    FRAME_SECONDS,
    LAST_WORDS_WAIT_S,
    CallAction,
    CallerTranscript,
    CallSession,
    CallSetup,
    EngineError,
    EngineNotice,
    OracleUpdate,
    ToolUse,
)
from knowledge.agents import Agent

from . import metrics
from .framing import InboundFramer
from .logs import call_id_var
from .playout_clock import BARGE_IN_AFTER_S, CLEAR_ON_BARGE_IN_ABOVE_S, DRAIN_ABOVE_S, DRAIN_SILENT_DBFS, PlayoutClock
from .stream_limits import StreamLimits
from .turns import SILENCE_DBFS, TurnTracker, Unanswered
from .twilio_messages import (
    BINARY_FRAME,
    DUPLICATE_START,
    FLOODING,
    LINE_RATE,
    MEDIA_BEFORE_START,
    NO_START,
    OVERSIZE,
    SILENT_SOCKET,
    WRONG_STREAM_SID,
    ConnectedMessage,
    DtmfMessage,
    MarkMessage,
    MediaMessage,
    MediaMessageTemplate,
    ProtocolError,
    StartMessage,
    StopMessage,
    clear_message,
    mark_message,
    parse_twilio_message,
)
from .twilio_rest import TwilioRestError

if TYPE_CHECKING:
    from .server import ServerContext

log = logging.getLogger(__name__)

TOKEN_PARAMETER = "token"  # the <Parameter> carrying the call's admission token
AGENT_PARAMETER = "agent"  # the agent chosen at the webhook (with "to" and "from": the call's setup)
# Before a call action, the bot says its line. The model begins speaking an oracle within about a second
# and says a word in well under half a second; its audio trails its text by a couple of frames.
LINE_LEAD_FRAMES = 12
FRAMES_PER_WORD = 6
AUDIO_AFTER_TEXT_FRAMES = 3
LINE_MARK_WAIT_S = 5.0
# The bot's words go to the call record when the caller's next utterance ends, or after this many words
# (about a minute of speech): a caller on hold or silent would otherwise leave the live record without the
# bot's side, and lose it with the node.
BOT_TURN_FLUSH_WORDS = 150
LINE_AFTER_CLEAR_S = 1.0  # a `clear` emptied the line before it played: what the bot says next, then the action
ACTION_ANSWER_WAIT_S = 11.0  # the REST client's own timeout (10 s), and a little more


@dataclass
class StreamState:
    """What one stream knows about its call; the receive loop and the output pump share it."""

    call_sid: str | None = None
    stream_sid: str | None = None
    agent: str = "default"
    started_at: float | None = None  # monotonic, at the `start` event
    start_received_at: float | None = None  # monotonic, when `start` was read (before the seat was claimed)
    inbound_packets: int = 0
    inbound_audio_s: float = 0.0  # the caller's audio taken (µ-law bytes / 8000)
    frames_sent: int = 0
    first_audio_sent: bool = False
    marks_sent: int = 0
    marks_played: int = 0
    last_mark_played: str | None = None
    bot_words: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


class MediaStreamSession:
    def __init__(
        self,
        ws: web.WebSocketResponse,
        ctx: ServerContext,
        *,
        peer: str = "?",
        transport: asyncio.BaseTransport | None = None,
    ) -> None:
        self.ws = ws
        # The connection's transport, to see how much we have written that the peer has not read yet.
        self._transport = transport if isinstance(transport, asyncio.WriteTransport) else None
        self._backlogged_since: float | None = None
        self._frames_dropped = 0
        self.ctx = ctx
        self.peer = peer
        self.state = StreamState()
        self.engine_call: CallSession | None = None
        self.inbound = InboundFramer()
        self.turns = TurnTracker()
        self._pump: asyncio.Task[None] | None = None
        self._media: MediaMessageTemplate | None = None  # set at `start`, once the streamSid is known
        self._last_mark_at_frame = 0
        self._last_message_at = time.monotonic()
        self._oracle_draft: tuple[int, str, float] | None = None  # (candidate, latest text, started)
        self._ended = False
        self._ended_as = ""  # the reason end() was given (it may run before the call is known: a drain)
        self._end_reason = "completed"
        self._agent: Agent | None = None  # set at `start`
        self._acting = False  # a transfer or hang-up through the REST API is under way
        self._action_task: asyncio.Task[Any] | None = None  # the task carrying it out
        self._requesting = False  # its REST request is in flight
        self._awaited_mark: tuple[str, asyncio.Event] | None = None  # a mark whose echo someone waits for
        self._awaited_played = False  # its echo said played (not emptied by a `clear`)
        self.playout = PlayoutClock()
        self._clear_due = False  # the caller talked over a stale queue: clear it (from the receive loop)
        self._talking_since: float | None = None  # the caller's utterance began (for a barge-in's clear)
        self._bot_word_starts = 0  # words the bot has begun (its text pieces starting with '▁')
        self._bot_words_flushed_at = 0  # `_bot_word_starts` when the bot's words last went to the record
        self.limits = StreamLimits()
        # Upgraded (the signature was good) but not started: such sockets are capped per node and closed
        # after the start timeout, however often they send `connected`.
        self.opened_at = time.monotonic()
        self._evicted = False
        self._unstarted = True
        ctx.unstarted_sockets += 1
        ctx.awaiting_start[self] = None
        metrics.MEDIA_UNSTARTED_SOCKETS.set(ctx.unstarted_sockets)

    def evict(self) -> None:
        """The unstarted cap is full and a newer upgrade came: this socket, which never sent `start`, goes."""
        self.ctx.awaiting_start.pop(self, None)
        self._protocol_error(NO_START, "closed before its start to make room for a newer stream")
        self._end_reason = "no_start"
        self._evicted = True  # a `start` already on its way is not acted on: the socket is closing
        self.ctx.spawn(self.ws.close())

    def _started(self) -> None:
        self.ctx.awaiting_start.pop(self, None)
        if self._unstarted:
            self._unstarted = False
            self.ctx.unstarted_sockets -= 1
            metrics.MEDIA_UNSTARTED_SOCKETS.set(self.ctx.unstarted_sockets)

    # ---- errors ----

    def _protocol_error(self, kind: str, detail: str) -> None:
        metrics.TWILIO_PROTOCOL_ERRORS.labels(kind=kind).inc()
        n = self.state.errors[kind] = self.state.errors.get(kind, 0) + 1
        if n <= 3 or n % 100 == 0:  # a flood of bad frames must not flood the logs too
            log.warning("twilio protocol error %s (#%d) from %s: %s", kind, n, self.peer, detail)

    # ---- the receive loop ----

    async def run(self) -> None:
        watchdog = asyncio.create_task(self._watch_for_silence(), name="silence-watchdog")
        try:
            while not self.ws.closed:
                msg = await self.ws.receive()
                self._last_message_at = time.monotonic()
                if msg.type == WSMsgType.TEXT:
                    await self._on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    self._protocol_error(BINARY_FRAME, f"{len(msg.data)} bytes")
                elif msg.type == WSMsgType.ERROR:
                    exc = self.ws.exception()
                    if getattr(exc, "code", None) == WSCloseCode.MESSAGE_TOO_BIG:
                        self._protocol_error(OVERSIZE, "WebSocket message over the size limit")
                        self._end_reason = "oversize"
                    else:
                        log.warning("websocket error: %s", exc)
                        if self._end_reason == "completed":  # keep a reason already given (stalled_peer)
                            self._end_reason = "socket_error"
                    break
                else:  # CLOSE, CLOSING, CLOSED
                    break
        finally:
            watchdog.cancel()
            await self.end(self._end_reason)

    async def _watch_for_silence(self) -> None:
        """Close a stream Twilio stopped talking on. One check a second per call, rather than a timer
        armed and cancelled for every one of its 50 messages a second."""
        limit, start_limit = self.ctx.config.silent_socket_s, self.ctx.config.start_timeout_s
        while not self.ws.closed:
            await asyncio.sleep(min(1.0, limit / 2, start_limit / 2))
            if self._unstarted and time.monotonic() - self.opened_at > start_limit:
                self._protocol_error(NO_START, f"no stream start within {start_limit:.0f}s of the upgrade")
                self._end_reason = "no_start"
                await self.ws.close()
                return
            if time.monotonic() - self._last_message_at > limit:
                self._protocol_error(SILENT_SOCKET, f"no message for {limit:.0f}s")
                self._end_reason = "silent_socket"
                await self.ws.close()
                return
            if self._past_max_length():
                await self._end_at_max_length()
                return

    def _past_max_length(self) -> bool:
        started, cap = self.state.started_at, self.ctx.config.max_call_s
        return bool(cap) and started is not None and not self._ended and time.monotonic() - started > cap

    async def _end_at_max_length(self) -> None:
        """A call past --max-call-minutes (a line left open, a robocaller looping) gives its seat back: hung up
        through the REST API when it can be (the call ends there), else the stream is closed and Twilio asks
        the connect action (the agent's fallback: a person, or the apology)."""
        log.warning("call past its maximum length (%.0f min): ending it", self.ctx.config.max_call_s / 60)
        self._end_reason = "max_duration"
        if self.ctx.twilio_rest is not None and not self._acting:
            self._acting = True
            await self._act("end", "max_duration")
            self._end_reason = "max_duration"  # not the hang-up's own outcome
        await self.ws.close()

    async def _on_text(self, raw: str) -> None:
        try:
            message = parse_twilio_message(raw)
        except ProtocolError as e:
            self._protocol_error(e.kind, e.detail)
            await self._limit("invalid")
            return
        if isinstance(message, MediaMessage):  # the hot path first (it has its own real-time guard)
            refused = self._on_media(message)
            if refused is not None:  # counted against the stream, as any refused message, so a flood ends it
                await self._refused(refused)
            if self._clear_due:
                self._clear_due = False
                metrics.MEDIA_PLAYOUT_CLEARS.inc()
                await self.clear()
        elif not await self._limit(message.event):
            return
        elif isinstance(message, StartMessage):
            await self._on_start(message)
        elif isinstance(message, MarkMessage):
            if self._check_sid(message.stream_sid):
                self._on_mark(message.mark.name)
        elif isinstance(message, DtmfMessage):
            if self._check_sid(message.stream_sid):
                await self._on_dtmf(message.dtmf.digit)
        elif isinstance(message, StopMessage):
            if self._check_sid(message.stream_sid):
                # Twilio stops the stream of a call we transferred or hung up: that is its outcome.
                if self._end_reason not in ("transferred", "ended_by_agent"):
                    self._end_reason = "completed"
                await self.ws.close()
        elif isinstance(message, ConnectedMessage):
            log.debug("stream connected from %s (protocol %s)", self.peer, message.protocol)

    async def _limit(self, kind: str) -> bool:
        """The message kind's rate limit; a stream far past its limits is ended as `flooding`."""
        if self.limits.allow(kind):
            return True
        await self._end_if_flooding()
        return False

    async def _refused(self, kind: str) -> None:
        """A media message refused: before start or of another stream (`invalid`, under its rate limit), or
        past real time (`media`, a drop each)."""
        if kind == "media":
            self.limits.drop(kind)
            await self._end_if_flooding()
        else:
            await self._limit(kind)

    async def _end_if_flooding(self) -> None:
        if self.limits.flooding and self._end_reason != "flooding":
            log.warning("stream from %s ended: %d messages over their rate limits", self.peer, self.limits.dropped)
            self._end_reason = "flooding"
            await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"flooding")

    def _check_sid(self, stream_sid: str) -> bool:
        if self.state.stream_sid is None:
            self._protocol_error(MEDIA_BEFORE_START, "event before start")
            return False
        if stream_sid != self.state.stream_sid:
            self._protocol_error(WRONG_STREAM_SID, "streamSid does not match this stream")
            return False
        return True

    async def _on_start(self, message: StartMessage) -> None:
        if self.state.stream_sid is not None:
            self._protocol_error(DUPLICATE_START, "second start on one stream")
            return
        if self._evicted:
            return
        self.ctx.awaiting_start.pop(self, None)  # starting: no longer the one a full cap closes
        # First audio is timed from here (the real-time guard counts from the upgrade: see `_on_media`).
        self.state.start_received_at = time.monotonic()
        start = message.start
        call_sid = start.call_sid
        call_id_var.set(call_sid)
        token = start.custom_parameters.get(TOKEN_PARAMETER)
        # The token is single-use: a second socket for a live call here is refused, never swapped in (not even
        # with a fresh token, as a replayed webhook gets once Redis has lost the first one's binding).
        if call_sid in self.ctx.streams or not await self.ctx.cluster.claim(call_sid, token):
            reason = "second_stream" if call_sid in self.ctx.streams else "bad_token"
            metrics.WEBHOOK_REJECTIONS.labels(endpoint="media", reason=reason).inc()
            log.warning("stream for %s rejected (%s)", call_sid, reason)
            metrics.CALLS_TOTAL.labels(outcome="rejected", agent="default").inc()  # its agent is not ours to trust
            self._end_reason = "rejected"
            # Off the unstarted count now, not after the close handshake (up to 2 s a peer may never answer):
            # sockets sending a start that fails, over and over, held the cap as well as silent ones did.
            self._started()
            await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"not admitted")
            return
        self.ctx.add_stream(call_sid, self)
        self._started()
        params = start.custom_parameters  # set by our own webhook's TwiML (the token proved it)
        self._agent = self.ctx.agents.agents.get(params.get(AGENT_PARAMETER))  # kept for the call (reloads)
        self.state.agent = self._agent.name
        # The call actions this edge can carry out: the back-end offers the LLM only those tools.
        actions: tuple[CallAction, ...] = ("transfer", "end") if self.ctx.twilio_rest is not None else ()
        setup = CallSetup(agent=self.state.agent, to_number=params.get("to"), from_number=params.get("from"),
                          actions=actions, forced_delay_ms=self._agent.forced_delay_ms)  # fmt: skip
        log.info("call answered by agent %s", self.state.agent)
        try:
            self.engine_call = await self.ctx.engine.open_call(call_sid, setup)
        except BaseException as e:
            # Until the call is seated, end() does not know it: its stream and seat are given back here, or
            # they would be held for good (a node losing capacity with every failed open).
            await self.ctx.forget_stream(call_sid, self)
            if not isinstance(e, Exception):
                raise  # cancelled: the socket's handler is going away
            outcome = "engine_full" if isinstance(e, EngineError) else "engine_lost"
            if outcome == "engine_full":
                log.error("engine refused the call: %s", e)
            else:
                log.exception("engine failed to open the call")
            metrics.CALLS_TOTAL.labels(outcome=outcome, agent=self.state.agent).inc()
            self._end_reason = outcome
            # The record gets this outcome: left ringing, Twilio's status callback counted it again (no_stream).
            await self.ctx.store.end(call_sid, outcome)
            await self.ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=b"engine busy")
            return
        if self._ended:
            # end() ran while the seat was being opened (a drain that timed out): it could not know the call
            # then, so the seat, the stream and the record are given back here, not held for good.
            await self.engine_call.close()
            await self.ctx.forget_stream(call_sid, self)
            metrics.CALLS_TOTAL.labels(outcome=self._ended_as, agent=self.state.agent).inc()
            await self.ctx.store.end(call_sid, self._ended_as)
            return
        self.state.call_sid = call_sid
        self.state.stream_sid = message.stream_sid
        self.state.started_at = time.monotonic()
        self._media = MediaMessageTemplate(message.stream_sid)
        metrics.CALLS_ACTIVE.inc()
        log.info("stream %s started (tracks %s)", message.stream_sid, ",".join(start.tracks))
        self.ctx.store.adopt(call_sid)  # a copy of the record, should Redis lose it mid-call (read in the background)
        await self.ctx.store.update(
            call_sid,
            stream_sid=message.stream_sid,
            state="streaming",
            started_at=time.time(),
            node=self.ctx.config.node_id,
        )
        self._pump = asyncio.create_task(self._pump_outputs(), name=f"pump-{call_sid}")

    def _on_media(self, message: MediaMessage) -> str | None:
        """Takes the caller's audio; returns the limit kind a refused message counts against, else None."""
        if not self._check_sid(message.stream_sid):
            return "invalid"
        if message.media.track != "inbound":
            return None
        now = time.monotonic()
        st = self.state
        # Audio seconds, not packets: Twilio sends 20 ms a packet, but a packet may hold up to a second.
        seconds = len(message.media.payload) / LINE_RATE
        # Real time counts from the upgrade: Twilio opens the socket and sends `start` and audio on it at once,
        # so a network stall that held up `start` held up its audio too and delivered both in one burst (from
        # `start` as read, a 1.5 s stall lost the caller's first half second as a "flood"). A socket that waits
        # before it starts is closed after --start-timeout, so that is all the extra burst it can save up.
        allowed = now - self.opened_at + self.ctx.config.flood_burst_packets * 0.02
        if st.inbound_audio_s + seconds > allowed:
            # Faster than real time: drop rather than let the caller push the engine behind.
            self._protocol_error(FLOODING, "inbound audio faster than real time")
            return "media"
        st.inbound_packets += 1
        st.inbound_audio_s += seconds
        assert self.engine_call is not None
        for frame in self.inbound.push(message.media.payload, arrived_at=now):
            self.engine_call.push_audio(frame.pcm)
            metrics.MEDIA_INBOUND_SECONDS.observe(time.monotonic() - frame.last_arrival)
            was_speaking = self.turns.caller_speaking
            ended = self.turns.caller_frame(frame.pcm, frame.last_arrival)
            if self.turns.caller_speaking and not was_speaking:
                self._talking_since = frame.last_arrival
            elif (self.turns.caller_speaking and self._talking_since is not None
                    and self.turns.last_caller_voice - self._talking_since >= BARGE_IN_AFTER_S
                    and self.playout.backlog(now) > CLEAR_ON_BARGE_IN_ABOVE_S):
                self._talking_since = None  # once per utterance
                self._clear_due = True  # the bot's queued speech is older than what the model now hears
            if isinstance(ended, Unanswered):
                metrics.TURNS_UNANSWERED_SECONDS.observe(ended.waited_s)
            elif ended is not None and ended.overlap:
                metrics.TURN_OVERLAPS.inc()
                metrics.TURN_LATENCY_SECONDS.observe(0.0)
                self._store_soon(self.ctx.store.add_latency(st.call_sid, "turn", 0.0))
            elif ended is not None and ended.reply_latency_s is not None:  # answered inside the hangover
                metrics.TURN_LATENCY_SECONDS.observe(ended.reply_latency_s)
                self._store_soon(self.ctx.store.add_latency(st.call_sid, "turn", ended.reply_latency_s))

    def _on_mark(self, name: str) -> None:
        # Twilio echoes a mark once the audio queued before it has played, or at once when a `clear`
        # emptied the queue: that audio was never heard.
        echo = self.playout.echoed(name, time.monotonic())
        if echo.waited_s is not None:
            metrics.MEDIA_PLAYOUT_DELAY_SECONDS.observe(echo.waited_s)
        if echo.played:
            self.state.marks_played += 1
            self.state.last_mark_played = name
        if self._awaited_mark is not None and self._awaited_mark[0] == name:
            self._awaited_played = echo.played
            self._awaited_mark[1].set()

    async def _on_dtmf(self, digit: str) -> None:
        log.debug("dtmf received")  # one line per key would let a flood flood the logs; the digit may be a PIN
        assert self.state.call_sid is not None
        await self.ctx.store.append_dtmf(self.state.call_sid, digit)
        agent = self._agent
        if agent is not None and agent.transfer_to and digit == agent.dtmf_transfer and not self._acting:
            self._acting = True
            self._action_task = self.ctx.spawn(self._act("transfer", "dtmf"))

    async def _on_tool(self, use: ToolUse) -> None:
        """The agent's LLM called a tool: recorded; a call action is carried out once its line has played."""
        call_sid = self.state.call_sid
        assert call_sid is not None
        if use.action is None:
            await self.ctx.store.append_tool(call_sid, use.name, use.arguments, use.outcome)
        elif self._acting:
            await self.ctx.store.append_tool(call_sid, use.name, use.arguments, "ignored")  # one at a time
        else:
            self._acting = True
            self._action_task = self.ctx.spawn(self._act_after_line(use, use.action))

    async def _act_after_line(self, use: ToolUse, action: CallAction) -> None:
        await self._line_played(use.say)
        result = await self._act(action, "tool") if self.playing else "cancelled"  # the caller hung up first
        if result in ("error", "unavailable") and self.engine_call is not None and not self._ended:
            # The caller heard the action's line and is still here: the back-end's LLM is told, and speaks.
            self.engine_call.action_failed(action, result)
        assert self.state.call_sid is not None
        await self.ctx.store.append_tool(self.state.call_sid, use.name, use.arguments, result)

    async def _line_played(self, say: str) -> None:
        """Wait until the bot has said `say` (the back-end made it the call's newest oracle) and Twilio has
        played it: the bot's text has begun as many words, plus the audio's lag behind its text, or else a
        generous time per word; then a mark, whose echo says the audio before it has played."""
        st = self.state
        words = max(1, len(say.split()))
        start_frames, start_words = st.frames_sent, self._bot_word_starts
        cap = start_frames + LINE_LEAD_FRAMES + words * FRAMES_PER_WORD
        deadline = time.monotonic() + 2 * (cap - start_frames) * FRAME_SECONDS  # should frames stop coming
        spoken_at: int | None = None
        while self.playing and st.frames_sent < cap and time.monotonic() < deadline:
            if spoken_at is None and self._bot_word_starts - start_words >= words:
                spoken_at = st.frames_sent
            if spoken_at is not None and st.frames_sent >= spoken_at + AUDIO_AFTER_TEXT_FRAMES:
                break
            await asyncio.sleep(FRAME_SECONDS / 2)
        # Once more if a `clear` (an engine reset, a barge-in) emptied the queue before the line played: the
        # action then waits for what the bot says next, rather than cutting in at once.
        for attempt in range(2):
            if not self.playing or self._media is None:
                return
            name, played = f"line{st.frames_sent}.{attempt}", asyncio.Event()
            self._awaited_mark, self._awaited_played = (name, played), False
            try:
                with contextlib.suppress(ConnectionResetError, RuntimeError):
                    await self.ws.send_str(mark_message(self._media.stream_sid, name))
                    self.playout.mark_sent(name, time.monotonic())
                    st.marks_sent += 1
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LINE_MARK_WAIT_S):  # a peer that never echoes must not hold it
                        await played.wait()
            finally:
                self._awaited_mark = None
            if self._awaited_played or not played.is_set():
                return
            await asyncio.sleep(LINE_AFTER_CLEAR_S)

    async def _act(self, action: CallAction, trigger: str) -> str:
        """Hand the caller to a person (Twilio replaces the call's TwiML with a <Dial>: our stream ends) or hang
        up, through the REST API. Returns the result (counted in kame_call_actions_total)."""
        rest, agent, call_sid = self.ctx.twilio_rest, self._agent, self.state.call_sid
        assert call_sid is not None
        result = "ok"
        if rest is None or (action == "transfer" and (agent is None or not agent.transfer_to)):
            result = "unavailable"
            log.warning("%s asked (%s) but there are no Twilio REST credentials or no transfer_to", action, trigger)
        else:
            self._requesting = True
            try:
                if action == "transfer":
                    assert agent is not None and agent.transfer_to is not None
                    await rest.transfer(call_sid, agent.transfer_to)
                else:
                    await rest.complete(call_sid)
            except TwilioRestError as e:
                result = "error"
                log.error("%s (%s) failed: %s", action, trigger, e)
            except Exception:  # a bug of ours or the client's: still the call's own error, never its last action
                result = "error"
                log.exception("%s (%s) failed unexpectedly", action, trigger)
            finally:
                self._requesting = False
        metrics.CALL_ACTIONS.labels(action=action, trigger=trigger, result=result).inc()
        if result == "ok":
            log.info("call %s (%s)", "transferred" if action == "transfer" else "ended by the agent", trigger)
            self._end_reason = "transferred" if action == "transfer" else "ended_by_agent"
        else:
            self._acting = False  # the call goes on; a later request may try again
        return result

    # ---- engine -> Twilio: audio (from the server's BotAudioFanout) ----

    @property
    def playing(self) -> bool:
        """Streaming with an engine seat: the bot's audio can go out."""
        return self._media is not None and self.engine_call is not None and not self._ended and not self.ws.closed

    def note_bot_text(self, piece: str) -> None:
        if piece:
            if piece.startswith("\u2581"):
                self._bot_word_starts += 1
                if self._bot_word_starts - self._bot_words_flushed_at >= BOT_TURN_FLUSH_WORDS:
                    self._flush_bot_turn()  # at a word's start: no word is split across two entries
            self.state.bot_words.append(piece)

    async def restart_playout(self) -> None:
        """The engine started this call's model afresh (after a reset): drop what Twilio still has queued."""
        if self.state.frames_sent:
            await self.clear()

    async def send_bot_audio(self, mulaw: bytes, level_dbfs: float) -> float | None:
        """Send one engine frame (80 ms of μ-law) as one media message; when it left, or None if it did not.

        Never waits for the peer: a peer that stops reading gets its frames dropped (and, after
        `silent_socket_s` of that, its stream closed) instead of stalling every other call's audio. A silent
        frame is not sent while Twilio's queue is deeper than DRAIN_ABOVE_S: a pause skipped, so a stall's
        backlog drains instead of delaying the bot's every later word."""
        assert self._media is not None
        if self._peer_backlogged():
            return None
        # The level first: the clock is read only for a silent frame (this runs for every call every tick).
        if level_dbfs <= DRAIN_SILENT_DBFS and self.playout.backlog(now := time.monotonic()) > DRAIN_ABOVE_S:
            metrics.MEDIA_PLAYOUT_DRAINED.inc()
            self.bot_silent(now)
            return None
        try:
            await self.ws.send_frame(self._media.render(mulaw), WSMsgType.TEXT)
        except (ConnectionResetError, RuntimeError):  # socket gone under us: the receive loop ends the call
            return None
        sent = time.monotonic()
        self.playout.sent(sent)
        return sent

    def _peer_backlogged(self) -> bool:
        transport = self._transport
        if transport is None or transport.get_write_buffer_size() <= self.ctx.config.outbound_backlog_bytes:
            self._backlogged_since = None
            return False
        now = time.monotonic()
        if self._backlogged_since is None:
            self._backlogged_since = now
        metrics.MEDIA_OUTBOUND_DROPPED.inc()
        self._frames_dropped += 1
        if self._frames_dropped in (1, 10) or self._frames_dropped % 100 == 0:
            log.warning(
                "peer is not reading: %d bytes unsent, %d bot frames dropped",
                transport.get_write_buffer_size(), self._frames_dropped,
                extra={"call_id": self.state.call_sid},  # logged from the fan-out task, outside the call's context
            )
        if now - self._backlogged_since > self.ctx.config.silent_socket_s:
            self._end_reason = "stalled_peer"
            transport.abort()  # a clean close would queue behind the unread bytes; the receive loop ends the call
        return True

    def after_bot_audio(self, level_dbfs: float, produced_at: float, sent: float) -> None:
        """Account for a frame `send_bot_audio` sent (kept apart so a tick's sends go out back to back)."""
        metrics.MEDIA_OUTBOUND_SECONDS.observe(sent - produced_at)
        st = self.state
        st.frames_sent += 1
        # The first frame the caller can hear (above the turn threshold): a speech model's rows are "voiced"
        # within a tick or two whether or not it says anything. From the `start` event as read, before the
        # seat's claim and the engine's open (a slow Redis or a remote engine is the caller's wait too).
        if not st.first_audio_sent and st.started_at is not None and level_dbfs > self.turns.threshold_dbfs:
            st.first_audio_sent = True
            first = sent - (st.start_received_at if st.start_received_at is not None else st.started_at)
            metrics.FIRST_AUDIO_SECONDS.observe(first)
            self._store_soon(self.ctx.store.add_latency(st.call_sid, "first_audio", first))
        reply = self.turns.bot_level(level_dbfs, sent)
        if reply is not None:
            metrics.TURN_LATENCY_SECONDS.observe(reply.latency_s)
            self._store_soon(self.ctx.store.add_latency(st.call_sid, "turn", reply.latency_s))

    def bot_silent(self, at: float) -> None:
        """The engine gave this call no audio this tick (held by a forced delay, or just reset)."""
        self.turns.bot_level(SILENCE_DBFS, at)

    async def send_mark_if_due(self) -> None:
        """A mark every `mark_every_frames` frames, so Twilio's echoes tell what has actually played."""
        st = self.state
        if st.frames_sent - self._last_mark_at_frame < self.ctx.config.mark_every_frames or self._media is None:
            return
        self._last_mark_at_frame = st.frames_sent
        name = f"f{st.frames_sent}"
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await self.ws.send_str(mark_message(self._media.stream_sid, name))
            self.playout.mark_sent(name, time.monotonic())
            st.marks_sent += 1

    # ---- engine -> this call's record: events ----

    async def _pump_outputs(self) -> None:
        assert self.engine_call is not None and self.state.call_sid is not None
        call_sid = self.state.call_sid
        async for out in self.engine_call.outputs():
            if isinstance(out, CallerTranscript):
                if out.final:
                    self._flush_bot_turn()
                    await self.ctx.store.append_turn(call_sid, "caller", out.text)
            elif isinstance(out, OracleUpdate):
                await self._on_oracle(out)
            elif isinstance(out, ToolUse):
                await self._on_tool(out)
            elif isinstance(out, EngineNotice):  # a reset's stale audio is cleared by `restart_playout`
                log.warning("engine notice %s: %s", out.kind, out.detail)
                if out.kind == "engine_lost":  # nothing left to answer with: hang up (the receive loop ends it)
                    self._end_reason = "engine_lost"
                    await self.ws.close()

    async def _on_oracle(self, update: OracleUpdate) -> None:
        # A draft streams in as a growing text: the call record keeps one entry per candidate (its last
        # text, at the time it started), not one per streamed chunk.
        draft = self._oracle_draft
        if draft is not None and draft[0] != update.candidate:
            await self._record_oracle()
            draft = None
        self._oracle_draft = (update.candidate, update.text, draft[2] if draft else update.at)

    async def _record_oracle(self) -> None:
        if self._oracle_draft is None or self.state.call_sid is None:
            return
        _, text, started = self._oracle_draft
        self._oracle_draft = None
        await self.ctx.store.append_oracle(self.state.call_sid, text, at=time.time() - (time.monotonic() - started))

    def _flush_bot_turn(self) -> None:
        self._bot_words_flushed_at = self._bot_word_starts
        words = "".join(self.state.bot_words).replace("\u2581", " ").strip()
        self.state.bot_words.clear()
        if words and self.state.call_sid:
            self._store_soon(self.ctx.store.append_turn(self.state.call_sid, "bot", words))

    def _store_soon(self, coro) -> None:  # type: ignore[no-untyped-def]
        # Store writes only enqueue (they never wait on Redis), so awaiting them inline is cheap;
        # from sync code, hand them to the context's task set.
        self.ctx.spawn(coro)

    async def clear(self) -> None:
        """Drop the audio Twilio has queued but not played (barge-in, hang-up, engine reset)."""
        if self.state.stream_sid and not self.ws.closed:
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await self.ws.send_str(clear_message(self.state.stream_sid))
                self.playout.cleared(time.monotonic())

    # ---- the end ----

    async def end(self, reason: str) -> None:
        """Idempotent: close the engine seat, record the outcome, close the socket."""
        if self._ended:
            return
        self._ended, self._ended_as = True, reason
        if self._requesting and self._action_task is not None:
            # Twilio's `stop` (or the socket closing) for a call we transferred or hung up travels apart from
            # the REST answer and may overtake it: the REST outcome, once known, is the call's.
            await asyncio.wait({self._action_task}, timeout=ACTION_ANSWER_WAIT_S)
            if self._end_reason in ("transferred", "ended_by_agent"):
                reason = self._end_reason
        self._started()  # no longer an unstarted socket, whatever happened
        if self.state.started_at is not None:  # a stream refused before its start has no length
            metrics.CALL_DURATION_SECONDS.observe(time.monotonic() - self.state.started_at)
            if (left := self.turns.hang_up(time.monotonic())) is not None:  # hung up into the bot's silence
                metrics.TURNS_UNANSWERED_SECONDS.observe(left.waited_s)
        self.ctx.fanout.forget(self)
        if self.engine_call is not None:
            await self.engine_call.close()
        if self._pump is not None:
            # The engine's last outputs (the caller's last words, made final as its back-end closes: a
            # "...goodbye" and an immediate hang-up) reach the record before the call's end does; bounded.
            await asyncio.wait({self._pump}, timeout=LAST_WORDS_WAIT_S)
            self._pump.cancel()
            try:
                await self._pump
            except asyncio.CancelledError:
                pass
            except Exception:  # a pump that died must not skip what follows (the seat, the record's end)
                log.exception("the call's output pump failed")
        call_sid = self.state.call_sid
        if call_sid is not None:
            metrics.CALLS_ACTIVE.dec()
            metrics.CALLS_TOTAL.labels(outcome=reason, agent=self.state.agent).inc()
            self._flush_bot_turn()
            await self._record_oracle()
            await self.ctx.forget_stream(call_sid, self)
            await self.ctx.store.end(call_sid, reason)
            log.info(
                "stream ended (%s): %d packets in, %d frames out, %d/%d marks played",
                reason,
                self.state.inbound_packets,
                self.state.frames_sent,
                self.state.marks_played,
                self.state.marks_sent,
            )
        if not self.ws.closed:
            await self.ws.close()

