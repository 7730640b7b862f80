"""Serve an aiohttp app on 127.0.0.1 at a free port, for the tests' stand-ins of paid external APIs."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serve_on_loopback(app: web.Application) -> AsyncIterator[str]:
    """Yield the app's base URL (http://127.0.0.1:PORT); the server is cleaned up on exit, even on failure."""
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
