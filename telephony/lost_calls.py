"""Calls left "streaming" by a node that crashed: ended as node_lost by the nodes still up.

A node ends its own calls; one that crashes ends none. A Twilio call's final status callback may land on another
node, which ends it there if the node is gone by then (server.handle_call_status); an AudioSocket call has no
such callback, and a Twilio one's may come while the crashed node's heartbeat has not expired yet. So each node
now and then reads which nodes have calls streaming, and a gone node's calls, of either carrier, and ends them.
Every node heartbeats while up, an AudioSocket-only one too (out of routing: `RedisCluster.routable`). Ending a
call is one script that also checks the node's heartbeat keys, so each call is ended, and counted, once, and
never after its node came back.

A node that restarts under the same id (a container keeps its hostname, the default node id) is alive again
to the others before they see it gone, so the calls its last run left streaming, of either carrier, are ended
by the node itself when it starts. None of this run's is touched: the ones live here are skipped, and the
store never ends as lost a call it wrote (one that just hung up has its own `end` on the way).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from . import metrics
from .bot_audio import cancel_and_wait
from .call_store import CallBrief, CallStore, CallStoreUnavailable
from .cluster import Cluster

log = logging.getLogger(__name__)

SWEEP_S = 5.0  # how often a node sweeps
# How long a node must have been found gone, on every sweep, before its calls are ended: a node whose heartbeats
# only paused (a short partition from Redis, Redis refusing connections at maxclients, a stalled process) keeps
# its live calls. Nothing is urgent: the records would otherwise say "streaming" until they expire (24 h).
CONFIRM_S = 30.0
# This node's own set is read (which prunes it) this often, in sweeps (~5 min): a busy node's set never expires
# (each call's writes refresh it), so a name whose record went without its end (a dropped write, an eviction)
# would stay in it for good.
PRUNE_OWN_EVERY = 60


@dataclass(eq=False)
class LostCallSweep:
    """Ends the calls of nodes found gone on every sweep for `confirm_s` (and at least two sweeps in a row): a node
    whose heartbeats only paused past node_ttl_s keeps its live calls' records. A sweep reads which nodes have
    calls streaming (a small set) and only a gone node's calls, so its cost does not grow with the fleet's calls."""

    store: CallStore
    cluster: Cluster
    node_id: str  # this node: its own calls are its to end
    every_s: float = SWEEP_S
    live: Callable[[], Collection[str]] = tuple  # this run's calls now (ServerContext.streams)
    confirm_s: float = CONFIRM_S
    clock: Callable[[], float] = time.monotonic
    _gone: dict[str, float] = field(default_factory=dict)  # nodes found gone on every sweep since: when first
    _leftovers_done: bool = False  # the last run's calls ended (retried each sweep until Redis answers)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="lost-call-sweep")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        sweeps = 0
        while True:
            if sweeps:
                await asyncio.sleep(self.every_s * random.uniform(0.8, 1.2))  # the nodes' sweeps drift apart
            sweeps += 1
            try:
                if not self._leftovers_done:
                    await self.end_own_leftovers()
                elif sweeps % PRUNE_OWN_EVERY == 0:
                    await self.prune_own()
                await self.sweep()
            except Exception:  # a bug must not stop the sweeps for good
                log.exception("sweeping calls of lost nodes failed")

    async def end_own_leftovers(self) -> int:
        """At start, and each sweep until it went through: end the calls Redis has streaming on this node id
        that are not live here (a previous run of this node left them). Returns how many."""
        try:
            calls = await self.store.streaming_on(self.node_id)
        except CallStoreUnavailable:
            return 0  # counted by the store; tried again next sweep
        ended, complete = await self._end(self.node_id, calls, "was streaming on this node's last run",
                                          own_node=True)  # fmt: skip
        self._leftovers_done = complete
        return ended

    async def prune_own(self) -> None:
        """Read this node's set of calls streaming, which drops the names whose record is gone or no longer
        streaming here (the store's read prunes as it goes)."""
        try:
            await self.store.streaming_on(self.node_id)
        except CallStoreUnavailable:
            pass  # counted by the store; the next round tries again

    async def sweep(self) -> int:
        """One sweep; returns how many calls this node ended."""
        try:
            nodes = await self.store.streaming_nodes()
        except CallStoreUnavailable:
            return 0  # counted by the store; the next sweep tries again
        now = self.clock()
        gone: dict[str, float] = {}
        for node in nodes - {self.node_id}:
            if await self.cluster.node_alive(node) is False:  # None (Redis failing): left alone
                gone[node] = self._gone.get(node, now)  # seen alive (or not asked) since: the clock starts over
        confirmed = {node for node, since in gone.items() if node in self._gone and now - since >= self.confirm_s}
        self._gone = gone
        ended = 0
        for node in sorted(confirmed):
            try:
                calls = await self.store.streaming_on(node)
            except CallStoreUnavailable:
                break
            n, complete = await self._end(node, calls, "was streaming on a node that is gone",
                                          self.cluster.heartbeat_keys(node))  # fmt: skip
            ended += n
            if not complete:
                break
        return ended

    async def _end(self, node: str, calls: dict[str, CallBrief], why: str,
                   alive_keys: tuple[str, ...] = (), *, own_node: bool = False) -> tuple[int, bool]:  # fmt: skip
        """End `calls` (streaming on `node`) as node_lost, each once across the nodes and the status callbacks,
        none once one of `alive_keys` is back, and none live here (this run's: a stream taken over since, on
        another node's calls); (how many this node ended, whether it went through them all)."""
        ended, live = 0, set(self.live())
        for sid, call in calls.items():
            if sid in live:
                continue
            try:
                if not await self.store.end_lost(sid, node, "node_lost", alive_keys, own_node=own_node):
                    continue  # another node's sweep took it: each call is ended, and counted, once
            except CallStoreUnavailable:
                return ended, False
            log.warning("call %s %s (node %s): ended as node_lost", sid, why, node)
            metrics.CALLS_TOTAL.labels(outcome="node_lost", agent=call.agent or "default").inc()
            ended += 1
        return ended, True
