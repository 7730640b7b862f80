"""The aiohttp service: Twilio webhooks, the Media Streams socket, health and the admin API (public), and
/metrics on a listener of its own (`metrics_http`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import json
import logging
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import urlencode

from aiohttp import web
from multidict import MultiDictProxy
from twilio.twiml.voice_response import VoiceResponse

from engine.interface import MAX_SETUP_TEXT, Engine
from engine.log_sampler import LogSampler
from knowledge.agents import AgentDirectory, Agents

from . import metrics
from .admission import CallSidUsed
from .audiosocket_server import AudioSocketServer
from .bot_audio import BotAudioFanout
from .call_leg import CallLeg
from .call_store import CallRecord, CallStore, CallStoreUnavailable
from .cluster import Cluster, LocalCluster, open_cluster
from .config import ServiceConfig, hide_password
from .connection_cap import ConnectionCap, prove
from .logs import call_id_var
from .lost_calls import LostCallSweep
from .media_session import AGENT_PARAMETER, TOKEN_PARAMETER, MediaStreamSession
from .metrics_http import MetricsListener
from .signatures import (
    SIGNATURE_HEADER,
    public_url_for,
    validate_webhook,
    validate_websocket,
    websocket_signature_url,
)
from .twilio_rest import TwilioRest
from .twiml import at_capacity_twiml, busy_twiml, connect_stream_twiml, fallback_twiml, hangup_twiml, xml_safe

log = logging.getLogger(__name__)

VOICE_PATH = "/twilio/voice"
CONNECT_ACTION_PATH = "/twilio/connect-action"  # Twilio's request once a call's stream has ended
APOLOGY_MESSAGE = "Sorry, we have lost the line on our side. Please call again in a moment. Goodbye."
MEDIA_PATH = "/twilio/media"  # a node's stream URLs' base: each call streams on its own, MEDIA_PATH/<CallSid>
STATUS_PATH = "/twilio/stream-status"
CALL_STATUS_PATH = "/twilio/call-status"  # the number's StatusCallback: the call's own progress
LOADING_STOP_TIMEOUT_S = 30.0  # a stop while the engine loads: its load is given up within this
ENGINE_WATCH_S = 1.0  # how often a serving node checks that its engine is still alive
ENGINE_LOST_END_S = 5.0  # a dead engine's calls end themselves (engine_lost) within this, else are ended
_CALL_SID = re.compile(r"^CA[0-9a-fA-F]{32}$")
_CALL_ID = re.compile(r"^(CA|AS)[0-9a-fA-F]{32}$")  # a record's id: a Twilio CallSid, or an AudioSocket call's
BUSY_MESSAGE = "All our lines are busy right now. Please call again in a few minutes. Goodbye."
UNAVAILABLE_MESSAGE = "Sorry, we cannot take your call right now. Please call again later. Goodbye."


class ServerContext:
    """Shared state of one service instance. The engine arrives after the model has loaded.

    Without a `cluster`, calls are admitted on this node only (`LocalCluster`)."""

    def __init__(
        self, config: ServiceConfig, store: CallStore, engine: Engine | None = None, cluster: Cluster | None = None,
        agents: AgentDirectory | None = None, twilio_rest: TwilioRest | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.store = store
        # Which agent answers which number, and what it does at capacity (shared with the back-end in serve).
        self.agents = agents or AgentDirectory(Agents.builtin())
        self.twilio_rest = twilio_rest  # transfers; None without REST credentials
        self.engine: Engine | None = engine
        self.cluster: Cluster = cluster or LocalCluster(
            config.node_id,
            lambda: self.config.ws_base_url + MEDIA_PATH,  # the port is known once listening
            self.free_slots,
            config.reservation_ttl_s,
        )
        self.streams: dict[str, CallLeg] = {}  # every carrier's calls, by call id
        self.no_streams = asyncio.Event()  # set whenever no call is streaming (drain waits on it)
        self.no_streams.set()
        self.draining = False
        self.remote_engine = False  # an edge on an engine-serve (run_service says)
        # Connections with no call started on them yet, per carrier ("media": Twilio upgrades, "audiosocket"),
        # each capped on its own: a host inside --audiosocket-allow must not fill Twilio's cap (CallLeg counts).
        self.unstarted: dict[str, int] = {"media": 0, "audiosocket": 0}
        # Those of them that have sent no `start` at all, oldest first: the ones a full cap closes (insertion
        # order of a dict; each CallLeg adds and removes itself).
        self.awaiting_start: dict[str, dict[Any, None]] = {"media": {}, "audiosocket": {}}
        # CallSids with a socket open on their own stream URL (upgrading, awaiting its start, or streaming): one
        # at a time, so a captured upgrade signature cannot open a second one beside Twilio's.
        self.media_urls_open: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.fanout = BotAudioFanout(self.streams)
        self.sampled = LogSampler()  # node-wide: which warnings of a repeated kind reach the log

    def attach_engine(self, engine: Engine) -> None:
        """Serve calls on `engine` (it arrives once the model has loaded) and start playing its audio."""
        self.engine = engine
        self.fanout.start(engine)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # keep a reference until done
        task.add_done_callback(self._tasks.discard)
        return task

    def free_slots(self) -> int:
        """Engine seats no stream holds (reservations not subtracted); 0 while loading or draining.

        A stream counts from the moment its reservation is claimed, before the engine seat opens."""
        return 0 if self.draining else self.engine_seats_free()

    def engine_seats_free(self) -> int:
        """`free_slots` while draining too: for a stream of a call already promised a seat elsewhere."""
        engine = self.engine
        if engine is None or not engine.ready:
            return 0
        return max(0, min(engine.free_slots, engine.max_calls - len(self.streams)))

    @property
    def capacity_left(self) -> int:
        """Calls this node can still take: free seats less the reservations waiting for their stream."""
        return self.free_slots() - self.cluster.reserved

    def add_stream(self, call_sid: str, session: CallLeg) -> None:
        """A claimed call's stream (its token is single-use: never a second one for the same call)."""
        self.streams[call_sid] = session
        self.no_streams.clear()

    async def forget_stream(self, call_sid: str, session: CallLeg) -> None:
        if self.streams.get(call_sid) is session:
            del self.streams[call_sid]
            await self.cluster.release(call_sid)
        if not self.streams:
            self.no_streams.set()

    @property
    def unstarted_sockets(self) -> int:
        return sum(self.unstarted.values())

    def room_for_unstarted(self, endpoint: str, peer: str) -> bool:
        """A new connection of `endpoint`'s carrier may wait for its start: under that carrier's cap, or room
        made by closing its oldest connection that never started. False: refused (counted and logged)."""
        if self.unstarted[endpoint] < self.config.max_unstarted_streams:
            return True
        # Room is made by closing the oldest socket that never sent its start (a carrier sends it within
        # milliseconds of connecting): refusing the newest let one captured upgrade signature, held on as
        # many sockets and reopened as each timed out, refuse every real call's stream.
        # Not one younger than a second: a burst of real calls whose starts wait in a busy loop's sockets
        # must not close each other (the newest is refused then, as before).
        oldest = next(iter(self.awaiting_start[endpoint]), None)
        if oldest is None or time.monotonic() - oldest.opened_at < EVICT_UNSTARTED_AFTER_S:
            metrics.WEBHOOK_REJECTIONS.labels(endpoint=endpoint, reason="unstarted_cap").inc()
            if n := self.sampled(f"{endpoint}:unstarted_cap"):
                log.warning("%s connection from %s refused (#%d): %d sockets await their start", endpoint, peer, n,
                            self.unstarted[endpoint])  # fmt: skip
            return False
        metrics.WEBHOOK_REJECTIONS.labels(endpoint=endpoint, reason="unstarted_evicted").inc()
        if n := self.sampled(f"{endpoint}:unstarted_evicted"):
            log.warning("%d sockets await their start: the oldest (from %s) closed for a %s connection from %s "
                        "(#%d)", self.unstarted[endpoint], oldest.peer, endpoint, peer, n)  # fmt: skip
        oldest.evict()
        return True

    def webhook_ok(self, request: web.Request, form: Any, endpoint: str) -> bool:
        """Twilio's signature over the public URL it called and the form it posted."""
        token = self.config.twilio_auth_token
        if token is None:  # --insecure-dev (loopback only), or an AudioSocket-only node: Twilio is refused
            return self.config.insecure_dev or _counted(request, endpoint, False)
        if not request.raw_path.startswith("/"):  # an absolute-form request line (http://host/path): no
            return _counted(request, endpoint, False)  # URL Twilio signs; refused, not a 500
        url = public_url_for(request.raw_path, self.config.base_url)
        return _counted(request, endpoint, validate_webhook(token, url, form, request.headers.get(SIGNATURE_HEADER)))

    def websocket_ok(self, request: web.Request) -> bool:
        """Twilio's signature on the Media Streams upgrade: over this node's own wss URL, no params."""
        token = self.config.twilio_auth_token
        if token is None:
            return self.config.insecure_dev or _counted(request, "media", False)
        url = websocket_signature_url(self.config.node_base_url, request.path)
        return _counted(request, "media", validate_websocket(token, url, request.headers.get(SIGNATURE_HEADER)))


def _caller_id(value: object) -> str | None:
    """A `To` or `From` as the call carries it (its stream's parameters, the engine's call setup): phone
    numbers, client names and SIP URIs, at most MAX_SETUP_TEXT characters of text XML can carry. A SIP URI
    with long parameters is cut, not allowed to fail the call (or, past the engine link's limit, its edge)."""
    text = xml_safe(str(value or ""))[:MAX_SETUP_TEXT]
    return text or None


def _counted(request: web.Request, endpoint: str, ok: bool) -> bool:
    """Count and log a refused signature (never the token or the signature itself); a good one proves its
    request to the connection cap."""
    if ok:
        prove(request)
    else:
        reason = "missing_signature" if SIGNATURE_HEADER not in request.headers else "bad_signature"
        metrics.WEBHOOK_REJECTIONS.labels(endpoint=endpoint, reason=reason).inc()
        if n := _ctx(request).sampled(f"{endpoint}:{reason}"):  # anyone can send these: never a line each
            log.warning("%s refused (%s) from %s (#%d)", endpoint, reason, request.remote, n)
    return ok


# A `To` longer than this is no number or SIP address an agent could claim (an agent's entry is at most a few
# hundred characters); the cap bounds the matching's work on a 32 KB form field.
MAX_ROUTED_TEXT = 1024

# An unstarted media socket at least this old may be closed to make room for a newer upgrade.
EVICT_UNSTARTED_AFTER_S = 1.0
# A webhook's body arrives within this, or the request is over (408). aiohttp's keep-alive timer runs only
# between requests: a body announced and never sent held its connection, and 256 of them (the connection cap)
# shut out every call, Twilio's webhooks and admitted streams alike.
BODY_READ_S = 5.0
RECORD_CHECK_S = 0.3  # the voice webhook's look at the call's record (a replay's): Redis answers in a millisecond
_FORM = "application/x-www-form-urlencoded"  # what Twilio sends; anything else is not a webhook of its


async def _webhook_form(request: web.Request, endpoint: str) -> MultiDictProxy[Any]:
    """The webhook's form, read within BODY_READ_S. A slow body is 408, and a body that is not a form Twilio
    sends (another content type, bytes that are not UTF-8, an unknown charset) 400, each counted and logged
    once: never a 500 with a traceback, and never seen by the signature check."""
    if request.content_type != _FORM:
        raise _refused(request, endpoint, "malformed", web.HTTPBadRequest(text=f"expected {_FORM}"))
    try:
        async with asyncio.timeout(BODY_READ_S):
            return await request.post()
    except TimeoutError:
        raise _refused(request, endpoint, "slow_body", web.HTTPRequestTimeout(text="request body too slow")) from None
    except web.HTTPRequestEntityTooLarge as e:  # over client_max_size (32 KB)
        raise _refused(request, endpoint, "oversize", e) from None
    except (ValueError, LookupError) as e:  # UnicodeDecodeError is a ValueError; LookupError: a bogus charset
        raise _refused(request, endpoint, "malformed", web.HTTPBadRequest(text="malformed form")) from e


def _refused(request: web.Request, endpoint: str, reason: str, answer: web.HTTPException) -> web.HTTPException:
    metrics.WEBHOOK_REJECTIONS.labels(endpoint=endpoint, reason=reason).inc()
    if n := _ctx(request).sampled(f"{endpoint}:{reason}"):
        log.warning("%s refused (%s) from %s (#%d)", endpoint, reason, request.remote, n)
    return answer


def _ctx(request: web.Request) -> ServerContext:
    return request.app[CONTEXT]


CONTEXT: web.AppKey[ServerContext] = web.AppKey("kame_context", ServerContext)


async def _call_went_on(ctx: ServerContext, call_sid: str) -> bool:
    """Whether the call's record says it went past ringing (streamed, or answered busy, or ended): a replayed
    webhook, which the cluster's memory of used CallSids misses after a busy answer, a restart, or past its
    12 h. Bounded: an outage or a slow Redis leaves it to that memory rather than hold up the webhook."""
    try:
        async with asyncio.timeout(RECORD_CHECK_S):
            earlier = await ctx.store.brief(call_sid)
    except (CallStoreUnavailable, TimeoutError):
        return False
    return earlier is not None and earlier.state != "ringing"


async def handle_voice(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    form = await _webhook_form(request, "voice")
    if not ctx.webhook_ok(request, form, "voice"):
        return web.Response(status=403, text="invalid Twilio signature")
    call_sid = str(form.get("CallSid", ""))
    if not _CALL_SID.fullmatch(call_sid):
        return web.Response(status=400, text="CallSid missing or malformed")
    call_id_var.set(call_sid)
    to_number, from_number = _caller_id(form.get("To")), _caller_id(form.get("From"))
    # `?agent=NAME` on the webhook URL (signed with it) picks the agent of an outbound call.
    # Our number is `To` on an inbound call, `From` on an outbound one (`kame-phone dial`).
    # Routed on the number as sent, not as cut for the record (a long SIP URI's host must stay whole).
    ours = form.get("From" if str(form.get("Direction", "")).startswith("outbound") else "To")
    ours = str(ours or "")
    agent = ctx.agents.agents.for_call(ours if len(ours) <= MAX_ROUTED_TEXT else None, request.query.get("agent"))
    record = CallRecord(call_sid=call_sid, from_number=from_number, to_number=to_number, node=ctx.config.node_id,
                        agent=agent.name)  # fmt: skip
    try:
        if await _call_went_on(ctx, call_sid):
            raise CallSidUsed(call_sid)
        reservation = await ctx.cluster.reserve(call_sid)
    except CallSidUsed:  # a replay (signatures have no nonce): never a second token, never a new record
        metrics.WEBHOOK_REJECTIONS.labels(endpoint="voice", reason="replayed").inc()
        log.warning("voice webhook replayed for a call whose stream already started; hanging up")
        return web.Response(text=hangup_twiml(), content_type="text/xml")
    if reservation is None:
        log.warning("no capacity on any node (draining=%s): busy policy %r of agent %s", ctx.draining, agent.busy,
                    agent.name)  # fmt: skip
        metrics.CALLS_TOTAL.labels(outcome="busy", agent=agent.name).inc()
        await ctx.store.create(record)
        await ctx.store.end(call_sid, "busy")
        twiml = at_capacity_twiml(agent.busy, BUSY_MESSAGE, agent.transfer_to)
        return web.Response(text=twiml, content_type="text/xml")
    record.node = reservation.node_id
    await ctx.store.create(record)
    try:
        twiml = connect_stream_twiml(
            reservation.stream_url,
            ctx.config.base_url + STATUS_PATH,
            {TOKEN_PARAMETER: reservation.token, AGENT_PARAMETER: agent.name,
             **{k: v for k, v in (("to", to_number), ("from", from_number)) if v}},  # fmt: skip
            allow_insecure_ws=ctx.config.insecure_dev,
            action_url=f"{ctx.config.base_url}{CONNECT_ACTION_PATH}?{urlencode({'agent': agent.name})}",
        )
    except ValueError as e:
        # A stream URL Twilio cannot open (not wss://). Free the slot now: held until it expired, it would
        # also hold up a drain. The caller hears why instead of Twilio's "application error".
        await ctx.cluster.release(call_sid)
        log.error("cannot send the stream to node %s (%s): check its PUBLIC_URL / KAME_NODE_URL",
                  reservation.node_id, e)  # fmt: skip
        metrics.CALLS_TOTAL.labels(outcome="misconfigured", agent=agent.name).inc()
        await ctx.store.end(call_sid, "misconfigured")
        return web.Response(text=busy_twiml(UNAVAILABLE_MESSAGE), content_type="text/xml")
    log.info("answering with a media stream on node %s (agent %s)", reservation.node_id, agent.name)
    return web.Response(text=twiml, content_type="text/xml")


async def handle_media(request: web.Request) -> web.StreamResponse:
    """A call's own stream URL (MEDIA_PATH/<CallSid>, as the voice webhook's TwiML gives it): the signature
    covers the CallSid, so a captured one opens that call's socket only, one at a time, while its reservation
    waits for its stream (seconds): never after it started, lapsed, or was forgotten."""
    ctx = _ctx(request)
    if not ctx.websocket_ok(request):  # refused before the upgrade
        return web.Response(status=403, text="invalid Twilio signature")
    call_sid = request.match_info["call_sid"]
    if not _CALL_SID.fullmatch(call_sid):
        return web.Response(status=404, text="no such stream")
    call_id_var.set(call_sid)
    if call_sid in ctx.media_urls_open:
        raise _media_refused(request, "second_socket", web.HTTPConflict(text="a socket is open for this call"))
    ctx.media_urls_open.add(call_sid)  # before the await below: two upgrades at once get one socket
    try:
        if await _stream_awaited(ctx, call_sid) is False:
            raise _media_refused(request, "replayed", web.HTTPForbidden(text="no stream is awaited for this call"))
        return await _serve_stream(ctx, request, call_sid)
    finally:
        ctx.media_urls_open.discard(call_sid)


async def handle_media_fixed(request: web.Request) -> web.StreamResponse:
    """The fixed stream URL of versions before per-call URLs: taken only while a node of that version
    heartbeats in the cluster (a rolling update), whose webhooks still send streams here."""
    ctx = _ctx(request)
    if not ctx.websocket_ok(request):
        return web.Response(status=403, text="invalid Twilio signature")
    if not ctx.cluster.legacy_media_path:
        raise _media_refused(request, "fixed_url", web.HTTPNotFound(text=f"streams are per call: {MEDIA_PATH}/CA…"))
    return await _serve_stream(ctx, request, None)


def _media_refused(request: web.Request, reason: str, answer: web.HTTPException) -> web.HTTPException:
    """A signed upgrade refused before it happens (counted; logged, sampled: a captured signature can repeat)."""
    metrics.WEBHOOK_REJECTIONS.labels(endpoint="media", reason=reason).inc()
    if n := _ctx(request).sampled(f"media:{reason}"):
        log.warning("media upgrade refused (%s) from %s (#%d)", reason, request.remote, n)
    return answer


async def _stream_awaited(ctx: ServerContext, call_sid: str) -> bool | None:
    """Whether a reservation of the call waits for its stream (else the signed upgrade is a replay). None: a
    slow or failing Redis cannot say, and the start's single-use token decides, as before per-call URLs."""
    try:
        async with asyncio.timeout(RECORD_CHECK_S):
            return await ctx.cluster.awaits_stream(call_sid)
    except TimeoutError:
        return None


async def _serve_stream(ctx: ServerContext, request: web.Request, call_sid: str | None) -> web.StreamResponse:
    # Only an engine that is gone refuses here. The webhook already admitted this call (its token, its
    # seat): an engine falling behind, or draining, takes no *new* calls, but one it answered gets its stream.
    if ctx.engine is None or ctx.engine.failed:
        return web.Response(status=503, text="engine not serving")
    if not ctx.room_for_unstarted("media", str(request.remote)):
        return web.Response(status=503, text="too many streams awaiting their start")
    # No permessage-deflate: Twilio does not ask for it, and it costs CPU on every 20 ms message.
    # A peer that does not answer our close (a hostile one) is dropped after 2 s, not aiohttp's 10.
    # Pings are answered by the session, rate-limited (autoping answered every one, and stalled on a peer
    # that never reads).
    ws = web.WebSocketResponse(max_msg_size=ctx.config.max_message_bytes, autoping=False, compress=False,
                               timeout=2.0)  # fmt: skip
    await ws.prepare(request)
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None and ctx.config.media_send_buffer_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, ctx.config.media_send_buffer_bytes)
    await MediaStreamSession(ws, ctx, peer=str(request.remote), transport=request.transport, call_sid=call_sid).run()
    return ws


async def handle_connect_action(request: web.Request) -> web.Response:
    """The call's <Connect> ended: Twilio asks what next. Signed and checked like the voice webhook.
    A caller still on the line gets the agent's fallback (a person, or an apology): never dead air."""
    ctx = _ctx(request)
    form = await _webhook_form(request, "connect_action")
    if not ctx.webhook_ok(request, form, "connect_action"):
        return web.Response(status=403, text="invalid Twilio signature")
    call_id_var.set(str(form.get("CallSid", "")) or None)
    if str(form.get("CallStatus", "in-progress")) not in ("in-progress", "ringing"):
        return web.Response(text=VoiceResponse().to_xml(), content_type="text/xml")  # the caller is gone
    agent = ctx.agents.agents.get(request.query.get("agent"))
    action = "dial" if agent.transfer_to else "apology"
    metrics.CALL_FALLBACKS.labels(action=action).inc()
    log.warning("the stream ended with the caller on the line: fallback %s (agent %s)", action, agent.name)
    return web.Response(text=fallback_twiml(agent.transfer_to, APOLOGY_MESSAGE), content_type="text/xml")


async def handle_stream_status(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    form = await _webhook_form(request, "stream_status")
    if not ctx.webhook_ok(request, form, "stream_status"):
        return web.Response(status=403, text="invalid Twilio signature")
    event = str(form.get("StreamEvent", "unknown"))
    if event not in metrics.STREAM_EVENT_KINDS:
        event = "unknown"
    call_id_var.set(str(form.get("CallSid", "")) or None)
    metrics.STREAM_EVENTS.labels(event=event).inc()
    if event == "stream-error":
        log.error("Twilio reports a stream error: %s", str(form.get("StreamError", ""))[:300])
    else:
        log.info("Twilio stream status: %s", event)
    return web.Response(status=204)


async def handle_call_status(request: web.Request) -> web.Response:
    """Twilio's call status callback: counted; a call that ended before its stream ever started (the caller
    hung up while the webhook was answered, the stream could not be opened) is closed in its record, and so
    is one still streaming on a node that is gone (it crashed: nobody else would end it, node_lost)."""
    ctx = _ctx(request)
    form = await _webhook_form(request, "call_status")
    if not ctx.webhook_ok(request, form, "call_status"):
        return web.Response(status=403, text="invalid Twilio signature")
    status = str(form.get("CallStatus", "unknown"))
    if status not in metrics.CALL_STATUSES:
        status = "unknown"
    call_sid = str(form.get("CallSid", ""))
    metrics.CALL_STATUS_EVENTS.labels(status=status).inc()
    if not _CALL_SID.fullmatch(call_sid):
        return web.Response(status=204)
    call_id_var.set(call_sid)
    log.info("Twilio call status: %s", status)
    if status in metrics.FINAL_CALL_STATUSES:
        try:
            record = await ctx.store.brief(call_sid)  # not get(): the state, not every turn of a long call
        except CallStoreUnavailable:
            return web.Response(status=204)  # the record keeps its state; Redis errors are counted already
        if record is not None and record.state == "ringing":
            # Its reservation used up in the same step: a `start` racing this callback would reopen the record.
            forsaken = await ctx.cluster.forsake(call_sid)
            if forsaken is not True:
                # Its stream did start, on a node whose writes have not landed (a Redis outage there): that
                # node records the call's outcome; ending it here would count the call twice. None (the cluster
                # cannot tell): left as it is, the same.
                log.info("call status %s for a call whose stream started elsewhere (or cannot tell: %s); its node "
                         "records it", status, forsaken is None)  # fmt: skip
            else:
                metrics.CALLS_TOTAL.labels(outcome="no_stream", agent=record.agent or "default").inc()
                await ctx.store.end(call_sid, "no_stream")
        elif record is not None and record.state == "streaming" and record.node is not None:
            # A live node ends its own calls. One that crashed with the call is found by the lost-call sweep,
            # which ends its calls once it has been gone CONFIRM_S (lost_calls.py). Ended here as soon as its
            # heartbeat lapsed (3 s), a node whose heartbeats only paused (a partition from Redis, a stall) had
            # its finished calls recorded as node_lost, and counted twice with its own end (review, session 28).
            log.info("call status %s for a call streaming on node %s: its node (or, if it is gone, the lost-call "
                     "sweep) records its end", status, record.node)  # fmt: skip
    return web.Response(status=204)


async def handle_healthz(request: web.Request) -> web.Response:
    engine = _ctx(request).engine
    if engine is not None and engine.failed:  # a dead engine process: only a restart brings it back
        return web.json_response({"status": "engine failed"}, status=503)
    return web.json_response({"status": "alive"})


async def handle_readyz(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    checks = {
        "model_loaded": bool(ctx.engine is not None and ctx.engine.ready),
        "not_draining": not ctx.draining,
    }
    # An edge on the engine every edge shares, with a cluster to route through, stays in rotation while its
    # link is down: every edge loses the engine at once, and out of rotation every webhook and connect action
    # got the load balancer's 503 (Twilio's "application error") instead of the agent's busy or fallback
    # answer; the seats other nodes publish in Redis still take what calls they can.
    # (Not an AudioSocket-only node: it routes nothing through Redis, and its PBX must move on to another node.)
    # A node with its own engine, loaded and alive but not taking calls for now (a few seconds behind its 80 ms
    # ticks, its STT's process restarting), stays too, for the same reason: with one replica (ops/k8s) it was
    # the only endpoint, and Twilio got the load balancer's 503 for every webhook, and for the media upgrade of
    # a call answered a moment before. Its webhooks answer busy, or route the caller to a node with room.
    twilio = bool(ctx.config.twilio_auth_token or ctx.config.insecure_dev)
    engine = ctx.engine
    holds = ctx.remote_engine or (engine is not None and not engine.failed)
    routed = bool(ctx.config.redis_url) and twilio and holds
    ready = checks["not_draining"] and (checks["model_loaded"] or routed)
    # Reported, not required: every node shares the one Redis, so gating on it would take every node out of
    # rotation at once in an outage, failing every new call, which the write-behind store and this node's own
    # admission are built to ride out. kame_redis_errors_total and its alert say the store is down.
    body = {"ready": ready, "checks": checks, "store_reachable": await ctx.store.ping(),
            "capacity_left": max(ctx.capacity_left, 0)}
    return web.json_response(body, status=200 if ready else 503)


def _admin_refusal(ctx: ServerContext, request: web.Request) -> str | None:
    """Why an admin request is refused (None: it is not): no ADMIN_TOKEN on this node (`disabled`), no bearer
    token, or the wrong one."""
    expected = ctx.config.admin_token
    given = request.headers.get("Authorization", "")
    if not expected:
        return "disabled"
    if not given.startswith("Bearer "):
        return "missing_token"
    # (surrogateescape: aiohttp hands over a header's non-UTF-8 bytes that way, and a plain encode() was a 500.)
    ok = hmac.compare_digest(given.removeprefix("Bearer ").encode("utf-8", "surrogateescape"), expected.encode())
    return None if ok else "bad_token"


def _unauthorized(request: web.Request, reason: str) -> web.Response:
    """401, counted and logged sampled (a token guesser sends thousands; never the token it tried)."""
    metrics.WEBHOOK_REJECTIONS.labels(endpoint="admin", reason=reason).inc()
    if n := _ctx(request).sampled(f"admin:{reason}"):
        # The route, not the path: a path is the sender's text (newlines and all).
        resource = request.match_info.route.resource
        log.warning("admin request %s %s refused (%s) from %s (#%d)", request.method,
                    resource.canonical if resource else "?", reason, request.remote, n)
    return web.json_response(
        {"error": "bearer token required (ADMIN_TOKEN)"}, status=401, headers={"WWW-Authenticate": "Bearer"}
    )


async def handle_calls(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    if refusal := _admin_refusal(ctx, request):
        return _unauthorized(request, refusal)
    try:
        limit = max(1, min(int(request.query.get("limit", "50")), 500))
    except ValueError:
        return web.json_response({"error": "limit must be an integer"}, status=400)
    try:
        records = await ctx.store.list_recent(limit)
    except CallStoreUnavailable:
        return _store_unavailable()
    # Summaries (each list's length, not the list): GET /calls/{CallSid} has the whole record.
    return web.json_response({"calls": [r.summary() for r in records]}, dumps=json.dumps)


async def handle_call(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    if refusal := _admin_refusal(ctx, request):
        return _unauthorized(request, refusal)
    call_sid = request.match_info["call_sid"]
    # Only a well-formed call id reaches the store: `CA…:turns` would name one of a call's own Redis keys.
    if not _CALL_ID.fullmatch(call_sid):
        return web.json_response({"error": "no such call"}, status=404)
    try:
        record = await ctx.store.get(call_sid)
    except CallStoreUnavailable:
        return _store_unavailable()
    if record is None:
        return web.json_response({"error": "no such call"}, status=404)
    return web.json_response(record.to_dict())


def _store_unavailable() -> web.Response:
    return web.json_response({"error": "call store unavailable"}, status=503)


async def handle_agents(request: web.Request) -> web.Response:
    """The agents in force and the numbers they answer (bearer ADMIN_TOKEN)."""
    ctx = _ctx(request)
    if refusal := _admin_refusal(ctx, request):
        return _unauthorized(request, refusal)
    agents = ctx.agents.agents
    return web.json_response({"source": str(agents.source) if agents.source else None, "agents": agents.describe()})


def build_app(ctx: ServerContext) -> web.Application:
    # Twilio's webhooks are 1-3 KB of form; a larger body is refused (413) before it is read or parsed.
    app = web.Application(client_max_size=32 * 1024)
    app[CONTEXT] = ctx
    app.router.add_post(VOICE_PATH, handle_voice)
    app.router.add_post(CONNECT_ACTION_PATH, handle_connect_action)
    app.router.add_get(MEDIA_PATH + "/{call_sid}", handle_media)
    app.router.add_get(MEDIA_PATH, handle_media_fixed)
    app.router.add_post(STATUS_PATH, handle_stream_status)
    app.router.add_post(CALL_STATUS_PATH, handle_call_status)
    app.router.add_get("/healthz", handle_healthz)
    app.router.add_get("/readyz", handle_readyz)
    app.router.add_get("/calls", handle_calls)
    app.router.add_get("/calls/{call_sid}", handle_call)
    app.router.add_get("/agents", handle_agents)
    return app


class ServiceHandle:
    """A running service on host:port (port 0 picks a free one, for tests), and its metrics listener when
    the config names a metrics port."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        # lingering_time 0: a request answered before its body came (408, 400) is closed at once, not held
        # another 10 s reading what the peer still sends.
        # Only the calls on this listener (Twilio's streams) are its connections, not AudioSocket's.
        self.connection_cap = ConnectionCap(ctx.config.max_idle_connections,
                                            lambda: sum(leg.carrier == "twilio" for leg in self.ctx.streams.values()))
        app = build_app(ctx)
        self.connection_cap.attach(app)
        self.runner = web.AppRunner(app, handle_signals=False,
                                    keepalive_timeout=ctx.config.keepalive_timeout_s, lingering_time=0)
        self.port = 0
        self.metrics: MetricsListener | None = None
        self.audiosocket = AudioSocketServer(ctx)

    async def start(self) -> ServiceHandle:
        config = self.ctx.config
        if config.metrics_port is not None:  # first: its port is the one most likely taken on a shared host
            self.metrics = await MetricsListener(config.metrics_host, config.metrics_port).start()
        await self.runner.setup()
        assert self.runner.server is not None
        self.connection_cap.install(self.runner.server)
        site = web.TCPSite(self.runner, self.ctx.config.host, self.ctx.config.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        if self.ctx.engine is not None:
            self.ctx.attach_engine(self.ctx.engine)
        if self.ctx.config.port != self.port:  # port 0: the public URL must name the port we got
            self.ctx.config = dataclasses.replace(self.ctx.config, port=self.port)
        await self.audiosocket.start()
        return self

    @property
    def http_url(self) -> str:
        return f"http://{self.ctx.config.host}:{self.port}"

    async def drain(self, timeout_s: float, poll_s: float = 0.1, cut: asyncio.Event | None = None) -> None:
        """Take no new calls (and tell the other nodes); wait for the calls in progress to finish, and for
        reservations already promised to this node to start their stream or expire. `cut` set (a second
        SIGTERM/SIGINT: the operator will not wait) ends the calls still up at once, as the timeout does."""
        ctx = self.ctx
        ctx.draining = True
        self.audiosocket.stop_listening()
        await ctx.cluster.drain()
        # An edge on a remote engine gives the seats it is not using back (engine link protocol 5), so a
        # rollout's new edge is seated without waiting out this one's longest call: once the reservations
        # promised to this node have started their stream or expired (their callers keep their seats).
        give_back_seats = getattr(ctx.engine, "give_back_seats", None)
        cut = cut or asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                # A reservation starts its stream or expires without an event (and maybe on Redis): poll.
                while (ctx.streams or ctx.cluster.reserved > 0) and not cut.is_set():  # noqa: ASYNC110 - see above
                    if give_back_seats is not None and ctx.cluster.reserved == 0:
                        give_back_seats()
                        give_back_seats = None
                    await asyncio.sleep(poll_s)
            if cut.is_set():
                log.warning("stopped again during the drain: ending the %d calls still up now", len(ctx.streams))
        except TimeoutError:
            log.warning("drain timed out with %d calls still up: ending them", len(ctx.streams))
        await self.end_calls(outcome="drain_timeout")

    async def end_calls(self, outcome: str) -> None:
        # At once, not one after another: each call's end may wait a moment for its last words.
        await asyncio.gather(*(session.end(outcome) for session in list(self.ctx.streams.values())))

    async def engine_lost(self) -> None:
        """The engine failed for good: take no new calls, let its calls end themselves (each is told
        engine_lost and hangs up), and end the ones still up after ENGINE_LOST_END_S (a hung engine tells none)."""
        ctx = self.ctx
        ctx.draining = True
        await ctx.cluster.drain()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ENGINE_LOST_END_S):
                await ctx.no_streams.wait()
        await self.end_calls(outcome="engine_lost")

    @property
    def metrics_url(self) -> str | None:
        if self.metrics is None:
            return None
        return f"http://{self.metrics.host}:{self.metrics.port}/metrics"

    async def aclose(self) -> None:
        await self.audiosocket.aclose()
        await self.ctx.fanout.aclose()
        await self.runner.cleanup()
        if self.metrics is not None:  # last: the drain and the shutdown stay visible to Prometheus
            await self.metrics.aclose()


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, the model's Python objects, the app) out of the collector's
    sight. Without it a full collection walks them all: measured 140 ms with the audio of every call
    stalled, a few times a minute under load. Call once, when start-up is done."""
    gc.collect()
    gc.freeze()


async def run_service(
    config: ServiceConfig,
    store: CallStore,
    load_engine: Callable[[], Awaitable[Any]],
    *,
    agents: AgentDirectory | None = None,
    remote_engine: bool = False,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain: no new calls, finish the current ones, exit (0).

    HTTP comes up first so /healthz answers while the model loads; /readyz turns 200 once it has.
    Returns 1 once the engine has failed for good (its process died, or it hung), after ending its calls:
    only a restart brings it back, and Docker restarts a container that exits, never one merely unhealthy.
    `remote_engine` (an edge on an engine-serve shared by every edge): a lost link only fails /healthz.
    """
    ctx = ServerContext(config, store, agents=agents, twilio_rest=TwilioRest.from_env())
    ctx.remote_engine = remote_engine
    if ctx.twilio_rest is None and any(a.dtmf_transfer for a in ctx.agents.agents.by_name.values()):
        log.warning("agents have dtmf_transfer but there are no Twilio REST credentials: those keys do nothing")
    handle = await ServiceHandle(ctx).start()
    # AudioSocket only (no token): it refuses Twilio, so it must not be offered Twilio's calls by the other nodes;
    # it still heartbeats, so their sweep (lost_calls) leaves its calls alone.
    routable = bool(config.twilio_auth_token or config.insecure_dev)
    if not routable:
        log.warning("no TWILIO_AUTH_TOKEN: answering AudioSocket only; every Twilio webhook is refused (403)")
    ctx.cluster = open_cluster(ctx.config, ctx.free_slots, ctx.config.ws_base_url + MEDIA_PATH,
                               seats_fn=ctx.engine_seats_free, routable=routable)
    await ctx.cluster.start()
    sweep = LostCallSweep(store, ctx.cluster, config.node_id, live=ctx.streams.keys)
    if config.redis_url:  # without Redis there are no other nodes
        sweep.start()
    if config.insecure_dev:
        log.warning("!!! --insecure-dev: Twilio signatures are NOT checked; listening on %s only !!!", config.host)
    log.info("listening on %s:%d (public %s)", config.host, handle.port, hide_password(config.base_url))
    log.info("%s", config.twilio_summary())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, ctx.agents.reload)  # new calls get the new agents, live ones keep theirs
    engine = None
    try:
        loading = asyncio.create_task(load_engine())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({loading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            stopped.cancel()
            engine = loading.result()
            ctx.attach_engine(engine)
            freeze_startup_heap()
            await ctx.cluster.refresh()  # routable now, not at the next heartbeat
            log.info("ready: %d call slots", engine.max_calls)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), ENGINE_WATCH_S)
                if engine.failed and not remote_engine:
                    log.error("the engine failed (its process died or hung): ending its calls and exiting, "
                              "so the container or pod is restarted")  # fmt: skip
                    await handle.engine_lost()
                    return 1
        else:
            loading.cancel()  # the engine gives up its load (engine/service.py: start)
            await asyncio.wait({loading}, timeout=LOADING_STOP_TIMEOUT_S)
        log.info("stopping: draining %d calls (up to %.0fs)", len(ctx.streams), config.drain_timeout_s)
        cut = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal ends the calls now and exits
            loop.add_signal_handler(sig, cut.set)
        await handle.drain(config.drain_timeout_s, cut=cut)
        return 0
    finally:
        await sweep.aclose()
        if engine is not None:
            await engine.stop()
        # The drained calls' ends are written (the store's close flushes, bounded) before this node leaves the
        # cluster: gone, its calls still "streaming" in Redis would be ended by the other nodes' sweeps as
        # node_lost, and counted twice.
        await store.aclose()
        await ctx.cluster.aclose()  # other nodes stop seeing this one now, not after node_ttl_s
        if ctx.twilio_rest is not None:
            await ctx.twilio_rest.aclose()
        await handle.aclose()
        log.info("stopped")
