"""More than one node: slot reservations in a real Redis (127.0.0.1:6379, or KAME_TEST_REDIS_URL), then two
real `kame-phone serve` processes on loopback sharing it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
import redis.asyncio as aioredis
from twilio.request_validator import RequestValidator

from telephony import admission
from telephony.admission import CallSidUsed
from telephony.audiosocket_session import call_id_for
from telephony.call_store import CallRecord, open_call_store
from telephony.cluster import LocalCluster, NodeIdInUse, RedisCluster, Reservation, open_cluster, stream_url_for
from telephony.config import ServiceConfig
from telephony.lost_calls import LostCallSweep
from telephony.server import CALL_STATUS_PATH, MEDIA_PATH, VOICE_PATH, ServerContext, ServiceHandle
from telephony.sim_caller import CallReport, simulate_call
from telephony.twiml import parse_connect_stream

from .phone_fixtures import flite_wav, metric, new_call_sid
from .polling import until
from .redis_support import REDIS_URL, RedisServer, SlowProxy, free_port, redis_errors

ROOT = Path(__file__).resolve().parents[1]


def client(url: str = REDIS_URL) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=1.0, socket_connect_timeout=1.0)


@pytest.fixture
async def raw() -> AsyncIterator[aioredis.Redis]:
    r = client()
    yield r
    await r.aclose()


# ---------------------------------------------------------------------------------------------------------
# RedisCluster against a real Redis, with fake engines (a dict of free seats per node)


@contextlib.asynccontextmanager
async def nodes(
    prefix: str, free: dict[str, int], url: str = REDIS_URL, **kw: float
) -> AsyncIterator[dict[str, RedisCluster]]:
    kw = {"heartbeat_s": 0.1, "node_ttl_s": 0.6, **kw}
    clusters = {
        name: RedisCluster(client(url), name, f"ws://127.0.0.1/{name}{MEDIA_PATH}", _seats(free, name),
                           key_prefix=prefix, **kw)  # type: ignore[arg-type]
        for name in free
    }
    try:
        for c in clusters.values():
            await c.start()
        yield clusters
    finally:
        for c in clusters.values():
            await c.aclose()


def _seats(free: dict[str, int], name: str) -> Callable[[], int]:
    return lambda: free[name]


async def reserve_many(c: RedisCluster, n: int) -> list[Reservation | None]:
    return [await c.reserve(new_call_sid()) for _ in range(n)]


def where(reservations: list[Reservation | None]) -> list[str | None]:
    return [None if r is None else r.node_id for r in reservations]


async def test_reserves_here_first_then_on_the_node_with_most_room(prefix: str) -> None:
    async with nodes(prefix, {"a": 2, "b": 1}) as n:
        a, b = n["a"], n["b"]
        sid = new_call_sid()
        first = await a.reserve(sid)
        assert first is not None and first.node_id == "a" and first.stream_url == f"ws://127.0.0.1/a{MEDIA_PATH}/{sid}"
        assert await a.reserve(sid) == first  # Twilio retrying the webhook: the same reservation
        assert where(await reserve_many(a, 3)) == ["a", "b", None]
        assert a.reserved == 2
        assert await b.reserve(new_call_sid()) is None  # the whole cluster is full, from any node
        await b.refresh()
        assert b.reserved == 1
    async with nodes(prefix + "2:", {"a": 0, "b": 1, "c": 2}) as n:
        # Not here: the node with the most room (ties by node id).
        assert where(await reserve_many(n["a"], 4)) == ["c", "b", "c", None]


async def test_a_node_of_an_older_version_is_sent_streams_on_its_fixed_url(prefix: str, raw: aioredis.Redis) -> None:
    """A rolling update: a node whose heartbeat writes no `percall` (the version before per-call URLs) serves
    only the fixed URL, so a reservation there gives it, and a retried webhook the same. While it heartbeats the
    newer nodes give their fixed URL too (behind one shared host name the stream may reach the older node), and
    take the fixed URL themselves until its reservations have lapsed. A node id rolled back to that version (a
    `percall` its beats no longer move) is seen as older at its first beat."""
    async with nodes(prefix, {"a": 0, "b": 2}, reservation_ttl_s=1.0) as n:
        a, b = n["a"], n["b"]
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "b" and r.stream_url == stream_url_for(b.stream_url, sid)
        assert not a.legacy_media_path and not b.legacy_media_path
        old_url = f"ws://127.0.0.1/old{MEDIA_PATH}"

        async def old_beats(per_call: bool = False) -> None:
            """One heartbeat of "old" as its version writes it (fresh, so no prune drops it meanwhile)."""
            sec, usec = await raw.time()
            now = sec * 1000 + usec // 1000
            fields = {"url": old_url, "free": 3, "draining": 0, "ts": now}
            await raw.hset(f"{prefix}node:old", mapping={**fields, "percall": now} if per_call else fields)
            await raw.zadd(f"{prefix}nodes", {"old": now})

        await old_beats()
        await a.refresh()
        await b.refresh()
        assert a.legacy_media_path and b.legacy_media_path
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "old" and r.stream_url == old_url
        assert await a.reserve(sid) == r  # Twilio retrying the webhook: the URL it was given
        mine = await b.reserve(new_call_sid())  # here first, and the fixed URL while an older node heartbeats
        assert mine is not None and mine.node_id == "b" and mine.stream_url == b.stream_url
        await old_beats(per_call=True)  # upgraded: its beats write percall = ts
        await a.refresh()
        assert not a._legacy_peers and a.legacy_media_path  # the fixed URL still taken: a reservation's life
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "old" and r.stream_url == stream_url_for(old_url, sid)
        await until(lambda: not a.legacy_media_path, "the older node's reservations lapsed", within=5)
        await asyncio.sleep(0.01)  # a later millisecond: beats are a second apart, loopback round trips are not
        await old_beats()  # rolled back: its beat moves ts and leaves the newer version's percall behind
        await a.refresh()
        assert a.legacy_media_path
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "old" and r.stream_url == old_url


async def test_a_node_missing_from_redis_still_reserves_its_own_seats(prefix: str, raw: aioredis.Redis) -> None:
    """Redis restarted empty (or this node's last heartbeat came late and was pruned): until the next beat the
    node is in no one's list, but a webhook landing on it still gets its free seat, never a busy signal. The
    other node, missing too, is offered only once it beats again; the seat taken is counted once it does."""
    async with nodes(prefix, {"a": 1, "b": 1}, heartbeat_s=30.0, node_ttl_s=60.0) as n:
        a = n["a"]
        await raw.delete(*[k async for k in raw.scan_iter(match=prefix + "*")])  # Redis came back empty
        first = await a.reserve(new_call_sid())
        assert first is not None and first.node_id == "a"
        assert await a.reserve(new_call_sid()) is None  # "a" full; "b" unknown until it beats
        await n["b"].refresh()
        assert where(await reserve_many(a, 2)) == ["b", None]
        a.draining = True  # out of routing: never a candidate, heartbeat or not
        await raw.delete(*[k async for k in raw.scan_iter(match=prefix + "*")])
        assert await a.reserve(new_call_sid()) is None


async def test_claim_needs_this_node_and_the_token(prefix: str, raw: aioredis.Redis) -> None:
    async with nodes(prefix, {"a": 0, "b": 1}) as n:
        a, b = n["a"], n["b"]
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "b"
        assert not await a.claim(sid, r.token)  # the stream reached the wrong node
        for wrong in (None, "", "x" * len(r.token), r.token[:-1], "ü" + r.token[1:]):
            assert not await b.claim(sid, wrong)
        assert not await b.claim(new_call_sid(), r.token)  # another call's token
        await b.refresh()  # b learns of reservations made elsewhere from its heartbeat
        assert b.reserved == 1
        assert await a.streamed(sid) is False and await a.streamed(new_call_sid()) is None  # reserved; unknown
        assert await b.claim(sid, r.token)
        assert await a.streamed(sid) is True  # any node can tell the stream started (a call status callback)
        assert b.reserved == 0
        # The claim moved the seat from "reserved" to "taken" in b's published record at once.
        assert await raw.hget(f"{prefix}node:b", "free") == "0"
        assert not await b.claim(sid, r.token)  # single-use: a second socket with it is refused
        await b.release(sid)
        assert await a.streamed(sid) is True
        assert not await b.claim(sid, r.token)  # the call is over: its token is dead
        for node in (a, b):  # a replayed webhook (signatures carry no nonce) gets no new token, on any node
            with pytest.raises(CallSidUsed):
                await node.reserve(sid)


async def test_a_forsaken_reservation_is_used_up_on_whichever_node_holds_it(prefix: str, raw: aioredis.Redis) -> None:
    """The caller's final status, on any node, for a call whose stream never started: its reservation (here
    on b, asked from a) is used up in the same step as the check, its seat freed, and a stream that starts
    after is refused. A call whose stream started is not forsaken; one Redis knows nothing of cannot tell."""
    async with nodes(prefix, {"a": 0, "b": 2}) as n:
        a, b = n["a"], n["b"]
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "b"
        assert await raw.zscore(f"{prefix}node:b:resv", sid) is not None
        assert await a.forsake(sid) is True
        assert await raw.zscore(f"{prefix}node:b:resv", sid) is None  # b's seat is free again
        assert not await b.claim(sid, r.token)  # the late start
        assert await a.forsake(sid) is False  # (ended: as for a stream that ran, nothing more to do)
        started = new_call_sid()
        r = await a.reserve(started)
        assert r is not None and await b.claim(started, r.token)
        assert await a.forsake(started) is False and await b.forsake(started) is False
        assert await a.forsake(new_call_sid()) is None  # never reserved, or forgotten: cannot tell


async def test_a_reservation_without_a_stream_expires(prefix: str) -> None:
    async with nodes(prefix, {"a": 1}, reservation_ttl_s=0.3) as n:
        a = n["a"]
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None
        assert await a.reserve(new_call_sid()) is None
        await asyncio.sleep(0.5)
        assert where(await reserve_many(a, 1)) == ["a"]  # the slot came back
        assert not await a.claim(sid, r.token)  # too late for the stream
        # Its webhook replayed now (a captured one) is used up: no second seat and token, every few seconds.
        with pytest.raises(CallSidUsed):
            await a.reserve(sid)
        assert await a.streamed(sid) is False  # and yet it never streamed: its final status ends its record


async def test_a_stream_is_awaited_only_while_its_reservation_waits(prefix: str, raw: aioredis.Redis) -> None:
    """What the upgrade of a call's stream URL asks first (a signed upgrade on it otherwise is a replay): on any
    node, a live reservation whose stream has not started; not one claimed, ended, lapsed, or unknown."""
    async with nodes(prefix, {"a": 0, "b": 3}, reservation_ttl_s=0.5) as n:
        a, b = n["a"], n["b"]
        sid, lapsing = new_call_sid(), new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "b" and await a.reserve(lapsing) is not None
        assert await a.awaits_stream(sid) is True and await b.awaits_stream(sid) is True
        assert await b.awaits_stream(new_call_sid()) is False  # never reserved (or long forgotten)
        assert await b.claim(sid, r.token)
        assert await a.awaits_stream(sid) is False and await b.awaits_stream(sid) is False
        await b.release(sid)
        assert await a.awaits_stream(sid) is False
        await asyncio.sleep(0.6)
        assert await a.awaits_stream(lapsing) is False  # its stream came too late, or never
        await raw.delete(f"{prefix}resv:{lapsing}")  # Redis restarted empty: nothing awaited
        assert await a.awaits_stream(lapsing) is False
    async with nodes(prefix + "down:", {"a": 1}, url=f"redis://127.0.0.1:{free_port()}/0") as n:
        assert await n["a"].awaits_stream(new_call_sid()) is None  # Redis down: cannot tell


async def test_a_draining_node_gets_no_reservations(prefix: str, raw: aioredis.Redis) -> None:
    async with nodes(prefix, {"a": 1, "b": 1}) as n:
        a, b = n["a"], n["b"]
        await b.drain()
        assert await raw.hget(f"{prefix}node:b", "draining") == "1"  # published at once
        assert where(await reserve_many(b, 1)) == ["a"]  # a draining node still routes webhooks elsewhere
        assert await a.reserve(new_call_sid()) is None  # a is full and b takes nothing


async def test_a_silent_node_disappears_and_a_closed_one_at_once(prefix: str, raw: aioredis.Redis) -> None:
    async with nodes(prefix, {"a": 0, "b": 5, "c": 5}, node_ttl_s=0.5) as n:
        a, b, c = n["a"], n["b"], n["c"]
        assert sorted(set(where(await reserve_many(a, 2)))) == ["b", "c"]
        b._closing = True  # b hangs: no more heartbeats, its record stays until it expires
        b._poke.set()
        await asyncio.sleep(0.7)
        assert where(await reserve_many(a, 2)) == ["c", "c"]
        await c.aclose()  # c shuts down cleanly: gone at once
        assert await raw.zrange(f"{prefix}nodes", 0, -1) == ["a"]
        assert await a.reserve(new_call_sid()) is None


async def test_concurrent_reservations_never_over_book(prefix: str) -> None:
    async with nodes(prefix, {"a": 5, "b": 3}, heartbeat_s=0.05) as n:
        a, b = n["a"], n["b"]
        got = await asyncio.gather(*[(a if i % 2 else b).reserve(new_call_sid()) for i in range(20)])
        taken = where(list(got))
        assert taken.count("a") == 5 and taken.count("b") == 3 and taken.count(None) == 12


async def test_redis_down_admits_on_this_node_only(prefix: str) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    errors = redis_errors()
    async with nodes(prefix, {"a": 1}, url=dead) as n:
        a = n["a"]
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "a"
        assert await a.reserve(sid) == r
        assert await a.reserve(new_call_sid()) is None  # this node's own capacity still holds
        assert await a.claim(sid, r.token) and not await a.claim(sid, "forged")
        await a.release(sid)
    assert redis_errors() > errors


async def test_a_hung_redis_does_not_queue_webhooks_behind_its_timeout(prefix: str, tmp_path: Path) -> None:
    """A Redis that hangs (a partition, a failover) rather than refusing: each reservation took the lock
    and waited for the 1 s socket timeout in turn, so the tenth of a burst of calls waited 10 s or more,
    near Twilio's 15 s webhook timeout. Once Redis has failed, reservations are made here until a heartbeat
    reaches it again; then they go through Redis once more."""
    redis = RedisServer(tmp_path)
    await redis.start()
    assert redis.proc is not None
    try:
        async with nodes(prefix, {"a": 20}, url=redis.url, heartbeat_s=0.2, node_ttl_s=1.0) as n:
            a = n["a"]
            early_sid = new_call_sid()
            early = await a.reserve(early_sid)  # through Redis, just before it hangs: its stream comes after
            assert early is not None
            redis.proc.send_signal(signal.SIGSTOP)
            try:
                loop = asyncio.get_running_loop()
                started = loop.time()
                got = await asyncio.gather(*[a.reserve(new_call_sid()) for _ in range(10)])
                took = loop.time() - started
                started = loop.time()
                claimed = await a.claim(early_sid, early.token)  # from this node's own book, not after a timeout
                claim_took = loop.time() - started
            finally:
                redis.proc.send_signal(signal.SIGCONT)
            assert where(list(got)) == ["a"] * 10
            assert took < 5.0, f"{took:.1f} s for 10 reservations"  # was 10 s and more (one timeout each)
            assert claimed and claim_took < 0.5, f"{claim_took:.2f} s"  # was the 1 s socket timeout
            await until(lambda: not a._failing, "a heartbeat reaching Redis again", within=10)
            r = await a.reserve(new_call_sid())
            assert r is not None and r.node_id == "a" and a._fallback.reserved == 10  # this one through Redis
    finally:
        await redis.kill()


async def test_redis_password_never_logged() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"redis://:hunter2secret@127.0.0.1:{s.getsockname()[1]}/0"
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("telephony.cluster")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        config = ServiceConfig(twilio_auth_token="t", redis_url=url, node_id="n")
        cluster = open_cluster(config, lambda: 1, "ws://127.0.0.1:1" + MEDIA_PATH)
        assert isinstance(cluster, RedisCluster)
        await cluster.start()
        assert await cluster.reserve(new_call_sid()) is not None  # Redis is down: this node takes it
        await cluster.aclose()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert any("127.0.0.1" in m for m in seen) and any("failed" in m for m in seen)
    assert not any("hunter2secret" in m for m in seen), seen
    assert isinstance(open_cluster(ServiceConfig(twilio_auth_token="t"), lambda: 1, "ws://x"), LocalCluster)


async def test_local_cluster() -> None:
    free = {"here": 1}
    c = LocalCluster("here", lambda: "ws://127.0.0.1:1" + MEDIA_PATH, _seats(free, "here"), reservation_ttl_s=30)
    sid = new_call_sid()
    r = await c.reserve(sid)
    assert r is not None and r.node_id == "here" and await c.reserve(sid) == r
    assert await c.reserve(new_call_sid()) is None and c.reserved == 1
    assert await c.claim(sid, r.token) and c.reserved == 0
    await c.drain()
    assert await c.reserve(new_call_sid()) is None


def _one_seat() -> LocalCluster:
    return LocalCluster("here", "ws://127.0.0.1:1" + MEDIA_PATH, lambda: 1, reservation_ttl_s=0.3)


async def test_a_local_reservation_that_expires_unstreamed_is_used_up() -> None:
    """A webhook replayed after its reservation expired gets no second token (a captured one, every few s)."""
    c = _one_seat()
    sid = new_call_sid()
    assert await c.reserve(sid) is not None
    await asyncio.sleep(0.5)
    with pytest.raises(CallSidUsed):
        await c.reserve(sid)
    assert await c.streamed(sid) is False  # expired, not streamed: the status callback ends its record


async def test_a_local_token_is_claimed_once() -> None:
    """A second socket presenting the same token (a replayed webhook's answer) never gets the call."""
    c = _one_seat()
    sid = new_call_sid()
    r = await c.reserve(sid)
    assert r is not None and await c.claim(sid, r.token)
    assert not await c.claim(sid, r.token)


async def test_the_oldest_used_up_call_sids_are_forgotten_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the memory cap the oldest CallSid goes, never the newest: a fresh call's replay is still refused."""
    monkeypatch.setattr(admission, "REMEMBERED_CALLS", 2)
    c = _one_seat()
    for sid in ("a", "b", "c"):
        r = await c.reserve(sid)
        assert r is not None and await c.claim(sid, r.token)
    assert await c.streamed("c") and not await c.streamed("a")
    with pytest.raises(CallSidUsed):
        await c.reserve("c")


# ---------------------------------------------------------------------------------------------------------
# Redis losing reservations, outages, a slow Redis


async def _drop_prefix(raw: aioredis.Redis, prefix: str) -> None:
    """Redis restarted without persistence (or failed over to a replica without these keys)."""
    keys = [k async for k in raw.scan_iter(match=f"{prefix}*")]
    if keys:
        await raw.delete(*keys)


async def test_a_claim_survives_redis_losing_the_reservation(prefix: str, raw: aioredis.Redis) -> None:
    """Redis lost resv:<sid> between the webhook and the stream: the node that reserved still knows the token,
    so the call is admitted (not rejected as bad_token) and the binding is written back as claimed."""
    async with nodes(prefix, {"a": 2}) as n:
        a = n["a"]
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "a"
        await _drop_prefix(raw, prefix)
        assert not await a.claim(sid, "x" * len(r.token))  # its own record still checks the token
        assert await a.claim(sid, r.token)
        assert await raw.hmget(f"{prefix}resv:{sid}", ["node", "state"]) == ["a", "claimed"]
        assert not await a.claim(sid, r.token)  # still single-use
        with pytest.raises(CallSidUsed):  # a replayed webhook gets no new token
            await a.reserve(sid)


async def test_a_replayed_webhook_after_redis_lost_the_binding_gets_no_second_stream(
    prefix: str, raw: aioredis.Redis
) -> None:
    """The binding of a live call is lost; the signed webhook is replayed to another node, which reserves on
    the node streaming the call with a new token. That node refuses the second stream: a call sid is claimed
    once on a node, whichever token comes with it."""
    async with nodes(prefix, {"a": 4, "b": 0}) as n:
        a, b = n["a"], n["b"]
        for reserved_by in (a, b):  # through a's own webhook, or through b's (then a never saw the token)
            sid = new_call_sid()
            r1 = await reserved_by.reserve(sid)
            assert r1 is not None and r1.node_id == "a" and await a.claim(sid, r1.token)
            await _drop_prefix(raw, prefix)
            await until(lambda: _node_listed(raw, prefix, "a"), "a's next heartbeat")
            r2 = await b.reserve(sid)  # b cannot know: Redis forgot the call
            assert r2 is not None and r2.node_id == "a" and r2.token != r1.token
            assert not await a.claim(sid, r2.token)
            with pytest.raises(CallSidUsed):
                await a.reserve(sid)


def _redis_port() -> int:
    return urlsplit(REDIS_URL).port or 6379


async def _node_listed(raw: aioredis.Redis, prefix: str, node_id: str) -> bool:
    return node_id in await raw.zrange(f"{prefix}nodes", 0, -1)


async def test_reservations_counted_before_an_outage_do_not_outlive_it(prefix: str, tmp_path: Path) -> None:
    """Redis dies with reservations open on this node. Claimed through the node's own record, they stop
    counting as reserved at once (a stream is not also a reservation); unclaimed, they stop counting once
    they have expired, so the node is not busy with idle seats and a drain does not wait for them."""
    redis = RedisServer(tmp_path)
    await redis.start()
    try:
        free = {"a": 4}
        async with nodes(prefix, free, url=redis.url, reservation_ttl_s=0.5) as n:
            a = n["a"]
            res = {sid: await a.reserve(sid) for sid in (new_call_sid(), new_call_sid(), new_call_sid())}
            assert a.reserved == 3
            await redis.kill()
            claimed = list(res)[:2]
            for sid in claimed:
                r = res[sid]
                assert r is not None and await a.claim(sid, r.token)
                free["a"] -= 1  # the stream takes its seat
            assert a.reserved == 1  # the third: still expected
            await asyncio.sleep(0.7)  # past reservation_ttl_s: it cannot be claimed any more
            assert a.reserved == 0
            assert where([await a.reserve(new_call_sid()) for _ in range(3)]) == ["a", "a", None]
            for sid in claimed:
                await a.release(sid)
                free["a"] += 1
    finally:
        await redis.kill()


async def test_concurrent_reservations_do_not_queue_behind_each_others_round_trip(prefix: str) -> None:
    """With Redis 0.3 s away, webhooks took one round trip each in turn behind a process lock (40 at 0.2 s:
    the last took 8 s, near Twilio's 15 s webhook timeout). Now they go to Redis side by side."""
    proxy = SlowProxy(_redis_port(), 0.3)
    await proxy.start()
    try:
        async with nodes(prefix, {"a": 30}, url=proxy.url, heartbeat_s=0.5, node_ttl_s=3.0) as n:
            a = n["a"]
            assert where([await a.reserve(new_call_sid())]) == ["a"]  # loads the script
            loop = asyncio.get_running_loop()
            started = loop.time()
            got = await asyncio.gather(*[a.reserve(new_call_sid()) for _ in range(20)])
            took = loop.time() - started
            assert took < 8 * 0.3, f"{took:.1f} s for 20 reservations"  # was 20 round trips, 6 s and more
            assert where(list(got)) == ["a"] * 20 and not a._failing and a._fallback.reserved == 0
    finally:
        await proxy.aclose()


async def test_a_claim_racing_reservations_and_heartbeats_never_over_books(
    prefix: str, raw: aioredis.Redis
) -> None:
    """No lock orders claims before reservations and heartbeats any more: a claim landing in Redis while a
    reservation or a heartbeat computed from a `free` that does not count it yet is in flight must not make
    its seat count twice."""
    proxy = SlowProxy(_redis_port(), 0.2)
    await proxy.start()
    try:
        free = {"a": 1}
        async with nodes(prefix, free, url=proxy.url, heartbeat_s=1.0, node_ttl_s=5.0) as n, \
                nodes(prefix, {"b": 0}, node_ttl_s=5.0) as m:  # fmt: skip
            a, b = n["a"], m["b"]

            async def stream(sid: str, token: str) -> bool:
                if await a.claim(sid, token):
                    free["a"] -= 1  # as add_stream: before the next await
                    return True
                return False

            for claim_first in (False, True):
                sid = new_call_sid()
                r = await a.reserve(sid)
                assert r is not None and r.node_id == "a"
                await a.refresh()
                claim = asyncio.create_task(stream(sid, r.token))
                if claim_first:  # the claim has landed in Redis; its reply is still on the way (0.2 s)
                    await until(lambda s=sid: _hget_is(raw, f"{prefix}resv:{s}", "state", "claimed"), every=0.01)
                    assert not claim.done()
                late = await asyncio.gather(a.reserve(new_call_sid()), a.refresh())
                assert await claim
                assert late[0] is None  # no seat left on a
                assert await b.reserve(new_call_sid()) is None  # nor, as published, for another node
                await a.release(sid)
                free["a"] += 1
                await a.refresh()
    finally:
        await proxy.aclose()


async def test_the_heartbeat_survives_an_unexpected_error(prefix: str, raw: aioredis.Redis) -> None:
    """A heartbeat that raised anything but a Redis error ended the heartbeat task, silently: the node dropped
    out of the cluster after node_ttl_s. It is logged and the heartbeats go on."""
    seats = {"n": 0}
    boom = [True]

    def capacity() -> int:
        if boom[0] and seats["n"] == 1:
            boom[0] = False
            raise RuntimeError("engine state unreadable")
        return seats["n"]

    a = RedisCluster(client(), "a", f"ws://127.0.0.1/a{MEDIA_PATH}", capacity, key_prefix=prefix,
                     heartbeat_s=0.1, node_ttl_s=0.6)  # fmt: skip
    await a.start()
    try:
        seats["n"] = 1  # the next heartbeat raises once
        await until(lambda: not boom[0], "the failing heartbeat")
        seats["n"] = 2
        await until(lambda: _hget_is(raw, f"{prefix}node:a", "free", "2"), "heartbeats going on", within=3)
        assert a._task is not None and not a._task.done()
    finally:
        await a.aclose()


async def test_during_an_outage_a_call_end_does_not_wait_for_redis(prefix: str, tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    await redis.start()
    try:
        async with nodes(prefix, {"a": 2}, url=redis.url) as n:
            a = n["a"]
            sid = new_call_sid()
            r = await a.reserve(sid)
            assert r is not None and await a.claim(sid, r.token)
            await redis.kill()
            await until(lambda: a._failing, "a heartbeat failing")
            tried: list[str] = []
            script = a._release_script

            async def spy(*args: object, **kw: object) -> object:
                tried.append("release")
                return await script(*args, **kw)  # type: ignore[arg-type]

            a._release_script = spy  # type: ignore[assignment]
            await a.release(sid)
            assert tried == []  # Redis failed the last time it was asked: not asked again per call end
            with pytest.raises(CallSidUsed):
                await a.reserve(sid)
    finally:
        await redis.kill()


# ---------------------------------------------------------------------------------------------------------
# Two `kame-phone serve` processes on loopback, one Redis


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return flite_wav("Hello, what time does the store open on Monday?", tmp_path_factory.mktemp("speech") / "q.wav")



@dataclass
class Node:
    node_id: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{MEDIA_PATH}"


def start_node(
    node_id: str, max_calls: int, checkpoint: Path, prefix: str, token: str, logdir: Path, *extra_args: str
) -> Node:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAME_", "TWILIO_", "PUBLIC_URL", "REDIS_"))}
    env |= {
        "TWILIO_AUTH_TOKEN": token,
        "PUBLIC_URL": f"http://127.0.0.1:{port}",
        "REDIS_URL": REDIS_URL,
        "KAME_REDIS_PREFIX": prefix,
        "KAME_NODE_ID": node_id,
        "KAME_METRICS_PORT": "0",  # two nodes on one host: each its own metrics port
    }
    cmd = [sys.executable, "-m", "kame_phone.cli", "serve", "--port", str(port), "--checkpoint", str(checkpoint),
           "--device", "cpu", "--max-calls", str(max_calls), "--stt", "none", "--llm", "none", "--greedy", *extra_args]
    log = logdir / f"{node_id}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Node(node_id, port, proc, log)


async def readyz(http: aiohttp.ClientSession, node: Node) -> int:
    try:
        async with http.get(node.base + "/readyz") as r:
            return r.status
    except aiohttp.ClientError:
        return 0


async def answer(http: aiohttp.ClientSession, node: Node, token: str, call_sid: str) -> tuple[str | None, str]:
    """POST the voice webhook to `node`, signed like Twilio; (the TwiML stream URL or None if busy, token)."""
    url = node.base + VOICE_PATH
    params = {"CallSid": call_sid, "AccountSid": "AC" + "0" * 32, "From": "+15550001", "To": "+15550002"}
    headers = {"X-Twilio-Signature": RequestValidator(token).compute_signature(url, params)}
    async with http.post(url, data=params, headers=headers) as r:
        assert r.status == 200, await r.text()
        twiml = await r.text()
    if "<Reject" in twiml:  # busy everywhere
        return None, ""
    stream = parse_connect_stream(twiml)
    return stream.url, stream.parameters["token"]


async def node_free(raw: aioredis.Redis, prefix: str, node_id: str) -> int | None:
    free = await raw.hget(f"{prefix}node:{node_id}", "free")
    return None if free is None else int(free)


async def test_two_service_processes_share_one_redis(
    tiny_checkpoint: Path, question_wav: Path, prefix: str, raw: aioredis.Redis, tmp_path: Path
) -> None:
    token = uuid.uuid4().hex
    a = start_node("node-a", 1, tiny_checkpoint, prefix, token, tmp_path, "--no-engine-process")  # both kinds
    b = start_node("node-b", 2, tiny_checkpoint, prefix, token, tmp_path)  # of engine: serve's default, its own process
    sids: list[str] = []
    tasks: list[asyncio.Task[CallReport]] = []

    def call(ws_url: str, via: Node, sid: str, hold_after: float) -> asyncio.Task[CallReport]:
        # The simulated caller posts the webhook again (a Twilio retry: same reservation), then streams.
        tasks.append(asyncio.create_task(simulate_call(
            ws_url, question_wav, auth_token=token, public_url=via.base, voice_url=via.base + VOICE_PATH,
            custom_sid=sid, hold_after=hold_after,
        )))
        return tasks[-1]

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for node in (a, b):
                await until(lambda n=node: _is(readyz(http, n), 200), f"{node.node_id} ready", 120, every=0.5)
            await until(lambda: _all_free(raw, prefix, {a.node_id: 1, b.node_id: 2}), "both nodes published")

            # Webhooks on a: a first (it has room), then b (a is full), then busy.
            sids += [new_call_sid() for _ in range(4)]
            routed = [await answer(http, a, token, sid) for sid in sids]
            want = [stream_url_for(n.ws_url, sid) for n, sid in zip((a, b, b), sids, strict=False)] + [None]
            assert [url for url, _ in routed] == want  # each call's own URL, on the node reserved
            calls = [call(url, a, sid, 0.5) for (url, _), sid in zip(routed[:3], sids, strict=False)]
            reports = await asyncio.wait_for(asyncio.gather(*calls), 60)
            for report, (_, tok) in zip(reports, routed, strict=False):
                assert report.outcome == "completed", report.errors
                assert report.custom_parameters["token"] == tok  # the retried webhook got the same reservation
                assert report.bot_seconds_received > 0
            # One call store for both nodes: b's record of a call a answered.
            keys = [f"{p}call:{sids[1]}" for p in (prefix, "kame:")]  # the CLI may not pass the prefix on
            await until(lambda: _any_hget_is(raw, keys, "end_reason", "completed"), "b's call record")
            assert "node-b" in [await raw.hget(k, "node") for k in keys]

            # Drain b mid-call while it still has a free seat: it stops taking calls, finishes, exits 0.
            await until(lambda: _all_free(raw, prefix, {a.node_id: 1, b.node_id: 2}), "seats published again")
            sids += [new_call_sid(), new_call_sid()]
            on_b, _ = await answer(http, b, token, sids[4])
            on_a, _ = await answer(http, a, token, sids[5])
            assert (on_b, on_a) == (stream_url_for(b.ws_url, sids[4]), stream_url_for(a.ws_url, sids[5]))  # its own
            calls = [call(on_b, b, sids[4], 4.0), call(on_a, a, sids[5], 4.0)]
            for sid in sids[4:6]:
                await until(lambda s=sid: _hget_is(raw, f"{prefix}resv:{s}", "state", "claimed"), "streaming")
            await until(lambda: _all_free(raw, prefix, {a.node_id: 0, b.node_id: 1}), "b has a seat left")
            b.proc.send_signal(signal.SIGTERM)
            await until(lambda: _is(readyz(http, b), 503), "b not ready while draining", 5)
            await until(lambda: _hget_is(raw, f"{prefix}node:node-b", "draining", "1"), "b draining in Redis", 5)
            sids.append(new_call_sid())
            assert (await answer(http, a, token, sids[6]))[0] is None  # a is full and b takes nothing new
            assert b.proc.poll() is None  # b is still finishing its call
            reports = await asyncio.wait_for(asyncio.gather(*calls), 60)
            assert [r.outcome for r in reports] == ["completed", "completed"], [r.errors for r in reports]
            assert not reports[0].server_hung_up  # the caller hung up, not the draining node
            assert await asyncio.wait_for(asyncio.to_thread(b.proc.wait), 30) == 0
            assert await raw.zrange(f"{prefix}nodes", 0, -1) == ["node-a"]  # b left the cluster on exit
            a.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(asyncio.to_thread(a.proc.wait), 30) == 0
    finally:
        for task in tasks:
            task.cancel()
        for node in (a, b):
            if node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(10)
            print(f"---- {node.node_id} (exit {node.proc.returncode}) ----")
            print(node.log.read_text(errors="replace")[-6000:])
        for sid in sids:  # the call store's keys (its prefix is not configurable from the CLI)
            keys = [k async for k in raw.scan_iter(match=f"kame:call:{sid}*")]
            if keys:
                await raw.delete(*keys)
            await raw.zrem("kame:calls", sid)


async def _is(status: Awaitable[int], expected: int) -> bool:
    return await status == expected


async def _hget_is(raw: aioredis.Redis, key: str, field: str, value: str) -> bool:
    return await raw.hget(key, field) == value


async def _any_hget_is(raw: aioredis.Redis, keys: list[str], field: str, value: str) -> bool:
    return any([await raw.hget(key, field) == value for key in keys])


async def _all_free(raw: aioredis.Redis, prefix: str, expected: dict[str, int]) -> bool:
    return all([await node_free(raw, prefix, node_id) == free for node_id, free in expected.items()])


async def test_serve_under_a_live_nodes_id_exits_2_and_leaves_it_serving(
    tiny_checkpoint: Path, question_wav: Path, prefix: str, raw: aioredis.Redis, tmp_path: Path
) -> None:
    """`serve` started with the KAME_NODE_ID of a live node (a copied .env, two replicas on one hostname) says
    so in one line and exits 2, before loading a model; the live node's call goes on to its end."""
    token = uuid.uuid4().hex
    a = start_node("node-same", 1, tiny_checkpoint, prefix, token, tmp_path, "--no-engine-process")
    twin: Node | None = None
    sid = new_call_sid()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            await until(lambda: _is(readyz(http, a), 200), "a ready", 120, every=0.5)
            url, _ = await answer(http, a, token, sid)
            assert url is not None
            call = asyncio.create_task(simulate_call(
                url, question_wav, auth_token=token, public_url=a.base, voice_url=a.base + VOICE_PATH,
                custom_sid=sid, hold_after=1.0))  # fmt: skip
            await until(lambda: _hget_is(raw, f"{prefix}resv:{sid}", "state", "claimed"), "streaming")
            twin_dir = tmp_path / "twin"
            twin_dir.mkdir()
            twin = start_node("node-same", 1, tiny_checkpoint, prefix, token, twin_dir)
            assert await asyncio.wait_for(asyncio.to_thread(twin.proc.wait), 60) == 2
            assert "node id 'node-same' is in use by a live node" in twin.log.read_text()
            report = await asyncio.wait_for(call, 60)
            assert report.outcome == "completed" and report.bot_seconds_received > 0, report.errors
            assert await readyz(http, a) == 200
            keys = [f"{p}call:{sid}" for p in (prefix, "kame:")]
            await until(lambda: _any_hget_is(raw, keys, "end_reason", "completed"), "the call's own end")
    finally:
        for node in (a, twin):
            if node is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(10)
        keys = [k async for k in raw.scan_iter(match=f"kame:call:{sid}*")]
        if keys:
            await raw.delete(*keys)
        await raw.zrem("kame:calls", sid)


async def test_nodes_behind_one_url_take_each_others_streams(prefix: str, raw: aioredis.Redis) -> None:
    """Two nodes behind one public host name (an old and a new pod in a rolling update, one Ingress): the
    webhook reserves on one, the load balancer sends the stream to either. It used to be refused on the
    other (bad_token: the caller heard the fallback apology); the seat now moves to where the stream is."""
    shared = f"wss://phone.example.com{MEDIA_PATH}"
    free = {"a": 2, "b": 2}
    a, b, c = (RedisCluster(client(), name, shared if name != "c" else f"wss://c.example.com{MEDIA_PATH}",
                            (lambda n=name: free.get(n, 2)), key_prefix=prefix, heartbeat_s=0.1, node_ttl_s=0.6)
               for name in ("a", "b", "c"))
    try:
        for node in (a, b, c):
            await node.start()
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "a" and r.stream_url == stream_url_for(shared, sid)
        assert not await c.claim(sid, r.token)  # a node at another URL: still the wrong node
        assert not await b.claim(sid, "x" * len(r.token))  # the token still counts
        assert await b.claim(sid, r.token)
        assert await raw.hget(f"{prefix}resv:{sid}", "node") == "b"
        assert await raw.zscore(f"{prefix}node:a:resv", sid) is None  # a's seat is free again
        assert await raw.zscore(f"{prefix}node:b:held", sid) is not None  # b's is taken
        for node in (a, b):  # single-use, wherever the replay lands
            assert not await node.claim(sid, r.token)
        await b.release(sid)
        assert await raw.hget(f"{prefix}resv:{sid}", "state") == "ended"

        free["b"] = 1  # b's one seat is promised to a call b reserved itself: not to be taken over
        own = new_call_sid()
        mine = await b.reserve(own)
        assert mine is not None and mine.node_id == "b"
        sid = new_call_sid()
        r = await a.reserve(sid)
        assert r is not None and r.node_id == "a"
        assert not await b.claim(sid, r.token)
        assert await b.claim(own, mine.token)  # the caller promised b's seat gets it
        assert await a.claim(sid, r.token)  # and the other still reaches its own node

        # A draining node (the old pod of a rolling update) takes no reservation but still takes over a
        # stream the load balancer sends it, on a seat its engine really has free.
        d = RedisCluster(client(), "d", shared, lambda: 0, key_prefix=prefix, heartbeat_s=0.1, node_ttl_s=0.6,
                         seats_fn=lambda: 1)
        await d.start()
        try:
            sid = new_call_sid()
            r = await a.reserve(sid)
            assert r is not None and r.node_id == "a"
            assert await d.claim(sid, r.token)
        finally:
            await d.aclose()
    finally:
        for node in (a, b, c):
            await node.aclose()


async def test_the_final_call_status_leaves_a_streaming_call_to_its_node_or_the_sweep(prefix: str) -> None:
    """The status callback (which may land on any node) ended a call streaming on a node whose heartbeat had
    lapsed (3 s) as node_lost at once: a node whose heartbeats only paused (a partition from Redis) then had its
    finished calls recorded as lost and counted twice with its own end (review, session 28). It leaves them
    now, live node or not: a node that is really gone has its calls ended by the lost-call sweep, once
    confirmed. The check reads the record's state and node only, never the whole record (every turn of a long
    call)."""
    token = "t" * 32
    store = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")
    config = ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token, redis_url=REDIS_URL, redis_prefix=prefix,
                           node_id="here", heartbeat_s=0.1, node_ttl_s=0.6)  # fmt: skip
    ctx = ServerContext(config, store)
    ctx.cluster = open_cluster(config, lambda: 0, "ws://127.0.0.1/here" + MEDIA_PATH)
    handle = await ServiceHandle(ctx).start()
    await ctx.cluster.start()
    lost, live, ours = new_call_sid(), new_call_sid(), new_call_sid()

    async def whole_record(_: str) -> None:
        raise AssertionError("the status callback read the whole record")

    try:
        async with nodes(prefix, {"alive": 1}):
            writer = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")  # the nodes' own stores
            for sid, node in ((lost, "crashed"), (live, "alive"), (ours, "here")):
                await writer.create(CallRecord(call_sid=sid, node=node, agent="default"))
                await writer.update(sid, state="streaming")
                await writer.append_turn(sid, "caller", "hello")
            await writer.aclose()
            store.get = whole_record  # type: ignore[method-assign]
            before = metric("kame_calls_total", outcome="node_lost")
            url = handle.http_url + CALL_STATUS_PATH
            async with aiohttp.ClientSession() as http:
                for sid in (lost, live, ours):
                    form = {"CallSid": sid, "CallStatus": "completed"}
                    signed = {"X-Twilio-Signature": RequestValidator(token).compute_signature(url, form)}
                    async with http.post(url, data=form, headers=signed) as r:
                        assert r.status == 204
            await store.flush()
            del store.get  # type: ignore[method-assign]
            records = {sid: await store.get(sid) for sid in (lost, live, ours)}
            assert metric("kame_calls_total", outcome="node_lost") == before
            sweep = LostCallSweep(store, ctx.cluster, "here", confirm_s=0.0)  # the sweep ends the gone node's
            await sweep.sweep()
            assert await sweep.sweep() == 1
            await store.flush()
            swept = await store.get(lost)
    finally:
        await ctx.cluster.aclose()
        await handle.aclose()
        await store.aclose()
    got = {sid: (r.state, r.end_reason) for sid, r in records.items() if r is not None}
    assert got == {lost: ("streaming", None), live: ("streaming", None), ours: ("streaming", None)}
    assert swept is not None and (swept.state, swept.end_reason) == ("ended", "node_lost")
    assert metric("kame_calls_total", outcome="node_lost") == before + 1


async def test_the_sweep_ends_calls_left_streaming_by_a_node_that_is_gone(prefix: str) -> None:
    """An AudioSocket call has no status callback, and a Twilio call's may come before the crashed node's
    heartbeat expired: a node that crashed mid-call left such records "streaming" until they expired (24 h).
    Now every node sweeps the calls streaming and ends, once, those of either carrier on a node found gone on
    two sweeps in a row, `confirm_s` apart (node_lost). An AudioSocket-only node, out of Twilio's routing,
    still heartbeats: its calls are left alone."""
    store = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")

    def node(name: str, free: int, routable: bool) -> RedisCluster:
        return RedisCluster(client(), name, f"ws://127.0.0.1/{name}{MEDIA_PATH}", lambda: free, key_prefix=prefix,
                            heartbeat_s=0.1, node_ttl_s=0.6, routable=routable)  # fmt: skip

    async def crashed_is_gone() -> bool:
        return await here.node_alive("crashed") is False

    here, pbx, crashed = node("here", 1, True), node("pbx", 5, False), node("crashed", 5, False)
    lost, live, ours = (call_id_for(uuid.uuid4()) for _ in range(3))
    twilio = new_call_sid()
    try:
        for c in (here, pbx, crashed):
            await c.start()
        assert await here.node_alive("pbx") and await here.node_alive("crashed")
        assert where(await reserve_many(here, 2)) == ["here", None]  # never routed to the AudioSocket-only nodes
        writer = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")  # the nodes' own stores
        for sid, node in ((lost, "crashed"), (live, "pbx"), (ours, "here"), (twilio, "crashed")):
            await writer.create(CallRecord(call_sid=sid, node=node, agent="default"))
            await writer.update(sid, state="streaming")
        await writer.aclose()
        assert crashed._task is not None
        crashed._task.cancel()  # it crashed: no more heartbeats, nothing ended
        await until(crashed_is_gone, "the crashed node's heartbeat expires")
        sweeps = [LostCallSweep(store, here, "here", confirm_s=0), LostCallSweep(store, pbx, "pbx", confirm_s=0)]
        before = metric("kame_calls_total", outcome="node_lost")
        assert [await s.sweep() for s in sweeps] == [0, 0]  # gone once: maybe only a pause in its heartbeats
        assert sorted([await s.sweep() for s in sweeps]) == [0, 2]  # gone twice: ended by one node, once
        await store.flush()
        records = {sid: await store.get(sid) for sid in (lost, live, ours, twilio)}
    finally:
        for c in (here, pbx):
            await c.aclose()
        await crashed._redis.aclose()
        await store.aclose()
    got = {sid: (r.state, r.end_reason) for sid, r in records.items() if r is not None}
    assert got == {lost: ("ended", "node_lost"), live: ("streaming", None), ours: ("streaming", None),
                   twilio: ("ended", "node_lost")}  # fmt: skip
    assert metric("kame_calls_total", outcome="node_lost") == before + 2


async def test_a_node_is_gone_only_after_confirm_s_of_sweeps_and_keeps_calls_it_is_back_for(prefix: str) -> None:
    """A node whose heartbeats paused for a few seconds (a partition from Redis, Redis at maxclients, a stalled
    process) was taken for gone on two sweeps 5 s apart, and its live calls ended as node_lost (then counted
    again by the node itself). Now it must be found gone on every sweep for `confirm_s` (30 s): seen alive in
    between, the clock starts over. A node back under its id in the meantime keeps its calls: the ending
    script checks its heartbeat keys (review, session 22)."""
    store = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")
    now = [0.0]

    def node(name: str) -> RedisCluster:
        return RedisCluster(client(), name, f"ws://127.0.0.1/{name}{MEDIA_PATH}", lambda: 1, key_prefix=prefix,
                            heartbeat_s=0.1, node_ttl_s=0.6, routable=False)  # fmt: skip

    here, paused = node("here"), node("paused")
    call = call_id_for(uuid.uuid4())
    sweep = LostCallSweep(store, here, "here", confirm_s=30.0, clock=lambda: now[0])

    async def alive(want: bool) -> bool:
        return await here.node_alive("paused") is want

    try:
        await here.start()
        await paused.start()
        writer = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")
        await writer.create(CallRecord(call_sid=call, node="paused", agent="default"))
        await writer.update(call, state="streaming")
        await writer.aclose()
        assert paused._task is not None
        paused._task.cancel()  # its heartbeats pause
        await until(lambda: alive(False), "the paused node's heartbeat expires")
        for t in (0.0, 5.0, 10.0, 29.0):
            now[0] = t
            assert await sweep.sweep() == 0  # gone, but not for 30 s yet
        await paused.start()  # back (a restart under its id, or the pause over)
        await until(lambda: alive(True), "the node heartbeats again")
        now[0] = 31.0
        assert await sweep.sweep() == 0 and sweep._gone == {}  # alive: the clock starts over
        # Found gone, then back before the call is ended: the script sees its heartbeat and leaves the call.
        assert not await store.end_lost(call, "paused", "node_lost", here.heartbeat_keys("paused"))
        paused._task.cancel()
        await until(lambda: alive(False), "the paused node's heartbeat expires again")
        for t, ended in ((40.0, 0), (50.0, 0), (69.0, 0), (70.0, 1)):
            now[0] = t
            assert await sweep.sweep() == ended, t
        await store.flush()
        record = await store.get(call)
    finally:
        await here.aclose()
        await paused._redis.aclose()
        await store.aclose()
    assert record is not None and (record.state, record.end_reason) == ("ended", "node_lost")


async def test_the_node_that_answered_a_calls_webhook_ends_it_when_the_node_streaming_it_is_gone(prefix: str) -> None:
    """Node A answered the webhook (its store wrote the record) and sent the stream to B, which crashed. A's
    sweep refused every call its store had written, as if they were its own: in a cluster of two, such calls
    stayed "streaming" for a day, never counted (review, session 30)."""
    store_a = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")
    store_b = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")

    def node(name: str) -> RedisCluster:
        return RedisCluster(client(), name, f"ws://127.0.0.1/{name}{MEDIA_PATH}", lambda: 1, key_prefix=prefix,
                            heartbeat_s=0.1, node_ttl_s=0.6, routable=False)  # fmt: skip

    a, b = node("A"), node("B")
    call = call_id_for(uuid.uuid4())
    sweep = LostCallSweep(store_a, a, "A", confirm_s=0.0)
    try:
        await a.start()
        await b.start()
        await store_a.create(CallRecord(call_sid=call, node="B", agent="default"))  # the webhook, on A
        await store_a.flush()
        store_b.adopt(call)  # the stream, on B
        await store_b.update(call, state="streaming", node="B", stream_sid="MZ" + "1" * 32)
        await store_b.flush()
        assert b._task is not None
        b._task.cancel()  # B crashes
        await until(lambda: _is_gone(a, "B"), "B's heartbeat expires")
        ended = [await sweep.sweep() for _ in range(2)]
        record = await store_a.get(call)
    finally:
        await a.aclose()
        await b._redis.aclose()
        await store_a.aclose()
        await store_b.aclose()
    assert sum(ended) == 1 and record is not None and (record.state, record.end_reason) == ("ended", "node_lost")


async def _is_gone(cluster: RedisCluster, node: str) -> bool:
    return await cluster.node_alive(node) is False


async def test_a_sweep_whose_cluster_cannot_reach_redis_ends_nothing(prefix: str) -> None:
    """Whether a node is gone is unknown while this node's cluster client fails (node_alive None): its calls are
    left alone however many sweeps run, not taken for gone (the store, on another client, still answers)."""
    from .redis_support import free_port

    store = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")
    blind = RedisCluster(client(f"redis://127.0.0.1:{free_port()}/0"), "here", "ws://127.0.0.1/here" + MEDIA_PATH,
                         lambda: 1, key_prefix=prefix)  # fmt: skip
    call = call_id_for(uuid.uuid4())
    try:
        writer = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")
        await writer.create(CallRecord(call_sid=call, node="elsewhere", agent="default"))
        await writer.update(call, state="streaming")
        await writer.aclose()
        sweep = LostCallSweep(store, blind, "here", confirm_s=0)
        assert [await sweep.sweep() for _ in range(3)] == [0, 0, 0]
        record = await store.get(call)
    finally:
        await blind._redis.aclose()
        await store.aclose()
    assert record is not None and record.state == "streaming"


async def test_a_live_node_prunes_its_own_set_of_names_whose_record_went(prefix: str, raw: aioredis.Redis) -> None:
    """A busy node's set of calls streaming never expires (each call's writes refresh it): a name whose record
    went without its end (evicted, a dropped write) stayed in it for good. The sweep reads the node's own set now
    and then, which prunes it; a live call stays."""
    store = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")
    here = LocalCluster("here", "ws://127.0.0.1/here", lambda: 1)
    live, evicted = call_id_for(uuid.uuid4()), call_id_for(uuid.uuid4())
    try:
        for sid in (live, evicted):
            await store.create(CallRecord(call_sid=sid, node="here", agent="default"))
            await store.update(sid, state="streaming")
        await store.flush()
        own = store._streaming_key + ":here"  # type: ignore[attr-defined]
        assert await raw.smembers(own) == {live, evicted}
        await raw.delete(store._call_keys(evicted)[0])  # type: ignore[attr-defined]  (evicted, no end)
        await LostCallSweep(store, here, "here", live=lambda: {live}).prune_own()
        assert await raw.smembers(own) == {live}
    finally:
        await store.aclose()


async def test_a_node_restarted_under_its_id_ends_the_calls_its_last_run_left_streaming(prefix: str) -> None:
    """A container restarted keeps its hostname, the default node id: it heartbeats again before any other
    node sees it gone, so nobody ended the calls its last run left "streaming", of either carrier (24 h in
    the records and on the dashboards). The restarted node ends them as it starts; a call live here, one of
    this run that has just hung up (out of the live calls, its own `end` still queued), and another node's are
    left alone."""
    store = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")
    again = RedisCluster(client(), "again", "ws://127.0.0.1/again" + MEDIA_PATH, lambda: 1, key_prefix=prefix,
                         heartbeat_s=0.1, node_ttl_s=0.6)  # fmt: skip
    left_as, left_twilio, live, other = call_id_for(uuid.uuid4()), new_call_sid(), new_call_sid(), new_call_sid()
    sweep = LostCallSweep(store, again, "again", every_s=3600, live=lambda: {live})
    try:
        await again.start()
        last_run = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")  # the node's last run (and another)
        for sid, node in ((left_as, "again"), (left_twilio, "again"), (live, "again"), (other, "elsewhere")):
            await last_run.create(CallRecord(call_sid=sid, node=node, agent="default"))
            await last_run.update(sid, state="streaming")
        await last_run.aclose()
        hung_up = new_call_sid()  # this run's: written by this run's store
        await store.create(CallRecord(call_sid=hung_up, node="again", agent="default"))
        await store.update(hung_up, state="streaming")
        await store.flush()
        before = metric("kame_calls_total", outcome="node_lost")
        sweep.start()  # as run_service does: the pass runs first, the sweeps every_s after

        async def ended() -> bool:
            return metric("kame_calls_total", outcome="node_lost") == before + 2

        await until(ended, "the restarted node ends its last run's calls")
        await store.flush()
        records = {sid: await store.get(sid) for sid in (left_as, left_twilio, live, other, hung_up)}
        assert await sweep.end_own_leftovers() == 0  # once ended, never again
    finally:
        await sweep.aclose()
        await again.aclose()
        await store.aclose()
    got = {sid: (r.state, r.end_reason) for sid, r in records.items() if r is not None}
    assert got == {left_as: ("ended", "node_lost"), left_twilio: ("ended", "node_lost"), live: ("streaming", None),
                   other: ("streaming", None), hung_up: ("streaming", None)}  # fmt: skip


@pytest.mark.parametrize("routable", [True, False])
async def test_a_second_node_with_a_live_nodes_id_is_refused_and_a_restart_is_not(
    prefix: str, raw: aioredis.Redis, routable: bool
) -> None:
    """Two nodes under one id (replicas sharing a hostname or a KAME_NODE_ID): the second one's start ended the
    first one's live calls as its own last run's leftovers, and both published seats under one key. A live
    node renews its keys, so the second start is refused; a dead last run's keys only age, so a restart (the
    container restarted with its hostname) starts after watching a beat and a half, and a clean one at once."""
    url = "ws://127.0.0.1/dup" + MEDIA_PATH

    def node() -> RedisCluster:
        return RedisCluster(client(), "dup", url, lambda: 2, key_prefix=prefix, heartbeat_s=0.1, node_ttl_s=0.6,
                            routable=routable)  # fmt: skip

    first = node()
    await first.start()
    try:
        with pytest.raises(NodeIdInUse, match="'dup' is in use by a live node"):
            await node().start()
        await asyncio.sleep(0.3)
        key = f"{prefix}node:dup" if routable else f"{prefix}alive:dup"
        assert await raw.pttl(key) > 300  # still beating: the refused start changed nothing of the first's
        if routable:
            assert (await first.reserve(new_call_sid())) is not None
    finally:
        first._closing = True  # dies without closing: its keys stay until they expire
        first._poke.set()
        if first._task is not None:
            await first._task
        await first._redis.aclose()
    restarted = node()
    t0 = time.monotonic()
    await restarted.start()  # the last run's keys still there, not renewed: started after watching
    assert 0.14 <= time.monotonic() - t0 < 1.0
    await restarted.aclose()
    again = node()
    t0 = time.monotonic()
    await again.start()  # closed cleanly: nothing to watch
    assert time.monotonic() - t0 < 0.14
    await again.aclose()


async def test_a_node_whose_own_engine_falls_behind_stays_in_rotation_to_answer_busy(
    prefix: str, tiny_checkpoint: Path
) -> None:
    """ops/k8s runs one replica. Its engine a few seconds behind its ticks (or its STT's process restarting),
    the node left rotation: the load balancer had no endpoint, and Twilio got its 503 for every webhook and for
    the media upgrade of a call answered a moment before. With a cluster to route through it stays ready (the
    engine's state is still reported) and answers busy; a dead engine still takes it out."""
    from .phone_fixtures import running_phone

    async with running_phone(tiny_checkpoint, max_calls=2, redis_url=REDIS_URL, redis_prefix=prefix,
                             node_id="solo", heartbeat_s=0.1, node_ttl_s=0.6) as phone:  # fmt: skip
        ctx = phone.ctx
        ctx.cluster = open_cluster(ctx.config, ctx.free_slots, phone.base.replace("http://", "ws://") + MEDIA_PATH)
        await ctx.cluster.start()
        try:
            stats, now = phone.engine.frame_loop.stats, time.monotonic()
            for i in range(25):  # the last 2 s as a starved loop reports them: every tick past its frame
                stats.record_tick(0.12, True, now=now - 1.9 + i * 0.076)
            async with aiohttp.ClientSession() as http:
                async with http.get(phone.base + "/readyz") as r:
                    body = await r.json()
                    assert r.status == 200 and body["checks"]["model_loaded"] is False, body
                    assert body["capacity_left"] == 0
                url = phone.base + VOICE_PATH
                form = {"CallSid": new_call_sid(), "AccountSid": "AC" + "0" * 32, "From": "+15550001",
                        "To": "+15550002"}  # fmt: skip
                async with http.post(url, data=form, headers={"X-Twilio-Signature": phone.sign(url, form)}) as r:
                    assert r.status == 200 and 'reason="busy"' in await r.text()
                ctx.config = replace(ctx.config, redis_url=None)  # no cluster to route through: out, as before
                async with http.get(phone.base + "/readyz") as r:
                    assert r.status == 503
        finally:
            await ctx.cluster.aclose()


async def test_an_edge_whose_shared_engine_is_down_stays_in_rotation_to_answer_busy(prefix: str) -> None:
    """The split layout: every edge shares one engine-serve, so all lose it at once (a drain, a crash, a
    restart). Not ready, each left the load balancer without endpoints, and Twilio got its 503 for every
    webhook ("an application error has occurred") instead of the agent's busy answer. With a cluster to route
    through, an edge whose link is down stays ready (the model's state is still reported) and answers."""
    token = "t" * 32
    config = ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token, redis_url=REDIS_URL, redis_prefix=prefix,
                           node_id="edge", heartbeat_s=0.1, node_ttl_s=0.6)  # fmt: skip
    store = open_call_store(REDIS_URL, key_prefix=prefix + "calls:")
    ctx = ServerContext(config, store)  # no engine: its link is down
    ctx.remote_engine = True
    ctx.cluster = open_cluster(config, ctx.free_slots, "ws://127.0.0.1/edge" + MEDIA_PATH)
    handle = await ServiceHandle(ctx).start()
    await ctx.cluster.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(handle.http_url + "/readyz") as r:
                body = await r.json()
                assert r.status == 200 and body["checks"]["model_loaded"] is False, body
            url = handle.http_url + VOICE_PATH
            form = {"CallSid": new_call_sid(), "AccountSid": "AC" + "0" * 32, "From": "+15550001", "To": "+15550002"}
            signed = {"X-Twilio-Signature": RequestValidator(token).compute_signature(url, form)}
            async with http.post(url, data=form, headers=signed) as r:
                assert r.status == 200 and 'reason="busy"' in await r.text()  # the agent's busy answer
            ctx.remote_engine = False  # a node with its own engine (or no cluster): out of rotation, as before
            async with http.get(handle.http_url + "/readyz") as r:
                assert r.status == 503
            ctx.remote_engine, ctx.draining = True, True  # a draining edge leaves rotation all the same
            async with http.get(handle.http_url + "/readyz") as r:
                assert r.status == 503
    finally:
        await ctx.cluster.aclose()
        await handle.aclose()
        await store.aclose()


async def test_a_seat_taken_without_a_reservation_is_published_at_once(prefix: str, raw: aioredis.Redis) -> None:
    """An AudioSocket call takes a seat on the node Asterisk reached, with no reservation: until the next
    heartbeat the other nodes would still route a Twilio call to that seat (its stream then refused,
    engine_full). `seat_taken()` publishes the node's room at once."""
    free = {"a": 1, "b": 0}
    async with nodes(prefix, free, heartbeat_s=30.0, node_ttl_s=60.0) as n:
        free["a"] = 0  # the AudioSocket call's seat
        n["a"].seat_taken()
        await until(lambda: raw.hget(f"{prefix}node:a", "free"), within=5)  # published once at start
        await until(lambda: _is(raw.hget(f"{prefix}node:a", "free"), "0"), "a's room published", within=2)
        assert await n["b"].reserve(new_call_sid()) is None  # one Redis round trip, not a heartbeat (30 s)


async def _is(value: Awaitable[str | None], expected: str) -> bool:
    return await value == expected
