"""The call store under faults (issue 13, findings 4 and 5), through the real service on loopback: a Redis that
restarts empty mid-call, and a stream flooding the store with writes beside a good call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from kame_phone.media_bench import LoopbackEngine
from telephony.call_store import CallRecord, RedisCallStore, open_call_store
from telephony.config import ServiceConfig
from telephony.server import MEDIA_PATH, ServerContext, ServiceHandle
from telephony.sim_caller import simulate_call

from .link_fixtures import TOKEN, tone
from .phone_fixtures import metric, new_call_sid
from .polling import until
from .redis_support import RedisServer, SlowProxy, free_port

ADMIN = "faults-admin"


@pytest.fixture
async def redis_server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    await server.start()
    yield server
    await server.kill()


async def _service(store: RedisCallStore) -> tuple[ServiceHandle, str]:
    port = free_port()
    config = ServiceConfig(host="127.0.0.1", port=port, twilio_auth_token=TOKEN, admin_token=ADMIN)
    handle = await ServiceHandle(ServerContext(config, store, LoopbackEngine(max_calls=4))).start()
    return handle, f"http://127.0.0.1:{port}"


async def _admin_record(base: str, sid: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(
        f"{base}/calls/{sid}", headers={"Authorization": f"Bearer {ADMIN}"}
    ) as resp:
        return resp.status, await resp.json() if resp.status == 200 else {}


async def _redis_record(url: str, sid: str) -> CallRecord | None:
    """What Redis itself holds (a fresh store: nothing of ours pending to merge in)."""
    fresh = open_call_store(url)
    try:
        return await fresh.get(sid)
    finally:
        await fresh.aclose()


async def test_a_redis_that_restarts_empty_mid_call_gets_the_live_calls_record_back_whole(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    store = open_call_store(redis_server.url, socket_timeout_s=0.5, retry_max_s=0.2)
    assert isinstance(store, RedisCallStore)
    handle, base = await _service(store)
    restored = metric("kame_call_store_restored_records_total")
    unapplied = metric("kame_call_store_unapplied_ops_total")
    sid = new_call_sid()
    ws_url = base.replace("http://", "ws://") + MEDIA_PATH
    try:
        call = asyncio.create_task(simulate_call(
            ws_url, tone(600.0, 5.0), auth_token=TOKEN, public_url=base, custom_sid=sid,
            dtmf=[("1", 0.5), ("2", 4.0)], hold_after=0.5,
        ))  # fmt: skip
        for _ in range(100):  # the stream is up and its first digit is in Redis
            record = await _redis_record(redis_server.url, sid)
            if record is not None and record.dtmf == ["1"] and record.first_audio_s is not None:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the call never reached Redis")
        await redis_server.restart_empty()  # no AOF, no RDB: everything is gone
        assert await _redis_record(redis_server.url, sid) is None
        report = await call
        assert report.outcome == "completed", report.errors
        async with asyncio.timeout(10):
            await store.flush()
        status, got = await _admin_record(base, sid)
        assert status == 200, "the live call's record was lost with Redis"
        in_redis = await _redis_record(redis_server.url, sid)
        assert in_redis is not None and in_redis.to_dict() == got
        # Whole: what was written before the restart (at the webhook and the stream's start) and after it.
        assert got["from_number"] == "+15005550006" and got["to_number"] == "+15005550001"
        assert got["created_at"] and got["started_at"] and got["stream_sid"] == report.stream_sid
        assert got["dtmf"] == ["1", "2"]  # once each: the restore and the ops queued behind it do not repeat
        assert got["first_audio_s"] is not None
        assert got["state"] == "ended" and got["end_reason"] == "completed" and got["ended_at"]
        assert metric("kame_call_store_restored_records_total") == restored + 1
        assert metric("kame_call_store_unapplied_ops_total") == unapplied
    finally:
        await handle.aclose()
        await store.aclose()


async def test_a_call_adopted_from_another_node_is_read_in_the_background_and_given_back_whole(
    redis_server: RedisServer,
) -> None:
    """Node A took the webhook; node B carries the stream, behind a slow Redis (0.4 s a reply). B's adoption of
    the record must not hold up the call's start: adopt() returns at once and reads in the background. B's
    writes before, during and after that read all end up once in the copy it gives back to a Redis that
    restarted empty (it used to await the read, and to keep no copy when it had writes of its own pending)."""
    a = open_call_store(redis_server.url)
    proxy = SlowProxy(redis_server.port, 0.4)
    await proxy.start()
    b = open_call_store(proxy.url, socket_timeout_s=2.0, retry_max_s=0.2)
    assert isinstance(a, RedisCallStore) and isinstance(b, RedisCallStore)
    restored = metric("kame_call_store_restored_records_total")
    sid = new_call_sid()
    try:
        await a.create(CallRecord(call_sid=sid, state="ringing", from_number="+15005550006",
                                  to_number="+15005550001"))  # fmt: skip
        await a.append_dtmf(sid, "1")
        await a.flush()
        await b.append_dtmf(sid, "2")  # pending when the adoption begins: Redis may or may not have it yet
        assert b.adopt(sid) is None  # not a coroutine: nothing to await on the call's start
        await b.update(sid, state="streaming", stream_sid="MZadopted")
        await b.append_dtmf(sid, "3")
        await asyncio.sleep(0.2)  # the read is out
        await b.append_dtmf(sid, "4")
        await until(lambda: not b._adopt_tasks, "the adoption's read returned")
        async with asyncio.timeout(10):
            await b.flush()
        await redis_server.restart_empty()
        await b.append_dtmf(sid, "5")
        async with asyncio.timeout(10):
            await b.flush()
        got = await _redis_record(redis_server.url, sid)
        assert got is not None, "B kept no copy of the call it adopted"
        assert got.from_number == "+15005550006" and got.to_number == "+15005550001"  # A's, read by B
        assert got.state == "streaming" and got.stream_sid == "MZadopted"
        assert got.dtmf == ["1", "2", "3", "4", "5"]  # each once, in order
        assert metric("kame_call_store_restored_records_total") == restored + 1
    finally:
        await a.aclose()
        await b.aclose()
        await proxy.aclose()


async def test_writes_redis_refuses_for_a_while_wait_for_it_and_are_never_dropped(redis_server: RedisServer) -> None:
    """Redis short of its replicas (min-replicas-to-write, a partition) refuses every write with NOREPLICAS, as it
    does with MISCONF when its disk fails. Taken for a poison op, each write was logged and thrown away, the
    call's end with it (its record "streaming" for a day). They wait in the buffer and land once Redis heals."""
    store = open_call_store(redis_server.url, retry_max_s=0.2)
    raw = aioredis.Redis.from_url(redis_server.url)
    sid = new_call_sid()
    dropped = metric("kame_call_store_dropped_ops_total")
    try:
        await store.create(CallRecord(call_sid=sid, state="streaming"))
        await store.flush()
        await raw.config_set("min-replicas-to-write", "1")
        await store.append_turn(sid, "caller", "hello")
        await store.end(sid, "completed")
        await asyncio.sleep(1.0)  # several write attempts, each refused
        assert store.pending_ops == 2  # still held, not dropped
        await raw.config_set("min-replicas-to-write", "0")
        async with asyncio.timeout(10):
            await store.flush()
        got = await _redis_record(redis_server.url, sid)
        assert got is not None and got.state == "ended" and [t.text for t in got.turns] == ["hello"]
        assert metric("kame_call_store_dropped_ops_total") == dropped
    finally:
        await raw.aclose()
        await store.aclose()


async def test_a_long_outage_keeps_the_write_buffer_bounded(redis_server: RedisServer) -> None:
    """Redis refusing writes (its disk full: MISCONF) while calls go on writing: ops past the buffer's bound were
    marked dropped but kept, text and all, until the writer passed them, which in an outage it never does; the
    buffer grew with the outage until the process ran out of memory (review, session 26). Once Redis takes writes
    again, each call's record gets its start and its end."""
    store = open_call_store(redis_server.url, max_pending=50, retry_max_s=0.2)
    assert isinstance(store, RedisCallStore)
    raw = aioredis.Redis.from_url(redis_server.url)
    sids = [new_call_sid() for _ in range(20)]
    try:
        await raw.config_set("min-replicas-to-write", "1")  # every write refused, as with MISCONF
        for sid in sids:
            await store.create(CallRecord(call_sid=sid, state="streaming"))
        for i in range(5000):  # digits from every call, 25x the buffer
            await store.append_dtmf(sids[i % len(sids)], "5")
            assert len(store._pending) <= 2 * store.max_pending
        for sid in sids:
            await store.end(sid, "completed")
        assert store.pending_ops == store.max_pending
        await raw.config_set("min-replicas-to-write", "0")
        async with asyncio.timeout(10):
            await store.flush()
        for sid in sids:
            got = await _redis_record(redis_server.url, sid)
            assert got is not None and got.state == "ended" and got.end_reason == "completed", (sid, got)
    finally:
        await raw.aclose()
        await store.aclose()


async def test_an_op_for_a_call_redis_does_not_have_is_counted_not_silent(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A write for a call that is neither in Redis nor one of this node's live calls (it expired) cannot be
    applied: counted, and logged with the call id."""
    store = open_call_store(redis_server.url)
    unapplied = metric("kame_call_store_unapplied_ops_total")
    try:
        await store.append_dtmf("CA" + "0" * 32, "5")
        await store.flush()
    finally:
        await store.aclose()
    assert metric("kame_call_store_unapplied_ops_total") == unapplied + 1
    assert any("CA" + "0" * 32 in r.getMessage() and "not applied" in r.getMessage() for r in caplog.records)


async def test_a_stream_flooding_the_store_cannot_push_out_another_calls_writes(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """20k DTMF messages from one admitted stream, while Redis takes no writes. The stream's rate limit lets
    ~20 through (then ends it); a small buffer here makes even those overflow it: the flooding call loses
    its own writes, the good call beside it loses none."""
    store = open_call_store(redis_server.url, max_pending=16)
    assert isinstance(store, RedisCallStore)
    handle, base = await _service(store)
    ws_url = base.replace("http://", "ws://") + MEDIA_PATH
    good_sid, flood_sid = new_call_sid(), new_call_sid()
    dropped = metric("kame_call_store_dropped_ops_total")
    try:
        good = asyncio.create_task(simulate_call(
            ws_url, tone(500.0, 4.0), auth_token=TOKEN, public_url=base, custom_sid=good_sid,
            dtmf=[(d, 1.0 + 0.2 * i) for i, d in enumerate("12345")], hold_after=0.5,
        ))  # fmt: skip
        flood = asyncio.create_task(simulate_call(
            ws_url, tone(900.0, 3.0), auth_token=TOKEN, public_url=base, custom_sid=flood_sid,
            dtmf=[("9", 2.0 + i / 10_000) for i in range(20_000)], hold_after=0.5,
        ))  # fmt: skip
        # Redis takes no writes from 0.7 s to 3.7 s: the good call's digits (1.0-1.8 s) wait in the buffer
        # when the flood (2.0 s) overflows it.
        await asyncio.sleep(0.7)
        raw = aioredis.Redis.from_url(redis_server.url)
        await raw.execute_command("CLIENT", "PAUSE", 3000, "WRITE")
        await raw.aclose()
        reports = await asyncio.gather(good, flood)
        assert reports[0].outcome == "completed", reports[0].errors
        async with asyncio.timeout(20):
            await store.flush()
        got = await _redis_record(redis_server.url, good_sid)
        assert got is not None
        assert got.dtmf == list("12345")
        assert got.state == "ended" and got.end_reason == "completed" and got.first_audio_s is not None
        flooded = await _redis_record(redis_server.url, flood_sid)
        assert flooded is not None and flooded.state == "ended"  # its end is kept too
        assert metric("kame_call_store_dropped_ops_total") > dropped  # the flood did overflow the buffer
    finally:
        await handle.aclose()
        await store.aclose()


async def test_a_node_that_starts_before_its_redis_still_ends_its_last_runs_calls(redis_server: RedisServer) -> None:
    """The host rebooted: the node restarts under its id (its hostname) a moment before Redis is back. Its
    start-up pass over the calls its last run left streaming failed on Redis and never ran again; the other
    nodes see this id alive, so nobody ended them (24 h in the records). It is retried each sweep until it
    goes through."""
    from telephony.cluster import LocalCluster
    from telephony.lost_calls import LostCallSweep

    sid = "AS" + "7" * 32
    store = open_call_store(redis_server.url, socket_timeout_s=0.5, retry_max_s=0.2)
    sweep = LostCallSweep(store, LocalCluster("me", "ws://127.0.0.1/me", lambda: 1), "me", every_s=0.2)
    try:
        last_run = open_call_store(redis_server.url)
        await last_run.create(CallRecord(call_sid=sid, node="me", agent="default"))
        await last_run.update(sid, state="streaming")
        await last_run.aclose()
        await redis_server.kill()  # (append-only file, fsync always: nothing written is lost)
        before = metric("kame_calls_total", outcome="node_lost")
        sweep.start()
        await asyncio.sleep(0.6)  # the start-up pass and a sweep or two, on a Redis that is down
        assert not sweep._leftovers_done
        await redis_server.start()

        async def ended() -> bool:
            return metric("kame_calls_total", outcome="node_lost") == before + 1

        await until(ended, "the pass retried once Redis is back")
        record = await _redis_record(redis_server.url, sid)
        assert record is not None and (record.state, record.end_reason) == ("ended", "node_lost")
    finally:
        await sweep.aclose()
        await store.aclose()
