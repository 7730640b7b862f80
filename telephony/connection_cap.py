"""A cap on the public listener's connections that hold no started call.

Every connection is unauthenticated until a request on it proves itself (a webhook's signature, a stream's
single-use token), and aiohttp keeps an idle one open until its keep-alive timeout (`keepalive_timeout_s`,
75 s; aiohttp's own default is an hour). Without a cap, a
few thousand idle sockets take file descriptors and memory from the calls. Connections carrying a started
stream are not counted: the calls are capped by the engine's seats."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from . import metrics

log = logging.getLogger(__name__)


def cap_connections(
    server: web.Server, limit: int, streaming: Callable[[], int] = lambda: 0, listener: str = "public listener"
) -> None:
    """Refuse (abort at once) each connection beyond `limit` that is not one of `streaming()`'s calls."""
    admit = server.connection_made
    refused = 0

    def connection_made(handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        nonlocal refused
        if len(server.connections) - streaming() >= limit:
            refused += 1
            metrics.HTTP_CONNECTIONS_REFUSED.inc()
            if refused in (1, 10) or refused % 1000 == 0:  # a flood must not flood the logs
                log.warning("%s: %d connections without a call already; refusing (%d so far)",
                            listener, limit, refused)  # fmt: skip
            transport.abort()
            return
        admit(handler, transport)

    server.connection_made = connection_made  # type: ignore[method-assign]
