"""What the engine link's tests share: an echoing engine behind a real `EngineServer`, edge services on it,
and a test-only TLS certificate."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from engine.link_server import EngineServer
from engine.link_wire import Address, server_tls
from engine.remote import RemoteEngine
from kame_phone.media_bench import LoopbackEngine
from telephony.call_store import MemoryCallStore
from telephony.config import ServiceConfig
from telephony.server import ServerContext, ServiceHandle

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "e" * 32
# A self-signed certificate for localhost/127.0.0.1 and its key, made for these tests only (valid to 2126).
TLS_CERT, TLS_KEY = ROOT / "tests/data/engine-link-cert.pem", ROOT / "tests/data/engine-link-key.pem"

StartEngineServer = Callable[..., Awaitable[tuple[EngineServer, Address]]]


def tone(hz: float, seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * 8000)) / 8000
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


async def edge_service(engine: RemoteEngine) -> ServiceHandle:
    """A phone edge (the real aiohttp service) whose engine is `engine`."""
    config = ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=TOKEN)
    return await ServiceHandle(ServerContext(config, MemoryCallStore(), engine)).start()


async def engine_servers(tmp_path: Path) -> AsyncIterator[StartEngineServer]:
    """Starts loopback engines behind `EngineServer`s (a Unix socket, or loopback TCP/TLS); all stop after."""
    started: list[tuple[LoopbackEngine, EngineServer]] = []

    async def start(
        max_calls: int, *, tcp: bool = False, tls: bool = False, **kwargs: Any
    ) -> tuple[EngineServer, Address]:
        engine = LoopbackEngine(max_calls=max_calls)
        server = EngineServer(engine, **{"token": None, **kwargs})
        started.append((engine, server))
        if tls:
            server.tls = server_tls(str(TLS_CERT), str(TLS_KEY))
        where = (
            Address(host="127.0.0.1", port=0, tls=tls)
            if tcp or tls
            else Address(unix_path=str(tmp_path / "engine.sock"))
        )
        return server, await server.listen(where)

    yield start
    for engine, server in started:
        await server.aclose()
        await engine.stop()


# Real processes (`kame-phone engine-serve`, `kame-phone serve --engine`): their environment, start and health.


def process_env(**extra: str) -> dict[str, str]:
    """This environment without the service's own settings (a developer's KAME_*, TWILIO_*, REDIS_URL), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAME_", "TWILIO_", "PUBLIC_URL", "REDIS_"))}
    return env | extra


def start_cli(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kame_phone.cli", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


async def http_status(http: aiohttp.ClientSession, url: str) -> int:
    """The status of a GET, 0 when nothing answers."""
    try:
        async with http.get(url) as r:
            return r.status
    except aiohttp.ClientError:
        return 0


async def engine_keeps_time(http: aiohttp.ClientSession, engine_base: str, within: float = 60.0) -> None:
    """Until an engine-serve's /readyz has said 200 (keeping time) for over a status period, so its edges have
    heard it: behind after the calls before (a slow box), it has its edges answer new calls busy, by design."""
    from engine.link_wire import STATUS_EVERY_S

    from .polling import until

    since: list[float] = []

    async def steady() -> bool:
        if await http_status(http, engine_base + "/readyz") != 200:
            since.clear()
            return False
        since.append(time.monotonic())
        return since[-1] - since[0] > STATUS_EVERY_S + 0.5

    await until(steady, "the engine keeping time", within, every=0.1)


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM (a drain) to each still running, then each waited for, killed after 20 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
