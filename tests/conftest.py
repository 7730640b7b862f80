"""Shared fixtures: the tiny random-weight checkpoint, made once per test session by our own code."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-kame"))


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
