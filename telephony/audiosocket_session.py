"""One Asterisk AudioSocket connection: a PBX's call straight to the bot, no Twilio between.

Asterisk connects when its dialplan runs `AudioSocket(<uuid>,host:port)`, sends the call's UUID, then the
caller's audio as 16-bit linear at 8 kHz. The call is admitted here, on this node (there is no webhook to
reserve a seat first): with no seat free, or the node draining, the connection is closed at once and
Asterisk hangs the channel up (the dialplan caps its own concurrency below ours: see the README).
The bot's audio goes back as 20 ms messages paced by `AudioSocketPacer`: Asterisk plays what it gets the
moment it gets it, so the only queue is ours, and a caller talking over the bot empties it at once.
There is no transfer (AudioSocket has no way to hand the channel back with a destination): agents on this
carrier are offered `end_call` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.interface import FRAME_SECONDS, CallAction, CallSetup, ToolUse
from telephony.call_store import CallRecord, CallStoreUnavailable

from . import metrics
from .audiosocket_wire import (
    DTMF_DIGITS,
    FLOODING,
    KIND_DTMF,
    KIND_ERROR,
    KIND_HANGUP,
    KIND_SLIN,
    LINE_RATE,
    ODD_AUDIO,
    OTHER_RATES,
    OVERSIZE,
    PACKET_S,
    PEER_ERROR,
    SAMPLE_BYTES,
    UNKNOWN_KIND,
    WRONG_RATE,
    AudioSocketError,
    Message,
    hangup,
    parse_uuid,
    read_message,
    slin_messages,
)
from .call_leg import CallLeg
from .framing import InboundFramer
from .logs import call_id_var
from .playout_clock import DRAIN_ABOVE_S, DRAIN_SILENT_DBFS
from .stream_limits import StreamLimits

if TYPE_CHECKING:
    from .server import ServerContext

log = logging.getLogger(__name__)

CALL_ID_PREFIX = "AS"  # call ids are "AS" + the UUID's 32 hex digits (Twilio's are "CA" + 32)
# Our queue of the bot's audio, at most: an engine tick is 4 messages; more than this is a burst after a
# stall, and its oldest audio is dropped rather than delaying every later word.
MAX_QUEUED_S = 1.0
# After the queue ran dry (the call's start, an engine tick late), sending resumes this many messages' time
# after audio came back: the queue then stands that much deeper, and a tick a little late plays on instead
# of leaving a gap.
CUSHION_PACKETS = 2
TICK_MESSAGES = round(FRAME_SECONDS / PACKET_S)  # 4: what the fan-out queues a tick
LINE_WAIT_S = 10.0  # an `end_call`'s line: spoken and played out within this, or the call ends anyway
CLOSE_WAIT_S = 2.0  # a peer that does not close its side after ours is dropped
CLAIM_WAIT_S = 0.2  # the replay check's Redis round trip, at most: a hung Redis must not hold every call's answer
LINE_AUDIO_MESSAGES = 3 * TICK_MESSAGES  # the bot's audio trails its text by a few frames


def call_id_for(call_uuid: uuid.UUID) -> str:
    return CALL_ID_PREFIX + call_uuid.hex


@dataclass(eq=False)
class PacedQueue:
    """The bot's audio waiting for the pacer, 20 ms a message. Once it has run dry, nothing is taken until
    `cushion` messages' time after audio is queued again; past `max_messages` the oldest go (a stall's burst)."""

    cushion: int = CUSHION_PACKETS
    max_messages: int = round(MAX_QUEUED_S / PACKET_S)
    queued: int = 0  # messages ever queued
    gone: int = 0  # of those, sent, dropped or cleared: `queued - gone` are waiting
    _items: deque[bytes] = field(default_factory=deque)
    _primed: bool = False
    _start_at: float = 0.0  # monotonic: when a dry queue's new audio starts to play

    def __len__(self) -> int:
        return len(self._items)

    def extend(self, messages: list[bytes], now: float) -> int:
        """Queue a tick's messages; returns how many of the oldest were dropped to stay under the bound."""
        if not self._items and not self._primed:
            self._start_at = now + self.cushion * PACKET_S
        self._items.extend(messages)
        self.queued += len(messages)
        dropped = max(0, len(self._items) - self.max_messages)
        for _ in range(dropped):
            self._items.popleft()
        self.gone += dropped
        return dropped

    def next(self, now: float) -> bytes | None:
        """The message to send now, or None (dry, or waiting out the cushion)."""
        if not self._items:
            self._primed = False
            return None
        if not self._primed and now < self._start_at:
            return None
        self._primed = True
        self.gone += 1
        return self._items.popleft()

    def wait_s(self, now: float) -> float:
        """How long a message queued now waits before the pacer takes it (half a pacer period on average)."""
        queued = len(self._items) * PACKET_S
        if not self._primed:
            queued = max(queued, self._start_at - now if self._items else self.cushion * PACKET_S)
        return queued + PACKET_S / 2

    def clear(self) -> None:
        self.gone += len(self._items)
        self._items.clear()
        self._primed = False


class AudioSocketSession(CallLeg):
    protocol_errors = metrics.AUDIOSOCKET_PROTOCOL_ERRORS
    carrier = "audiosocket"
    endpoint = "audiosocket"

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ctx: ServerContext, *, agent: str | None,
    ) -> None:  # fmt: skip
        peer = writer.get_extra_info("peername")
        super().__init__(ctx, peer=str(peer[0] if peer else "?"), transport=writer.transport,
                         inbound=InboundFramer.slin())  # fmt: skip
        self.reader = reader
        self.writer = writer
        self.agent_name = agent  # the listener's agent (None: the agents file's default)
        self.outbox = PacedQueue()  # the bot's SLIN messages, 20 ms each, sent by the pacer
        self.limits = StreamLimits()
        self._acting = False

    # ---- CallLeg ----

    @property
    def closed(self) -> bool:
        return self.writer.is_closing()

    @property
    def playing(self) -> bool:
        started = self.state.started_at is not None and self.engine_call is not None
        return started and not self._ended and not self.closed

    async def close_transport(self) -> None:
        if self.writer.is_closing():
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            self.writer.write(hangup())  # Asterisk hangs the channel up on this (or on the close itself)
        self.writer.close()
        try:
            with contextlib.suppress(ConnectionError, TimeoutError, RuntimeError):
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await self.writer.wait_closed()
        finally:  # also when this wait is cancelled (the watchdog, the pump): `end` sees closing and skips its own
            self.writer.transport.abort()

    def queued_bot_s(self, now: float) -> float:
        return len(self.outbox) * PACKET_S

    def barge_in(self) -> None:
        self.outbox.clear()  # never sent, never heard: the model already hears the caller
        metrics.MEDIA_PLAYOUT_CLEARS.inc()

    async def restart_playout(self) -> None:
        self.outbox.clear()

    async def send_bot_audio(self, mulaw: bytes, level_dbfs: float) -> float | None:
        """Queue one engine frame for the pacer; when it was queued, or None if it was not. A silent frame is
        skipped while the queue is deeper than DRAIN_ABOVE_S: a stall's burst drains through the bot's pauses."""
        if self.peer_backlogged():
            return None
        now = time.monotonic()
        if level_dbfs <= DRAIN_SILENT_DBFS and self.queued_bot_s(now) > DRAIN_ABOVE_S:
            metrics.MEDIA_PLAYOUT_DRAINED.inc()
            self.bot_silent(now)
            return None
        ahead = self.outbox.wait_s(now)  # the frame goes out behind what is queued (first audio, turn latency)
        if dropped := self.outbox.extend(slin_messages(mulaw), now):
            metrics.AUDIOSOCKET_QUEUE_DROPPED.inc(dropped)
        return now + ahead

    async def send_mark_if_due(self) -> None:
        """Nothing to mark: what we have not sent is what the caller has not heard."""

    def pace(self) -> None:
        """The pacer's tick: the next 20 ms of the bot's audio onto the socket."""
        message = self.outbox.next(time.monotonic())
        if message is not None and not self.writer.is_closing():
            self.writer.write(message)

    def log_error(self, kind: str, n: int) -> bool:
        # Node-wide, not per connection: a host inside the allowlist may open connections by the thousand.
        return n == 1 and self.ctx.sampled(f"audiosocket:{kind}") is not None

    def ended_log(self, reason: str) -> None:
        log.info("audiosocket call ended (%s): %d packets in, %d frames out", reason, self.state.inbound_packets,
                 self.state.frames_sent)  # fmt: skip

    # ---- the receive loop ----

    async def run(self) -> None:
        watchdog = asyncio.create_task(self.watch_for_silence(), name="silence-watchdog")
        try:
            first = await read_message(self.reader)
            if first is not None:
                self._last_message_at = time.monotonic()
                if await self._start(parse_uuid(first)):
                    await self._receive()
        except AudioSocketError as e:
            self.protocol_error(e.kind, e.detail)
            if self._end_reason == "completed":
                self._end_reason = "oversize" if e.kind == OVERSIZE else "rejected"
        # OSError, not only ConnectionError: a timed-out or unreachable peer (ETIMEDOUT, EHOSTUNREACH) is none.
        except (asyncio.IncompleteReadError, OSError) as e:
            if self._end_reason == "completed" and not self._ended:  # keep a reason given (no_start, flooding)
                if n := self.ctx.sampled("audiosocket:cut"):
                    log.warning("audiosocket connection from %s cut (#%d): %s", self.peer, n, type(e).__name__)
                self._end_reason = "socket_error"
        finally:
            watchdog.cancel()
            await self.end(self._end_reason)

    async def _receive(self) -> None:
        while not self.closed:
            message = await read_message(self.reader)
            self._last_message_at = time.monotonic()
            if message is None or message.kind == KIND_HANGUP:  # Asterisk hung up (the caller did)
                return
            if message.kind == KIND_SLIN:
                if self.limits.allow("audio") and not self._on_audio(message.payload):
                    self.limits.drop("media")  # each refused packet counts towards ending a flood
            elif message.kind in OTHER_RATES:
                self.protocol_error(WRONG_RATE, f"audio of kind {message.kind:#04x}: the channel must be 8 kHz slin")
                self._end_reason = "misconfigured"  # every message would be refused: end now, not after a flood
                return
            elif message.kind == KIND_DTMF:
                if self.limits.allow("dtmf"):
                    await self._on_dtmf(message.payload)
            else:
                self._on_other(message)
            if self.limits.flooding:
                log.warning("audiosocket from %s ended: %d messages over their limits", self.peer,
                            self.limits.dropped)  # fmt: skip
                self._end_reason = "flooding"
                return

    def _on_other(self, message: Message) -> None:
        """An error or an unknown kind: counted, under the invalid-message rate limit."""
        if message.kind == KIND_ERROR:
            code = message.payload[:1].hex() or "none"
            self.protocol_error(PEER_ERROR, f"Asterisk reported error {code}")
        else:
            self.protocol_error(UNKNOWN_KIND, f"message of kind {message.kind:#04x} ({len(message.payload)} bytes)")
        self.limits.allow("invalid")

    def _on_audio(self, payload: bytes) -> bool:
        """The caller's audio to the engine; False when refused (faster than real time, or not whole samples)."""
        if not payload or len(payload) % SAMPLE_BYTES:
            self.protocol_error(ODD_AUDIO, f"{len(payload)} bytes of 16-bit audio")
            return False
        now, st = time.monotonic(), self.state
        seconds = len(payload) / (LINE_RATE * SAMPLE_BYTES)
        # Real time counts from the connection, as for Twilio's streams (see MediaStreamSession._on_media).
        if not self.audio_allowance.take(seconds, now):
            self.protocol_error(FLOODING, "inbound audio faster than real time")
            return False
        st.inbound_packets += 1
        st.inbound_audio_s += seconds
        self.take_caller_audio(payload, now)
        return True

    async def _on_dtmf(self, payload: bytes) -> None:
        if len(payload) != 1 or payload[0] not in DTMF_DIGITS:
            self.protocol_error(UNKNOWN_KIND, f"a DTMF message of {len(payload)} bytes that is not a digit")
            return
        log.debug("dtmf received")  # never the digit: it may be a PIN
        assert self.state.call_sid is not None
        await self.ctx.store.append_dtmf(self.state.call_sid, payload.decode("ascii"))

    # ---- admission ----

    async def _start(self, call_uuid: uuid.UUID) -> bool:
        """Admit the call on this node and open its engine seat; False: refused (recorded and counted)."""
        ctx = self.ctx
        self.not_awaiting_start()
        if self._evicted:
            return False
        self.state.start_received_at = time.monotonic()
        call_sid = call_id_for(call_uuid)
        call_id_var.set(call_sid)
        agent = ctx.agents.agents.get(self.agent_name)
        if self.agent_name is not None and agent.name != self.agent_name:
            log.warning("the agents file has no agent %r (reloaded without it?): answering with %s",
                        self.agent_name, agent.name)  # fmt: skip
        self._agent, self.state.agent = agent, agent.name
        # The UUID of a call live here, or of one with a record (Asterisk's ${UUID()} is fresh each call: taking
        # it would write a stranger's words into that call's record), or claimed by another node: never a
        # second leg. The seat is checked first (a busy answer leaves no claim: a dialplan may retry the UUID)
        # and again after the claim's round trip, which another call may have used to take the last seat.
        if call_sid in ctx.streams:
            return self._refuse(agent.name, call_sid, "second_stream")
        if not self._seat_free():
            return self._busy(agent.name)
        try:
            claimed = await self._claim(call_sid)
        except asyncio.CancelledError:  # the peer went meanwhile: a claim that landed must not hold the UUID
            ctx.spawn(ctx.store.release_claim(call_sid, ctx.config.node_id))
            raise
        if call_sid in ctx.streams or not claimed:
            return self._refuse(agent.name, call_sid, "second_stream" if call_sid in ctx.streams else "replayed")
        if not self._seat_free():
            ctx.spawn(ctx.store.release_claim(call_sid, ctx.config.node_id))
            return self._busy(agent.name)
        ctx.add_stream(call_sid, self)
        ctx.cluster.seat_taken()
        self._started()
        actions: tuple[CallAction, ...] = ("end",)
        setup = CallSetup(agent=agent.name, to_number=None, from_number=None, actions=actions,
                          forced_delay_ms=agent.forced_delay_ms)  # fmt: skip
        log.info("audiosocket call from %s answered by agent %s", self.peer, agent.name)
        if not await self.open_engine(call_sid, setup):
            return False
        await self.streaming(call_sid, str(call_uuid))
        return True

    async def record_seated(self, call_sid: str) -> None:
        await self.ctx.store.create(CallRecord(call_sid=call_sid, node=self.ctx.config.node_id, agent=self.state.agent))

    async def record_unseated(self, call_sid: str, outcome: str) -> None:
        if outcome == "engine_full":
            # As a busy answer: no record, and the claim given back, so the dialplan may retry the UUID. With a
            # record (ended engine_full) the retry was refused as a replay: a real caller turned away.
            self.ctx.spawn(self.ctx.store.release_claim(call_sid, self.ctx.config.node_id))
            return
        await self.record_seated(call_sid)  # the engine failed: kept on record
        await super().record_unseated(call_sid, outcome)

    def _seat_free(self) -> bool:
        ctx = self.ctx
        return ctx.engine is not None and not ctx.engine.failed and ctx.capacity_left > 0

    def _refuse(self, agent: str, call_sid: str, reason: str) -> bool:
        metrics.WEBHOOK_REJECTIONS.labels(endpoint="audiosocket", reason=reason).inc()
        if n := self.ctx.sampled(f"audiosocket:{reason}"):
            log.warning("audiosocket for %s refused (%s, #%d)", call_sid, reason, n)
        metrics.CALLS_TOTAL.labels(outcome="rejected", agent=agent).inc()
        self._end_reason = "rejected"
        self._started()
        return False

    def _busy(self, agent: str) -> bool:
        # Counted and logged, no record: a dialplan may retry with the same UUID, and a flood of made-up ones
        # against a full node must not write a record each.
        if n := self.ctx.sampled("audiosocket:busy"):
            log.warning("audiosocket call refused (#%d): no seat free here (draining=%s)", n, self.ctx.draining)
        metrics.CALLS_TOTAL.labels(outcome="busy", agent=agent).inc()
        self._end_reason = "busy"
        self._started()
        return False

    async def _claim(self, call_sid: str) -> bool:
        """Claim the UUID for this node (Redis: atomic across nodes). Redis down or slower than CLAIM_WAIT_S:
        the call is answered unchecked, logged and counted (its record's writes wait for Redis) — a PBX's
        calls must not all fail with the store."""
        try:
            async with asyncio.timeout(CLAIM_WAIT_S):
                return await self.ctx.store.claim(call_sid, self.ctx.config.node_id)
        except (CallStoreUnavailable, TimeoutError) as exc:
            metrics.AUDIOSOCKET_UNCHECKED.inc()
            if n := self.ctx.sampled("audiosocket:unchecked"):
                log.warning("audiosocket call answered without its replay check (#%d): call store %s", n,
                            "slow" if isinstance(exc, TimeoutError) else "unavailable")  # fmt: skip
            return True

    # ---- call actions ----

    async def on_tool(self, use: ToolUse) -> None:
        call_sid = self.state.call_sid
        assert call_sid is not None
        if use.action is None:
            await self.ctx.store.append_tool(call_sid, use.name, use.arguments, use.outcome)
        elif use.action != "end" or self._acting:
            await self.ctx.store.append_tool(call_sid, use.name, use.arguments, "ignored")
        else:
            self._acting = True
            self.ctx.spawn(self._hang_up_after_line(use))

    async def _hang_up_after_line(self, use: ToolUse) -> None:
        """`end_call`: the bot says its line, the line plays out, then the call ends (Asterisk hangs up)."""
        words = max(1, len(use.say.split()))
        start_words, deadline = self._bot_word_starts, time.monotonic() + LINE_WAIT_S
        # Polled once a tick: the words arrive with the fan-out's ticks, which set no event for one call.
        while self.playing and time.monotonic() < deadline and self._bot_word_starts - start_words < words:  # noqa: ASYNC110
            await asyncio.sleep(FRAME_SECONDS)
        # Then what was queued by now, and the audio trailing the words, has gone to Asterisk (the queue never
        # empties: the bot's pauses are audio too).
        played_out = self.outbox.queued + LINE_AUDIO_MESSAGES
        trailing_until = time.monotonic() + LINE_AUDIO_MESSAGES * PACKET_S  # a bot gone quiet sends no more
        # Its own bound: the words may have taken the whole first one, and their audio is still to play.
        deadline = time.monotonic() + (len(self.outbox) + LINE_AUDIO_MESSAGES) * PACKET_S + 0.5
        while self.playing and time.monotonic() < deadline and self.outbox.gone < played_out:
            if not self.outbox and time.monotonic() > trailing_until:
                break
            await asyncio.sleep(PACKET_S)
        assert self.state.call_sid is not None
        if not self.playing:  # the caller hung up first
            await self.ctx.store.append_tool(self.state.call_sid, use.name, use.arguments, "cancelled")
            return
        metrics.CALL_ACTIONS.labels(action="end", trigger="tool", result="ok").inc()
        await self.ctx.store.append_tool(self.state.call_sid, use.name, use.arguments, "ok")
        log.info("call ended by the agent (tool)")
        self._end_reason = "ended_by_agent"
        await self.close_transport()
