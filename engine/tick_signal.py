"""The engine's "a tick just ended" across processes, for the STT's own process to step on (`FrameTicker.follow`).

Not a `multiprocessing.Event`: that is a lock plus a semaphore, and a process killed while it held the lock (inside
`set` or `wait`) left it held for good. The other side then blocked in its next `set` or `wait`, whatever its
timeout: killing the STT's process froze the restarted one, and the engine's tick thread with it. Here a tick is a
byte in a pipe: the engine's end never blocks (a full pipe, nobody reading, drops the byte), the follower polls with
its timeout and drains, and either side may die at any moment without leaving anything held.
"""

from __future__ import annotations

import multiprocessing
import os


class TickSignal:
    """`threading.Event`'s `set`/`wait`/`clear`, between processes. Made in the parent, it crosses to spawned
    children as a Process argument; any number of processes may `set`, one at a time should `wait`."""

    def __init__(self) -> None:
        self._reader, self._writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
        # Shared by every copy of the descriptor, in every process it crosses to.
        os.set_blocking(self._writer.fileno(), False)

    def set(self) -> None:
        try:
            self._writer.send_bytes(b"\0")  # 5 bytes, under PIPE_BUF: written whole or not at all
        except (BlockingIOError, BrokenPipeError, OSError, ValueError):
            pass  # nobody has read the last ~13,000 ticks, or every reader is gone: a pace nobody follows

    def wait(self, timeout: float | None = None) -> bool:
        try:
            return self._reader.poll(timeout)
        except (OSError, ValueError):  # closed
            return False

    def clear(self) -> None:
        try:
            while self._reader.poll(0):
                self._reader.recv_bytes()
        except (EOFError, OSError, ValueError):
            pass

    def close(self) -> None:
        self._reader.close()
        self._writer.close()
