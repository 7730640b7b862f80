"""Each call streams on its own URL (…/twilio/media/<CallSid>), which Twilio signs: a captured upgrade
signature opens that call's socket once, before its stream starts, and nothing else. The fixed URL of older
versions is taken only while a node of such a version heartbeats in the cluster (a rolling update)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
import redis.asyncio as aioredis

from telephony import twilio_messages as tm
from telephony.cluster import RedisCluster
from telephony.server import VOICE_PATH
from telephony.sim_caller import simulate_call
from telephony.twiml import parse_connect_stream

from .phone_fixtures import Phone, metric, new_call_sid, running_phone
from .polling import until
from .redis_support import REDIS_URL, SlowProxy


def _refused(reason: str) -> float:
    return metric("kame_webhook_rejections_total", endpoint="media", reason=reason)


async def _upgrade_status(http: aiohttp.ClientSession, url: str, signature: str) -> int:
    """The HTTP status of a signed upgrade on `url` (101 when it opened; closed again at once)."""
    try:
        ws = await http.ws_connect(url, headers={"X-Twilio-Signature": signature})
    except aiohttp.WSServerHandshakeError as e:
        return e.status
    await ws.close()
    return 101


async def _streaming(ws: aiohttp.ClientWebSocketResponse, stream_sid: str) -> None:
    """Caller audio in until the bot's audio comes back: the stream carries the call."""
    for i in range(25):
        await ws.send_str(tm.media_msg(stream_sid, 2 + i, 1 + i, 20 * i, b"\xff" * 160))
    async with asyncio.timeout(10):
        while True:
            m = await ws.receive()
            assert m.type == aiohttp.WSMsgType.TEXT, m
            if '"media"' in m.data:
                return


async def _hang_up(phone: Phone, ws: aiohttp.ClientWebSocketResponse, stream_sid: str, call_sid: str) -> None:
    await ws.send_str(tm.stop_msg(stream_sid, 10**6, call_sid, "AC1"))
    await ws.close()
    await phone.settled()


async def test_a_captured_upgrade_signature_opens_one_socket_for_its_own_call_only(
    tiny_checkpoint: Path, question_wav: Path
) -> None:
    async with running_phone(tiny_checkpoint, max_calls=3) as phone, aiohttp.ClientSession() as http:
        await phone.keeping_time()
        good = asyncio.create_task(simulate_call(phone.ws_url, question_wav, auth_token=phone.token,
                                                 public_url=phone.base, hold_after=1.0))  # fmt: skip
        fixed, second, replayed, wrong = (_refused(r) for r in ("fixed_url", "second_socket", "replayed", "wrong_url"))
        # The fixed URL, signed: no node of an older version in this cluster, so nothing streams there.
        assert await _upgrade_status(http, phone.ws_url, phone.sign(phone.ws_url, {})) == 404
        assert _refused("fixed_url") == fixed + 1

        # Call A on its own URL; a second socket there while it is open is refused before the upgrade.
        call_a, params_a = await phone.answer(http)
        url_a = phone.stream_url(call_a)
        captured = phone.sign(url_a, {})
        ws = await http.ws_connect(url_a, headers={"X-Twilio-Signature": captured})
        assert await _upgrade_status(http, url_a, captured) == 409
        await ws.send_str(tm.start_msg("MZ1", call_a, "AC1", params_a))
        await _streaming(ws, "MZ1")
        assert await _upgrade_status(http, url_a, captured) == 409
        assert _refused("second_socket") == second + 2
        await _hang_up(phone, ws, "MZ1", call_a)

        # After it, the captured signature opens nothing, however often it is replayed: no socket awaits a
        # start, so the cap on those (which real calls need) is never touched.
        for _ in range(20):
            assert await _upgrade_status(http, url_a, captured) == 403
            assert phone.ctx.unstarted["media"] == 0
        assert _refused("replayed") == replayed + 20

        # A socket on B's URL starting another call (C, answered, its token known): refused, and C's token is
        # not spent by it. B and C then stream on their own URLs.
        call_b, params_b = await phone.answer(http)
        call_c, params_c = await phone.answer(http)
        ws = await phone.open_stream(http, call_b)
        await ws.send_str(tm.start_msg("MZ2", call_c, "AC1", params_c))
        msg = await ws.receive(timeout=5)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.POLICY_VIOLATION
        assert _refused("wrong_url") == wrong + 1
        ws_c = await phone.open_stream(http, call_c)
        await ws_c.send_str(tm.start_msg("MZ3", call_c, "AC1", params_c))
        await _streaming(ws_c, "MZ3")
        await _hang_up(phone, ws_c, "MZ3", call_c)
        # B's socket was closed by the refusal; its URL is free again for its real stream (not yet started).
        ws_b = await phone.open_stream(http, call_b)
        await ws_b.send_str(tm.start_msg("MZ4", call_b, "AC1", params_b))
        await _streaming(ws_b, "MZ4")
        await _hang_up(phone, ws_b, "MZ4", call_b)

        report = await good  # the good call, on its own URL all along, never noticed
        assert report.outcome == "completed", report.errors
        assert report.bot_seconds_received > 2.0
        for sid in (call_a, call_b, call_c):  # each streamed once, on its own socket
            record = await phone.store.get(sid)
            assert record is not None and record.state == "ended" and record.started_at is not None, record


@contextlib.asynccontextmanager
async def _older_node(raw: aioredis.Redis, prefix: str, node_id: str, url: str, *, rolled_back: bool = False
                      ) -> AsyncIterator[None]:  # fmt: skip
    """A node heartbeating as the version before per-call URLs did: its hash has no `percall` (or, the node
    id rolled back to that version, a `percall` its beats no longer move)."""
    key = f"{prefix}node:{node_id}"
    stop = asyncio.Event()

    async def beats() -> None:
        while not stop.is_set():
            sec, usec = await raw.time()
            now = sec * 1000 + usec // 1000
            fields = {"url": url, "free": 5, "draining": 0, "ts": now}
            if rolled_back:
                fields["percall"] = now - 5000
            await raw.hset(key, mapping=fields)
            await raw.pexpire(key, 600)
            await raw.zadd(f"{prefix}nodes", {node_id: now})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await stop.wait()

    task = asyncio.create_task(beats())
    try:
        yield
    finally:
        # Stopped by a flag, never cancelled: a command cancelled mid-flight leaves its Redis connection out of
        # step, and the next one on it waited for good (a 300 s timeout in a full run).
        stop.set()
        await task
        await raw.delete(key)
        await raw.zrem(f"{prefix}nodes", node_id)


@pytest.fixture
async def raw() -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(REDIS_URL, decode_responses=True, socket_timeout=5.0)
    yield r
    await r.aclose()


async def _answered(phone: Phone, http: aiohttp.ClientSession) -> tuple[str, str, dict[str, str]]:
    """The voice webhook answered as Twilio posts it: (CallSid, the TwiML's stream URL, its parameters)."""
    await phone.keeping_time()
    sid = new_call_sid()
    form = {"CallSid": sid, "AccountSid": "AC" + "0" * 32, "From": "+15550001", "To": "+15550002"}
    url = phone.base + VOICE_PATH
    async with http.post(url, data=form, headers={"X-Twilio-Signature": phone.sign(url, form)}) as r:
        stream = parse_connect_stream(await r.text())
    return sid, stream.url, dict(stream.parameters)


async def test_a_stream_url_opens_only_while_its_reservation_waits(tiny_checkpoint: Path) -> None:
    """A call never answered, or one whose reservation lapsed unclaimed (Twilio never came, or came too late):
    no stream is awaited, so a signed upgrade on its URL opens nothing, however long ago it was captured."""
    async with running_phone(tiny_checkpoint, reservation_ttl_s=0.5) as phone, aiohttp.ClientSession() as http:
        replayed = _refused("replayed")
        never = phone.stream_url(new_call_sid())
        assert await _upgrade_status(http, never, phone.sign(never, {})) == 403
        sid, url, _ = await _answered(phone, http)
        assert url == phone.stream_url(sid)
        await asyncio.sleep(0.7)  # its reservation lapses
        assert await _upgrade_status(http, url, phone.sign(url, {})) == 403
        assert _refused("replayed") == replayed + 2 and phone.ctx.unstarted["media"] == 0


async def test_the_fixed_url_is_taken_only_while_an_older_node_heartbeats(
    tiny_checkpoint: Path, prefix: str, raw: aioredis.Redis
) -> None:
    """A rolling update from a version before per-call URLs: the older nodes' webhooks send streams to the
    fixed URL of whichever node they reserved, so a new node takes streams there while one heartbeats, and
    for a reservation's life after the last one left (a draining node's last webhooks; it exits at once),
    then refuses them. Meanwhile the new nodes give the fixed URL too: behind one shared host name the stream
    may reach an older node, which has no per-call route. Before, such calls failed either way."""
    async with running_phone(tiny_checkpoint, max_calls=2) as phone, aiohttp.ClientSession() as http:
        cluster = RedisCluster(aioredis.Redis.from_url(REDIS_URL, decode_responses=True), "new", phone.ws_url,
                               phone.ctx.free_slots, key_prefix=prefix, heartbeat_s=0.1, node_ttl_s=0.6,
                               reservation_ttl_s=1.5)  # fmt: skip
        phone.ctx.cluster = cluster
        await cluster.start()
        try:
            fixed_sig = phone.sign(phone.ws_url, {})
            assert not cluster.legacy_media_path
            assert await _upgrade_status(http, phone.ws_url, fixed_sig) == 404
            async with _older_node(raw, prefix, "old", "ws://127.0.0.1:9/twilio/media"):
                await until(lambda: cluster.legacy_media_path, "the older node seen", within=5)
                # This node's own webhook gives the fixed URL now, and takes the stream there.
                call_sid, url, params = await _answered(phone, http)
                assert url == phone.ws_url
                ws = await http.ws_connect(phone.ws_url, headers={"X-Twilio-Signature": fixed_sig})
                await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", params))
                await _streaming(ws, "MZ1")
                await _hang_up(phone, ws, "MZ1", call_sid)
            # The older node gone (its hash deleted as it exits): its last reservations' streams still come.
            left = time.monotonic()
            await until(lambda: not cluster._legacy_peers, "the older node's exit seen", within=5)
            assert await _upgrade_status(http, phone.ws_url, fixed_sig) == 101
            call_sid, url, _ = await _answered(phone, http)
            assert url == phone.stream_url(call_sid)  # per-call URLs again at once
            await until(lambda: not cluster.legacy_media_path, "the older nodes' reservations lapsed", within=8)
            assert time.monotonic() - left >= 1.5  # not before a reservation's life
            assert await _upgrade_status(http, phone.ws_url, fixed_sig) == 404
            # A node id taken over by the older version (a rollback): its hash keeps a stale `percall`.
            async with _older_node(raw, prefix, "back", "ws://127.0.0.1:9/twilio/media", rolled_back=True):
                started = time.monotonic()
                await until(lambda: cluster.legacy_media_path, "the rolled-back node seen as older", within=5)
                assert time.monotonic() - started < 2
        finally:
            await cluster.aclose()


async def test_a_start_read_in_time_is_not_closed_while_its_claim_waits_on_a_slow_redis(
    tiny_checkpoint: Path, prefix: str
) -> None:
    """The start timeout ran until the start's claim returned: a start read in time, whose claim took two slow
    Redis round trips, was closed as no_start after its token was spent and its seat opened (review, session 26).
    It counts to the start being read."""
    proxy = SlowProxy(urlsplit(REDIS_URL).port or 6379, 0.7)  # each Redis reply 0.7 s late: a claim takes 1.4 s
    await proxy.start()
    async with running_phone(tiny_checkpoint, start_timeout_s=1.0) as phone, aiohttp.ClientSession() as http:
        client = aioredis.Redis.from_url(proxy.url, decode_responses=True, socket_timeout=1.0,
                                         socket_connect_timeout=1.0)  # fmt: skip
        cluster = RedisCluster(client, "slow", phone.ws_url, phone.ctx.free_slots, key_prefix=prefix,
                               heartbeat_s=5.0, node_ttl_s=15.0)  # fmt: skip
        phone.ctx.cluster = cluster
        await cluster.start()
        try:
            no_start = metric("kame_calls_total", outcome="no_start", agent="default")
            call_sid, params = await phone.answer(http)
            ws = await phone.open_stream(http, call_sid)
            await asyncio.sleep(0.5)
            await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", params))  # in time; claimed 1.9 s in
            await _streaming(ws, "MZ1")
            await _hang_up(phone, ws, "MZ1", call_sid)
            record = await phone.store.get(call_sid)
            assert record is not None and record.end_reason == "completed", record
            assert metric("kame_calls_total", outcome="no_start", agent="default") == no_start
        finally:
            await cluster.aclose()
            await proxy.aclose()


async def test_the_peers_text_never_makes_a_log_line_of_its_own(
    tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream's holder put a newline and a made-up log line in an unknown event's name, or in the start's
    tracks: the parser's message quoted it, and the plain log format wrote it as a line of its own."""
    caplog.set_level(logging.INFO)
    forged = "\n2026-11-27 11:00:00,000 WARNING telephony.server [CA0] admin login from 10.0.0.1"
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        call_sid, params = await phone.answer(http)
        ws = await phone.open_stream(http, call_sid)
        await ws.send_str(json.dumps({"event": "x" + forged}))
        await ws.send_str(tm.start_msg("MZ1", call_sid, "AC1", params, tracks=("inbound" + forged,)))
        await _streaming(ws, "MZ1")
        await _hang_up(phone, ws, "MZ1", call_sid)
    lines = [record.getMessage() for record in caplog.records]
    assert any("protocol error" in line for line in lines) and any("started (tracks" in line for line in lines)
    assert not any("\n" in line for line in lines if "admin login" in line), [x for x in lines if "admin" in x]
