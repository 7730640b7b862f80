"""Which node takes a call: slot reservations across one or many service nodes.

`/twilio/voice` may land on any node. It reserves a call slot on a node with room and answers TwiML
that points Twilio's media stream at *that* node, with a per-call token. The stream's `start` then
claims the reservation on the node it reached (or, where nodes share one URL behind a load balancer and
the stream reached another of them, moves it there). Two implementations of one `Cluster` protocol:

- `LocalCluster`: a single node, in process (no REDIS_URL).
- `RedisCluster`: nodes publish their free slots in Redis with heartbeats; one Lua script picks a node
  and writes the reservation atomically, so concurrent webhooks on many nodes never over-book a node.
  If Redis fails, a node falls back to admitting calls on itself only, so an outage never drops a call
  this node could take.

Redis layout (prefix `kame:` by default; all times are Redis's own clock, in ms, so node clocks don't matter):
  <p>nodes              sorted set: node id scored by its last heartbeat; stale ones are pruned
  <p>node:<id>          hash url (the node's wss media URL), free, draining, ts, percall (= ts when the node's
                        streams take per-call URLs: see `stream_url_for`); expires after node_ttl_s
  <p>node:<id>:resv     sorted set: CallSids with an unclaimed reservation on the node, scored by expiry
  <p>node:<id>:held     sorted set: CallSids claimed on the node whose stream the node has not yet counted in a
                        `free` it sent (see below), scored by expiry
  <p>alive:<id>         a node out of routing (AudioSocket only: `routable` False) says it is up here instead of
                        in nodes and node:<id>; expires after node_ttl_s, like node:<id>
  <p>resv:<sid>         hash node, url, token, state (reserved|claimed|ended), until (the reservation's expiry,
                        ms), percall (1: the TwiML gave the call's own URL); kept bound_ttl_s (a replayed
                        webhook for it gets no new token, claimed, ended or expired unclaimed)
A node's room is `free - (live entries in its resv set)`. `free` counts engine seats not held by a
stream; a claim moves a call from the resv set into `free` at once (HINCRBY -1), and the node's next
heartbeat publishes the real figure.

No process lock is held across a round trip to Redis: concurrent webhooks reserve in parallel, and the
scripts alone keep the books. A node's own seat count (its `free` in a heartbeat, or in a reservation made
from it) is computed before the script runs, so a claim landing in between would make it count a seat
twice. So a claim also puts its call in the node's held set (until the call ends, or for a few seconds),
and each figure the node sends comes with the calls whose stream it counts (`acked`): held calls not acked
are seats taken that the figure has not subtracted. Entries leave the held set only by expiry or release,
never because a newer figure counted them: an older one may still be on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from .admission import Admission, CallSidUsed, new_token, tokens_match
from .call_store import _safe_url
from .config import ServiceConfig
from .metrics import REDIS_ERRORS

log = logging.getLogger(__name__)

CapacityFn = Callable[[], int]  # engine seats free on this node, not counting reservations


def stream_url_for(base_url: str, call_sid: str) -> str:
    """The call's own Media Streams URL on the node whose base is `base_url` (…/twilio/media/<CallSid>).

    Twilio signs the upgrade over the URL alone (no nonce, no body): on one fixed URL, a signature captured
    once opened sockets on any node forever. On the call's own URL it opens that call's stream, which starts
    once and is then refused before the upgrade."""
    return f"{base_url}/{call_sid}"


@dataclass(frozen=True, slots=True)
class Reservation:
    """A call slot held on `node_id` until its stream starts there (or the reservation expires)."""

    node_id: str
    stream_url: str  # the call's URL on that node (`stream_url_for`), or the node's fixed URL (an older node)
    token: str = field(repr=False)  # goes to Twilio as a <Parameter>; never logged


class Cluster(Protocol):
    """Slot reservations for calls, on this node or on any node of the cluster."""

    @property
    def reserved(self) -> int:
        """Reservations held on THIS node whose stream has not started (they count against its room)."""
        ...

    @property
    def legacy_media_path(self) -> bool:
        """Some node of the cluster still answers webhooks with the fixed stream URL (…/twilio/media, no
        CallSid): a rolling update from a version before per-call URLs. While one heartbeats, and for as long
        as a reservation it made may still be waiting for its stream, this node takes streams on the fixed
        URL as well; after that, it refuses them."""
        ...

    async def start(self) -> None: ...

    async def refresh(self) -> None:
        """Publish this node's free slots now (e.g. the engine just came up), not at the next heartbeat."""
        ...

    def seat_taken(self) -> None:
        """A call took a seat here without a reservation (AudioSocket): publish the free slots soon, so the
        other nodes stop routing Twilio calls to a seat that is gone (never waits on Redis)."""
        ...

    async def drain(self) -> None:
        """Take no new reservations on this node (and tell the other nodes at once)."""
        ...

    async def aclose(self) -> None: ...

    async def reserve(self, call_sid: str) -> Reservation | None:
        """Hold a slot for `call_sid` on a node with room; None when every node is full.
        A retried webhook (same CallSid) gets the same reservation back until its stream starts; after
        that (or after a release) raises `CallSidUsed`: a replayed webhook gets no new token."""
        ...

    async def claim(self, call_sid: str, token: str | None) -> bool:
        """On the node the stream reached: True if the call was reserved HERE with this token, once: the
        token is single-use, so a second socket with it gets False. After True, the caller counts the
        stream in `capacity_fn` before it next awaits (as `ServerContext.add_stream` does), so the seat is
        never seen free in between."""
        ...

    async def release(self, call_sid: str) -> None:
        """The call has ended on this node: forget its binding."""
        ...

    async def awaits_stream(self, call_sid: str) -> bool | None:
        """Whether the call has a live reservation whose stream has not started (its stream URL was given with
        one, so a signed upgrade on it otherwise is a replay: started, ended, expired, or forgotten long since).
        None: cannot tell (Redis failing)."""
        ...

    async def streamed(self, call_sid: str) -> bool | None:
        """Whether the call's stream started on some node (claimed, or ended since), whatever its record
        says: the record lags while that node's writes wait out a Redis outage. None: cannot tell."""
        ...

    async def forsake(self, call_sid: str) -> bool | None:
        """The caller is gone (Twilio's final status) and the call's record says its stream never started: if
        it has not (its reservation, on whichever node, still unclaimed), the reservation is used up at once,
        so a stream arriving after is refused, and True: the caller ends the record. False: it started after
        all (claimed, or ended since); None: cannot tell. Checked and used up in one step: checked and left
        live (`streamed`), a `start` racing the callback reopened the ended record and was counted twice."""
        ...

    async def node_alive(self, node_id: str) -> bool | None:
        """Whether node `node_id` still heartbeats (its node hash has not expired). None: cannot tell."""
        ...

    def heartbeat_keys(self, node_id: str) -> tuple[str, ...]:
        """The Redis keys whose presence says `node_id` heartbeats (none without Redis): ending a gone node's
        call checks them in the same script, so a node back in the meantime keeps its calls."""
        ...


class LocalCluster:
    """One node, in process: the per-call tokens of `Admission` plus this node's free slots."""

    def __init__(
        self,
        node_id: str,
        stream_url: str | Callable[[], str],
        capacity_fn: CapacityFn,
        reservation_ttl_s: float = 8.0,
    ) -> None:
        self.node_id = node_id
        self._stream_url = stream_url  # a callable when the port is only known once listening
        self.capacity_fn = capacity_fn
        self.admission = Admission(reservation_ttl_s)
        self.draining = False

    @property
    def stream_url(self) -> str:
        return self._stream_url() if callable(self._stream_url) else self._stream_url

    @property
    def reserved(self) -> int:
        return self.admission.reserved

    @property
    def legacy_media_path(self) -> bool:
        return False  # one node: its webhooks are this version's

    async def start(self) -> None:
        return None

    async def refresh(self) -> None:
        return None

    def seat_taken(self) -> None:
        return None  # free_slots() is read when asked: nothing to publish

    async def drain(self) -> None:
        self.draining = True

    async def aclose(self) -> None:
        return None

    async def reserve(self, call_sid: str) -> Reservation | None:
        if self.admission.used(call_sid):
            raise CallSidUsed(call_sid)
        token = self.admission.token_for(call_sid)
        if token is None:
            if self.draining or self.capacity_fn() - self.admission.reserved <= 0:
                return None
            token = self.admission.issue(call_sid)
        return Reservation(self.node_id, stream_url_for(self.stream_url, call_sid), token)

    async def claim(self, call_sid: str, token: str | None) -> bool:
        return self.admission.claim(call_sid, token)

    async def release(self, call_sid: str) -> None:
        self.admission.release(call_sid)

    async def awaits_stream(self, call_sid: str) -> bool | None:
        return self.admission.awaited(call_sid)

    async def streamed(self, call_sid: str) -> bool | None:
        return self.admission.streamed(call_sid)

    async def forsake(self, call_sid: str) -> bool | None:
        if self.admission.streamed(call_sid):
            return False
        self.admission.release(call_sid)  # unclaimed: used up (one process: nothing ran in between)
        return True

    async def node_alive(self, node_id: str) -> bool | None:
        return True if node_id == self.node_id else None  # no registry of other nodes here

    def heartbeat_keys(self, node_id: str) -> tuple[str, ...]:
        return ()


_NOW_MS_LUA = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"


# How many calls claimed in Redis on this node the node's own free-seat figure does not count yet: those in
# its held zset that are not among ARGV[first_acked..] (the calls whose stream the figure counts).
_HELD_LUA = """
local function unsubtracted(held, first_acked, now)
  redis.call('ZREMRANGEBYSCORE', held, '-inf', now)
  local n = redis.call('ZCARD', held)
  for i = first_acked, #ARGV do
    if redis.call('ZSCORE', held, ARGV[i]) then n = n - 1 end
  end
  return n
end
"""

# KEYS 1 node hash, 2 nodes zset, 3 node resv zset, 4 node held zset. ARGV 1 node id, 2 stream url, 3 free,
# 4 draining (0/1), 5 node ttl ms, 6 prefix, 7.. acked calls. Returns {the node's live reservation count, how
# many other live nodes give the fixed stream URL}. `percall` is written as the beat's own `ts`: an older
# version's beat moves `ts` and leaves `percall` behind, so a node id taken over by an older pod (a rollback)
# reads as fixed-URL at its first beat, not as per-call until its hash expires.
_HEARTBEAT_LUA = _NOW_MS_LUA + _HELD_LUA + """
local free = math.max(0, tonumber(ARGV[3]) - unsubtracted(KEYS[4], 7, now))
redis.call('HSET', KEYS[1], 'url', ARGV[2], 'free', free, 'draining', ARGV[4], 'ts', now, 'percall', now)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - tonumber(ARGV[5])))
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[5]) * 10)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local legacy = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if id ~= ARGV[1] then
    local n = redis.call('HMGET', ARGV[6] .. 'node:' .. id, 'ts', 'percall')
    if n[1] and n[1] ~= n[2] then legacy = legacy + 1 end
  end
end
return {redis.call('ZCARD', KEYS[3]), legacy}
"""

# KEYS 1 nodes zset, 2 resv:<sid>. ARGV 1 prefix, 2 call sid, 3 local node id, 4 token, 5 reservation ttl ms,
# 6 node ttl ms, 7 local node out of routing (draining, or AudioSocket only: 0/1), 8 local node's free slots now
# (fresher than its heartbeat), 9 ms to remember the CallSid, 10 local node's stream url, 11.. acked calls (see
# _HELD_LUA). Returns {node, url, token, reservations on that node, percall ('1': the node takes the call's own
# URL, `stream_url_for`; '0': an older node, its fixed URL)} or nil. A reservation is kept past its
# expiry (`until`): a webhook replayed after it (a captured one) is used up, not granted a seat and a token
# again every few seconds.
_RESERVE_LUA = _NOW_MS_LUA + _HELD_LUA + """
local held = redis.call('HMGET', KEYS[2], 'node', 'url', 'token', 'state', 'until', 'percall')
if held[1] then
  if held[4] ~= 'reserved' then return 'used' end  -- its stream started (or ended): a replayed webhook
  if held[5] and tonumber(held[5]) <= now then return 'used' end  -- expired unclaimed: its one chance went
  return {held[1], held[2], held[3], -1, held[6] or '0'}  -- a retried webhook: the URL it was given
end
local p, me = ARGV[1], ARGV[3]
local best, best_url, best_room, best_pc = nil, nil, 0, '1'
-- This node first (the webhook and the stream on one node: fewer hops), from its own figures: it is a
-- candidate even while its heartbeat is missing here (Redis restarted empty, or its last beat came late).
if ARGV[7] ~= '1' then
  local rz = p .. 'node:' .. me .. ':resv'
  redis.call('ZREMRANGEBYSCORE', rz, '-inf', now)
  local room = tonumber(ARGV[8]) - unsubtracted(p .. 'node:' .. me .. ':held', 11, now) - redis.call('ZCARD', rz)
  if room > 0 then best, best_url, best_room = me, ARGV[10], room end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[6])))
if not best then  -- else the node with the most room
  for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local n = redis.call('HMGET', p .. 'node:' .. id, 'url', 'free', 'draining', 'ts', 'percall')
    if id ~= me and n[1] and n[3] ~= '1' then
      local rz = p .. 'node:' .. id .. ':resv'
      redis.call('ZREMRANGEBYSCORE', rz, '-inf', now)
      local room = (tonumber(n[2]) or 0) - redis.call('ZCARD', rz)
      if room > 0 and (room > best_room or (room == best_room and id < best)) then
        best, best_url, best_room = id, n[1], room
        best_pc = (n[5] and n[5] == n[4]) and '1' or '0'
      end
    end
  end
end
if not best then return false end
local ttl = tonumber(ARGV[5])
local rz = p .. 'node:' .. best .. ':resv'
redis.call('HSET', KEYS[2], 'node', best, 'url', best_url, 'token', ARGV[4], 'state', 'reserved', 'until', now + ttl,
           'percall', best_pc)
redis.call('PEXPIRE', KEYS[2], ARGV[9])
redis.call('ZADD', rz, now + ttl, ARGV[2])
redis.call('PEXPIRE', rz, ttl * 2)
return {best, best_url, ARGV[4], redis.call('ZCARD', rz), best_pc}
"""

# The seat moves from the resv set to taken; held until the node's own figure counts the stream (_HELD_LUA).
_TAKE_SEAT_LUA = """
local function take_seat(resv, node, held, sid, held_ms, now)
  redis.call('ZREM', resv, sid)
  if redis.call('EXISTS', node) == 1 then
    redis.call('HINCRBY', node, 'free', -1)  -- the stream now holds the seat; the heartbeat catches up
  end
  redis.call('ZADD', held, now + held_ms, sid)
  redis.call('PEXPIRE', held, held_ms)
  return redis.call('ZCARD', resv)
end
"""

# KEYS 1 resv:<sid>, 2 node resv zset, 3 node hash, 4 node held zset. ARGV 1 call sid, 2 node id, 3 token,
# 4 bound ttl ms, 5 held ttl ms. The caller has already checked the token in constant time; this re-checks it
# to consume atomically. Returns the node's reservation count, or -1 when the reservation is gone or not ours.
_CLAIM_LUA = _NOW_MS_LUA + _TAKE_SEAT_LUA + """
local held = redis.call('HMGET', KEYS[1], 'node', 'token', 'state', 'until')
if held[1] ~= ARGV[2] or held[2] ~= ARGV[3] or held[3] ~= 'reserved' then return -1 end  -- single-use
if held[4] and tonumber(held[4]) <= now then return -1 end  -- expired: too late for its stream
redis.call('HSET', KEYS[1], 'state', 'claimed')
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return take_seat(KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[5]), now)
"""

# The stream reached this node, but the reservation is another node's that gives the same stream URL (nodes
# behind one public host name: Twilio's stream lands on whichever the load balancer picks, e.g. an old and a
# new pod during a rolling update). It is as good a stream as any: the seat moves here. KEYS 1 resv:<sid>,
# 2 the reserving node's resv zset, 3 this node's resv zset, 4 this node's hash, 5 this node's held zset.
# ARGV 1 call sid, 2 the reserving node's id, 3 token, 4 bound ttl ms, 5 held ttl ms, 6 this node's id, 7 this
# node's stream url. Returns this node's reservation count, or -1 as _CLAIM_LUA.
_TAKEOVER_LUA = _NOW_MS_LUA + _TAKE_SEAT_LUA + """
local held = redis.call('HMGET', KEYS[1], 'node', 'token', 'state', 'until', 'url')
if held[1] ~= ARGV[2] or held[2] ~= ARGV[3] or held[3] ~= 'reserved' or held[5] ~= ARGV[7] then return -1 end
if held[4] and tonumber(held[4]) <= now then return -1 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'node', ARGV[6], 'state', 'claimed')
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return take_seat(KEYS[3], KEYS[4], KEYS[5], ARGV[1], tonumber(ARGV[5]), now)
"""

# Redis lost resv:<sid> (a restart without persistence, a failover, an eviction) and this node's own book
# admitted the stream: write the binding back as claimed, so a replayed webhook gets no new token.
# KEYS and ARGV as _CLAIM_LUA, plus ARGV 6 the node's stream url. Returns the node's reservation count.
_RESTORE_LUA = _NOW_MS_LUA + _TAKE_SEAT_LUA + """
redis.call('HSET', KEYS[1], 'node', ARGV[2], 'url', ARGV[6], 'token', ARGV[3], 'state', 'claimed')
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return take_seat(KEYS[2], KEYS[3], KEYS[4], ARGV[1], tonumber(ARGV[5]), now)
"""

# KEYS 1 resv:<sid>, 2 node resv zset, 3 node held zset. ARGV 1 call sid, 2 node id, 3 ms to remember the
# CallSid as used up.
# KEYS 1 resv:<sid>. Returns 1 if the reservation waits for its stream (reserved, not expired on Redis's clock),
# else 0: one round trip, the expiry read as the other scripts read it.
_AWAITS_LUA = _NOW_MS_LUA + """
local held = redis.call('HMGET', KEYS[1], 'state', 'until')
if held[1] ~= 'reserved' then return 0 end
if held[2] and tonumber(held[2]) <= now then return 0 end
return 1
"""

# KEYS 1 resv:<sid>. ARGV 1 call sid, 2 prefix, 3 bound ttl ms. Returns 1 (was unclaimed: now used up, its
# node's seat freed), 0 (its stream started: claimed or ended) or -1 (no binding: cannot tell).
_FORSAKE_LUA = """
local held = redis.call('HMGET', KEYS[1], 'state', 'node')
if not held[1] then return -1 end
if held[1] ~= 'reserved' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'ended')  -- kept, so the stream's claim (and a replay) is refused
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if held[2] then redis.call('ZREM', ARGV[2] .. 'node:' .. held[2] .. ':resv', ARGV[1]) end
return 1
"""

_RELEASE_LUA = """
if redis.call('HGET', KEYS[1], 'node') == ARGV[2] then
  redis.call('HSET', KEYS[1], 'state', 'ended')  -- kept, token and all, so a replayed webhook is known
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

# A renewed key's TTL is a beat's interval above its unrenewed fall (1 s by default; tests use 0.1 s): this
# much allows for the round trips' own time.
_RENEWED_MARGIN_MS = 40
_REDIS_FAILURES = (RedisError, OSError)  # OSError covers socket errors and TimeoutError


class NodeIdInUse(RuntimeError):
    """Another live node heartbeats under this node's id: starting would end its calls as this node's own
    leftovers (lost_calls) and mix both nodes' seats under one key."""


class RedisCluster:
    """Many nodes sharing one Redis. See the module docstring for the key layout."""

    def __init__(
        self,
        client: aioredis.Redis,
        node_id: str,
        stream_url: str,
        capacity_fn: CapacityFn,
        *,
        heartbeat_s: float = 1.0,
        node_ttl_s: float = 3.0,
        reservation_ttl_s: float = 8.0,
        bound_ttl_s: float = 12 * 3600.0,
        key_prefix: str = "kame:",
        seats_fn: CapacityFn | None = None,
        routable: bool = True,
    ) -> None:
        assert 0 < heartbeat_s < node_ttl_s, (heartbeat_s, node_ttl_s)
        # Engine seats free even while draining (`capacity_fn` says 0 then, to take no new reservation): a
        # stream taken over from another node behind the same URL is a call already promised a seat, and in a
        # rolling update the old, draining pod still receives streams until its endpoint is removed.
        self._seats_fn = seats_fn or capacity_fn
        self._redis = client  # decode_responses=True (see open_cluster); closed by aclose
        self.node_id = node_id
        self.stream_url = stream_url
        self.capacity_fn = capacity_fn
        self.heartbeat_s = heartbeat_s
        self.node_ttl_s = node_ttl_s
        self.reservation_ttl_s = reservation_ttl_s
        self.bound_ttl_s = bound_ttl_s
        self.key_prefix = key_prefix
        self.draining = False
        # False: an AudioSocket-only node. It refuses Twilio, so it is never offered Twilio's calls, but it still
        # heartbeats (alive:<id>): without that, the other nodes' sweep would end its live calls as node_lost.
        self.routable = routable
        self._heartbeat_script = client.register_script(_HEARTBEAT_LUA)
        self._forsake_script = client.register_script(_FORSAKE_LUA)
        self._reserve_script = client.register_script(_RESERVE_LUA)
        self._claim_script = client.register_script(_CLAIM_LUA)
        self._takeover_script = client.register_script(_TAKEOVER_LUA)
        self._restore_script = client.register_script(_RESTORE_LUA)
        self._release_script = client.register_script(_RELEASE_LUA)
        self._awaits_script = client.register_script(_AWAITS_LUA)
        # Reservations made while Redis was failing, on this node only (counted in the published `free`).
        self._fallback = Admission(reservation_ttl_s)
        # Tokens of Redis reservations on this node, so a stream can still be claimed if Redis fails (or
        # loses the reservation) between the webhook and the stream (not counted: Redis already counts them);
        # and every call whose stream started here, however it was reserved: its token is spent.
        self._mine = Admission(reservation_ttl_s)
        # This node's live Redis reservations as of the last script reply (at _redis_reserved_at, monotonic):
        # each of them expires within reservation_ttl_s, so the figure is no use any older (a Redis outage).
        self._redis_reserved = 0
        self._redis_reserved_at = 0.0
        # Calls claimed through Redis whose stream `capacity_fn` now counts (see the module docstring), and
        # when: added in the same step the claim returns True, kept while the held set may still have them.
        self._acked: dict[str, float] = {}
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._failing = False
        # Other live nodes giving the fixed stream URL, as of the last heartbeat; and when one was last seen.
        self._legacy_peers = 0
        self._legacy_seen_at = -math.inf

    # ---- keys ----

    @property
    def _nodes_key(self) -> str:
        return f"{self.key_prefix}nodes"

    def _node_key(self, node_id: str) -> str:
        return f"{self.key_prefix}node:{node_id}"

    @property
    def _my_resv_key(self) -> str:
        return self._node_key(self.node_id) + ":resv"

    @property
    def _my_held_key(self) -> str:
        return self._node_key(self.node_id) + ":held"

    def _alive_key(self, node_id: str) -> str:
        return f"{self.key_prefix}alive:{node_id}"

    def _resv_key(self, call_sid: str) -> str:
        return f"{self.key_prefix}resv:{call_sid}"

    # ---- health ----

    def _failed(self, what: str, exc: BaseException) -> None:
        REDIS_ERRORS.inc()
        if not self._failing:  # one line per outage, not one per heartbeat
            log.warning("cluster: Redis %s failed (%s: %s); admitting calls on this node only",
                        what, type(exc).__name__, exc)
        self._failing = True

    def _succeeded(self) -> None:
        if self._failing:
            log.info("cluster: Redis reachable again")
        self._failing = False

    # ---- lifecycle ----

    @property
    def reserved(self) -> int:
        return self._fallback.reserved + self._live_redis_reserved()

    @property
    def legacy_media_path(self) -> bool:
        # Not only while one heartbeats: a draining older node's last webhooks reserve here and it exits at once
        # (its hash deleted), their streams still to come, for up to a reservation's life and a beat's lag.
        grace_s = self.reservation_ttl_s + 2 * self.node_ttl_s
        return time.monotonic() - self._legacy_seen_at < grace_s

    def _stream_url(self, base_url: str, call_sid: str, per_call: bool) -> str:
        """The TwiML's stream URL for a reservation on the node at `base_url`. The fixed one while an older node
        heartbeats: behind one shared host name the stream may reach that node, which has no per-call route
        (the newer nodes take the fixed URL meanwhile)."""
        older_here = self._legacy_peers > 0 and self.legacy_media_path  # (a last beat long ago: an outage)
        return stream_url_for(base_url, call_sid) if per_call and not older_here else base_url

    def _live_redis_reserved(self) -> int:
        if time.monotonic() - self._redis_reserved_at >= self.reservation_ttl_s:
            return 0  # all expired by now (or claimed): Redis has not answered since they were counted
        return self._redis_reserved

    def _set_redis_reserved(self, count: int) -> None:
        self._redis_reserved, self._redis_reserved_at = count, time.monotonic()

    def _one_reservation_claimed(self) -> None:
        """A reservation of ours was claimed without a script reply to recount them: count it out here."""
        self._redis_reserved = max(0, self._redis_reserved - 1)

    async def start(self) -> None:
        """Raises NodeIdInUse when a live node already heartbeats under this id."""
        with contextlib.suppress(*_REDIS_FAILURES):  # Redis down: nothing to compare (and no beats either)
            await self._check_node_id_free()
        await self._beat()  # visible (with free = 0 until the engine is ready) before the first webhook
        self._task = asyncio.create_task(self._heartbeats(), name="cluster-heartbeat")
        self._task.add_done_callback(self._heartbeats_ended)

    async def _check_node_id_free(self) -> None:
        """A node key of this id still alive is either this node's last run, which died without closing (its
        keys expire within node_ttl_s), or another node given the same id (two replicas sharing a hostname or
        a KAME_NODE_ID). Only the latter renews them: watched for a beat and a half, a renewal (its keys' TTL
        back up) refuses the start. The URL alone told nothing: replicas behind one host share it."""
        keys = (self._node_key(self.node_id), self._alive_key(self.node_id))

        async def ttls() -> list[int]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.pttl(key)
                return [int(t) for t in await pipe.execute()]

        before = await ttls()
        if all(t < 0 for t in before):  # none there (-2), the usual start: a clean stop deletes them
            return
        watch_s = min(1.5 * self.heartbeat_s, self.node_ttl_s)
        log.info("cluster: node id %r was heartbeating %.1f s ago: watching %.1f s for another live node with it",
                 self.node_id, self.node_ttl_s - max(before) / 1000, watch_s)
        t0 = time.monotonic()
        await asyncio.sleep(watch_s)
        elapsed_ms = (time.monotonic() - t0) * 1000
        # Unrenewed, a TTL falls by the time waited (or the key expires: -2); renewed, it is about a beat's
        # interval above that. A key that appeared meanwhile was made by a node starting with this id too.
        after = await ttls()
        renewed = any(a >= 0 and (b < 0 or a > b - elapsed_ms + _RENEWED_MARGIN_MS)
                      for b, a in zip(before, after, strict=True))
        if renewed:
            url = await self._redis.hget(keys[0], "url")
            where = f" (streams at {url})" if url else ""
            raise NodeIdInUse(f"node id {self.node_id!r} is in use by a live node{where}: give each node its own "
                              "KAME_NODE_ID (the default is the host name)")

    def _heartbeats_ended(self, task: asyncio.Task[None]) -> None:
        if self._closing:
            return
        # Other nodes drop this one after node_ttl_s: it would take no more calls routed from elsewhere.
        exc = None if task.cancelled() else task.exception()
        log.error("cluster: heartbeats of node %r stopped (%r); other nodes will stop routing calls here",
                  self.node_id, exc or "cancelled")

    async def refresh(self) -> None:
        await self._beat()

    def seat_taken(self) -> None:
        self._poke.set()

    async def drain(self) -> None:
        self.draining = True
        await self._beat()  # tell the other nodes now, not at the next heartbeat

    async def aclose(self) -> None:
        # Stopped by a flag, not cancel(): on Python 3.11 a cancel() landing as the heartbeat's
        # asyncio.timeout expires turns into TimeoutError, which the loop suppresses and carries on.
        self._closing = True
        self._poke.set()
        if self._task is not None:
            await self._task  # at most one heartbeat (bounded by the client's socket timeout)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self._node_key(self.node_id), self._alive_key(self.node_id))
                pipe.zrem(self._nodes_key, self.node_id)
                await pipe.execute()
        except _REDIS_FAILURES as exc:  # the record expires after node_ttl_s anyway
            self._failed("node removal", exc)
        await self._redis.aclose()

    async def _heartbeats(self) -> None:
        while not self._closing:
            self._poke.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat_s):
                    await self._poke.wait()
            if not self._closing:
                try:
                    await self._beat()
                except Exception:  # a bug (capacity_fn, a bad reply) must not stop the heartbeats for good
                    log.exception("cluster: heartbeat of node %r failed; beating on", self.node_id)

    async def _beat(self) -> None:
        if not self.routable:
            try:
                await self._redis.set(self._alive_key(self.node_id), "1", px=_ms(self.node_ttl_s))
            except _REDIS_FAILURES as exc:
                self._failed("heartbeat", exc)
                return
            self._succeeded()
            return
        # `free` and `acked` are read together, with no await between: the script subtracts the calls claimed
        # in Redis that this `free` does not count yet (held, not acked), however the round trips interleave.
        free, acked = self._free_here(), self._acked_now()
        keys = [self._node_key(self.node_id), self._nodes_key, self._my_resv_key, self._my_held_key]
        args = [self.node_id, self.stream_url, free, int(self.draining), _ms(self.node_ttl_s), self.key_prefix,
                *acked]  # fmt: skip
        try:
            count, legacy = await self._heartbeat_script(keys=keys, args=args)
        except _REDIS_FAILURES as exc:
            self._failed("heartbeat", exc)
            return
        self._set_redis_reserved(int(count))
        if bool(legacy) != bool(self._legacy_peers):
            log.info("cluster: %s", f"{legacy} node(s) still give the fixed stream URL: taking streams on it too"
                     if legacy else "every node gives per-call stream URLs: the fixed one is refused once the "
                     "older nodes' reservations have lapsed")  # fmt: skip
        self._legacy_peers = int(legacy)
        if legacy:
            self._legacy_seen_at = time.monotonic()
        self._succeeded()

    def _free_here(self) -> int:
        """Seats to publish: free engine seats less the reservations only this process knows about."""
        return 0 if self.draining else max(0, self.capacity_fn() - self._fallback.reserved)

    # ---- calls ----

    async def reserve(self, call_sid: str) -> Reservation | None:
        if self._fallback.used(call_sid) or self._mine.used(call_sid):
            raise CallSidUsed(call_sid)
        if (token := self._fallback.token_for(call_sid)) is not None:  # a retry of a fallback reservation
            return Reservation(self.node_id, self._stream_url(self.stream_url, call_sid, True), token)
        if self._failing:
            # Redis failed the last time it was asked; the heartbeat asks again every second and clears this.
            # Until then, a webhook must not wait its turn for Redis's timeout: with a Redis that hangs
            # rather than refuses, each waited up to a second behind the one before (and the heartbeat),
            # and a burst of calls ran past Twilio's 15 s webhook timeout.
            return self._reserve_here(call_sid)
        # No lock across the round trip: concurrent webhooks reserve in parallel. The script checks and takes
        # a seat atomically, and a claim landing before it is subtracted there (held, not in `acked`).
        keys = [self._nodes_key, self._resv_key(call_sid)]
        args: list[Any] = [self.key_prefix, call_sid, self.node_id, new_token(), _ms(self.reservation_ttl_s),
                           _ms(self.node_ttl_s), int(self.draining or not self.routable), self._free_here(),
                           _ms(self.bound_ttl_s), self.stream_url, *self._acked_now()]  # fmt: skip
        try:
            got = await self._reserve_script(keys=keys, args=args)
        except _REDIS_FAILURES as exc:
            self._failed("reserve", exc)
            return self._reserve_here(call_sid)
        self._succeeded()
        if got is None:
            return None
        if got == "used":
            raise CallSidUsed(call_sid)
        node_id, url, token, count, per_call = got
        if node_id == self.node_id:
            self._mine.issue(call_sid, token)
            if int(count) >= 0:
                self._set_redis_reserved(int(count))
        return Reservation(node_id, self._stream_url(url, call_sid, per_call == "1"), token)

    def _reserve_here(self, call_sid: str) -> Reservation | None:
        if self.draining or self.capacity_fn() - self.reserved <= 0:
            return None
        return Reservation(self.node_id, self._stream_url(self.stream_url, call_sid, True),
                           self._fallback.issue(call_sid))

    async def claim(self, call_sid: str, token: str | None) -> bool:
        if token is None:
            return False
        if self._mine.used(call_sid) or self._fallback.used(call_sid):
            # Its stream started here already (or it ended): the token is single-use per call, so a replayed
            # webhook's new reservation (Redis having lost the binding) never lets a second socket in.
            log.warning("cluster: call %s already streamed on this node (or its reservation expired); refusing "
                        "another stream", call_sid)  # fmt: skip
            return False
        if self._fallback.token_for(call_sid) is not None:
            return self._fallback.claim(call_sid, token)
        if self._failing:  # as `reserve`: no stream waits out a hung Redis's timeout while the heartbeat probes it
            return self._claim_from_mine(call_sid, token)
        keys = [self._resv_key(call_sid), self._my_resv_key, self._node_key(self.node_id), self._my_held_key]
        try:
            node_id, held, url = await self._redis.hmget(self._resv_key(call_sid), ["node", "token", "url"])
            if node_id is None:
                return await self._claim_lost(call_sid, token, keys)
            if held is None or not tokens_match(held, token):
                return False
            if node_id == self.node_id:
                count = int(await self._claim_script(keys=keys, args=[call_sid, self.node_id, token,
                                                                     _ms(self.bound_ttl_s), self._held_ms]))
            elif url == self.stream_url and self._seats_fn() - self.reserved > 0:  # not a seat promised here
                count = await self._take_over(call_sid, node_id, token)
            else:
                return False  # another node's stream URL: the stream reached the wrong node
        except _REDIS_FAILURES as exc:
            self._failed("claim", exc)
            return self._claim_from_mine(call_sid, token)  # reserved here through Redis before it failed
        self._succeeded()
        if count < 0:
            return False
        self._set_redis_reserved(count)
        if not self._mine.claim(call_sid, token):
            self._mine.mark_used(call_sid)  # reserved by another node's webhook: spent all the same
        self._acked[call_sid] = time.monotonic()  # the caller counts the stream before it next awaits
        return True

    async def _take_over(self, call_sid: str, node_id: str, token: str) -> int:
        keys = [self._resv_key(call_sid), f"{self._node_key(node_id)}:resv", self._my_resv_key,
                self._node_key(self.node_id), self._my_held_key]
        count = int(await self._takeover_script(keys=keys, args=[call_sid, node_id, token, _ms(self.bound_ttl_s),
                                                                 self._held_ms, self.node_id, self.stream_url]))
        if count >= 0:
            log.info("cluster: call %s was reserved on node %s behind the same URL; its stream is taken here",
                     call_sid, node_id)
        return count

    async def _claim_lost(self, call_sid: str, token: str, keys: list[str]) -> bool:
        """Redis has no reservation for the call (it restarted empty, failed over, evicted it): this node's
        own book decides, and the binding is written back as claimed (best effort)."""
        if not self._mine.claim(call_sid, token):
            return False
        log.warning("cluster: Redis had lost the reservation of call %s; admitted on this node's own record",
                    call_sid)
        try:
            count = int(await self._restore_script(keys=keys, args=[call_sid, self.node_id, token,
                                                                   _ms(self.bound_ttl_s), self._held_ms,
                                                                   self.stream_url]))  # fmt: skip
        except _REDIS_FAILURES as exc:  # a replay may get a new token, but this node's book refuses its stream
            self._failed("claim", exc)
            self._one_reservation_claimed()
        else:
            self._succeeded()
            self._set_redis_reserved(count)
        self._acked[call_sid] = time.monotonic()  # the caller counts the stream before it next awaits
        return True

    def _claim_from_mine(self, call_sid: str, token: str) -> bool:
        if not self._mine.claim(call_sid, token):
            return False
        self._one_reservation_claimed()  # else it would count both as reserved and as a stream
        self._acked[call_sid] = time.monotonic()  # the claim script may have landed before the reply was lost
        return True

    @property
    def _held_s(self) -> float:
        # Longer than a figure computed before a claim's reply can take to land (socket timeouts of ~1 s).
        return 2 * self.node_ttl_s

    @property
    def _held_ms(self) -> int:
        return _ms(self._held_s)

    def _acked_now(self) -> list[str]:
        """The acked calls still possibly held in Redis (read with `capacity_fn`, no await in between)."""
        old = time.monotonic() - self._held_s
        for sid in [sid for sid, at in self._acked.items() if at < old]:
            del self._acked[sid]
        return list(self._acked)

    async def release(self, call_sid: str) -> None:
        self._fallback.release(call_sid)
        self._mine.release(call_sid)
        self._acked.pop(call_sid, None)  # held no more (below), or counted taken until it expires: no over-booking
        if self._failing:
            # Redis failed the last time it was asked: do not hold the call's end for a socket timeout.
            # The binding stays claimed (a replay still gets no token) and expires after bound_ttl_s.
            log.info("cluster: Redis failing; call %s's binding left to expire", call_sid)
        else:
            keys = [self._resv_key(call_sid), self._my_resv_key, self._my_held_key]
            try:
                await self._release_script(keys=keys, args=[call_sid, self.node_id, _ms(self.bound_ttl_s)])
            except _REDIS_FAILURES as exc:  # the binding expires after bound_ttl_s
                self._failed("release", exc)
        self._poke.set()  # publish the freed seat now

    async def awaits_stream(self, call_sid: str) -> bool | None:
        if self._mine.awaited(call_sid) or self._fallback.awaited(call_sid):
            return True
        if self._mine.used(call_sid) or self._fallback.used(call_sid):
            return False
        if self._failing:
            return None
        try:
            # No binding: never reserved, or forgotten (its 12 h kept, Redis restarted empty); a claim would find
            # no reservation to take either.
            return bool(int(await self._awaits_script(keys=[self._resv_key(call_sid)])))
        except _REDIS_FAILURES as exc:
            self._failed("awaits_stream", exc)
            return None

    async def streamed(self, call_sid: str) -> bool | None:
        if self._mine.streamed(call_sid) or self._fallback.streamed(call_sid):
            return True
        if self._failing:
            return None
        try:
            state = await self._redis.hget(self._resv_key(call_sid), "state")
        except _REDIS_FAILURES as exc:
            self._failed("streamed", exc)
            return None
        return None if state is None else state != "reserved"  # gone: expired or lost, cannot tell

    async def forsake(self, call_sid: str) -> bool | None:
        if self._mine.streamed(call_sid) or self._fallback.streamed(call_sid):
            return False
        if self._fallback.awaited(call_sid):  # reserved here while Redis failed: this node's book alone
            self._fallback.release(call_sid)
            return True
        if self._failing:
            return None
        try:
            forsaken = int(await self._forsake_script(keys=[self._resv_key(call_sid)],
                                                      args=[call_sid, self.key_prefix, _ms(self.bound_ttl_s)]))
        except _REDIS_FAILURES as exc:
            self._failed("forsake", exc)
            return None
        if forsaken == 1:
            self._mine.release(call_sid)  # if it was reserved here: its local grant too
            self._poke.set()  # the seat it held, published now
        return None if forsaken < 0 else forsaken == 1

    async def node_alive(self, node_id: str) -> bool | None:
        if node_id == self.node_id:
            return True
        if self._failing:
            return None  # a Redis that fails us may have lost no node: say nothing
        try:
            # Either key expires node_ttl_s after the node's last beat (alive:<id>: a node out of routing).
            return bool(await self._redis.exists(*self.heartbeat_keys(node_id)))
        except _REDIS_FAILURES as exc:
            self._failed("node_alive", exc)
            return None

    def heartbeat_keys(self, node_id: str) -> tuple[str, ...]:
        return self._node_key(node_id), self._alive_key(node_id)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def open_cluster(
    config: ServiceConfig, capacity_fn: CapacityFn, stream_url: str, seats_fn: CapacityFn | None = None,
    routable: bool = True,
) -> Cluster:
    """A `RedisCluster` when REDIS_URL is set, else a single-node `LocalCluster`. Never blocks.
    Not `routable`: in Redis only to say it is up (see `RedisCluster.routable`)."""
    if not config.redis_url:
        return LocalCluster(config.node_id, stream_url, capacity_fn, config.reservation_ttl_s)
    client = aioredis.Redis.from_url(
        config.redis_url,
        decode_responses=True,
        socket_timeout=1.0,  # on the webhook's path: a stuck Redis must not hold the caller
        socket_connect_timeout=1.0,
        retry=Retry(NoBackoff(), 0),  # a failure falls back to this node at once
    )
    log.info("cluster: node %r, streams at %s, Redis at %s, prefix %r",
             config.node_id, stream_url, _safe_url(config.redis_url), config.redis_prefix)
    return RedisCluster(
        client,
        config.node_id,
        stream_url,
        capacity_fn,
        heartbeat_s=config.heartbeat_s,
        node_ttl_s=config.node_ttl_s,
        reservation_ttl_s=config.reservation_ttl_s,
        key_prefix=config.redis_prefix,
        seats_fn=seats_fn,
        routable=routable,
    )
