"""The messages between a parent and its child process (the engine's, the STT's), each written off the thread
that makes it: `PipeSender` in the child, `ParentSender` in the parent."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)

# Messages the child may hold for a parent that is not reading (~5 s of ticks, ~32 MB at 64 calls): past it the
# tick waits for the pipe, as every tick did before it had a sender of its own.
MAX_UNSENT = 64


class PipeSender:
    """A child process's messages to its parent, written by a thread of their own. A tick's message (its calls'
    audio, ~7.7 KB a call: half a megabyte at 64) is larger than the pipe holds, so written from the tick, the
    tick waited for the parent's reader, and the parent's GIL (its phone edge, its STT), to take it: the parent's
    load became the child's late frames, which the child process exists to prevent. In order, none dropped;
    bounded (past `max_unsent` the caller waits, as a write of its own would)."""

    def __init__(self, conn: Connection, max_unsent: int = MAX_UNSENT, name: str = "child") -> None:
        self._conn = conn
        self._max = max_unsent
        self._queue: deque[tuple[Any, ...]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def __call__(self, message: tuple[Any, ...]) -> None:
        with self._cond:
            while len(self._queue) >= self._max and self._thread.is_alive():
                self._cond.wait(0.1)  # the parent far behind: back-pressure, as a write of our own would be
            self._queue.append(message)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                message = self._queue[0]
            try:
                self._conn.send(message)
            except OSError:  # the parent is gone: nothing more to say
                return
            except Exception:  # pickling failed (a ValueError too: a ctypes pointer), before a byte was written
                log.exception("a %r message to the parent could not be sent; dropped", message[0])
            with self._cond:
                self._queue.popleft()
                self._cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to `timeout_s`), then stop: before the process exits."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)


class ParentSender:
    """A parent's messages to its child, written by a thread of their own: a pipe write blocks while the child is
    behind, and the callers are the event loop's threads, which must never. In order. Messages of `shed_kind`
    (a call's audio) are refused past `max_queued` unsent: the child that far behind sheds audio anyway, as a
    loop behind real time does. Every other message is always queued."""

    def __init__(self, conn: Connection, shed_kind: str, max_queued: int, name: str) -> None:
        self._conn = conn
        self._shed_kind = shed_kind
        self._max = max_queued
        self._queued = 0
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._name = name
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def put(self, message: tuple[Any, ...]) -> bool:
        """Queue `message`; False when it is of `shed_kind` and too many of those are unsent (it was dropped)."""
        if message[0] == self._shed_kind:
            with self._lock:
                if self._queued >= self._max:
                    return False
                self._queued += 1
        self._outbox.put(message)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop (waits up to `timeout_s` for it)."""
        self._outbox.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (message := self._outbox.get()) is not None:
            if message[0] == self._shed_kind:
                with self._lock:
                    self._queued -= 1
            try:
                self._conn.send(message)
            except OSError as e:  # the child is gone: the parent's reader says so
                log.debug("%s pipe closed: %s", self._name, e)
                return
            except Exception:  # pickled before a byte is written: that one message goes, the pipe stays whole
                # (the thread dying here left every later message queued for good, the child alive and unfed)
                log.exception("%s: a %r message could not be sent; dropped", self._name, message[0])


def commands(conn: Connection) -> Iterator[tuple[str, list[Any]]]:
    """A child's commands from its parent, as (kind, body), until "stop" or the parent is gone."""
    while True:
        try:
            kind, *body = conn.recv()
        except (EOFError, OSError):
            return
        if kind == "stop":
            return
        yield kind, body
