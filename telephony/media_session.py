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
from typing import TYPE_CHECKING, Any

from aiohttp import WSCloseCode, WSMessage, WSMsgType, web

from engine.interface import FRAME_SECONDS, CallAction, CallSetup, ToolUse

from . import metrics
from .call_leg import CallLeg
from .framing import InboundFramer
from .logs import call_id_var
from .playout_clock import DRAIN_ABOVE_S, DRAIN_SILENT_DBFS, PlayoutClock
from .stream_limits import StreamLimits
from .twilio_messages import (
    BINARY_FRAME,
    DUPLICATE_START,
    FLOODING,
    LINE_RATE,
    MEDIA_BEFORE_START,
    OVERSIZE,
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
LINE_AFTER_CLEAR_S = 1.0  # a `clear` emptied the line before it played: what the bot says next, then the action
# A stream Twilio stops because we acted on the call keeps that outcome (not "completed").
_OUTCOMES_OF_OUR_ACTIONS = ("transferred", "ended_by_agent", "max_duration")
CLOSE_WAIT_S = 5.0  # a close that has not gone through by then never will: the connection is dropped
ACTION_ANSWER_WAIT_S = 11.0  # the REST client's own timeout (10 s), and a little more


class MediaStreamSession(CallLeg):
    """One Twilio Media Streams WebSocket (see the module's docstring)."""

    protocol_errors = metrics.TWILIO_PROTOCOL_ERRORS
    carrier = "twilio"
    endpoint = "media"

    def __init__(
        self,
        ws: web.WebSocketResponse,
        ctx: ServerContext,
        *,
        peer: str = "?",
        transport: asyncio.BaseTransport | None = None,
        call_sid: str | None = None,
    ) -> None:
        super().__init__(ctx, peer=peer, transport=transport, inbound=InboundFramer())
        self.ws = ws
        self._url_call_sid = call_sid  # the CallSid of the URL it upgraded on (None: the fixed URL)
        self._media: MediaMessageTemplate | None = None  # set at `start`, once the streamSid is known
        self._last_mark_at_frame = 0
        self._acting = False  # a transfer or hang-up through the REST API is under way
        self._action_task: asyncio.Task[Any] | None = None  # the task carrying it out
        self._requesting = False  # its REST request is in flight
        self._awaited_mark: tuple[str, asyncio.Event] | None = None  # a mark whose echo someone waits for
        self._awaited_played = False  # its echo said played (not emptied by a `clear`)
        self.playout = PlayoutClock()
        self._clear_due = False  # the caller talked over a stale queue: clear it (from the receive loop)
        self.limits = StreamLimits()

    # ---- CallLeg ----

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def close_transport(self) -> None:
        try:
            # aiohttp waits up to 2 s (the socket's timeout) for the peer's close; this bounds the rest, a write
            # to a peer that does not read (its window shut), which would wait for ever.
            async with asyncio.timeout(CLOSE_WAIT_S):
                await self.ws.close()
        except TimeoutError:
            log.warning("stream from %s: no clean close within %.0f s; dropped", self.peer, CLOSE_WAIT_S)
            if self._transport is not None:
                self._transport.abort()

    def queued_bot_s(self, now: float) -> float:
        return self.playout.backlog(now)

    def barge_in(self) -> None:
        self._clear_due = True  # sent from the receive loop, after the packet is taken

    def ended_log(self, reason: str) -> None:
        log.info("stream ended (%s): %d packets in, %d frames out, %d/%d marks played", reason,
                 self.state.inbound_packets, self.state.frames_sent, self.state.marks_played,
                 self.state.marks_sent)  # fmt: skip

    async def before_end(self) -> str | None:
        if self._requesting and self._action_task is not None:
            # Twilio's `stop` (or the socket closing) for a call we transferred or hung up travels apart from
            # the REST answer and may overtake it: the REST outcome, once known, is the call's.
            await asyncio.wait({self._action_task}, timeout=ACTION_ANSWER_WAIT_S)
            if self._end_reason in _OUTCOMES_OF_OUR_ACTIONS:
                return self._end_reason
        return None

    # ---- the receive loop ----

    async def run(self) -> None:
        watchdog = asyncio.create_task(self.watch_for_silence(), name="silence-watchdog")
        try:
            while not self.ws.closed:
                msg = await self.ws.receive()
                self._last_message_at = time.monotonic()
                if msg.type == WSMsgType.TEXT:
                    await self._on_text(msg.data)
                elif msg.type in (WSMsgType.PING, WSMsgType.PONG):
                    await self._on_ping(msg)
                elif msg.type == WSMsgType.BINARY:
                    # Twilio sends none: counted against the stream as any invalid message, so a flood of them
                    # ends it (it skipped every limit, and one stream held the node's loop for 0.6 s at a time).
                    self.protocol_error(BINARY_FRAME, f"{len(msg.data)} bytes")
                    await self._limit("invalid")
                elif msg.type == WSMsgType.ERROR:
                    exc = self.ws.exception()
                    if getattr(exc, "code", None) == WSCloseCode.MESSAGE_TOO_BIG:
                        self.protocol_error(OVERSIZE, "WebSocket message over the size limit")
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

    async def _on_ping(self, msg: WSMessage) -> None:
        """Answered here, under a rate limit, and only to a peer that reads what it is sent: a pong written to
        one that never reads waits for ever once the socket's buffer is full, and the receive loop with it."""
        if not await self._limit("ping") or msg.type == WSMsgType.PONG:
            return
        transport = self._transport
        if transport is not None and transport.get_write_buffer_size() > self.ctx.config.outbound_backlog_bytes:
            return
        with contextlib.suppress(ConnectionError):
            await self.ws.pong(msg.data)

    async def end_at_max_length(self) -> None:
        """A call past --max-call-minutes (a line left open, a robocaller looping) gives its seat back: hung up
        through the REST API when it can be (the call ends there), else the stream is closed and Twilio asks
        the connect action (the agent's fallback: a person, or the apology)."""
        log.warning("call past its maximum length (%.0f min): ending it", self.ctx.config.max_call_s / 60)
        self._end_reason = "max_duration"
        if self.ctx.twilio_rest is not None and not self._acting:
            self._acting = True
            # Its own task, as the agent's actions: Twilio's `stop` for the hang-up may come before the REST
            # answer, and the receive loop's end then waits for it (before_end) instead of cancelling it with
            # this watchdog.
            self._action_task = self.ctx.spawn(self._hang_up_at_max_length())
            await asyncio.wait({self._action_task})
        await self.close_transport()

    async def _hang_up_at_max_length(self) -> None:
        await self._act("end", "max_duration")
        self._end_reason = "max_duration"  # not the hang-up's own outcome

    async def _on_text(self, raw: str) -> None:
        if not self.limits.allow_text(len(raw)):  # before the parse, which is what a flood of big frames costs
            await self._end_if_flooding()
            return
        try:
            message = parse_twilio_message(raw)
        except ProtocolError as e:
            self.protocol_error(e.kind, e.detail)
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
                if self._end_reason not in _OUTCOMES_OF_OUR_ACTIONS:
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
        elif kind == "media_msgs":  # over its count: the bucket counted the drop
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
            self.protocol_error(MEDIA_BEFORE_START, "event before start")
            return False
        if stream_sid != self.state.stream_sid:
            self.protocol_error(WRONG_STREAM_SID, "streamSid does not match this stream")
            return False
        return True

    async def _on_start(self, message: StartMessage) -> None:
        if self.state.stream_sid is not None:
            self.protocol_error(DUPLICATE_START, "second start on one stream")
            return
        if self._evicted:
            return
        self.not_awaiting_start()
        # First audio is timed from here (the real-time guard counts from the upgrade: see `_on_media`).
        self.state.start_received_at = time.monotonic()
        start = message.start
        call_sid = start.call_sid
        call_id_var.set(call_sid)
        token = start.custom_parameters.get(TOKEN_PARAMETER)
        # The token is single-use: a second socket for a live call here is refused, never swapped in (not even
        # with a fresh token, as a replayed webhook gets once Redis has lost the first one's binding).
        # A socket opened on one call's URL starts that call only (its signature covered no other).
        wrong_url = self._url_call_sid is not None and call_sid != self._url_call_sid
        if wrong_url or call_sid in self.ctx.streams or not await self.ctx.cluster.claim(call_sid, token):
            reason = "wrong_url" if wrong_url else "second_stream" if call_sid in self.ctx.streams else "bad_token"
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
        if not await self.open_engine(call_sid, setup):
            if self.engine_call is None:  # refused (not ended by a drain while it opened)
                await self.ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=b"engine busy")
            return
        self._media = MediaMessageTemplate(message.stream_sid)
        log.info("stream %s started (tracks %s)", message.stream_sid, ",".join(start.tracks).encode("unicode_escape")
                 .decode("ascii")[:100])  # the peer's text: escaped, never a log line of its own
        await self.streaming(call_sid, message.stream_sid)

    def _on_media(self, message: MediaMessage) -> str | None:
        """Takes the caller's audio; returns the limit kind a refused message counts against, else None."""
        if not self._check_sid(message.stream_sid):
            return "invalid"
        if not self.limits.allow("media_msgs"):
            return "media_msgs"
        if message.media.track != "inbound":
            return None
        now = time.monotonic()
        st = self.state
        # Audio seconds, not packets: Twilio sends 20 ms a packet, but a packet may hold up to a second.
        seconds = len(message.media.payload) / LINE_RATE
        # Real time counts from the upgrade: Twilio opens the socket and sends `start` and audio on it at once,
        # so a network stall that held up `start` held up its audio too and delivered both in one burst (from
        # `start` as read, a 1.5 s stall lost the caller's first half second as a "flood"). What a stream saves
        # up is capped at the longest stall it may survive (call_leg's audio_allowance).
        if not self.audio_allowance.take(seconds, now):
            # Faster than real time: drop rather than let the caller push the engine behind.
            self.protocol_error(FLOODING, "inbound audio faster than real time")
            return "media"
        st.inbound_packets += 1
        st.inbound_audio_s += seconds
        self.take_caller_audio(message.media.payload, now)

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

    async def on_tool(self, use: ToolUse) -> None:
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
        return self._media is not None and self.engine_call is not None and not self._ended and not self.ws.closed

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
        if self.peer_backlogged():
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

    async def clear(self) -> None:
        """Drop the audio Twilio has queued but not played (barge-in, hang-up, engine reset)."""
        if self.state.stream_sid and not self.ws.closed:
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await self.ws.send_str(clear_message(self.state.stream_sid))
                self.playout.cleared(time.monotonic())
