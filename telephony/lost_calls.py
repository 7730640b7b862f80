"""AudioSocket calls left "streaming" by a node that crashed: ended as node_lost by the nodes still up.

A node ends its own calls; one that crashes ends none. A Twilio call's final status callback lands on another
node, which ends it there (server.handle_call_status). An AudioSocket call has no such callback, so each node
now and then reads the calls Redis has streaming and ends those on a node that no longer heartbeats. Every
node heartbeats while up, an AudioSocket-only one too (out of routing: `RedisCluster.routable`).

A node that restarts under the same id (a container keeps its hostname, the default node id) is alive again
to the others before they see it gone, so the calls its last run left streaming, of either carrier, are ended
by the node itself when it starts: no call of this run can be among them (call ids are never reused; the
ones live here are skipped all the same).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from . import metrics
from .audiosocket_session import CALL_ID_PREFIX
from .bot_audio import cancel_and_wait
from .call_store import CallBrief, CallStore, CallStoreUnavailable
from .cluster import Cluster

log = logging.getLogger(__name__)

SWEEP_S = 5.0  # how often a node sweeps: a crashed node's calls end within node_ttl_s and two of these


@dataclass(eq=False)
class LostCallSweep:
    """Ends the AudioSocket calls of nodes found gone on two sweeps in a row: a node whose heartbeats only
    paused (a slow Redis) past node_ttl_s keeps its live calls' records."""

    store: CallStore
    cluster: Cluster
    node_id: str  # this node: its own calls are its to end
    every_s: float = SWEEP_S
    live: Callable[[], Collection[str]] = tuple  # this run's calls now (ServerContext.streams)
    _gone: set[str] = field(default_factory=set)  # nodes found gone by the last sweep
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="lost-call-sweep")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        try:
            await self.end_own_leftovers()
        except Exception:
            log.exception("ending this node's calls left streaming by its last run failed")
        while True:
            await asyncio.sleep(self.every_s * random.uniform(0.8, 1.2))  # the nodes' sweeps drift apart
            try:
                await self.sweep()
            except Exception:  # a bug must not stop the sweeps for good
                log.exception("sweeping calls of lost nodes failed")

    async def end_own_leftovers(self) -> int:
        """At start: end the calls Redis has streaming on this node id that are not live here (a previous run
        of this node left them). Returns how many."""
        try:
            calls = await self.store.streaming()
        except CallStoreUnavailable:
            return 0  # counted by the store; they expire with their TTL
        live = set(self.live())
        mine = [(sid, c) for sid, c in calls.items() if c.node == self.node_id and sid not in live]
        return await self._end(mine, "was streaming on this node's last run")

    async def _end(self, calls: list[tuple[str, CallBrief]], why: str) -> int:
        ended = 0
        for sid, call in calls:
            try:
                if not await self.store.end_lost(sid, "node_lost"):
                    continue  # another node's sweep took it: each call is ended, and counted, once
            except CallStoreUnavailable:
                break
            log.warning("call %s %s (node %s): ended as node_lost", sid, why, call.node)
            metrics.CALLS_TOTAL.labels(outcome="node_lost", agent=call.agent or "default").inc()
            ended += 1
        return ended

    async def sweep(self) -> int:
        """One sweep; returns how many calls this node ended."""
        try:
            calls = await self.store.streaming()
        except CallStoreUnavailable:
            return 0  # counted by the store; the next sweep tries again
        # Twilio's calls are left to its status callback: ended here too, one could be counted twice.
        calls = {sid: c for sid, c in calls.items()
                 if sid.startswith(CALL_ID_PREFIX) and c.node not in (None, self.node_id)}  # fmt: skip
        gone: set[str] = set()
        for node in {c.node for c in calls.values() if c.node is not None}:
            if await self.cluster.node_alive(node) is False:  # None (Redis failing): left alone
                gone.add(node)
        confirmed, self._gone = gone & self._gone, gone
        return await self._end([(sid, c) for sid, c in calls.items() if c.node in confirmed],
                               "was streaming on a node that is gone")
