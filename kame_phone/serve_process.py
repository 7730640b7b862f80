"""`kame-phone serve` in a child process, for the commands that test the service as deployed (the node
bench, the eval): started with the given flags and environment, waited for until /readyz says 200,
its output drained all along into a log file as it comes (a bench killed by its timeout keeps the log)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serve_process(argv: list[str], env: dict[str, str], base: str, log_path: Path) -> AsyncIterator[None]:
    """`kame-phone serve` in its own process, until its /readyz says 200."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kame_phone.cli", "serve", *argv, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    # Drained all along (a full pipe would stall the service) into the log as it comes, flushed per chunk:
    # a bench that its timeout kills (no `finally` then) leaves the log of what serve said up to then.
    logged = asyncio.create_task(_drain(proc.stdout, log_path))
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 180
            while True:
                if proc.returncode is not None or logged.done():
                    await proc.wait()
                    raise RuntimeError(f"serve exited with {proc.returncode}: {(await logged).decode()[-2000:]}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(base + "/readyz") as resp:
                        if resp.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError("serve did not become ready in 180 s")
                await asyncio.sleep(0.25)
        yield
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await logged


async def _drain(stream: asyncio.StreamReader, log_path: Path) -> bytes:
    """Everything `stream` says until it closes, appended to `log_path` as it comes; returns it all."""
    said = bytearray()
    with log_path.open("wb", buffering=0) as log:
        while chunk := await stream.read(65536):
            said += chunk
            log.write(chunk)
    return bytes(said)
