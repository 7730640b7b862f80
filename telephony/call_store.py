"""Per-call state store: one `CallRecord` per Twilio CallSid, in Redis or in process.

Writes come from the media loop, so they must never wait on the network. Every write method
turns into one or more `_Op`s, applied by one pure function (`_apply`) in memory, or queued in a
bounded buffer that a background task flushes to Redis in order. The Lua script that applies an
op in Redis mirrors `_apply`, so both stores and the read-side merge of unflushed ops agree.

Redis layout (prefix `kame:` by default), every key with the retention TTL refreshed on each write:
  <p>call:<sid>                 hash of scalar fields, plus `seq:<writer>` (last op applied per writer)
  <p>call:<sid>:turns|oracle|dtmf|turn_latencies|tools   lists, appended with RPUSH
  <p>calls                      sorted set of CallSids scored by last write, for `list_recent`
  <p>streaming                  set of the nodes with calls streaming (node ids), for `streaming_nodes`
  <p>streaming:<node>           set of the CallSids streaming on that node, for `streaming_on`
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import random
import re
import threading
import time
import urllib.parse
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ReadOnlyError, RedisError, ResponseError

from telephony.metrics import (
    CALL_STORE_DROPPED_OPS,
    CALL_STORE_PENDING_OPS,
    CALL_STORE_RESTORED_RECORDS,
    CALL_STORE_UNAPPLIED_OPS,
    CALL_STORE_UNREADABLE,
    REDIS_ERRORS,
)

logger = logging.getLogger(__name__)

CallState = Literal["ringing", "streaming", "ended"]
Role = Literal["caller", "bot"]
LatencyName = Literal["first_audio", "turn"]
_ListName = Literal["turns", "oracle", "dtmf", "turn_latencies_s", "tools"]

DEFAULT_TTL_S = 24 * 3600.0  # short on purpose: transcripts and phone numbers are personal data
DEFAULT_MAX_PENDING = 10_000
DEFAULT_MAX_RECORDS = 10_000
DEFAULT_KEY_PREFIX = "kame:"
_MASKED_DIGIT = "*"  # DTMF can carry PINs or card numbers, so it is masked like a transcript


@dataclass(frozen=True, slots=True)
class Turn:
    role: Role
    text: str | None  # None when transcripts are not stored
    at: float  # epoch seconds


@dataclass(frozen=True, slots=True)
class OracleNote:
    text: str | None  # None when transcripts are not stored
    at: float  # epoch seconds


@dataclass(frozen=True, slots=True)
class ToolNote:
    """A tool the agent's LLM called: its arguments are masked like DTMF when transcripts are not stored."""

    name: str
    arguments: str
    outcome: str
    at: float  # epoch seconds


@dataclass(slots=True)
class CallRecord:
    """Everything kept about one call. Timestamps are epoch seconds; latencies are seconds."""

    call_sid: str
    stream_sid: str | None = None
    from_number: str | None = None
    to_number: str | None = None
    node: str | None = None  # the instance that holds the media stream
    agent: str | None = None  # the agent that answered (knowledge/agents.py)
    state: CallState = "ringing"
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    end_reason: str | None = None
    first_audio_s: float | None = None
    dtmf: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    oracle: list[OracleNote] = field(default_factory=list)
    turn_latencies_s: list[float] = field(default_factory=list)
    tools: list[ToolNote] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> dict[str, Any]:
        """The scalar fields and how long each list is: what a listing of many calls shows (each whole, a
        listing of long calls ran to tens of MB built on the event loop)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _LIST_NAMES}
        return out | {"counts": {name: len(getattr(self, name)) for name in _LIST_NAMES}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CallRecord:
        data = dict(data)
        data["turns"] = [Turn(**t) for t in data.get("turns", ())]
        data["oracle"] = [OracleNote(**o) for o in data.get("oracle", ())]
        data["tools"] = [ToolNote(**t) for t in data.get("tools", ())]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> CallRecord:
        return cls.from_dict(json.loads(text))


# The newest this many items of each list are kept: a 4 h call (or one with no limit) that talks on grew its
# lists without bound, and each read of the record (the admin API, `dial --wait` every second) with them.
MAX_LIST_ITEMS = 1000
MAX_LIST_PAGES = 10  # index pages a listing reads at most (records gone since their index entry was written)

# Scalar fields `update` may set, by type. call_sid and created_at are fixed at create time.
_STR_FIELDS = frozenset({"stream_sid", "from_number", "to_number", "node", "state", "end_reason", "agent"})
_FLOAT_FIELDS = frozenset({"started_at", "ended_at", "first_audio_s"})
_UPDATABLE = _STR_FIELDS | _FLOAT_FIELDS
_LIST_NAMES: tuple[_ListName, ...] = get_args(_ListName)


@dataclass(frozen=True, slots=True)
class CallBrief:
    """A call's state and where it streams, without its lists (a long call's turns are thousands of items)."""

    state: CallState
    node: str | None
    agent: str | None


class CallStoreUnavailable(RuntimeError):
    """A read could not reach the backing store (writes never raise this; they are buffered)."""


class CallStore(Protocol):
    """Async per-call state. Write methods return at once; reads may touch the network."""

    async def create(self, record: CallRecord) -> None: ...
    async def update(self, call_sid: str, **fields: Any) -> None: ...
    async def begin_stream(self, call_sid: str, *, stream_sid: str, node: str, started_at: float) -> None: ...
    async def append_turn(self, call_sid: str, role: Role, text: str, at: float | None = None) -> None: ...
    async def append_oracle(self, call_sid: str, text: str, at: float | None = None) -> None: ...
    async def append_dtmf(self, call_sid: str, digit: str) -> None: ...
    async def append_tool(self, call_sid: str, name: str, arguments: str, outcome: str) -> None: ...
    async def add_latency(self, call_sid: str, name: LatencyName, seconds: float) -> None: ...
    async def end(self, call_sid: str, reason: str, at: float | None = None) -> None: ...
    async def get(self, call_sid: str) -> CallRecord | None: ...
    async def brief(self, call_sid: str) -> CallBrief | None: ...
    async def claim(self, call_sid: str, node: str) -> bool: ...
    async def release_claim(self, call_sid: str, node: str) -> None: ...
    async def list_recent(self, limit: int = 50) -> list[CallRecord]: ...
    async def streaming_nodes(self) -> set[str]: ...
    async def streaming_on(self, node: str) -> dict[str, CallBrief]: ...
    async def end_lost(
        self, call_sid: str, node: str, reason: str, alive_keys: Sequence[str] = (), *, own_node: bool = False
    ) -> bool: ...
    def adopt(self, call_sid: str) -> None: ...
    async def ping(self) -> bool: ...
    async def flush(self) -> None: ...
    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Op:
    """One write. `kind`: create (if absent; else it fills in the fields the record lacks), set (fields), begin
    (set, creating the record if absent: a stream's start), end (once), push (append to a list)."""

    seq: int  # per store instance, strictly increasing; makes Redis retries idempotent
    call_sid: str
    kind: Literal["create", "set", "begin", "end", "push"]
    fields: dict[str, str | float | None] = field(default_factory=dict)
    list_name: _ListName | None = None
    item: Turn | OracleNote | str | float | None = None
    submitted: float = field(default_factory=lambda: time.time())  # epoch s (this node's clock): orders `list_recent`


def _items(cls: type, encoded: Iterable[str]) -> list[Any]:
    """List items as their dataclass, keys it does not know (a newer version's) dropped, and an item that
    is not an object of it skipped."""
    known = {f.name for f in dataclasses.fields(cls)}
    out = []
    for text in encoded:
        try:
            data = json.loads(text)
            out.append(cls(**{k: v for k, v in data.items() if k in known}))
        except (ValueError, TypeError, AttributeError):
            CALL_STORE_UNREADABLE.labels(what="item").inc()
            continue
    return out


def _apply(record: CallRecord | None, op: _Op) -> CallRecord | None:
    """Apply `op` to `record` in place (or build it, for create and begin). Other ops on an unknown call are
    dropped: a late write must not resurrect an expired record. Mirrored by `_APPLY_LUA`."""
    if op.kind in ("create", "begin") and record is None:
        return CallRecord(call_sid=op.call_sid, **op.fields)  # type: ignore[arg-type]
    if op.kind == "create":  # the stream's start got there first: what it lacks, the webhook's record gives
        for name, value in op.fields.items():
            if value is not None and getattr(record, name) is None:
                setattr(record, name, value)
        return record
    if record is None:
        return None
    if op.kind == "begin":
        op = dataclasses.replace(op, fields={k: v for k, v in op.fields.items() if k != "created_at"})
    if op.kind == "end" and record.state == "ended":
        return record  # first end wins: the stream stop and the status callback both end a call
    if op.kind == "push":
        assert op.list_name is not None and op.item is not None, op
        items = getattr(record, op.list_name)
        items.append(op.item)
        if len(items) > MAX_LIST_ITEMS:
            del items[:-MAX_LIST_ITEMS]
    else:
        for name, value in op.fields.items():
            setattr(record, name, value)
    return record


class _OpStore:
    """Write methods shared by both stores: validate, build ops, hand them to `_submit`."""

    def __init__(self, *, store_transcripts: bool) -> None:
        self.store_transcripts = store_transcripts
        self._seq = itertools.count(1)

    def _submit(self, ops: Sequence[_Op]) -> None:
        raise NotImplementedError

    def _op(self, call_sid: str, kind: Any, **kw: Any) -> _Op:
        return _Op(seq=next(self._seq), call_sid=call_sid, kind=kind, **kw)

    def _push(self, call_sid: str, list_name: _ListName, item: Turn | OracleNote | ToolNote | str | float) -> _Op:
        return self._op(call_sid, "push", list_name=list_name, item=item)

    async def create(self, record: CallRecord) -> None:
        """Store a new call unless one with this CallSid exists (a retried webhook is harmless)."""
        if record.state not in get_args(CallState):
            raise ValueError(f"bad call state {record.state!r}")
        skip = {*_LIST_NAMES, "call_sid"}
        scalars = {f.name: getattr(record, f.name) for f in dataclasses.fields(CallRecord) if f.name not in skip}
        ops = [self._op(record.call_sid, "create", fields=scalars)]
        # Lists in the given record become ordinary appends, so the transcript switch applies to them.
        ops += [self._push(record.call_sid, "dtmf", self._digit(d)) for d in record.dtmf]
        ops += [self._push(record.call_sid, "turns", self._turn(t.role, t.text, t.at)) for t in record.turns]
        ops += [self._push(record.call_sid, "oracle", self._note(o.text, o.at)) for o in record.oracle]
        ops += [self._push(record.call_sid, "turn_latencies_s", float(s)) for s in record.turn_latencies_s]
        ops += [self._push(record.call_sid, "tools", self._tool(t.name, t.arguments, t.outcome, t.at))
                for t in record.tools]  # fmt: skip
        self._submit(ops)

    async def begin_stream(self, call_sid: str, *, stream_sid: str, node: str, started_at: float) -> None:
        """The call's media stream started here: its record says so. Should the webhook's record not be there
        yet (its node's writes held up by a Redis blip), this makes it, and the webhook's create fills in the
        rest when it lands: as an update, it was dropped as a write to an unknown call, and the live call's
        record said "ringing" for good, its stream, start and first turns gone."""
        fields = {"stream_sid": stream_sid, "state": "streaming", "started_at": float(started_at), "node": node,
                  "created_at": float(started_at)}  # fmt: skip
        self._submit([self._op(call_sid, "begin", fields=fields)])

    async def update(self, call_sid: str, **fields: Any) -> None:
        for name, value in fields.items():
            if name not in _UPDATABLE:
                raise TypeError(f"update() cannot set {name!r}")
            if name == "state" and value not in get_args(CallState):
                raise ValueError(f"bad call state {value!r}")
            if name in _FLOAT_FIELDS and value is not None:
                fields[name] = float(value)
        if fields:
            self._submit([self._op(call_sid, "set", fields=fields)])

    async def append_turn(self, call_sid: str, role: Role, text: str, at: float | None = None) -> None:
        self._submit([self._push(call_sid, "turns", self._turn(role, text, at))])

    async def append_oracle(self, call_sid: str, text: str, at: float | None = None) -> None:
        self._submit([self._push(call_sid, "oracle", self._note(text, at))])

    async def append_dtmf(self, call_sid: str, digit: str) -> None:
        self._submit([self._push(call_sid, "dtmf", self._digit(digit))])

    async def append_tool(self, call_sid: str, name: str, arguments: str, outcome: str) -> None:
        self._submit([self._push(call_sid, "tools", self._tool(name, arguments, outcome, None))])

    async def add_latency(self, call_sid: str, name: LatencyName, seconds: float) -> None:
        if name == "first_audio":
            self._submit([self._op(call_sid, "set", fields={"first_audio_s": float(seconds)})])
        elif name == "turn":
            self._submit([self._push(call_sid, "turn_latencies_s", float(seconds))])
        else:
            raise ValueError(f"unknown latency {name!r}")

    async def end(self, call_sid: str, reason: str, at: float | None = None) -> None:
        ended_at = time.time() if at is None else float(at)
        fields = {"state": "ended", "end_reason": reason, "ended_at": ended_at}
        self._submit([self._op(call_sid, "end", fields=fields)])

    def _turn(self, role: str, text: str | None, at: float | None) -> Turn:
        if role not in get_args(Role):
            raise ValueError(f"bad turn role {role!r}")
        at = time.time() if at is None else float(at)
        return Turn(role=role, text=text if self.store_transcripts else None, at=at)  # type: ignore[arg-type]

    def _note(self, text: str | None, at: float | None) -> OracleNote:
        at = time.time() if at is None else float(at)
        return OracleNote(text=text if self.store_transcripts else None, at=at)

    def _digit(self, digit: str) -> str:
        return str(digit) if self.store_transcripts else _MASKED_DIGIT

    def _tool(self, name: str, arguments: str, outcome: str, at: float | None) -> ToolNote:
        masked = arguments if self.store_transcripts else _masked_arguments(arguments)
        return ToolNote(name=name, arguments=masked, outcome=outcome, at=time.time() if at is None else float(at))


_WORD_CHAR = re.compile(r"\w")


def _masked_arguments(arguments: str) -> str:
    """Tool arguments with transcripts off: the keys kept (what was asked for), every value's letters and digits
    masked like DTMF's. They carry what the caller said: a card number, and as much a name or an email."""

    def mask(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: mask(v) for key, v in value.items()}
        if isinstance(value, list):
            return [mask(v) for v in value]
        if isinstance(value, bool) or value is None:
            return value
        return _WORD_CHAR.sub(_MASKED_DIGIT, str(value))

    try:
        return json.dumps(mask(json.loads(arguments)), ensure_ascii=False)
    except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit ("[[[[...")
        return _WORD_CHAR.sub(_MASKED_DIGIT, arguments)


class MemoryCallStore(_OpStore):
    """Single-node store for when no Redis is configured. Bounded like the Redis one: a call expires
    `ttl_s` after its last write, and past `max_records` the least recently written is evicted."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_records: int = DEFAULT_MAX_RECORDS,
        store_transcripts: bool = True,
    ) -> None:
        super().__init__(store_transcripts=store_transcripts)
        assert ttl_s > 0 and max_records > 0, (ttl_s, max_records)
        self.ttl_s = ttl_s
        self.max_records = max_records
        # CallSid -> (record, monotonic expiry), least recently written first: the front expires first.
        self._records: collections.OrderedDict[str, tuple[CallRecord, float]] = collections.OrderedDict()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._records and next(iter(self._records.values()))[1] <= now:
            call_sid, (record, _) = self._records.popitem(last=False)
            if record.state == "streaming":  # a live call quiet past the retention (on hold) is kept
                self._records[call_sid] = (record, now + self.ttl_s)

    def _submit(self, ops: Sequence[_Op]) -> None:
        self._expire()
        for op in ops:
            entry = self._records.get(op.call_sid)
            record = _apply(None if entry is None else entry[0], op)
            if record is None:
                continue
            self._records[op.call_sid] = (record, time.monotonic() + self.ttl_s)
            self._records.move_to_end(op.call_sid)
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)

    async def get(self, call_sid: str) -> CallRecord | None:
        self._expire()
        entry = self._records.get(call_sid)
        return None if entry is None else CallRecord.from_dict(entry[0].to_dict())  # a copy

    async def brief(self, call_sid: str) -> CallBrief | None:
        self._expire()
        entry = self._records.get(call_sid)
        return None if entry is None else CallBrief(entry[0].state, entry[0].node, entry[0].agent)

    async def claim(self, call_sid: str, node: str) -> bool:
        """Whether this call id is new (no record): one process, so nothing else can claim it between."""
        self._expire()
        return call_sid not in self._records

    async def release_claim(self, call_sid: str, node: str) -> None:
        return None

    async def list_recent(self, limit: int = 50) -> list[CallRecord]:
        """Live calls, most recently written first."""
        self._expire()
        newest = itertools.islice(reversed(self._records.values()), limit)
        return [CallRecord.from_dict(record.to_dict()) for record, _ in newest]

    async def streaming_nodes(self) -> set[str]:
        """The nodes with calls streaming."""
        self._expire()
        return {r.node for r, _ in self._records.values() if r.state == "streaming" and r.node is not None}

    async def streaming_on(self, node: str) -> dict[str, CallBrief]:
        """The calls streaming on `node`, by call id."""
        self._expire()
        return {sid: CallBrief(r.state, r.node, r.agent) for sid, (r, _) in self._records.items()
                if r.state == "streaming" and r.node == node}  # fmt: skip

    async def end_lost(
        self, call_sid: str, node: str, reason: str, alive_keys: Sequence[str] = (), *, own_node: bool = False
    ) -> bool:
        """End a call still streaming on `node`, which left it behind; False if it is not (any more). (One
        process: no other node's calls, so no rule about this store's own, as RedisCallStore has, and no
        heartbeat keys to check.)"""
        entry = self._records.get(call_sid)
        if entry is None or entry[0].state != "streaming" or entry[0].node != node:
            return False
        await self.end(call_sid, reason)
        return True

    def adopt(self, call_sid: str) -> None:
        return None  # nothing to lose: the records live here

    async def ping(self) -> bool:
        return True

    async def flush(self) -> None:
        return None

    async def aclose(self) -> None:
        self._records.clear()


# Keeps the call's place in its node's set of calls streaming (KEYS[8] .. ':' .. node), and the node's in the
# nodes set (KEYS[8]), from the record `h` as it now is; `sid` and `ttl` (ms) set by the script around it.
# A gone node's calls are then found by reading its set alone, however many calls the other nodes carry.
# Every write, pushes too, keeps the set as long-lived as the record (a long call whose only writes are its
# turns must not outlive its node's set). A set left naming a call whose node changed is pruned where it is
# read (_STREAMING_ON_LUA).
_TRACK_STREAMING_LUA = """
local r = redis.call('HMGET', h, 'state', 'node')
if r[1] == 'streaming' and r[2] then
  redis.call('SADD', KEYS[8] .. ':' .. r[2], sid)
  redis.call('PEXPIRE', KEYS[8] .. ':' .. r[2], ttl)
  redis.call('SADD', KEYS[8], r[2])
elseif r[2] then
  redis.call('SREM', KEYS[8] .. ':' .. r[2], sid)
end
"""

# Applies one _Op atomically. KEYS: 1 hash, 2 turns, 3 oracle, 4 dtmf, 5 turn_latencies, 6 tools, 7 index,
# 8 the set of nodes with calls streaming (each node's calls in the set KEYS[8] .. ':' .. node).
# ARGV: 1 kind, 2 writer seq field, 3 seq, 4 ttl ms, 5 call sid, 6 activity time (epoch s),
# 7 payload (JSON fields, or the list item), 8 list KEYS position (push).
# The index is scored by last activity, so entries older than the TTL are exactly the expired calls.
_APPLY_LUA = """
local h = KEYS[1]
local kind = ARGV[1]
if redis.call('EXISTS', h) == 1 then
  -- a batch retried after a dropped reply must not apply twice
  if tonumber(ARGV[3]) <= tonumber(redis.call('HGET', h, ARGV[2]) or '0') then return 0 end
  if kind == 'end' and redis.call('HGET', h, 'state') == 'ended' then
    kind = 'noop'
  elseif kind == 'create' then
    kind = 'fill'  -- the stream's start (begin) got here first: what it lacks, the webhook's record gives
  end
elseif kind == 'begin' then
  kind = 'create'  -- the webhook's create is still on its way (its node's writes held up)
elseif kind ~= 'create' then
  return -1  -- an unknown call: expired, or lost with the data of a Redis that came back empty
end
if kind == 'push' then
  redis.call('RPUSH', KEYS[tonumber(ARGV[8])], ARGV[7])
  redis.call('LTRIM', KEYS[tonumber(ARGV[8])], -MAX_LIST_ITEMS, -1)
elseif kind == 'fill' then
  for f, v in pairs(cjson.decode(ARGV[7])) do
    if v ~= cjson.null then redis.call('HSETNX', h, f, v) end
  end
elseif kind ~= 'noop' then
  for f, v in pairs(cjson.decode(ARGV[7])) do
    if kind == 'begin' and f == 'created_at' then  -- (a begin on a record: its webhook's time stays)
    elseif v == cjson.null then redis.call('HDEL', h, f) else redis.call('HSET', h, f, v) end
  end
end
local sid, ttl = ARGV[5], ARGV[4]
""" + _TRACK_STREAMING_LUA + """
redis.call('HSET', h, ARGV[2], ARGV[3])
-- Scored by the write's own time, but never past Redis's clock, and pruned by Redis's clock: a node whose
-- clock runs a day fast must not prune every other node's calls from the index.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[7], 'GT', math.min(tonumber(ARGV[6]), now), ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', '(' .. (now - tonumber(ARGV[4]) / 1000))
for i = 1, 8 do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

_APPLY_LUA = _APPLY_LUA.replace("MAX_LIST_ITEMS", str(MAX_LIST_ITEMS))

# Writes a live call's whole record back, if Redis has none (it restarted empty, or lost it). Same KEYS.
# ARGV: 1 writer seq field, 2 seq (the last op the record includes), 3 ttl ms, 4 call sid, 5 activity time,
# 6 scalars (JSON object), 7 lists (JSON array of 5 arrays of encoded items, in KEYS 2-6 order).
_RESTORE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for f, v in pairs(cjson.decode(ARGV[6])) do
  if v ~= cjson.null then redis.call('HSET', KEYS[1], f, v) end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local lists = cjson.decode(ARGV[7])
for i = 1, 5 do
  redis.call('DEL', KEYS[i + 1])
  for _, item in ipairs(lists[i]) do redis.call('RPUSH', KEYS[i + 1], item) end
end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[7], 'GT', math.min(tonumber(ARGV[5]), tonumber(t[1]) + tonumber(t[2]) / 1000000), ARGV[4])
local h, sid, ttl = KEYS[1], ARGV[4], ARGV[3]
""" + _TRACK_STREAMING_LUA + """
for i = 1, 8 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return 1
"""

# The calls streaming on one node: {call id, agent} each, from their hashes (never their lists). KEYS 1 the
# nodes set (see _APPLY_LUA); ARGV 1 the call hash prefix, 2 the node. Ids whose record has expired, moved
# to another node, or was ended by a writer that keeps no set (an older version, mid-upgrade) leave the set
# here, in the same step (a record written back meanwhile by _RESTORE_LUA must not lose its place); a node
# with none left leaves the nodes set.
_STREAMING_ON_LUA = """
local s = KEYS[1] .. ':' .. ARGV[2]
local out = {}
for _, sid in ipairs(redis.call('SMEMBERS', s)) do
  local r = redis.call('HMGET', ARGV[1] .. sid, 'state', 'node', 'agent')
  if r[1] == 'streaming' and r[2] == ARGV[2] then
    table.insert(out, {sid, r[3]})
  else
    redis.call('SREM', s, sid)
  end
end
if #out == 0 then redis.call('SREM', KEYS[1], ARGV[2]) end
return out
"""

# Ends a call its node left streaming, in one step: the check (still streaming, on that node, and, when ARGV 4
# is not empty, never written by this store: a call of this run that just hung up is ended by its own `end`,
# still queued), the fields `end` writes and the set. Not through the write-behind queue: a call taken off its
# node's set must not wait there for its end (a sweeping node that crashed next would leave it streaming, and in
# no set).
# The keys' expiry is left as the call's last write set it (its lists and index entry with it).
# KEYS 1 hash, 2 the nodes set; ARGV 1 node, 2 reason, 3 ended at (epoch s), 4 this store's seq field, 5 sid.
_END_LOST_LUA = """
local r = redis.call('HMGET', KEYS[1], 'state', 'node', ARGV[4])
if r[1] ~= 'streaming' or r[2] ~= ARGV[1] or (ARGV[4] ~= '' and r[3]) then return 0 end
for i = 3, #KEYS do  -- the node's heartbeat keys: back (restarted under its id) since it was found gone
  if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end
end
redis.call('HSET', KEYS[1], 'state', 'ended', 'end_reason', ARGV[2], 'ended_at', ARGV[3])
redis.call('SREM', KEYS[2] .. ':' .. ARGV[1], ARGV[5])
return 1
"""

# Claims a call id for one node, atomically: refused when the call has a record, or another node (or this one)
# claimed it first. The claim outlives the call as its record does, so the id stays spent.
# KEYS 1 hash, 2 the claim; ARGV 1 node, 2 ttl (ms).
_CLAIM_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

# Gives back a claim this node holds (a call refused busy after claiming: its PBX may retry the same id).
_RELEASE_CLAIM_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_KEY_SUFFIXES = ("", ":turns", ":oracle", ":dtmf", ":turn_latencies", ":tools")  # KEYS 1-6, see _APPLY_LUA
_LIST_KEY_POS = {"turns": 2, "oracle": 3, "dtmf": 4, "turn_latencies_s": 5, "tools": 6}
_LIST_NAMES_BY_KEY = sorted(_LIST_KEY_POS, key=_LIST_KEY_POS.__getitem__)
# Refusals that pass, even when returned for a single op: Redis failing to save (MISCONF), short of replicas
# (NOREPLICAS), busy in a script, loading, out of memory, failing over, or without our script. The batch is
# retried (ops are idempotent by seq); taken for a poison op, the writes were thrown away for good.
_TRANSIENT_OP_ERRORS = (NoScriptError, ReadOnlyError)
_TRANSIENT_REPLY = re.compile(
    r"\b(MISCONF|NOREPLICAS|BUSY|LOADING|OOM|MASTERDOWN|TRYAGAIN|CLUSTERDOWN|READONLY|NOSCRIPT)\b"
)


def _transient(error: ResponseError) -> bool:
    return isinstance(error, _TRANSIENT_OP_ERRORS) or _TRANSIENT_REPLY.search(str(error)) is not None


def _safe_url(url: str) -> str:
    """The URL without user or password, for logs. Everything up to the last '@' goes first: a password with an
    unencoded '/' (or '@' then '/') ended the URL's host part early, and parsed, the rest of it was the path,
    logged in clear (a password starting with '/', or digits then '/', in the review)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "(unparsable address)"
    parts = urllib.parse.urlsplit(f"{scheme}://{rest.rpartition('@')[2]}")
    try:
        port = parts.port or 6379
    except ValueError:
        return f"{scheme}://(unparsable address)"
    return f"{scheme}://{parts.hostname}:{port}{parts.path}"


def _log_writer_death(task: asyncio.Task[None]) -> None:
    # The next write restarts the writer; this only makes a bug visible instead of silent.
    if not task.cancelled() and (exc := task.exception()) is not None:
        REDIS_ERRORS.inc()
        logger.error("call store: writer task died; restarting on next write", exc_info=exc)


def _encode_scalar(value: str | float | None) -> str | None:
    return None if value is None else (repr(value) if isinstance(value, float) else str(value))


def _encode_item(item: Turn | OracleNote | ToolNote | str | float) -> str:
    """A list item as Redis holds it (read back by `RedisCallStore._decode`)."""
    if isinstance(item, Turn | OracleNote | ToolNote):
        return json.dumps(dataclasses.asdict(item), separators=(",", ":"))
    return _encode_scalar(item) or ""


@dataclass(slots=True)
class _Shadow:
    """This store's own view of a live call it writes: what a Redis that lost the call is given back."""

    record: CallRecord
    seq: int  # the last of our ops the view includes: Redis skips those when they arrive after a restore


# Every open RedisCallStore, for the CALL_STORE_PENDING_OPS gauge (the sum of their buffers). Weak, so
# the metric keeps no store alive; dead and closed ones are pruned on each register and each scrape.
# No weakref callbacks: /metrics renders in a worker thread, so all access goes through the lock.
_open_stores: list[weakref.ref[RedisCallStore]] = []
_open_stores_lock = threading.Lock()


def _open_stores_pruned() -> list[RedisCallStore]:
    """The live, unclosed stores; drops the other refs. Call with the lock held."""
    live = [store for ref in _open_stores if (store := ref()) is not None and not store._closed]
    _open_stores[:] = [weakref.ref(store) for store in live]
    return live


def _register_store(store: RedisCallStore) -> None:
    with _open_stores_lock:
        _open_stores_pruned()
        _open_stores.append(weakref.ref(store))


def _pending_ops_total() -> int:
    with _open_stores_lock:
        stores = _open_stores_pruned()
    return sum(store.pending_ops for store in stores)


CALL_STORE_PENDING_OPS.set_function(_pending_ops_total)


class RedisCallStore(_OpStore):
    """Redis-backed store. Writes go to a bounded in-memory buffer, flushed in order by one
    background task with retry and backoff; reads merge the ops not yet flushed for that call."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        ttl_s: float = DEFAULT_TTL_S,
        store_transcripts: bool = True,
        max_pending: int = DEFAULT_MAX_PENDING,
        batch_size: int = 256,
        retry_initial_s: float = 0.1,
        retry_max_s: float = 5.0,
        close_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(store_transcripts=store_transcripts)
        assert ttl_s >= 0.001 and max_pending > 0 and batch_size > 0, (ttl_s, max_pending, batch_size)
        self._redis = client  # must use decode_responses=True (see open_call_store)
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self._batch_size = batch_size
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self.close_timeout_s = close_timeout_s
        self._script = client.register_script(_APPLY_LUA)
        # Each store instance writes its own `seq:<id>` field, so idempotency survives many writers.
        self._seq_field = f"seq:{uuid.uuid4().hex[:12]}"
        # Ops in submission order. An op evicted from the middle (fair share, below) stays here as a
        # tombstone (its seq in `_evicted`) until the writer passes it: a deque cannot drop from the middle.
        self._pending: collections.deque[_Op] = collections.deque()
        self._evicted: set[int] = set()
        self._by_call: dict[str, collections.deque[_Op]] = {}  # each call's live pending ops, in order
        self._restore = client.register_script(_RESTORE_LUA)
        self._streaming_on = client.register_script(_STREAMING_ON_LUA)
        self._end_lost = client.register_script(_END_LOST_LUA)
        self._claim = client.register_script(_CLAIM_LUA)
        self._release_claim = client.register_script(_RELEASE_CLAIM_LUA)
        # Live calls' records as written here, so a Redis that comes back empty gets them back whole.
        self._shadows: collections.OrderedDict[str, _Shadow] = collections.OrderedDict()
        self.max_shadows = DEFAULT_MAX_RECORDS
        # Calls being adopted: our ops for each since adopt() began, until the record read returns.
        self._adopting: dict[str, list[_Op]] = {}
        self._adopt_tasks: set[asyncio.Task[None]] = set()
        self.unapplied_ops = 0
        self._wakeup = asyncio.Event()
        self._progress = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closed = False
        self.dropped_ops = 0  # ops lost to the buffer bound (or written after aclose)
        _register_store(self)

    @property
    def pending_ops(self) -> int:
        return len(self._pending) - len(self._evicted)

    @property
    def _call_prefix(self) -> str:
        return f"{self.key_prefix}call:"

    def _call_keys(self, call_sid: str) -> list[str]:
        base = self._call_prefix + call_sid
        return [base + suffix for suffix in _KEY_SUFFIXES]

    @property
    def _index_key(self) -> str:
        return f"{self.key_prefix}calls"

    @property
    def _streaming_key(self) -> str:
        return f"{self.key_prefix}streaming"

    def _script_keys(self, call_sid: str) -> list[str]:
        """KEYS of _APPLY_LUA and _RESTORE_LUA."""
        return [*self._call_keys(call_sid), self._index_key, self._streaming_key]

    # ---- write side: never awaits, never raises for Redis trouble ----

    def _submit(self, ops: Sequence[_Op]) -> None:
        if self._closed:
            self._drop(len(ops), "store is closed")
            return
        for op in ops:
            self._shadow(op)
            if self.pending_ops >= self.max_pending:
                self._evict_from_largest()
            self._pending.append(op)
            self._by_call.setdefault(op.call_sid, collections.deque()).append(op)
        self._wakeup.set()
        self._ensure_writer()

    def _evict_from_largest(self) -> None:
        """The buffer is full: the call holding the most ops loses its oldest (not a create or an end, if it
        has another). One call flooding writes so pushes out its own, never another call's."""
        sid, ops = max(self._by_call.items(), key=lambda kv: len(kv[1]))
        victim = next((op for op in ops if op.kind not in ("create", "begin", "end")), ops[0])
        ops.remove(victim)  # usually the head
        if not ops:
            del self._by_call[sid]
        self._evicted.add(victim.seq)
        if len(self._evicted) > self.max_pending:
            # The tombstones leave only as the writer passes them: through an outage (Redis down, or refusing
            # writes) that is never, and they grew with it, ops' text and all, until the process ran out of
            # memory. Compacted here, the buffer holds at most twice its bound. The writer pops by seq, so an
            # op of its batch in flight that is dropped from the deque now is simply not there to pop.
            self._pending = collections.deque(op for op in self._pending if op.seq not in self._evicted)
            self._evicted.clear()
        self._drop(1, f"buffer full ({self.max_pending} ops); call {sid} holds the most")

    def _shadow(self, op: _Op) -> None:
        shadow = self._shadows.get(op.call_sid)
        if shadow is None:
            if op.kind != "create":
                if (adopting := self._adopting.get(op.call_sid)) is not None:
                    adopting.append(op)  # laid over the record once its read returns
                return
            record = _apply(None, op)
            assert record is not None
            shadow = self._shadows[op.call_sid] = _Shadow(record, op.seq)
            while len(self._shadows) > self.max_shadows:  # calls never ended (a bug elsewhere) stay bounded
                self._shadows.popitem(last=False)
        else:
            _apply(shadow.record, op)
            shadow.seq = op.seq
        self._shadows.move_to_end(op.call_sid)

    def adopt(self, call_sid: str) -> None:
        """Start a shadow of a call created elsewhere (another node took its webhook), before writing to it.
        Without one, a Redis that loses the call mid-stream could not be given it back.

        Returns at once: the record is read in the background, so a slow Redis never holds up a call's start
        (Twilio's packets queue meanwhile). Our ops for the call until the read returns are kept, and laid
        over what it read by seq: those Redis already had are not applied twice."""
        if self._closed or call_sid in self._shadows or call_sid in self._adopting:
            return
        self._adopting[call_sid] = list(self._by_call.get(call_sid, ()))  # ours, submitted but maybe not written
        task = asyncio.get_running_loop().create_task(self._adopt(call_sid), name=f"adopt-{call_sid}")
        self._adopt_tasks.add(task)
        task.add_done_callback(self._adopt_tasks.discard)

    async def _adopt(self, call_sid: str) -> None:
        try:
            ((record, applied),) = await self._read([call_sid])
        except Exception as exc:  # Redis down, or a record this version cannot decode: the call goes on, uncopied
            self._adopting.pop(call_sid, None)
            logger.warning("call store: cannot read call %s to keep a copy (%s); it is lost if Redis loses it",
                           call_sid, type(exc).__name__)  # fmt: skip
            return
        ops = self._adopting.pop(call_sid, None)
        if ops is None or call_sid in self._shadows:  # ended meanwhile, or created here after all
            return
        record = self._merge(record, applied, ops)
        if record is None:
            return  # not in Redis: nothing to keep (its ops are counted as unapplied when written)
        self._shadows[call_sid] = _Shadow(record, max(applied, ops[-1].seq if ops else 0))
        while len(self._shadows) > self.max_shadows:
            self._shadows.popitem(last=False)

    def _ensure_writer(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._run_writer(), name="call-store")
            self._writer.add_done_callback(_log_writer_death)

    def _drop(self, n: int, why: str) -> None:
        before = self.dropped_ops
        self.dropped_ops += n
        CALL_STORE_DROPPED_OPS.inc(n)
        if before == 0 or before // 1000 != self.dropped_ops // 1000:  # don't log every op in an outage
            logger.warning("call store: dropped %d op(s), %d in total: %s", n, self.dropped_ops, why)
        self._progress.set()

    async def _run_writer(self) -> None:
        delay = self._retry_initial_s
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            live = (op for op in self._pending if op.seq not in self._evicted)
            batch = list(itertools.islice(live, self._batch_size))
            if not batch:  # only tombstones left
                self._pop_written(self._pending[-1].seq)
                continue
            try:
                await self._write_batch(batch)
            except (RedisError, OSError) as exc:  # OSError covers socket errors and TimeoutError
                REDIS_ERRORS.inc()
                msg = "call store: Redis write failed (%s: %s); %d ops buffered, retry in %.1fs"
                logger.warning(msg, type(exc).__name__, exc, self.pending_ops, delay)
                await asyncio.sleep(delay * random.uniform(0.8, 1.0))
                delay = min(delay * 2, self._retry_max_s)
                continue
            if delay != self._retry_initial_s:
                logger.info("call store: Redis writes recovered; %d ops buffered", self.pending_ops)
            delay = self._retry_initial_s
            self._pop_written(batch[-1].seq)
            self._progress.set()

    def _pop_written(self, upto: int) -> None:
        """Ops up to seq `upto` are in Redis (or were evicted meanwhile): off the buffer; an ended call's
        shadow goes with its end."""
        while self._pending and self._pending[0].seq <= upto:
            op = self._pending.popleft()
            if op.seq in self._evicted:
                self._evicted.discard(op.seq)
                continue
            ops = self._by_call.get(op.call_sid)
            if ops and ops[0] is op:
                ops.popleft()
                if not ops:
                    del self._by_call[op.call_sid]
            if op.kind == "end":
                self._shadows.pop(op.call_sid, None)
                self._adopting.pop(op.call_sid, None)  # a read still out must not bring its shadow back

    async def _write_batch(self, batch: list[_Op]) -> None:
        # MULTI/EXEC: a batch lands whole or not at all, so per-call order survives a retry.
        async with self._redis.pipeline(transaction=True) as pipe:
            for op in batch:
                keys, args = self._encode(op)
                await self._script(keys=keys, args=args, client=pipe)
            results = await pipe.execute(raise_on_error=False)
        unknown: dict[str, list[_Op]] = {}
        for op, result in zip(batch, results, strict=True):
            if isinstance(result, ResponseError) and _transient(result):
                raise result
            if isinstance(result, ResponseError):
                # A poison op (e.g. a foreign key of the wrong type) would block the queue forever: dropped.
                REDIS_ERRORS.inc()
                logger.error("call store: Redis rejected %s op for %s: %s", op.kind, op.call_sid, result)
                self._drop(1, "rejected by Redis")
            elif result == -1:
                unknown.setdefault(op.call_sid, []).append(op)
        for sid, ops in unknown.items():
            await self._restore_or_count(sid, ops)

    async def _restore_or_count(self, call_sid: str, ops: list[_Op]) -> None:
        """Redis does not have a call we wrote to: if it is one of our live calls, write its whole record back
        (our later ops then apply on top; those it already includes are skipped by seq). Otherwise the ops
        cannot be applied: counted and logged, never silent."""
        shadow = self._shadows.get(call_sid)
        if shadow is not None:
            record = shadow.record
            scalars = {f.name: _encode_scalar(getattr(record, f.name)) for f in dataclasses.fields(CallRecord)
                       if f.name not in (*_LIST_NAMES, "call_sid")}  # fmt: skip
            lists = [[_encode_item(item) for item in getattr(record, name)] for name in _LIST_NAMES_BY_KEY]
            args = [self._seq_field, shadow.seq, self._ttl_ms, call_sid, repr(time.time()),
                    json.dumps(scalars, separators=(",", ":")), json.dumps(lists, separators=(",", ":"))]  # fmt: skip
            if await self._restore(keys=self._script_keys(call_sid), args=args) == 1:
                CALL_STORE_RESTORED_RECORDS.inc()
                logger.warning("call store: Redis had no record of live call %s (it expired while the call was "
                               "quiet, or Redis restarted empty); its whole record is written back", call_sid)
                return
        self.unapplied_ops += len(ops)
        CALL_STORE_UNAPPLIED_OPS.inc(len(ops))
        logger.warning("call store: %d %s op(s) for call %s not applied: Redis has no such call (expired or "
                       "lost) and this node holds no copy of it", len(ops), ops[0].kind, call_sid)  # fmt: skip

    def _encode(self, op: _Op) -> tuple[list[str], list[str | int | float]]:
        keys = self._script_keys(op.call_sid)
        args: list[str | int | float] = [op.kind, self._seq_field, op.seq, self._ttl_ms]
        args += [op.call_sid, repr(op.submitted)]
        if op.kind == "push":
            assert op.list_name is not None and op.item is not None
            args += [_encode_item(op.item), _LIST_KEY_POS[op.list_name]]
        else:
            fields = {k: _encode_scalar(v) for k, v in op.fields.items()}
            args.append(json.dumps(fields, separators=(",", ":")))
        return keys, args

    async def flush(self) -> None:
        """Wait until every op submitted so far is in Redis (or dropped). Bound it with
        `asyncio.timeout`: while Redis is down this waits for it."""
        if not self._pending:
            return
        target = self._pending[-1].seq
        self._ensure_writer()
        while self._pending and self._pending[0].seq <= target:
            self._progress.clear()
            await self._progress.wait()

    async def aclose(self) -> None:
        """Flush (up to `close_timeout_s`), stop the writer and close the client."""
        try:
            async with asyncio.timeout(self.close_timeout_s):
                await self.flush()
        except TimeoutError:
            logger.warning("call store: closing with %d ops not written to Redis", self.pending_ops)
        self._closed = True
        adopting = list(self._adopt_tasks)
        for task in adopting:
            task.cancel()
        await asyncio.gather(*adopting, return_exceptions=True)
        if self._writer is not None:
            self._writer.cancel()
            try:
                await self._writer
            except asyncio.CancelledError:
                pass
        await self._redis.aclose()

    # ---- read side: Redis state plus this instance's unflushed ops ----

    async def get(self, call_sid: str) -> CallRecord | None:
        pending = list(self._by_call.get(call_sid, ()))  # snapshot BEFORE the read
        ((record, applied),) = await self._read([call_sid])
        return self._merge(record, applied, pending)

    async def brief(self, call_sid: str) -> CallBrief | None:
        """`get` for three fields: one HMGET, no list read or decoded on the event loop (a 2-hour call's
        full read took 80 ms). Our unflushed writes are laid over it like `get` does."""
        pending = [op for op in self._by_call.get(call_sid, ()) if op.kind != "push"]  # snapshot BEFORE the read
        key = self._call_keys(call_sid)[0]
        state, node, agent, applied = await self._guard(
            self._redis.hmget(key, ["state", "node", "agent", self._seq_field]))  # fmt: skip
        record = None
        if state is not None:
            record = CallRecord(call_sid=call_sid, state=state, node=node, agent=agent)
        record = self._merge(record, int(applied or 0), pending)
        return None if record is None else CallBrief(record.state, record.node, record.agent)

    async def claim(self, call_sid: str, node: str) -> bool:
        """Take this call id for `node`: False if it has a record (here unflushed, or in Redis) or another
        claim holds it. One script, so two nodes offered the same id never both win. Raises
        CallStoreUnavailable when Redis cannot answer (the caller decides whether to answer unchecked)."""
        if call_sid in self._by_call or call_sid in self._shadows:
            return False
        claimed = await self._guard(self._claim(
            keys=[self._call_keys(call_sid)[0], self._claim_key(call_sid)],
            args=[node, self._ttl_ms]))  # fmt: skip
        return bool(claimed)

    async def release_claim(self, call_sid: str, node: str) -> None:
        """Give back `node`'s claim on this call id, if it still holds it; Redis trouble is logged, not raised
        (the claim then expires with its ttl)."""
        with contextlib.suppress(CallStoreUnavailable):
            await self._guard(self._release_claim(keys=[self._claim_key(call_sid)], args=[node]))

    @property
    def _ttl_ms(self) -> int:
        """`ttl_s` as the scripts take it (PX: whole milliseconds, at least 1)."""
        return max(1, round(self.ttl_s * 1000))

    def _claim_key(self, call_sid: str) -> str:
        return f"{self.key_prefix}claim:{call_sid}"

    async def list_recent(self, limit: int = 50) -> list[CallRecord]:
        """Live calls, most recently written first."""
        pending: dict[str, list[_Op]] = collections.defaultdict(list)
        for op in list(self._pending):
            if op.seq not in self._evicted:
                pending[op.call_sid].append(op)
        # Calls with unflushed writes are the most recent; then the index, page by page.
        sids = sorted(pending, key=lambda sid: pending[sid][-1].seq, reverse=True)
        records: list[CallRecord] = []
        seen: set[str] = set()
        start = 0
        # The index is pruned only by writes: after a quiet night it still held the day's expired calls, and a
        # listing walked them all (150,000 commands for one live call among 20,000). Pruned here too, by
        # Redis's clock as the writes do; and the walk is bounded.
        try:  # best effort: a Redis refusing writes (MISCONF, NOREPLICAS, a read-only replica) still lists
            seconds, micros = await self._redis.time()
            expired = seconds + micros / 1e6 - self.ttl_s
            await self._redis.zremrangebyscore(self._index_key, "-inf", f"({expired!r}")
        except (RedisError, OSError) as exc:
            logger.debug("call store: the index was not pruned before a listing (%s)", type(exc).__name__)
        pages = 0
        while True:
            batch = [sid for sid in sids if sid not in seen]
            seen.update(batch)
            for sid, (record, applied) in zip(batch, await self._read(batch), strict=True):
                if (merged := self._merge(record, applied, pending.get(sid, ()))) is not None:
                    records.append(merged)
            if len(records) >= limit or pages >= MAX_LIST_PAGES:
                return records[:limit]
            sids = await self._guard(self._redis.zrevrange(self._index_key, start, start + limit - 1))
            if not sids:
                return records
            start += len(sids)
            pages += 1

    async def streaming_nodes(self) -> set[str]:
        """The nodes Redis has calls streaming on (the sweep of crashed nodes' calls asks every few seconds:
        one small set, whatever the calls)."""
        return set(await self._guard(self._redis.smembers(self._streaming_key)))

    async def streaming_on(self, node: str) -> dict[str, CallBrief]:
        """The calls Redis has streaming on `node`, by call id: one script, no call's lists read. This store's
        unflushed writes are not laid over."""
        rows = await self._guard(self._streaming_on(keys=[self._streaming_key],
                                                    args=[self._call_prefix, node]))  # fmt: skip
        return {sid: CallBrief("streaming", node, agent or None) for sid, agent in rows}

    async def end_lost(
        self, call_sid: str, node: str, reason: str, alive_keys: Sequence[str] = (), *, own_node: bool = False
    ) -> bool:
        """End a call that `node`, gone, left streaming: once however many nodes find it (True: the one that
        ended it, to count it), written at once. False if it is not streaming on `node` (any more), if any of
        `alive_keys` (the node's heartbeat keys) exists (the node is back, and its calls of the new run are its
        own), or if it is this run's: `own_node` (this node's previous run's calls), one this store has written
        to; another node's, one with writes of this store still queued. A webhook this node answered wrote the
        call's record: by the first rule a node never ended a call whose stream another node had, in a
        cluster of two no node did."""
        if not own_node and call_sid in self._by_call:
            return False  # this run's writes to it are on their way (a stream taken over here): they decide
        args = [node, reason, repr(time.time()), self._seq_field if own_node else "", call_sid]
        keys = [self._call_keys(call_sid)[0], self._streaming_key, *alive_keys]
        return bool(await self._guard(self._end_lost(keys=keys, args=args)))

    @staticmethod
    def _merge(record: CallRecord | None, applied: int, ops: Iterable[_Op]) -> CallRecord | None:
        for op in ops:
            if op.seq > applied:  # ops at or below `applied` were already in the Redis snapshot
                record = _apply(record, op)
        return record

    async def _read(self, sids: Sequence[str]) -> list[tuple[CallRecord | None, int]]:
        """Each call's record (None if absent) and the last seq this instance applied to it."""
        if not sids:
            return []

        async def run() -> list[Any]:
            async with self._redis.pipeline(transaction=True) as pipe:  # one consistent snapshot
                for sid in sids:
                    base, *lists = self._call_keys(sid)
                    pipe.hgetall(base)
                    for key in lists:
                        pipe.lrange(key, 0, -1)
                return await pipe.execute()

        raw = await self._guard(run())
        n = len(_KEY_SUFFIXES)
        # Decoded in a thread: a listing of long calls is thousands of JSON items, and on the event loop it
        # held every live call's media for a second.
        return await asyncio.to_thread(
            lambda: [self._decode(sid, raw[i * n : (i + 1) * n]) for i, sid in enumerate(sids)])

    def _decode(self, call_sid: str, raw: list[Any]) -> tuple[CallRecord | None, int]:
        """A record as Redis holds it; None for one that cannot be read (logged), never an exception: one odd
        record (an item a newer version wrote, mid-upgrade) made the whole listing a 500."""
        fields, turns, oracle, dtmf, latencies, tools = raw
        if not fields:
            return None, 0
        try:
            kw: dict[str, Any] = {k: v for k, v in fields.items() if k in _STR_FIELDS}
            kw |= {k: float(v) for k, v in fields.items() if k in _FLOAT_FIELDS or k == "created_at"}
            kw |= {"turns": _items(Turn, turns), "dtmf": dtmf, "oracle": _items(OracleNote, oracle),
                   "tools": _items(ToolNote, tools)}  # fmt: skip
            record = CallRecord(call_sid=call_sid, turn_latencies_s=[float(x) for x in latencies], **kw)
            applied = int(fields.get(self._seq_field, 0))
        except (ValueError, TypeError) as exc:
            CALL_STORE_UNREADABLE.labels(what="record").inc()
            logger.warning("call %s: its record in Redis cannot be read (%s); left out", call_sid,
                           type(exc).__name__)  # fmt: skip
            return None, 0
        read = len(record.turns) + len(record.oracle) + len(record.tools)
        if skipped := len(turns) + len(oracle) + len(tools) - read:
            logger.warning("call %s: %d items of its record in Redis cannot be read; left out", call_sid, skipped)
        return record, applied

    async def _guard(self, aw: Any) -> Any:
        try:
            return await aw
        except (RedisError, OSError) as exc:
            REDIS_ERRORS.inc()
            logger.warning("call store: Redis read failed (%s: %s)", type(exc).__name__, exc)
            raise CallStoreUnavailable(f"call store read failed: {type(exc).__name__}") from exc

    async def ping(self) -> bool:
        """Health check. Not counted in REDIS_ERRORS: probes would double-count an outage."""
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False


def open_call_store(
    redis_url: str | None,
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    ttl_s: float = DEFAULT_TTL_S,
    store_transcripts: bool = True,
    max_pending: int = DEFAULT_MAX_PENDING,
    max_records: int = DEFAULT_MAX_RECORDS,
    socket_timeout_s: float = 2.0,
    retry_max_s: float = 5.0,
) -> CallStore:
    """A Redis store for `redis_url`, or an in-process one (single node only) when it is None.
    Connects lazily, so this never blocks."""
    if not redis_url:
        logger.warning("call store: no REDIS_URL; keeping call state in process (single node only)")
        return MemoryCallStore(ttl_s=ttl_s, max_records=max_records, store_transcripts=store_transcripts)
    client = aioredis.Redis.from_url(
        redis_url,
        decode_responses=True,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0),  # the writer task owns retry and backoff
    )
    msg = "call store: Redis at %s, prefix %r, retention %.0fs, transcripts %s"
    logger.info(msg, _safe_url(redis_url), key_prefix, ttl_s, "on" if store_transcripts else "off")
    return RedisCallStore(
        client,
        key_prefix=key_prefix,
        ttl_s=ttl_s,
        store_transcripts=store_transcripts,
        max_pending=max_pending,
        retry_max_s=retry_max_s,
    )
