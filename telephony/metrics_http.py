"""The Prometheus exposition (`GET /metrics`), on a listener of its own, never on the public port.

Rendering every family costs milliseconds of CPU: on the public listener anyone could ask for it hundreds
of times a second and take that CPU from the calls (600 requests in 4 s cut a live call to half real
time). `kame-phone serve` serves it on --metrics-host/--metrics-port (loopback by default);
`kame-phone engine-serve` on its own --http-host/--http-port, beside /healthz and /readyz.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from .connection_cap import ConnectionCap

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


async def handle_metrics(request: web.Request) -> web.Response:
    # In a worker thread: the event loop keeps moving call audio while the text is built.
    body = await asyncio.to_thread(generate_latest, REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# Listeners for scrapers and probes (metrics, engine-serve's health): a few connections at a time, each
# closed 5 s after its last request. With aiohttp's defaults (no cap, an hour's keep-alive) any peer on the
# pod or compose network could hold a thousand idle sockets and take the file descriptors the calls need.
INTERNAL_MAX_CONNECTIONS = 64
INTERNAL_KEEPALIVE_S = 5.0


async def internal_runner(app: web.Application, name: str) -> web.AppRunner:
    """An AppRunner set up for an internal listener (capped, short keep-alive); the caller starts its site."""
    cap = ConnectionCap(INTERNAL_MAX_CONNECTIONS, listener=name)
    cap.attach(app)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=INTERNAL_KEEPALIVE_S,
                           lingering_time=0)  # fmt: skip
    await runner.setup()
    assert runner.server is not None
    cap.install(runner.server)
    return runner


@dataclass
class MetricsListener:
    """`GET /metrics` alone on host:port (port 0: any free one, see `port` once started)."""

    host: str
    port: int
    _runner: web.AppRunner | None = field(default=None, repr=False)

    async def start(self) -> MetricsListener:
        app = web.Application()
        app.router.add_get(METRICS_PATH, handle_metrics)
        runner = await internal_runner(app, "metrics listener")
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        log.info("metrics on http://%s:%d%s", self.host, self.port, METRICS_PATH)
        return self

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
