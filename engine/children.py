"""Ending a spawned child (the engine's process, the STT's): one way, wherever a child is let go."""

from __future__ import annotations

from multiprocessing.process import BaseProcess


def end_child(process: BaseProcess, wait_s: float) -> None:
    """Waits up to `wait_s` for `process` to exit by itself (a stop it was sent, a failure it reported, its CUDA
    teardown), then kills it; returns once it is gone."""
    process.join(wait_s)
    if process.is_alive():
        process.kill()
        process.join()
