"""The AudioSocket listeners (serve --audiosocket) and the one pacer that sends every such call's audio.

AudioSocket carries no credentials: who may connect is decided by address (`--audiosocket-allow`; unset,
loopback only), and the listener belongs on the network between the PBX and this node.
Each listener answers with one agent, so the dialplan picks the agent by the port it connects to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from . import metrics
from .audiosocket_config import allowed
from .audiosocket_session import AudioSocketSession
from .audiosocket_wire import PACKET_S
from .bot_audio import cancel_and_wait
from .config import is_loopback

if TYPE_CHECKING:
    from .server import ServerContext

log = logging.getLogger(__name__)

# Behind by more than this, the pacer starts afresh rather than sending the missed packets as a burst.
PACER_RESYNC_S = 0.1


class AudioSocketPacer:
    """One task for every AudioSocket call on the node: each 20 ms, each call's next packet. Asterisk plays
    what it gets on arrival, so the pacing is ours; one wake-up for all calls, not one per call."""

    def __init__(self, sessions: Callable[[], Iterable[AudioSocketSession]]) -> None:
        self._sessions = sessions
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="audiosocket-pacer")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        due = time.monotonic()
        while True:
            due += PACKET_S
            delay = due - time.monotonic()
            if delay < -PACER_RESYNC_S:
                due, delay = time.monotonic(), 0.0  # a stalled loop: start afresh, no burst
            await asyncio.sleep(max(0.0, delay))
            for session in self._sessions():
                try:
                    session.pace()
                except Exception:  # one broken socket must not stop every other call's audio
                    log.exception("pacing an audiosocket call failed")


class AudioSocketServer:
    """The listeners of `config.audiosocket` and their pacer."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.servers: list[asyncio.Server] = []
        self.pacer = AudioSocketPacer(self._sessions)

    def _sessions(self) -> list[AudioSocketSession]:
        return [s for s in self.ctx.streams.values() if isinstance(s, AudioSocketSession)]

    @property
    def ports(self) -> list[int]:
        return [s.sockets[0].getsockname()[1] for s in self.servers]

    async def start(self) -> AudioSocketServer:
        for listen in self.ctx.config.audiosocket:
            server = await asyncio.start_server(
                lambda r, w, agent=listen.agent: self._connected(r, w, agent), listen.host, listen.port,
            )  # fmt: skip
            self.servers.append(server)
            log.info("AudioSocket listening on %s:%d (agent %s), callers from %s", listen.host,
                     server.sockets[0].getsockname()[1], listen.agent or "default",
                     ", ".join(map(str, self.ctx.config.audiosocket_allow)) or "loopback only")  # fmt: skip
            if any(net.prefixlen == 0 for net in self.ctx.config.audiosocket_allow) and not is_loopback(listen.host):
                # AudioSocket has no credentials: whoever reaches the port places calls on this node's seats and
                # LLM, and nothing else would say so.
                log.warning("AudioSocket on %s:%d is open to every address (--audiosocket-allow any): anyone who "
                            "reaches it places calls here; allow your PBX's networks only", listen.host,
                            server.sockets[0].getsockname()[1])  # fmt: skip
        if self.servers:
            self.pacer.start()
        return self

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, agent: str | None) -> None:
        ctx = self.ctx
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else "?"
        if not allowed(host, ctx.config.audiosocket_allow):
            self._refuse(writer, "not_allowed", f"from {host}, outside --audiosocket-allow")
            return
        if ctx.engine is None or ctx.engine.failed:
            self._refuse(writer, "engine_down", f"from {host}: the engine is not serving")
            return
        if not ctx.room_for_unstarted("audiosocket", host):
            writer.transport.abort()
            return
        sock = writer.get_extra_info("socket")
        if sock is not None and ctx.config.media_send_buffer_bytes > 0:
            # As for Twilio's sockets: left to autotuning the kernel buffers MBs, minutes of audio, and a peer
            # that stopped reading held its seat (the bot's audio going stale in the kernel) for as long.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, ctx.config.media_send_buffer_bytes)
        await AudioSocketSession(reader, writer, ctx, agent=agent).run()

    def _refuse(self, writer: asyncio.StreamWriter, reason: str, detail: str) -> None:
        metrics.WEBHOOK_REJECTIONS.labels(endpoint="audiosocket", reason=reason).inc()
        if n := self.ctx.sampled(f"audiosocket:{reason}"):  # a flood of connections must not flood the logs
            log.warning("audiosocket connection refused (#%d): %s", n, detail)
        writer.transport.abort()

    def stop_listening(self) -> None:
        """A drain: new connections are refused at the socket (Asterisk's AudioSocket() fails at once, and a
        load balancer's health check moves on); the calls up go on."""
        for server in self.servers:
            server.close()

    async def aclose(self) -> None:
        self.stop_listening()
        for server in self.servers:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await server.wait_closed()  # waits for the handlers too (3.12+): the calls end first
        await self.pacer.aclose()
