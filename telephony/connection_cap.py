"""A cap on a listener's connections that hold no started call.

Every connection is unauthenticated until a request on it proves itself (a webhook's signature, a stream's
single-use token), and aiohttp keeps an idle one open until its keep-alive timeout (`keepalive_timeout_s`,
75 s; aiohttp's own default is an hour). Without a cap, a few thousand idle sockets take file descriptors and
memory from the calls. Connections carrying a started stream are not counted: the calls are capped by the
engine's seats.

At the cap, a new connection closes the oldest one with no request in flight (a silent socket, an idle
keep-alive, headers trickling in), else the oldest whose request has not proved itself yet (a webhook whose
body is slow to come, before its signature is checked), rather than being refused: refusing the newest let 256
silent sockets, or slow bodies, opened by anyone and reopened as they timed out, shut out every webhook and
stream. A request proves itself with Twilio's signature (`prove`); only when every connection carries a proven
request is the new one refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from engine.log_sampler import LogSampler

from . import metrics

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def prove(request: web.Request) -> None:
    """Tell the listener's cap, if it has one, that `request` proved itself."""
    cap = request.app.get(CONNECTION_CAP)
    if cap is not None:
        cap.prove(request)


@dataclass(eq=False)
class ConnectionCap:
    """`attach` to the app before its runner is set up (its middleware tells busy connections from idle ones,
    and handlers `prove` signed requests); `install` on the runner's server after."""

    limit: int
    streaming: Callable[[], int] = lambda: 0  # connections carrying a started call, not counted
    listener: str = "public listener"
    _busy: dict[web.RequestHandler, int] = field(default_factory=dict)  # requests in flight, by connection
    _proven: set[web.RequestHandler] = field(default_factory=set)  # of those, with a request that proved itself
    _sampled: LogSampler = field(default_factory=LogSampler)

    def __post_init__(self) -> None:
        @web.middleware
        async def track_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
            connection = request.protocol
            self._busy[connection] = self._busy.get(connection, 0) + 1
            try:
                return await handler(request)
            finally:
                if (left := self._busy.pop(connection) - 1) > 0:
                    self._busy[connection] = left
                else:
                    self._proven.discard(connection)

        self.middleware = track_requests

    def attach(self, app: web.Application) -> None:
        """On `app` (before its runner is set up): its requests are tracked, and its handlers can `prove`."""
        app.middlewares.append(self.middleware)
        app[CONNECTION_CAP] = self

    def install(self, server: web.Server) -> None:
        admit = server.connection_made

        def connection_made(handler: web.RequestHandler, transport: asyncio.Transport) -> None:
            over = len(server.connections) - self.streaming() >= self.limit  # the usual case: no walk
            if over and len(server.connections) - self.streaming() - self._closing(server) >= self.limit:
                idle = self._oldest_idle(server)
                if idle is None:  # every one of them carries a proven request: the newcomer goes
                    metrics.HTTP_CONNECTIONS_REFUSED.inc()
                    if n := self._sampled("refused"):
                        log.warning("%s: %d connections without a call, all in signed requests; refusing (#%d)",
                                    self.listener, self.limit, n)  # fmt: skip
                    transport.abort()
                    return
                metrics.HTTP_CONNECTIONS_EVICTED.inc()
                if n := self._sampled("evicted"):
                    log.warning("%s: %d connections without a call; the oldest idle one closed for a new one (#%d)",
                                self.listener, self.limit, n)  # fmt: skip
                assert idle.transport is not None
                idle.transport.abort()
            admit(handler, transport)

        server.connection_made = connection_made  # type: ignore[method-assign]

    def prove(self, request: web.Request) -> None:
        """`request` is what it says (Twilio signed it): its connection is no longer one to close for a newer."""
        if request.protocol in self._busy:
            self._proven.add(request.protocol)

    def _oldest_idle(self, server: web.Server) -> web.RequestHandler | None:
        """The oldest open connection with no request in flight, else the oldest whose request is unproven."""
        unproven = None
        # server.connections is in the order they came (aiohttp appends each).
        for connection in server.connections:
            transport = connection.transport
            if transport is None or transport.is_closing():
                continue
            if connection not in self._busy:
                return connection
            if unproven is None and connection not in self._proven:
                unproven = connection
        return unproven

    @staticmethod
    def _closing(server: web.Server) -> int:
        """Connections aborted but not yet gone from the list (their `connection_lost` comes a turn later): a
        burst of newcomers in one turn must not pick the same victim, nor count it."""
        return sum(1 for c in server.connections if c.transport is None or c.transport.is_closing())


CONNECTION_CAP: web.AppKey[ConnectionCap] = web.AppKey("connection_cap", ConnectionCap)
