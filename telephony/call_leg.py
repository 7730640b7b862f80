"""One call's audio leg on this edge, whatever carrier brought it: what every carrier does the same way.

A carrier's session (Twilio Media Streams: `media_session.py`; Asterisk AudioSocket: `audiosocket_session.py`)
parses its own wire, admits the call its own way and sends the bot's audio in its own messages. This base
holds the rest, in one place: the caller's audio into the engine and the turn tracker, the bot's audio
accounted for (first audio, turn latency), the engine's outputs into the call record, a peer that stops
reading, and the call's end. The server's fan-out and drain speak to any `CallLeg`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from engine.interface import (
    LAST_WORDS_WAIT_S,
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
from .playout_clock import BARGE_IN_AFTER_S, CLEAR_ON_BARGE_IN_ABOVE_S
from .stream_limits import RealTimeAllowance
from .turns import SILENCE_DBFS, TurnTracker, Unanswered

if TYPE_CHECKING:
    from .server import ServerContext

log = logging.getLogger(__name__)

# The bot's words go to the call record when the caller's next utterance ends, or after this many words
# (about a minute of speech): a caller on hold or silent would otherwise leave the live record without the
# bot's side, and lose it with the node.
BOT_TURN_FLUSH_WORDS = 150
WATCHDOG_PERIOD_S = 1.0  # how often a call's watchdog checks for a silent or unstarted socket


@dataclass
class StreamState:
    """What one stream knows about its call; the receive loop and the output pump share it."""

    call_sid: str | None = None
    stream_sid: str | None = None
    agent: str = "default"
    started_at: float | None = None  # monotonic, at the `start` event
    start_received_at: float | None = None  # monotonic, when `start` was read (before the seat was claimed)
    inbound_packets: int = 0
    inbound_audio_s: float = 0.0  # the caller's audio taken (line seconds)
    frames_sent: int = 0
    first_audio_sent: bool = False
    marks_sent: int = 0
    marks_played: int = 0
    last_mark_played: str | None = None
    bot_words: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


class CallLeg:
    """The carrier-neutral half of a call's session. Subclasses set `protocol_errors` (their metric) and
    `carrier` (for logs), and implement `playing`, `queued_bot_s`, `barge_in`, `close_transport`,
    `on_tool` and `restart_playout`, `send_bot_audio`, `send_mark_if_due` (the fan-out's calls)."""

    protocol_errors: Counter
    carrier: str  # in logs
    endpoint: str  # its connections' label in kame_webhook_rejections_total, and its unstarted cap

    def __init__(
        self, ctx: ServerContext, *, peer: str, transport: asyncio.BaseTransport | None, inbound: InboundFramer,
    ) -> None:  # fmt: skip
        self.ctx = ctx
        self.peer = peer
        # The connection's transport, to see how much we have written that the peer has not read yet.
        self._transport = transport if isinstance(transport, asyncio.WriteTransport) else None
        self._backlogged_since: float | None = None
        self._frames_dropped = 0
        self.state = StreamState()
        self.engine_call: CallSession | None = None
        self.inbound = inbound
        self.turns = TurnTracker()
        self._pump: asyncio.Task[None] | None = None
        self._oracle_draft: tuple[int, str, float] | None = None  # (candidate, latest text, started)
        self._ended = False
        self._ended_as = ""  # the reason end() was given (it may run before the call is known: a drain)
        self._end_reason = "completed"
        self._agent: Agent | None = None  # set once the call is known
        self._talking_since: float | None = None  # the caller's utterance began (for a barge-in's clear)
        self._bot_word_starts = 0  # words the bot has begun (its text pieces starting with '▁')
        self._bot_words_flushed_at = 0  # `_bot_word_starts` when the bot's words last went to the record
        self._last_message_at = time.monotonic()
        # Connected but not started (no call known yet): such sockets are capped per node and closed after the
        # start timeout, however much they send.
        self.opened_at = time.monotonic()
        # The caller's audio, against real time from here (see RealTimeAllowance); the carriers' packets are 20 ms.
        # What may pile up before it is read, and must then pass: a `start` as late as the start timeout allows, the
        # seat's set-up after it (the receive loop waits), or a stall the silence watchdog (checking every second)
        # lets the socket survive; they can follow one another.
        cfg = ctx.config
        burst_s = cfg.flood_burst_packets * 0.02
        cap_s = cfg.start_timeout_s + cfg.silent_socket_s + WATCHDOG_PERIOD_S + burst_s
        self.audio_allowance = RealTimeAllowance(cap_s, burst_s, self.opened_at)
        self._evicted = False
        self._unstarted = True
        ctx.unstarted[self.endpoint] += 1
        ctx.awaiting_start[self.endpoint][self] = None
        metrics.MEDIA_UNSTARTED_SOCKETS.set(ctx.unstarted_sockets)

    # ---- what a carrier provides ----

    @property
    def playing(self) -> bool:
        """Streaming with an engine seat: the bot's audio can go out."""
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    def queued_bot_s(self, now: float) -> float:
        """Seconds of the bot's audio sent (or queued here) that the caller has not heard yet."""
        raise NotImplementedError

    def barge_in(self) -> None:
        """The caller talked over stale queued speech: drop it (from the receive path, never blocking)."""
        raise NotImplementedError

    async def close_transport(self) -> None:
        raise NotImplementedError

    async def on_tool(self, use: ToolUse) -> None:
        raise NotImplementedError

    async def restart_playout(self) -> None:
        """The engine started this call's model afresh (after a reset): drop the stale audio still queued."""
        raise NotImplementedError

    async def send_bot_audio(self, mulaw: bytes, level_dbfs: float) -> float | None:
        """One engine frame (80 ms of μ-law) towards the caller; when it left, or None if it did not."""
        raise NotImplementedError

    async def send_mark_if_due(self) -> None:
        raise NotImplementedError

    def ended_log(self, reason: str) -> None:
        log.info("call ended (%s): %d packets in, %d frames out", reason, self.state.inbound_packets,
                 self.state.frames_sent)  # fmt: skip

    async def before_end(self) -> str | None:
        """Run first in `end()`; may return the call's real outcome (an action's answer that overtook it)."""
        return None

    # ---- unstarted sockets ----

    def evict(self) -> None:
        """The unstarted cap is full and a newer connection came: this one, which never started, goes."""
        self.not_awaiting_start()
        self.protocol_error("no_start", "closed before its start to make room for a newer stream")
        self._end_reason = "no_start"
        self._evicted = True  # a start already on its way is not acted on: the socket is closing
        self.ctx.spawn(self.close_transport())

    def not_awaiting_start(self) -> None:
        """Starting (or going): no longer one a full cap may close."""
        self.ctx.awaiting_start[self.endpoint].pop(self, None)

    def _started(self) -> None:
        self.not_awaiting_start()
        if self._unstarted:
            self._unstarted = False
            self.ctx.unstarted[self.endpoint] -= 1
            metrics.MEDIA_UNSTARTED_SOCKETS.set(self.ctx.unstarted_sockets)

    # ---- errors ----

    def protocol_error(self, kind: str, detail: str) -> None:
        self.protocol_errors.labels(kind=kind).inc()
        n = self.state.errors[kind] = self.state.errors.get(kind, 0) + 1
        if self.log_error(kind, n):  # a flood of bad frames must not flood the logs too
            # The detail may quote the peer's own text (a parser's message): escaped, never a log line of its own.
            log.warning("%s protocol error %s (#%d) from %s: %s", self.carrier, kind, n, self.peer,
                        detail.encode("unicode_escape").decode("ascii")[:500])  # fmt: skip

    def log_error(self, kind: str, n: int) -> bool:
        """Whether the `n`th protocol error of `kind` on this connection is logged."""
        return n <= 3 or n % 100 == 0

    # ---- watchdog ----

    async def watch_for_silence(self) -> None:
        """Close a connection the carrier stopped talking on, or one that never started. One check a second
        per call, rather than a timer armed and cancelled for every one of its 50 messages a second."""
        limit, start_limit = self.ctx.config.silent_socket_s, self.ctx.config.start_timeout_s
        while not self.closed:
            await asyncio.sleep(min(WATCHDOG_PERIOD_S, limit / 2, start_limit / 2))
            if self.state.call_sid is not None and call_id_var.get() is None:
                # This task began before the call had an id (AudioSocket's comes in its first message): its own
                # lines (silent socket, maximum length) carried none.
                call_id_var.set(self.state.call_sid)
            # Not once its start is read: a start in time whose claim waits on a slow Redis was closed as
            # no_start after its token was spent and its seat opened.
            started = self.state.start_received_at is not None
            if self._unstarted and not started and time.monotonic() - self.opened_at > start_limit:
                self.protocol_error("no_start", f"no stream start within {start_limit:.0f}s of connecting")
                self._end_reason = "no_start"
                await self.close_transport()
                return
            if time.monotonic() - self._last_message_at > limit:
                self.protocol_error("silent_socket", f"no message for {limit:.0f}s")
                self._end_reason = "silent_socket"
                await self.close_transport()
                return
            if self._past_max_length():
                await self.end_at_max_length()
                return

    def _past_max_length(self) -> bool:
        started, cap = self.state.started_at, self.ctx.config.max_call_s
        return bool(cap) and started is not None and not self._ended and time.monotonic() - started > cap

    async def end_at_max_length(self) -> None:
        log.warning("call past its maximum length (%.0f min): ending it", self.ctx.config.max_call_s / 60)
        self._end_reason = "max_duration"
        await self.close_transport()

    # ---- the call's seat ----

    async def open_engine(self, call_sid: str, setup: CallSetup) -> bool:
        """Open the call's engine seat (the stream is already added to the context). False: refused or
        ended meanwhile, everything given back and recorded; the caller closes its transport."""
        try:
            self.engine_call = await self.ctx.engine.open_call(call_sid, setup)  # type: ignore[union-attr]
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
            await self.record_unseated(call_sid, outcome)
            return False
        await self.record_seated(call_sid)
        if self._ended:
            # end() ran while the seat was being opened (a drain that timed out): it could not know the call
            # then, so the seat, the stream and the record are given back here, not held for good.
            await self.engine_call.close()
            await self.ctx.forget_stream(call_sid, self)
            metrics.CALLS_TOTAL.labels(outcome=self._ended_as, agent=self.state.agent).inc()
            await self.ctx.store.end(call_sid, self._ended_as)
            return False
        return True

    async def record_seated(self, call_sid: str) -> None:
        """The call has its engine seat: its record exists from here (a Twilio call's, from its webhook)."""

    async def record_unseated(self, call_sid: str, outcome: str) -> None:
        """The engine refused the call or failed to seat it: its record gets the outcome (left ringing,
        Twilio's status callback counted it again as no_stream)."""
        await self.ctx.store.end(call_sid, outcome)

    async def streaming(self, call_sid: str, stream_sid: str) -> None:
        """The call is seated: count it, mark its record and start recording the engine's outputs."""
        self.state.call_sid = call_sid
        self.state.stream_sid = stream_sid
        self.state.started_at = time.monotonic()
        metrics.CALLS_ACTIVE.inc()
        self.ctx.store.adopt(call_sid)  # a copy of the record, should Redis lose it mid-call (read in the background)
        await self.ctx.store.begin_stream(call_sid, stream_sid=stream_sid, node=self.ctx.config.node_id,
                                          started_at=time.time())  # fmt: skip
        self._pump = asyncio.create_task(self._pump_outputs(), name=f"pump-{call_sid}")

    # ---- caller -> engine ----

    def take_caller_audio(self, payload: bytes, now: float) -> None:
        """The caller's line bytes, checked against real time by the carrier: to the engine and the turns."""
        st = self.state
        assert self.engine_call is not None
        for frame in self.inbound.push(payload, arrived_at=now):
            self.engine_call.push_audio(frame.pcm)
            metrics.MEDIA_INBOUND_SECONDS.observe(time.monotonic() - frame.last_arrival)
            was_speaking = self.turns.caller_speaking
            ended = self.turns.caller_frame(frame.pcm, frame.last_arrival)
            if self.turns.caller_speaking and not was_speaking:
                self._talking_since = frame.last_arrival
            elif (self.turns.caller_speaking and self._talking_since is not None
                    and self.turns.last_caller_voice - self._talking_since >= BARGE_IN_AFTER_S
                    and self.queued_bot_s(now) > CLEAR_ON_BARGE_IN_ABOVE_S):  # fmt: skip
                self._talking_since = None  # once per utterance
                self.barge_in()  # the bot's queued speech is older than what the model now hears
            if isinstance(ended, Unanswered):
                metrics.TURNS_UNANSWERED_SECONDS.observe(ended.waited_s)
            elif ended is not None and ended.overlap:
                metrics.TURN_OVERLAPS.inc()
                metrics.TURN_LATENCY_SECONDS.observe(0.0)
                self._store_soon(self.ctx.store.add_latency(st.call_sid, "turn", 0.0))
            elif ended is not None and ended.reply_latency_s is not None:  # answered inside the hangover
                metrics.TURN_LATENCY_SECONDS.observe(ended.reply_latency_s)
                self._store_soon(self.ctx.store.add_latency(st.call_sid, "turn", ended.reply_latency_s))

    # ---- engine -> caller: accounting (the fan-out calls these) ----

    def note_bot_text(self, piece: str) -> None:
        if piece:
            if piece.startswith("\u2581"):
                self._bot_word_starts += 1
                if self._bot_word_starts - self._bot_words_flushed_at >= BOT_TURN_FLUSH_WORDS:
                    self._flush_bot_turn()  # at a word's start: no word is split across two entries
            self.state.bot_words.append(piece)

    def peer_backlogged(self) -> bool:
        """The peer is not reading: drop this frame (and, after `silent_socket_s` of that, cut it off)."""
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
                await self.on_tool(out)
            elif isinstance(out, EngineNotice):  # a reset's stale audio is cleared by `restart_playout`
                log.warning("engine notice %s: %s", out.kind, out.detail)
                if out.kind == "engine_lost":  # nothing left to answer with: hang up (the receive loop ends it)
                    self._end_reason = "engine_lost"
                    await self.close_transport()

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

    def _store_soon(self, coro: Any) -> None:
        # Store writes only enqueue (they never wait on Redis), so awaiting them inline is cheap;
        # from sync code, hand them to the context's task set.
        self.ctx.spawn(coro)

    # ---- the end ----

    async def end(self, reason: str) -> None:
        """Idempotent: close the engine seat, record the outcome, close the connection."""
        if self._ended:
            return
        self._ended, self._ended_as = True, reason
        reason = await self.before_end() or reason
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
            self.ended_log(reason)
        if not self.closed:
            await self.close_transport()
