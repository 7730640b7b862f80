"""Shared by the tests that talk to a real Redis."""

from __future__ import annotations

import os

from prometheus_client import REGISTRY

REDIS_URL = os.environ.get("KAME_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_errors() -> float:
    return REGISTRY.get_sample_value("kame_redis_errors_total") or 0.0
