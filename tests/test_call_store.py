"""Call store against a real Redis (127.0.0.1:6379, or KAME_TEST_REDIS_URL) and in process.

The outage tests start their own redis-server on a free port, so they can kill and restart it.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
import weakref
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from telephony.call_store import (
    MAX_LIST_ITEMS,
    CallBrief,
    CallRecord,
    CallStore,
    CallStoreUnavailable,
    MemoryCallStore,
    OracleNote,
    RedisCallStore,
    Turn,
    _safe_url,
    open_call_store,
)

from .polling import until
from .redis_support import REDIS_URL, RedisServer, redis_errors

T0 = 1_700_000_000.0  # fixed epoch seconds, so records compare exactly
NONBLOCKING_S = 0.25  # generous for a loaded CI box; a write that waited on Redis takes >= 0.5 s here


@pytest.fixture
async def raw(prefix: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    await client.aclose()


def make_store(kind: str, prefix: str, url: str = REDIS_URL, **kw: object) -> CallStore:
    if kind == "memory":
        return MemoryCallStore(**kw)  # type: ignore[arg-type]
    return open_call_store(url, key_prefix=prefix, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=["memory", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


async def flushed(store: CallStore, within_s: float = 10.0) -> None:
    async with asyncio.timeout(within_s):
        await store.flush()


async def keys_under(raw: aioredis.Redis, prefix: str) -> list[str]:
    return sorted([k async for k in raw.scan_iter(match=prefix + "*")])


def new_call(sid: str, created_at: float = T0) -> CallRecord:
    return CallRecord(call_sid=sid, from_number="+15550001111", to_number="+15559990000", created_at=created_at)


async def test_record_lifecycle(kind: str, prefix: str) -> None:
    store = make_store(kind, prefix)
    await store.create(new_call("CA1"))
    await store.create(new_call("CA0", created_at=T0 - 60))
    await store.create(CallRecord(call_sid="CA1", from_number="+1999", created_at=T0 + 5))  # retry: ignored
    assert (await store.get("CA1")) == new_call("CA1")

    await store.update("CA1", state="streaming", stream_sid="MZ1", started_at=T0 + 1, node="gpu-a")
    await store.append_turn("CA1", "caller", "hello there", at=T0 + 2)
    await store.append_oracle("CA1", "Greet them back.", at=T0 + 2.5)
    await store.append_turn("CA1", "bot", "hi, how can I help?", at=T0 + 3)
    await store.append_dtmf("CA1", "4")
    await store.append_dtmf("CA1", "#")
    await store.add_latency("CA1", "first_audio", 0.42)
    await store.add_latency("CA1", "turn", 0.31)
    await store.add_latency("CA1", "turn", 0.27)
    await store.end("CA1", "caller_hangup — raccroché", at=T0 + 9)  # non-ASCII goes through Lua's cjson
    await store.end("CA1", "completed", at=T0 + 10)  # the status callback comes later: first end wins
    await store.append_turn("CA404", "caller", "no such call")  # a write to an unknown call is dropped

    expected = CallRecord(
        call_sid="CA1",
        stream_sid="MZ1",
        from_number="+15550001111",
        to_number="+15559990000",
        node="gpu-a",
        state="ended",
        created_at=T0,
        started_at=T0 + 1,
        ended_at=T0 + 9,
        end_reason="caller_hangup — raccroché",
        first_audio_s=0.42,
        dtmf=["4", "#"],
        turns=[Turn("caller", "hello there", T0 + 2), Turn("bot", "hi, how can I help?", T0 + 3)],
        oracle=[OracleNote("Greet them back.", T0 + 2.5)],
        turn_latencies_s=[0.31, 0.27],
    )
    # Read straight after the writes: for Redis most of them are still buffered and merged in.
    assert await store.get("CA1") == expected
    assert await store.get("CA404") is None
    assert [r.call_sid for r in await store.list_recent(10)] == ["CA1", "CA0"]
    assert CallRecord.from_json(expected.to_json()) == expected

    await flushed(store)
    if kind == "redis":  # a second instance has nothing buffered: this is what Redis holds
        other = make_store(kind, prefix)
        assert await other.get("CA1") == expected
        assert [r.call_sid for r in await other.list_recent(1)] == ["CA1"]
        await other.aclose()
    await store.aclose()


async def test_brief_reads_state_node_and_agent_with_our_unflushed_writes(kind: str, prefix: str) -> None:
    """The status callback's read: what `get` says of them, before and after the writes reach Redis."""
    store = make_store(kind, prefix)
    try:
        assert await store.brief("CA-none") is None
        await store.create(CallRecord(call_sid="CA-b", node="node-1", agent="sales"))
        await store.append_turn("CA-b", "caller", "hello")
        await store.update("CA-b", state="streaming")
        assert await store.brief("CA-b") == CallBrief("streaming", "node-1", "sales")  # maybe not flushed yet
        await flushed(store)
        await store.end("CA-b", "completed")
        assert await store.brief("CA-b") == CallBrief("ended", "node-1", "sales")
        await flushed(store)
        assert await store.brief("CA-b") == CallBrief("ended", "node-1", "sales")
    finally:
        await store.aclose()


async def test_a_call_id_is_claimed_once_across_nodes_and_never_over_a_record(kind: str, prefix: str) -> None:
    """AudioSocket's replay check: nodes offered the same id at the same moment, one wins; an id with a record
    (here unflushed, or in Redis) is never claimed; a claim given back (a busy answer) can be taken again."""
    a = make_store(kind, prefix)
    b = make_store(kind, prefix) if kind == "redis" else a  # memory: one node, one store
    try:
        if kind == "redis":  # two nodes, one Redis: one claim each, at once
            won = await asyncio.gather(*(s.claim("AS-race", n) for s, n in ((a, "node-a"), (b, "node-b"))))
            assert sorted(won) == [False, True]
        assert await a.claim("AS-free", "node-a")
        await a.release_claim("AS-free", "node-b")  # not node-b's to give back
        if kind == "redis":
            assert not await b.claim("AS-free", "node-b")
        await a.release_claim("AS-free", "node-a")
        assert await b.claim("AS-free", "node-b")

        await a.create(CallRecord(call_sid="AS-rec", node="node-a"))
        assert not await a.claim("AS-rec", "node-a")  # its own write, not flushed yet
        await flushed(a)
        assert not await b.claim("AS-rec", "node-b") and not await a.claim("AS-rec", "node-a")
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_claim_raises_unavailable_when_redis_is_down(server: RedisServer) -> None:
    store = open_call_store(server.url, socket_timeout_s=0.5, retry_max_s=0.2)
    try:
        assert await store.claim("AS-1", "node-a")
        await server.kill()
        errors = redis_errors()
        with pytest.raises(CallStoreUnavailable):
            await store.claim("AS-2", "node-a")
        await store.release_claim("AS-1", "node-a")  # logged and counted, never raised
        assert redis_errors() == errors + 2
    finally:
        store.close_timeout_s = 0.2  # type: ignore[attr-defined]
        await store.aclose()


async def test_each_nodes_streaming_calls_are_read_alone_and_end_lost_ends_each_once(kind: str, prefix: str) -> None:
    """The sweep of a crashed node's calls (lost_calls) reads which nodes have calls streaming, then one gone
    node's calls, without their lists: its cost grows with that node's calls, not the fleet's. end_lost ends a
    call at once (not through the write-behind queue), only while it still streams on that node, once however
    many nodes find it, and never a call the sweeping node's own store wrote (its own `end` is on its way).
    (One process, the memory store has no other node's calls: it has no such rule.)"""
    store = make_store(kind, prefix)  # the nodes that wrote the calls
    sweeper = store if kind == "memory" else make_store(kind, prefix)
    try:
        for sid, node in (("AS-a", "node-1"), ("AS-b", "node-2"), ("AS-c", "node-1"), ("AS-ringing", "node-1")):
            await store.create(CallRecord(call_sid=sid, node=node, agent="sales"))
            await store.append_turn(sid, "caller", "hello")
        for sid in ("AS-a", "AS-b", "AS-c"):
            await store.update(sid, state="streaming")
        await flushed(store)
        assert await sweeper.streaming_nodes() == {"node-1", "node-2"}
        assert await sweeper.streaming_on("node-1") == {"AS-a": CallBrief("streaming", "node-1", "sales"),
                                                        "AS-c": CallBrief("streaming", "node-1", "sales")}  # fmt: skip
        if kind == "redis":
            # A sweep of its own node's last run: a call this store wrote is this run's, left to its own end.
            assert not await store.end_lost("AS-a", "node-1", "node_lost", own_node=True)
        await store.update("AS-c", node="node-3")  # its stream moved (a node behind a shared URL took it)
        await store.end("AS-b", "completed")
        await flushed(store)
        assert list(await sweeper.streaming_on("node-1")) == ["AS-a"]
        assert await sweeper.streaming_on("node-2") == {}
        assert await sweeper.streaming_nodes() == {"node-1", "node-3"}  # node-2: none left, so not listed
        assert not await sweeper.end_lost("AS-b", "node-2", "node_lost")  # ended by its node: left as it is
        assert not await sweeper.end_lost("AS-c", "node-1", "node_lost")  # streaming, but on another node now
        assert await sweeper.end_lost("AS-a", "node-1", "node_lost")
        assert not await sweeper.end_lost("AS-a", "node-1", "node_lost")  # another node's sweep found it too
        assert await sweeper.brief("AS-a") == CallBrief("ended", "node-1", "sales")  # no flush needed
        assert await sweeper.streaming_on("node-1") == {}
        got = {sid: (r.state, r.end_reason) for sid in ("AS-a", "AS-b", "AS-c") if (r := await store.get(sid))}
        assert got == {"AS-a": ("ended", "node_lost"), "AS-b": ("ended", "completed"), "AS-c": ("streaming", None)}
        if kind == "redis":
            # Another node's call whose record this store wrote (its webhook was answered here): ended, once its
            # writes are out. With them still queued (a stream taken over here), it is left to them.
            await store.create(CallRecord(call_sid="AS-d", node="node-4", agent="sales"))
            await store.update("AS-d", state="streaming")
            await flushed(store)
            await store.append_turn("AS-d", "caller", "still queued")
            assert not await store.end_lost("AS-d", "node-4", "node_lost")
            await flushed(store)
            assert await store.end_lost("AS-d", "node-4", "node_lost")
    finally:
        await store.aclose()
        if sweeper is not store:
            await sweeper.aclose()


async def test_a_long_calls_node_set_lives_as_long_as_its_record(prefix: str) -> None:
    """A call whose only writes are its turns (pushes) kept its record alive but not its node's set: past the
    retention the set expired under a call still streaming, and had its node crashed then, no sweep found it."""
    store = make_store("redis", prefix, ttl_s=1.0)
    sweeper = make_store("redis", prefix)
    try:
        await store.create(CallRecord(call_sid="AS-long", node="node-1", agent="sales"))
        await store.update("AS-long", state="streaming")
        for _ in range(6):  # 1.8 s of turns, past the 1 s retention
            await store.append_turn("AS-long", "caller", "still here")
            await flushed(store)
            await asyncio.sleep(0.3)
        assert list(await sweeper.streaming_on("node-1")) == ["AS-long"]
    finally:
        await store.aclose()
        await sweeper.aclose()


async def test_a_node_whose_clock_runs_fast_does_not_hide_the_other_nodes_calls(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index of calls was scored and pruned by each writer's own clock: one write from a node two days
    ahead pruned every other call from `list_recent` (retention 1 day). Redis's clock prunes it now."""
    honest = make_store("redis", prefix, ttl_s=86_400)
    fast = make_store("redis", prefix, ttl_s=86_400)
    try:
        for sid in ("CA0", "CA1"):
            await honest.create(CallRecord(sid))
        await flushed(honest)
        skewed = time.time() + 2 * 86_400
        monkeypatch.setattr(time, "time", lambda: skewed)  # this node's clock, for the one write below
        await fast.create(CallRecord("CA2"))
        monkeypatch.undo()
        await flushed(fast)
        assert [r.call_sid for r in await honest.list_recent(10)] == ["CA2", "CA1", "CA0"]
    finally:
        await honest.aclose()
        await fast.aclose()


async def test_update_rejects_unknown_fields(kind: str, prefix: str) -> None:
    store = make_store(kind, prefix)
    with pytest.raises(TypeError):
        await store.update("CA1", created_at=1.0)
    with pytest.raises(ValueError):
        await store.update("CA1", state="dialing")
    with pytest.raises(ValueError):
        await store.add_latency("CA1", "ttfb", 0.1)  # type: ignore[arg-type]
    await store.aclose()


async def test_ttl_set_and_honoured(kind: str, prefix: str, raw: aioredis.Redis) -> None:
    store = make_store(kind, prefix, ttl_s=1.0)
    await store.create(new_call("CA1", created_at=time.time()))
    await store.append_turn("CA1", "caller", "hi")
    await store.append_oracle("CA1", "say hi")
    await store.append_dtmf("CA1", "1")
    await store.add_latency("CA1", "turn", 0.2)
    await flushed(store)
    if kind == "redis":
        keys = await keys_under(raw, prefix)
        assert len(keys) == 6  # hash, four lists, index
        for key in keys:
            assert 0 < await raw.pttl(key) <= 1000, key
    assert (await store.get("CA1")) is not None

    await asyncio.sleep(1.3)
    assert await store.get("CA1") is None
    assert await store.list_recent(10) == []
    if kind == "redis":
        assert await keys_under(raw, prefix) == []
    await store.aclose()


async def test_no_transcripts_stores_no_texts(kind: str, prefix: str, raw: aioredis.Redis) -> None:
    store = make_store(kind, prefix, store_transcripts=False)
    secret = "my account number is 99417"
    record = new_call("CA1")
    record.turns.append(Turn("caller", secret + " (given at create)", T0))
    await store.create(record)
    await store.append_turn("CA1", "caller", secret, at=T0 + 1)
    await store.append_turn("CA1", "bot", "thanks, " + secret, at=T0 + 2)
    await store.append_oracle("CA1", "They said " + secret, at=T0 + 3)
    await store.append_dtmf("CA1", "9")
    await store.add_latency("CA1", "turn", 0.3)
    await flushed(store)

    got = await store.get("CA1")
    assert got is not None
    assert got.turns == [Turn("caller", None, T0), Turn("caller", None, T0 + 1), Turn("bot", None, T0 + 2)]
    assert got.oracle == [OracleNote(None, T0 + 3)]
    assert got.dtmf == ["*"]  # digits can be PINs: counted, not kept
    assert got.turn_latencies_s == [0.3]
    assert "99417" not in got.to_json()
    if kind == "redis":  # and nothing in Redis itself holds the text or the digit
        base = f"{prefix}call:CA1"
        lists = {name: await raw.lrange(f"{base}:{name}", 0, -1) for name in ("turns", "oracle", "dtmf")}
        assert lists["dtmf"] == ["*"] and len(lists["turns"]) == 3 and len(lists["oracle"]) == 1
        assert "99417" not in str(lists) + str(await raw.hgetall(base))
    await store.aclose()


async def test_concurrent_appends_all_land(kind: str, prefix: str) -> None:
    # Two Redis stores stand for two nodes writing the same call (webhook node and media node).
    stores = [make_store(kind, prefix)] + ([make_store(kind, prefix)] if kind == "redis" else [])
    await stores[0].create(new_call("CA1"))
    await flushed(stores[0])

    async def talker(n: int) -> None:
        store = stores[n % len(stores)]
        for i in range(25):
            await store.append_turn("CA1", "caller" if n % 2 else "bot", f"{n}-{i}", at=T0 + i)
            await store.add_latency("CA1", "turn", n + i / 100)
            if i % 5 == 0:
                await asyncio.sleep(0)  # interleave with the other talkers and the writer tasks

    await asyncio.gather(*(talker(n) for n in range(40)))
    for store in stores:
        await flushed(store)
    fresh = make_store(kind, prefix) if kind == "redis" else stores[0]
    got = await fresh.get("CA1")
    assert got is not None
    texts = [t.text for t in got.turns]
    assert sorted(texts) == sorted(f"{n}-{i}" for n in range(40) for i in range(25))  # none lost, none twice
    assert len(got.turn_latencies_s) == 40 * 25
    for n in range(40):  # each task's own appends stay in order
        mine = [t for t in texts if t and t.startswith(f"{n}-")]
        assert mine == [f"{n}-{i}" for i in range(25)]
    for store in {*stores, fresh}:
        await store.aclose()


async def test_retry_after_lost_reply_applies_once(prefix: str) -> None:
    """The connection can drop after Redis ran a batch but before the reply came back. The writer
    then retries the batch; the per-writer sequence number in the hash must make that a no-op."""
    store = make_store("redis", prefix, retry_max_s=0.05)
    assert isinstance(store, RedisCallStore)
    real_write, lost = store._write_batch, []

    async def write_then_lose_reply(batch: list) -> None:  # type: ignore[type-arg]
        await real_write(batch)
        if not lost:
            lost.append(len(batch))
            raise aioredis.ConnectionError("connection reset after EXEC")

    store._write_batch = write_then_lose_reply  # type: ignore[method-assign]
    errors_before = redis_errors()
    await store.create(new_call("CA1"))
    for i in range(5):
        await store.append_turn("CA1", "caller", f"t{i}", at=T0 + i)
    await store.end("CA1", "completed", at=T0 + 9)
    await flushed(store)
    assert lost == [7] and redis_errors() == errors_before + 1
    other = make_store("redis", prefix)
    got = await other.get("CA1")
    assert got is not None and [t.text for t in got.turns] == [f"t{i}" for i in range(5)]
    await other.aclose()
    await store.aclose()


async def test_memory_store_is_bounded() -> None:
    store = MemoryCallStore(max_records=3)
    for i in range(5):
        await store.create(new_call(f"CA{i}", created_at=T0 + i))
    assert [r.call_sid for r in await store.list_recent(10)] == ["CA4", "CA3", "CA2"]
    assert await store.get("CA0") is None


async def test_open_call_store_without_url_is_memory(caplog: pytest.LogCaptureFixture) -> None:
    store = open_call_store(None)
    assert isinstance(store, MemoryCallStore)
    assert "no REDIS_URL" in caplog.text


async def test_a_streams_start_written_before_its_webhooks_record_is_kept_and_the_record_filled_in(
    prefix: str,
) -> None:
    """Node A answered the webhook, but its writes were held up (a Redis blip); B, streaming the call, wrote its
    start first. That update went to an unknown call and was dropped, with B's first turns: the live call's
    record said "ringing" for good, in no node's set of streaming calls (review, session 30). B's start now
    makes the record, and A's create fills in what it lacks when it lands."""
    store_a, store_b = make_store("redis", prefix), make_store("redis", prefix)
    held = asyncio.Event()
    write = store_a._write_batch  # type: ignore[attr-defined]

    async def held_up(batch):  # type: ignore[no-untyped-def]
        await held.wait()
        return await write(batch)

    store_a._write_batch = held_up  # type: ignore[attr-defined]
    try:
        await store_a.create(CallRecord(call_sid="CA-race", node="node-b", agent="sales", from_number="+15550001111",
                                        created_at=T0))  # fmt: skip
        await asyncio.sleep(0.05)
        store_b.adopt("CA-race")
        await store_b.begin_stream("CA-race", stream_sid="MZ1", node="node-b", started_at=T0 + 1)
        await store_b.append_turn("CA-race", "bot", "Hello, how can I help?")
        await flushed(store_b)
        held.set()
        await flushed(store_a)
        await store_b.append_turn("CA-race", "caller", "I need help")
        await flushed(store_b)
        record = await store_b.get("CA-race")
        assert record is not None
        assert (record.state, record.node, record.stream_sid, record.started_at) == ("streaming", "node-b", "MZ1",
                                                                                     T0 + 1)  # fmt: skip
        assert (record.agent, record.from_number) == ("sales", "+15550001111")  # filled in by the webhook's
        assert [t.text for t in record.turns] == ["Hello, how can I help?", "I need help"]
        assert store_b.unapplied_ops == 0  # type: ignore[attr-defined]
        assert list(await store_b.streaming_on("node-b")) == ["CA-race"]  # a sweep finds it should B die
    finally:
        await store_a.aclose()
        await store_b.aclose()


def test_a_redis_url_is_logged_without_its_password_whatever_it_holds() -> None:
    """Unencoded '/' or '@' in a password (as a generated one has, now and then) cut the host part short: the
    rest of the password was logged as the URL's path."""
    for url, shown in (("redis://:/Zk3pQ9sEcReT@redis:6379/0", "redis://redis:6379/0"),
                       ("redis://default:4821/xYzSecret@redis:6379/0", "redis://redis:6379/0"),
                       ("rediss://u:a@b/c@cache.example.com:6380/2", "rediss://cache.example.com:6380/2"),
                       ("redis://:plain@127.0.0.1/0", "redis://127.0.0.1:6379/0"),
                       ("redis://10.0.0.5:6379", "redis://10.0.0.5:6379")):  # fmt: skip
        assert _safe_url(url) == shown, url


async def test_password_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    store = open_call_store("redis://user:hunter2@127.0.0.1:1/0", socket_timeout_s=0.2)
    assert isinstance(store, RedisCallStore)
    store.close_timeout_s = 0.1  # nothing will ever flush
    errors_before = redis_errors()
    await store.create(new_call("CA1"))
    await until(lambda: redis_errors() > errors_before, "the writer failed and logged")
    with pytest.raises(CallStoreUnavailable):
        await store.get("CA1")
    await store.aclose()
    assert "Redis write failed" in caplog.text and "Redis read failed" in caplog.text
    assert "127.0.0.1" in caplog.text and "hunter2" not in caplog.text


# ---- Redis outages, with a redis-server of the test's own ----


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    srv = RedisServer(tmp_path)
    await srv.start()
    yield srv
    await srv.kill()


def pending_ops_gauge() -> float:
    return REGISTRY.get_sample_value("kame_call_store_pending_ops") or 0.0


def dropped_ops_counter() -> float:
    return REGISTRY.get_sample_value("kame_call_store_dropped_ops_total") or 0.0


def returns_at_once(write: Coroutine[object, object, None]) -> None:
    """The write finishes without ever suspending (no I/O, lock or sleep), and quickly."""
    start = time.perf_counter()
    with pytest.raises(StopIteration):
        write.send(None)
    assert time.perf_counter() - start < NONBLOCKING_S


async def test_redis_restart_mid_call_loses_nothing(server: RedisServer) -> None:
    store = open_call_store(server.url, socket_timeout_s=0.5, retry_max_s=0.2)
    assert await store.ping()
    await store.create(new_call("CA1"))
    await store.update("CA1", state="streaming", stream_sid="MZ1", started_at=T0 + 1)
    for i in range(5):
        await store.append_turn("CA1", "caller", f"before {i}", at=T0 + i)
    await flushed(store)

    # A hung Redis (SIGSTOP) is worse than a dead one: nothing is refused, the client only times out.
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    errors_before = redis_errors()
    for i in range(20):
        returns_at_once(store.append_turn("CA1", "caller", f"frozen {i}", at=T0 + 5 + i / 100))
    await until(lambda: redis_errors() > errors_before, "a Redis error counted")
    server.proc.send_signal(signal.SIGCONT)
    await flushed(store)

    await server.kill()
    errors_before = redis_errors()
    for i in range(200):  # the media loop keeps writing through the outage
        returns_at_once(store.append_turn("CA1", "bot", f"during {i}", at=T0 + 10 + i))
        returns_at_once(store.append_dtmf("CA1", str(i % 10)))
    returns_at_once(store.create(new_call("CA2", created_at=T0 + 50)))
    returns_at_once(store.append_oracle("CA2", "new caller", at=T0 + 51))
    returns_at_once(store.add_latency("CA1", "turn", 0.5))
    returns_at_once(store.end("CA1", "caller_hangup", at=T0 + 300))
    await until(lambda: redis_errors() > errors_before, "a Redis error counted")
    assert not await store.ping()
    with pytest.raises(CallStoreUnavailable):  # reads say so instead of returning half a record
        await store.get("CA1")

    await server.start()  # same port, same AOF
    await flushed(store)
    other = open_call_store(server.url)  # nothing buffered: only what Redis holds
    ca1, ca2 = await other.get("CA1"), await other.get("CA2")
    assert ca1 is not None and ca2 is not None
    before, frozen = [f"before {i}" for i in range(5)], [f"frozen {i}" for i in range(20)]
    assert [t.text for t in ca1.turns] == before + frozen + [f"during {i}" for i in range(200)]
    assert ca1.dtmf == [str(i % 10) for i in range(200)]
    assert (ca1.state, ca1.end_reason, ca1.stream_sid, ca1.turn_latencies_s) == (
        "ended",
        "caller_hangup",
        "MZ1",
        [0.5],
    )
    assert ca2.oracle == [OracleNote("new caller", T0 + 51)]
    assert [r.call_sid for r in await other.list_recent(5)] == ["CA1", "CA2"]  # CA1 ended last
    assert isinstance(store, RedisCallStore) and store.dropped_ops == 0
    await other.aclose()
    await store.aclose()


async def test_buffer_bound_drops_oldest_and_counts(server: RedisServer) -> None:
    store = open_call_store(server.url, socket_timeout_s=0.5, retry_max_s=0.2, max_pending=10)
    assert isinstance(store, RedisCallStore)
    await store.create(new_call("CA1"))
    await flushed(store)
    pending_before, dropped_before = pending_ops_gauge(), dropped_ops_counter()

    await server.kill()
    for i in range(25):
        returns_at_once(store.append_turn("CA1", "caller", f"t{i}", at=T0 + i))
    assert (store.pending_ops, store.dropped_ops) == (10, 15)
    # What /metrics shows: the buffer at its bound and every op it lost.
    assert (pending_ops_gauge(), dropped_ops_counter()) == (pending_before + 10, dropped_before + 15)

    await server.start()
    await flushed(store)
    assert pending_ops_gauge() == pending_before  # drained
    got = await store.get("CA1")
    assert got is not None
    assert [t.text for t in got.turns] == [f"t{i}" for i in range(15, 25)]  # the newest 10 survive
    await store.aclose()


async def test_pending_ops_gauge_sums_the_open_stores_only(server: RedisServer) -> None:
    base, dropped_before = pending_ops_gauge(), dropped_ops_counter()
    a = open_call_store(server.url, socket_timeout_s=0.5, retry_max_s=0.2)
    b = open_call_store(server.url, socket_timeout_s=0.5, retry_max_s=0.2)
    assert isinstance(a, RedisCallStore) and isinstance(b, RedisCallStore)
    await server.kill()
    for store, n in ((a, 3), (b, 4)):
        for i in range(n):
            returns_at_once(store.append_dtmf("CA1", str(i)))
    assert pending_ops_gauge() == base + 7  # both buffers

    a.close_timeout_s = 0.2
    await a.aclose()  # gives up on its 3 ops: no longer pending anywhere
    assert a.pending_ops == 3 and pending_ops_gauge() == base + 4
    returns_at_once(a.append_dtmf("CA1", "9"))  # a write after close is a dropped op
    assert dropped_ops_counter() == dropped_before + 1

    await server.start()
    await flushed(b)
    assert pending_ops_gauge() == base
    await b.aclose()

    # The gauge holds stores weakly: one dropped without aclose() is freed, not kept alive by the metric.
    c = open_call_store(server.url)
    ref, client = weakref.ref(c), c._redis  # type: ignore[attr-defined]
    del c
    gc.collect()
    assert ref() is None
    assert pending_ops_gauge() == base
    await client.aclose()


async def test_a_live_call_quiet_past_the_retention_is_kept_in_memory() -> None:
    """Records expire `ttl_s` after their last write; a call on hold longer than a short retention (set for
    privacy) lost its record, and its later writes and end went nowhere."""
    store = MemoryCallStore(ttl_s=0.3)
    await store.create(new_call("CA1", created_at=time.time()))
    await store.update("CA1", state="streaming")
    await asyncio.sleep(0.5)
    record = await store.get("CA1")
    assert record is not None and record.state == "streaming"
    await store.append_turn("CA1", "caller", "still there?")
    await store.end("CA1", "completed")
    record = await store.get("CA1")
    assert record is not None and record.state == "ended" and [t.text for t in record.turns] == ["still there?"]
    await asyncio.sleep(0.5)
    assert await store.get("CA1") is None  # once ended, the retention applies
    await store.aclose()


async def test_a_calls_lists_keep_their_newest_items(kind: str, prefix: str) -> None:
    """A long call that talks on grew its lists without bound, and every read of its record with them (the
    admin API, `dial --wait` each second): the newest MAX_LIST_ITEMS of each are kept, in Redis as in memory."""
    store = make_store(kind, prefix)
    await store.create(new_call("CA1"))
    for i in range(MAX_LIST_ITEMS + 25):
        await store.append_turn("CA1", "caller", f"turn {i}", at=T0 + i)
        await store.append_oracle("CA1", f"draft {i}", at=T0 + i)
    await flushed(store)
    for reader in (store, make_store(kind, prefix) if kind == "redis" else store):
        record = await reader.get("CA1")
        assert record is not None and len(record.turns) == len(record.oracle) == MAX_LIST_ITEMS
        assert record.turns[0].text == "turn 25" and record.turns[-1].text == f"turn {MAX_LIST_ITEMS + 24}"
        (summary,) = [c.summary() for c in await reader.list_recent(5)]
        assert "turns" not in summary and summary["counts"]["turns"] == MAX_LIST_ITEMS
        if reader is not store:
            await reader.aclose()
    await store.aclose()


async def test_an_odd_record_is_left_out_not_a_failed_listing(prefix: str, raw: aioredis.Redis,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """An item a newer version wrote (a field this one does not know) made every listing a 500 mid-upgrade:
    unknown keys are dropped, and an item or a record that cannot be read at all is left out, counted and
    logged with its call id."""
    store = make_store("redis", prefix)
    for sid in ("CA1", "CA2", "CA3"):
        await store.create(new_call(sid))
        await store.append_turn(sid, "caller", "hello", at=T0)
    await flushed(store)
    await raw.rpush(f"{prefix}call:CA1:turns", '{"role": "bot", "text": "hi", "at": 1.0, "lang": "en"}', "[1, 2]")
    await raw.hset(f"{prefix}call:CA2", "first_audio_s", "not a number")
    reader = make_store("redis", prefix)

    def unreadable(what: str) -> float:
        return REGISTRY.get_sample_value("kame_call_store_unreadable_total", {"what": what}) or 0.0

    before = {what: unreadable(what) for what in ("record", "item")}
    try:
        one = await reader.get("CA1")
        assert one is not None and [t.text for t in one.turns] == ["hello", "hi"]
        assert await reader.get("CA2") is None
        assert sorted(r.call_sid for r in await reader.list_recent(10)) == ["CA1", "CA3"]
        # Read twice each (get, then the listing): CA1's "[1, 2]" item, CA2's whole record.
        assert {what: unreadable(what) - n for what, n in before.items()} == {"record": 2, "item": 2}
        said = [r.getMessage() for r in caplog.records]
        assert "call CA1: 1 items of its record in Redis cannot be read; left out" in said
        assert any(line.startswith("call CA2: its record in Redis cannot be read") for line in said), said
    finally:
        await reader.aclose()
        await store.aclose()


async def test_a_listing_after_a_quiet_spell_prunes_the_expired_index(prefix: str, raw: aioredis.Redis) -> None:
    """The index was pruned only by writes: after a quiet night a listing walked the whole day's expired calls
    (150,000 Redis commands for one live call in the review). It prunes them first, by Redis's clock."""
    store = make_store("redis", prefix, ttl_s=1.0)
    for i in range(40):
        await store.create(new_call(f"CA{i}"))
    await flushed(store)
    await asyncio.sleep(0.6)
    await store.create(new_call("CA-last"))  # keeps the index alive past the others' expiry
    await flushed(store)
    await asyncio.sleep(0.6)  # the 40 expired, and nothing written since
    assert await raw.zcard(f"{prefix}calls") == 41
    reader = make_store("redis", prefix, ttl_s=1.0)  # nothing buffered: what Redis holds
    assert [r.call_sid for r in await reader.list_recent(2)] == ["CA-last"]
    assert await raw.zcard(f"{prefix}calls") == 1
    await reader.aclose()
    await store.aclose()


async def test_a_redis_refusing_writes_still_lists_its_calls(server: RedisServer) -> None:
    """The listing's prune of the index is a write: a Redis refusing writes (NOREPLICAS here; MISCONF, a
    read-only replica) made every listing a 503, exactly when an operator looks."""
    store = open_call_store(server.url)
    await store.create(new_call("CA1"))
    await flushed(store)
    admin = aioredis.Redis.from_url(server.url)
    try:
        await admin.config_set("min-replicas-to-write", 1)
        reader = open_call_store(server.url)
        assert [r.call_sid for r in await reader.list_recent(5)] == ["CA1"]
        await reader.aclose()
    finally:
        await admin.config_set("min-replicas-to-write", 0)
        await admin.aclose()
        await store.aclose()
