"""`--stt kyutai` in a child process of its own (`--stt-process`, on by default): the batched Kyutai STT's model
and its 80 ms thread, away from the phone edge's interpreter.

Why: in serve's process the STT's thread shares the GIL with the event loop (every call's WebSocket, codec and
resampling, the back-ends' LLM streams). On an H200 at 64 calls its step took 51 ms p50 where it takes 22 ms
alone and 31-48 ms beside one busy Python thread (docs/benchmarks.md): its ~400 launches a step each waited for
the GIL, and the STT fell a frame behind. In its own process it has its own GIL, and a crash there (a CUDA fault)
costs calls their transcript until it is restarted, not the service.

One duplex pipe. Parent -> child: open (a request id: the child picks the row, whose priming only it knows),
push (a row's whole frames), reset (with the row's new epoch), release, flush (a request id), follow, stop.
Child -> parent: ready or failed, opened (the row and lease, or why not), results (after each tick: the rows' new
transcripts tagged with their epoch, a row's failure, the step times and counters for this process's metrics),
flushed. `feed` never waits for the child: frames leave through a sender thread, results come back through a
reader thread and wait in the row's inbox for the call's next `feed`, as in process they wait in the engine's
outbox. A reset's epoch drops the results the child made before it, still on their way.

The pace: the KAME engine sets `tick_signal` (engine/tick_signal.py, handed to both children at their start)
right after each tick, in the engine's own process when it has one, so the STT steps after the engine's ticks
with no hop through this busy process; either child may be killed without leaving the other blocked on it.

A child that dies fails its calls' streams (their back-ends report it and open new ones after a backoff) and is
started again, after 1 s, then twice as long after each start that fails (or each child that dies within a minute
of its start), up to 30 s. A child is also made to die where it could not recover in place: its steps failing
STEP_FAILURES_TO_EXIT times in a row (a CUDA fault leaves its context broken for good) make it exit; a step
that never returns (a wedged GPU), with calls' audio still coming, makes this process kill it after STALL_S.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint import CheckpointError
from engine.child_logging import LogSetup
from engine.children import end_child
from engine.pipe_sender import ParentSender, PipeSender, commands
from engine.tick_signal import TickSignal

from . import metrics
from .stt import SttResult, SttUnavailable
from .stt_kyutai import KyutaiStreamingSTT, KyutaiSttEngine, KyutaiSttOptions, SttCapacityError, settings_from_env
from .stt_random import RANDOM_PREFIX

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # load and warm-up (stt-2.6b-en from a cold disk, CUDA graphs captured)
FETCH_TIMEOUT_S = 7200.0  # a repo id with an empty Hugging Face cache downloads first (as the engine's)
ANSWER_TIMEOUT_S = 5.0  # open and flush: the child answers between two steps
RESTART_BACKOFF_S = (1.0, 30.0)  # first wait, longest wait
SHORT_LIFE_S = 60.0  # a child dead within this of its start backs the next restart off, as a failed start does
STEP_FAILURES_TO_EXIT = 3  # steps failing in a row: the child exits, to be started afresh
CLOSE_SPAWN_WAIT_S = 15.0  # a start under way at a close: it gives up within a poll and a kill
STALL_S = 10.0  # calls' audio sent with no step since: the child is wedged, and is killed
STEPS_FAILED_EXIT = 70  # the child's exit code when its steps keep failing


@dataclass(frozen=True)
class SttChildSpec:
    """What the child builds its engine from (plain data: pickled to a spawned process)."""

    source: str
    device: str | None
    rows: int
    options: KyutaiSttOptions = field(default_factory=KyutaiSttOptions)

    @classmethod
    def from_env(cls, rows: int | None = None) -> SttChildSpec:
        source, device, max_streams, options = settings_from_env(rows=rows)
        return cls(source, device, max_streams, options)


@dataclass
class _Held:
    """A row one of this process's streams holds in the child."""

    lease: int
    generation: int  # which child: a restarted one deals leases from 1 again
    epoch: int = 0  # bumped by each reset; results of an older epoch are stale
    inbox: list[SttResult] = field(default_factory=list)
    failure: str | None = None


@dataclass
class _Link:
    """One child and the threads that talk to it."""

    generation: int
    process: multiprocessing.process.BaseProcess
    conn: Connection
    sender: ParentSender
    alive: bool = True
    started_at: float = field(default_factory=time.monotonic)
    unstepped_since: float | None = None  # the first audio sent since the child last reported a step
    pushed_at: float = 0.0  # the last audio sent
    killed_stalled: bool = False


class SttProcess:
    """The batched Kyutai STT in a spawned child: `open_stream` gives a call a `StreamingSTT` on one of its rows."""

    def __init__(self, spec: SttChildSpec, *, restart_backoff_s: tuple[float, float] = RESTART_BACKOFF_S) -> None:
        self.spec = spec
        self.batch_size = spec.rows
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process with threads (or CUDA)
        self.tick_signal = TickSignal()
        self._following = False
        self._restart_backoff_s = restart_backoff_s
        self._next_restart_s = restart_backoff_s[0]
        self._lock = threading.Lock()
        self._link: _Link | None = None
        self._generations = itertools.count(1)
        self._requests: dict[int, Future[Any]] = {}
        self._request_ids = itertools.count(1)
        self._held: dict[int, _Held] = {}
        self._counted = (0, 0)  # the child's (dropped frames, catch-up steps) already in this process's metrics
        self._counted_generation = 0
        self._closed = threading.Event()
        # (Re)starts under way (a caller's `start`, the restart thread's): `close` waits for them to give up
        # before it closes the tick signal a spawn is still handing its child.
        self._spawning = 0
        self._spawned = threading.Condition(self._lock)
        self.restarts = 0
        self.recent_steps: deque[tuple[float, float]] = deque(maxlen=4096)  # the child's (began, seconds)

    # ---- lifecycle (blocking: call from a thread) ----

    def start(self) -> None:
        """Spawn the child and wait until its model is loaded and warm; CheckpointError for a bad checkpoint."""
        if self._link is not None:
            return
        self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the Kyutai STT process is closed")
            self._spawning += 1
        try:
            self._spawn_child()
        finally:
            with self._lock:
                self._spawning -= 1
                self._spawned.notify_all()

    def _spawn_child(self) -> None:
        ours, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_child_main, name="kame-stt", daemon=True,
                                    args=(theirs, self.spec, self.tick_signal, LogSetup.of_this_process()))
        try:
            process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        try:
            self._await_ready(ours, process)
        except BaseException:
            ours.close()
            raise
        with self._lock:
            closed = self._closed.is_set()
            if not closed:
                # ~640 ms of every call's audio may wait for the pipe (this process starved): past it, dropped.
                sender = ParentSender(ours, "push", 8 * self.batch_size, name="kame-stt")
                link = self._link = _Link(next(self._generations), process, ours, sender)
        if closed:  # closed while this (re)start waited for the child: stop it, as `close` would have
            ours.send(("stop",))
            end_child(process, 10)
            ours.close()
            return
        threading.Thread(target=self._read_forever, args=(link,), name="kame-stt-reader", daemon=True).start()
        if self._following:
            self._send(link, ("follow", True))
        log.info("Kyutai STT process %d ready: %d rows", process.pid, self.batch_size)

    def _await_ready(self, conn: Connection, process: multiprocessing.process.BaseProcess) -> None:
        downloads = not self.spec.source.startswith(RANDOM_PREFIX) and not Path(self.spec.source).expanduser().is_dir()
        deadline = time.monotonic() + (FETCH_TIMEOUT_S if downloads else START_TIMEOUT_S)
        while not conn.poll(0.25):
            if self._closed.is_set() or time.monotonic() > deadline:
                process.kill()
                process.join()
                raise RuntimeError("the Kyutai STT process was stopped while starting" if self._closed.is_set()
                                   else "the Kyutai STT process did not come up in time")  # fmt: skip
        try:
            kind, *rest = conn.recv()
        except EOFError:
            end_child(process, 5)
            raise RuntimeError(f"the Kyutai STT process died while starting (exit code {process.exitcode})") from None
        if kind == "failed":
            message, bad_checkpoint = rest
            end_child(process, 5)  # still letting go of its GPU memory: the next try must not start beside it
            if bad_checkpoint:  # the same one clear line as in process
                raise CheckpointError(message.removeprefix("CheckpointError: "))
            raise RuntimeError(f"the Kyutai STT process failed to start: {message}")

    def follow(self, on: bool = True) -> None:
        """Step right after each KAME engine tick (`tick_signal`) instead of on the child's own clock."""
        with self._lock:
            self._following = on
            link = self._link
        if link is not None:
            self._send(link, ("follow", on))
        pace = "after each KAME engine tick" if on else "on its own clock"
        log.info("Kyutai STT steps %s (in its own process)", pace)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            # A (re)start waiting for its child sees `_closed` within a poll, kills it and gives up: waited for,
            # so that nothing outlives the close and the tick signal is not closed under a spawn.
            if not self._spawned.wait_for(lambda: self._spawning == 0, timeout=CLOSE_SPAWN_WAIT_S):
                log.error("the Kyutai STT process: a start did not give up within %.0f s of the close",
                          CLOSE_SPAWN_WAIT_S)  # fmt: skip
            link, self._link = self._link, None
            for request in self._requests.values():
                request.set_exception(RuntimeError("the Kyutai STT process is closing"))
            self._requests.clear()
        if link is None:
            self.tick_signal.close()
            return
        link.sender.put(("stop",))
        link.sender.close()
        end_child(link.process, 10)
        link.conn.close()
        self.tick_signal.close()  # an engine still ticking finds it closed: its `set` does nothing

    @property
    def alive(self) -> bool:
        link = self._link
        return link is not None and link.alive

    @property
    def pid(self) -> int | None:
        link = self._link
        return link.process.pid if link is not None else None

    # ---- streams (any thread) ----

    def open_stream(self) -> KyutaiStreamingSTT:
        """A `StreamingSTT` on a free row of the child (SttCapacityError if there is none; SttUnavailable while
        the child is being restarted: the back-end asks again every half second)."""
        with self._lock:
            link = self._link
            if link is None or not link.alive:
                raise SttUnavailable("the Kyutai STT process is not running (it is being restarted)")
            request_id = next(self._request_ids)
            answer: Future[Any] = Future()
            self._requests[request_id] = answer
        self._send(link, ("open", request_id))
        row, lease, error = self._answer(link, request_id, answer, "seat a call")
        if error is not None:
            raise SttCapacityError(error) if row == -1 else RuntimeError(error)
        return KyutaiStreamingSTT(self, row, lease, generation=link.generation)

    def _push(self, generation: int, row: int, lease: int, frames: np.ndarray) -> None:
        link = self._current(generation, row, lease)
        if not link.sender.put(("push", row, lease, frames)):  # as the child drops a backlog
            metrics.STT_DROPPED_FRAMES.inc(len(frames))
        self._check_stall(link)

    def _check_stall(self, link: _Link) -> None:
        """Audio is going to the child, so it should be stepping: with no step reported for STALL_S it is wedged
        (its commands are still answered: another thread), and only a new process can step again."""
        now = time.monotonic()
        # Judged over audio that keeps coming: after a gap (the last call's frames pushed, its row released
        # before they were stepped, no call since) the window starts again.
        if link.unstepped_since is None or now - link.pushed_at > STALL_S:
            link.unstepped_since = now
        link.pushed_at = now
        stalled_s = now - link.unstepped_since
        if stalled_s < STALL_S:
            return
        self._kill_wedged(link, f"has not stepped for {stalled_s:.0f} s while calls send it audio")

    def _kill_wedged(self, link: _Link, why: str) -> None:
        if link.killed_stalled:
            return
        link.killed_stalled = True
        log.error("the Kyutai STT process %d %s: killing it, to start it afresh", link.process.pid, why)
        link.process.kill()  # its pipe's end closes: the reader fails its calls and restarts it

    def _drain(self, generation: int, row: int, lease: int) -> list[SttResult]:
        with self._lock:
            held = self._held_row(generation, row, lease)
            out, held.inbox = held.inbox, []
            return out

    def _flush(self, generation: int, row: int, lease: int) -> list[SttResult]:
        with self._lock:
            link = self._current_locked(generation, row, lease)
            request_id = next(self._request_ids)
            answer: Future[Any] = Future()
            self._requests[request_id] = answer
        self._send(link, ("flush", request_id, row, lease))
        # With the inbox's results ahead of the final (the reader joins them as the answer comes: results the child
        # makes after the flush must not come before it).
        results, error = self._answer(link, request_id, answer, "flush")
        if error is not None:
            raise RuntimeError(error)
        return results

    def _answer(self, link: _Link, request_id: int, answer: Future[Any], what: str) -> Any:
        try:
            return answer.result(timeout=ANSWER_TIMEOUT_S)
        except FutureTimeout:
            with self._lock:
                waiting = self._requests.pop(request_id, None) is not None
            if waiting:  # else the reader took it just now: its answer is being set, and is ours (a seated row)
                # Its commands have a thread of their own, answered in milliseconds: the whole process is frozen.
                # Only audio going out was judged before: frozen on an idle node, it was never killed, every new
                # call went unheard and the node stayed ready (review, session 30).
                self._kill_wedged(link, f"did not {what} in {ANSWER_TIMEOUT_S:.0f} s")
                raise RuntimeError(f"the Kyutai STT process did not {what} in {ANSWER_TIMEOUT_S:.0f} s") from None
            return answer.result()

    def _reset(self, generation: int, row: int, lease: int) -> None:
        with self._lock:
            link = self._current_locked(generation, row, lease)
            held = self._held_row(generation, row, lease)
            held.epoch += 1
            held.inbox.clear()
            epoch = held.epoch
        self._send(link, ("reset", row, lease, epoch))

    def _release(self, generation: int, row: int, lease: int) -> None:
        with self._lock:
            held = self._held.get(row)
            if held is None or (held.generation, held.lease) != (generation, lease):
                return  # its child is gone: the row went with it
            del self._held[row]
            link = self._link
        if link is not None and link.generation == generation:
            self._send(link, ("release", row, lease))

    def _held_row(self, generation: int, row: int, lease: int) -> _Held:
        held = self._held.get(row)
        if held is None or (held.generation, held.lease) != (generation, lease):
            raise RuntimeError(f"Kyutai STT row {row} is no longer held by this stream")
        if held.failure is not None:
            raise RuntimeError(held.failure)
        return held

    def _current(self, generation: int, row: int, lease: int) -> _Link:
        with self._lock:
            return self._current_locked(generation, row, lease)

    def _current_locked(self, generation: int, row: int, lease: int) -> _Link:
        self._held_row(generation, row, lease)  # raises for a failed row or a dead child's
        link = self._link
        if link is None or link.generation != generation or not link.alive:  # closed, or dying as we speak
            raise RuntimeError("the Kyutai STT process this call's row was on is gone")
        return link

    # ---- the pipe ----

    def _send(self, link: _Link, message: tuple[Any, ...]) -> None:
        if link.alive:
            link.sender.put(message)

    def _read_forever(self, link: _Link) -> None:
        while True:
            try:
                kind, *body = link.conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(link, kind, body)
            except Exception:  # a bad message must not stop the pipe
                log.exception("Kyutai STT process message %r could not be handled", kind)
        link.alive = False
        link.sender.close(timeout_s=0)
        if self._closed.is_set():
            return
        link.process.join(1)
        reason = f"the Kyutai STT process died (exit code {link.process.exitcode})"
        with self._lock:
            calls = [held for held in self._held.values() if held.generation == link.generation]
            for held in calls:
                held.failure = reason
            for request in self._requests.values():  # a call starting now: asked again when it is back
                request.set_exception(SttUnavailable(reason))
            self._requests.clear()
        metrics.STT_PROCESS_RESTARTS.inc()
        if time.monotonic() - link.started_at >= SHORT_LIFE_S:
            self._next_restart_s = self._restart_backoff_s[0]  # it had lived a while: not a crash loop
        wait = self._next_restart_s
        log.error("%s: %d calls lose their transcript until it is back; starting it again in %.0f s", reason,
                  len(calls), wait)  # fmt: skip
        threading.Thread(target=self._restart, args=(wait,), name="kame-stt-restart", daemon=True).start()

    def _restart(self, wait: float) -> None:
        longest = self._restart_backoff_s[1]
        while not self._closed.wait(wait):
            wait = min(wait * 2, longest)
            self._next_restart_s = wait  # for the next death, should this child die young
            try:
                self._spawn()
            except Exception as e:
                if self._closed.is_set():  # closed meanwhile: the start gave up, as it should
                    return
                log.error("the Kyutai STT process did not start again (%s); next try in %.0f s", e, wait)
                continue
            self.restarts += 1
            return

    def _dispatch(self, link: _Link, kind: str, body: list[Any]) -> None:
        if kind == "results":
            items, step_seconds, counters = body
            with self._lock:
                for row, lease, epoch, results, failure in items:
                    held = self._held.get(row)
                    if held is None or (held.generation, held.lease) != (link.generation, lease):
                        continue  # released meanwhile
                    if failure is not None:
                        held.failure = f"Kyutai STT engine step failed: {failure}"
                    elif epoch == held.epoch:
                        held.inbox.extend(results)
            if step_seconds:
                link.unstepped_since = None
            self.recent_steps.extend(step_seconds)
            for _, seconds in step_seconds:
                metrics.STT_STEP_SECONDS.observe(seconds)
            self._count(link.generation, counters)
        elif kind == "opened":
            request_id, row, lease, error = body
            with self._lock:
                answer = self._requests.pop(request_id, None)
                if answer is not None and error is None:
                    self._held[row] = _Held(lease, link.generation)
            if answer is None:
                if error is None:  # asked by a stream that stopped waiting: nobody holds it
                    self._send(link, ("release", row, lease))
                return
            answer.set_result((row, lease, error))
        elif kind == "flushed":
            request_id, row, lease, results, error = body
            with self._lock:
                answer = self._requests.pop(request_id, None)
                held = self._held.get(row)
                ours = held is not None and (held.generation, held.lease) == (link.generation, lease)
                if answer is not None and held is not None and ours:
                    results, held.inbox = held.inbox + results, []
            if answer is not None:
                answer.set_result((results, error))

    def _count(self, generation: int, counters: tuple[int, int]) -> None:
        dropped, catchups = counters
        if generation != self._counted_generation:  # a restarted child counts from 0 again
            self._counted, self._counted_generation = (0, 0), generation
        before_dropped, before_catchups = self._counted
        if dropped > before_dropped:
            metrics.STT_DROPPED_FRAMES.inc(dropped - before_dropped)
        if catchups > before_catchups:
            metrics.STT_CATCHUP_STEPS.inc(catchups - before_catchups)
        self._counted = counters


# ---------------------------------------------------------------------------------------------------------
# The child


class _ChildSttEngine(KyutaiSttEngine):
    """The real engine, in the child: after each tick it sends the parent every row's new results."""

    def __init__(self, send: PipeSender, *args: Any, **kwargs: Any) -> None:
        self.send = send
        self.epochs: list[int] = []
        self._failures_sent: set[tuple[int, int]] = set()
        self._step_seconds: list[tuple[float, float]] = []
        self.failed_in_a_row = 0
        super().__init__(*args, **kwargs)
        self.epochs = [0] * self.batch_size

    def step(self):  # type: ignore[no-untyped-def]
        try:
            done = super().step()
        except Exception:
            self.failed_in_a_row += 1
            if self.failed_in_a_row >= STEP_FAILURES_TO_EXIT:
                self.report()  # the failed rows' calls hear why before the pipe closes
                log.critical("Kyutai STT: %d steps in a row failed; exiting, to be started afresh",
                             self.failed_in_a_row)  # fmt: skip
                self.send.close()
                os._exit(STEPS_FAILED_EXIT)  # not a clean close: a broken CUDA context can hang one
            raise
        if done is not None:  # a step that ran (an idle tick, nothing to step, says nothing of the device)
            self.failed_in_a_row = 0  # (when it began, on the machine's one monotonic clock; how long it took)
            self._step_seconds.append((time.monotonic() - self.last_step_s, self.last_step_s))
        return done

    def tick(self) -> int:
        try:
            return super().tick()
        finally:
            self.report()

    def report(self) -> None:
        # Drained and queued under the lock, so a flush's answer cannot overtake results drained before it.
        with self._lock:
            items = []
            for index, row in enumerate(self._rows):
                if row is None:
                    continue
                failure = None
                if row.failure is not None and (index, row.lease) not in self._failures_sent:
                    failure = row.failure
                    self._failures_sent.add((index, row.lease))
                if row.outbox or failure is not None:
                    items.append((index, row.lease, self.epochs[index], row.outbox, failure))
                    row.outbox = []
            steps, self._step_seconds = self._step_seconds, []
            if items or steps:
                self.send(("results", items, steps, (self.dropped_frames_total, self.catchup_steps_total)))

    def reset_row(self, index: int, lease: int, epoch: int) -> None:
        with self._lock:
            self._reset(index, lease)  # raises for a row no longer this lease's: its new holder's epoch stays
            self.epochs[index] = epoch

    def flush_row(self, request_id: int, index: int, lease: int) -> None:
        with self._lock:
            try:
                results, error = self._flush(index, lease), None
            except RuntimeError as e:
                results, error = [], str(e)
            self.send(("flushed", request_id, index, lease, results, error))

    def _release(self, index: int, lease: int) -> None:
        with self._lock:
            super()._release(index, lease)
            self._failures_sent.discard((index, lease))

    def open_row(self, request_id: int) -> None:
        # Under the lock to the answer: the row's first results (a tick may step it at once) must not reach the
        # parent before it knows the row is its call's, nor carry the epoch of the call that had it before.
        with self._lock:
            try:
                index, lease = self._acquire()
            except SttCapacityError as e:
                self.send(("opened", request_id, -1, 0, str(e)))
                return
            except RuntimeError as e:
                self.send(("opened", request_id, -2, 0, str(e)))
                return
            self.epochs[index] = 0
            self.send(("opened", request_id, index, lease, None))


def _child_main(conn: Connection, spec: SttChildSpec, tick_signal: Any, log_setup: LogSetup | None = None) -> None:
    import signal

    if log_setup is not None:
        log_setup.apply()

    # Ctrl-C reaches the whole process group: the parent drains its calls and then stops us over the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from engine.heap import freeze_startup_heap

    send = PipeSender(conn, name="stt-child")
    try:
        engine = _ChildSttEngine(send, spec.source, device=spec.device, max_streams=spec.rows, options=spec.options,
                                 start=False)  # fmt: skip
        engine.start()
    except Exception as e:
        send(("failed", f"{type(e).__name__}: {e}", isinstance(e, CheckpointError)))
        send.close()
        return
    freeze_startup_heap()  # the heap is torch and the model: a full collection over it stalls a step
    send(("ready",))
    for kind, body in commands(conn):
        try:
            _dispatch(engine, kind, body, tick_signal)
        except RuntimeError as e:  # a row released or failed meanwhile: its stream already knows
            log.debug("Kyutai STT %r for a row no longer held: %s", kind, e)
        except Exception:  # one call's bad command must not end this process, and with it every call's STT
            log.exception("Kyutai STT: a %r command failed; the engine goes on", kind)
    engine.close()
    send.close()


def _dispatch(engine: _ChildSttEngine, kind: str, body: list[Any], tick_signal: Any) -> None:
    if kind == "push":
        row, lease, frames = body
        engine._push(row, lease, frames)
    elif kind == "open":
        engine.open_row(*body)
    elif kind == "flush":
        engine.flush_row(*body)
    elif kind == "reset":
        engine.reset_row(*body)
    elif kind == "release":
        engine._release(*body)
    elif kind == "follow":
        (on,) = body
        engine.follow(tick_signal if on else None)
