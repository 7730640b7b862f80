"""The engine's "a tick just ended" across processes, for the STT's own process to step on (`FrameTicker.follow`).

Not a `multiprocessing.Event`: that is a lock plus a semaphore, and a process killed while it held the lock (inside
`set` or `wait`) left it held for good. The other side then blocked in its next `set` or `wait`, whatever its
timeout: killing the STT's process froze the restarted one, and the engine's tick thread with it. Here a tick is a
byte in a pipe: the engine's end never blocks (a full pipe, nobody reading, drops the byte), the follower polls with
its timeout and drains, and either side may die at any moment without leaving anything held.

Raw bytes, not `Connection.send_bytes`'s framed messages: a follower killed between reading a message's length and
its body left the stream misaligned for the next one, which then read a byte of zeros as a 16 MiB length and
blocked in `clear` for good. A byte carries nothing, so any number of them read at once is as good as one.
"""

from __future__ import annotations

import multiprocessing
import os

DRAIN_CHUNK = 65536  # bytes read at once by `clear`: a pipe's whole buffer on Linux


class TickSignal:
    """`threading.Event`'s `set`/`wait`/`clear`, between processes. Made in the parent, it crosses to spawned
    children as a Process argument; any number of processes may `set`, one at a time should `wait`."""

    def __init__(self) -> None:
        self._reader, self._writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
        # Both ends non-blocking, shared by every copy of the descriptors, in every process they cross to.
        os.set_blocking(self._writer.fileno(), False)
        os.set_blocking(self._reader.fileno(), False)

    def set(self) -> None:
        try:
            os.write(self._writer.fileno(), b"\0")  # one byte: written whole or not at all
        except (BlockingIOError, BrokenPipeError, OSError, ValueError):
            pass  # nobody has read the last ~65,000 ticks, or every reader is gone: a pace nobody follows

    def wait(self, timeout: float | None = None) -> bool:
        try:
            return self._reader.poll(timeout)  # readable: a byte is there (or every writer is gone)
        except (OSError, ValueError):  # closed
            return False

    def clear(self) -> None:
        try:
            while os.read(self._reader.fileno(), DRAIN_CHUNK):
                pass
        except (BlockingIOError, OSError, ValueError):
            pass  # drained (or closed)

    def close(self) -> None:
        self._reader.close()
        self._writer.close()
