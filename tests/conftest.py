"""Shared fixtures: the tiny random-weight checkpoint, made once per test session by our own code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# A developer's own .env must not reach the commands the tests run (kame_phone/cli.py).
os.environ["KAME_ENV_FILE"] = ""


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-kame"))


@pytest.fixture(scope="session")
def question_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A caller's question in real speech (flite), for tests that need a good call beside an attack."""
    from .phone_fixtures import flite_wav

    return flite_wav("Hello, what time does the store open on Monday?", tmp_path_factory.mktemp("speech") / "q.wav")


@pytest.fixture
def tiny_bundle(tiny_checkpoint: Path):
    """A freshly loaded tiny model (moshi keeps streaming state on the modules: one load per user)."""
    from engine.checkpoint import load_kame

    return load_kame(str(tiny_checkpoint), device="cpu")


@pytest.fixture
async def llm_server():
    """A real OpenAI-compatible streaming server on loopback (the stand-in for a paid LLM API)."""
    from .llm_server import serve_fake_llm

    async with serve_fake_llm() as server:
        yield server


@pytest.fixture
async def prefix():
    """A Redis key prefix of its own per test; every key under it is deleted afterwards."""
    import uuid

    import redis.asyncio as aioredis

    from .redis_support import REDIS_URL

    p = f"kame-test:{uuid.uuid4().hex[:10]}:"
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True, socket_timeout=1.0)
    try:
        await client.ping()
    except Exception as exc:  # noqa: BLE001 - turn any connection failure into one clear message
        pytest.fail(f"these tests need a Redis at {REDIS_URL} (scripts/setup.sh starts one): {exc!r}")
    yield p
    keys = [k async for k in client.scan_iter(match=p + "*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
async def engine_server(tmp_path: Path):
    """Start echoing engines behind real engine-link servers: `server, address = await engine_server(seats)`."""
    from .link_fixtures import engine_servers

    async for start in engine_servers(tmp_path):
        yield start
