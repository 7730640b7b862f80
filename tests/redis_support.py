"""Shared by the tests that talk to a real Redis."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import REGISTRY

REDIS_URL = os.environ.get("KAME_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_errors() -> float:
    return REGISTRY.get_sample_value("kame_redis_errors_total") or 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A throwaway redis-server. AOF with fsync on every write, so a SIGKILL loses nothing that was
    acknowledged: then "nothing lost" below is about the store, not about Redis durability."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = data_dir
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed (scripts/setup.sh installs it)"
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no", "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)]
        self.proc = await asyncio.create_subprocess_exec(
            exe, *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        client = aioredis.Redis.from_url(self.url)
        try:
            async with asyncio.timeout(10):
                while True:
                    try:
                        if await client.ping():
                            return
                    except (OSError, aioredis.ConnectionError):
                        await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def restart_empty(self) -> None:
        """Kill it and start it again with nothing on disk: a Redis run without persistence that restarted."""
        await self.kill()
        shutil.rmtree(self.dir)
        self.dir.mkdir()
        await self.start()


class SlowProxy:
    """A TCP proxy on loopback that holds every reply from upstream for `delay_s`: a slow Redis (or a far one),
    with requests still reaching it at once and in order."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        for task in (self._pipe(reader, up_writer, 0.0), self._pipe(up_reader, writer, self.delay_s)):
            t = asyncio.create_task(task)
            self._pipes.add(t)
            t.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay_s: float) -> None:
        try:
            while data := await src.read(65536):
                if delay_s:
                    await asyncio.sleep(delay_s)
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.close()
