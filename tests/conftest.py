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
