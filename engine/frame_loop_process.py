"""The frame loop, and the model it owns, in a child process: `FrameLoopProcess` has `FrameLoop`'s methods.

Why: in one interpreter the model's thread and the asyncio side (the phone edge, the STT + LLM back-end)
share the GIL and the cores. Measured on CPU, 32 calls' LLM streams doubled the tick (35 -> 75 ms p50)
and late ticks delayed every oracle. In its own process the loop keeps its own clock, a crash there
cannot take the service down, and the model's memory is not in the service's heap.

The parent keeps the slot table (rows are allocated here, so `join` needs no round trip) and talks to the
child over one duplex pipe. Parent -> child: join, leave, audio, oracle, turn, stop. Child -> parent:
ready, tick (every slot's output), reset (rows the engine restarted), timing, counters and oracle-fed
samples, which the parent turns into its own metrics (the child's registry is never scraped).
`time.monotonic()` is one clock for the whole machine, so timestamps cross unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from . import metrics
from .batch import ModelMemory
from .checkpoint import CheckpointError
from .child_logging import LogSetup
from .children import end_child
from .frame_loop import (
    FrameLoop,
    LoopStats,
    OracleFed,
    ResetHook,
    Slot,
    SlotOutput,
    SlotSink,
    TickSink,
    checked_frame,
    publish_memory,
)
from .interface import EngineClosed, EngineError, EngineFull
from .memory_check import NotEnoughMemory
from .oracle_buffer import OracleBuffer
from .pipe_sender import ParentSender, PipeSender, commands
from .sampling import SamplingConfig, SamplingOverrides

# What the child reports as an operator's error, by name, raised again here as itself.
_REFUSALS: dict[str, type[Exception]] = {"CheckpointError": CheckpointError, "NotEnoughMemory": NotEnoughMemory}
log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a 7B checkpoint from a cold disk takes minutes
# Fetching it first (an empty Hugging Face cache: ~16 GB) is timed apart: under START_TIMEOUT_S a first start
# needed >= 27 MB/s, else it was killed and restarted, downloading again. A stalled download fails on its own
# (the hub client's read timeout); this only bounds one that crawls (16 GB at ~2 MB/s).
FETCH_TIMEOUT_S = 7200.0
COMPILE_TIMEOUT_S = 1800.0  # and with --compile, compiling the tick in the warm-up (autotuning: many minutes)
BEAT_EVERY_S = 0.5  # an idle child's beat to the parent (its idle ticks are not sent)
EXIT_BROKEN = 70  # the child's exit code when every tick fails (EX_SOFTWARE)


@dataclass(frozen=True)
class ChildSpec:
    """What the child needs to build the model and its loop (plain data: it is pickled to a spawned process)."""

    checkpoint: str
    device: str
    max_calls: int
    context: int | None
    sampling: SamplingOverrides  # resolved in the child against the checkpoint's lm_gen_config
    forced_delay_ms: float
    max_queued_frames: int
    torch_threads: int = 0  # 0: torch's default
    kv_dtype: str = "auto"
    weights_dtype: str = "auto"
    compile_mode: str = "off"


@dataclass
class _Row:
    call_id: str
    on_reset: ResetHook | None


class FrameLoopProcess:
    """`FrameLoop`'s interface, with the loop running in a spawned child process."""

    def __init__(
        self, spec: ChildSpec, on_tick: TickSink | None = None, on_death: Callable[[], None] | None = None,
        tick_signal: Any = None,
    ) -> None:
        self.spec = spec
        # A TickSignal (engine/tick_signal.py) the child sets right after each tick (the STT's process steps then).
        self.tick_signal = tick_signal
        self.on_tick = on_tick
        self.on_death = on_death  # from the reader thread, once, if the child dies unasked
        self.died = False
        self.max_calls = spec.max_calls
        self.stats = LoopStats()
        self.sampling: SamplingConfig | None = None  # in force in the child, known once it is ready
        self.memory: ModelMemory | None = None  # the child's model as served, known once it is ready
        self.oracle_fed: deque[OracleFed] = deque(maxlen=10_000)
        self._rows: list[_Row | None] = [None] * spec.max_calls
        self._lock = threading.Lock()  # the slot table and the pipe's sending end
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: threading.Thread | None = None
        self._closed = False
        self._abort_start = threading.Event()  # SIGTERM while the child loads: kill it, stop waiting
        self.alive = False
        self._counted = (0, 0, 0)  # (underruns, overruns, catchups) already added to this process's metrics
        self.audio_shed = 0  # caller frames never sent because the child was that far behind
        self._sender: ParentSender | None = None
        # kame_engine_slots stays 0 until the child is ready (and again once it is gone): a loading or dead
        # engine's seats are not seats (capacity alerts and the free-slots panel counted them).
        metrics.ENGINE_SLOTS.set(0)

    # ---- lifecycle (blocking: call from a thread) ----

    def start(self, warmup_ticks: int = 4) -> None:
        if self._process is not None:
            return
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA or threads
        ours, theirs = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=_child_main, args=(theirs, self.spec, warmup_ticks, self.tick_signal, LogSetup.of_this_process()),
            name="kame-engine", daemon=True,
        )
        self._process.start()
        theirs.close()
        self._conn = ours
        timeout = START_TIMEOUT_S + (COMPILE_TIMEOUT_S if self.spec.compile_mode != "off" else 0.0)
        try:
            kind, rest = self._await_start(ours, timeout)
            if kind == "failed" and rest[1]:  # an operator's error: the same one clear line as in process
                name, _, message = rest[0].partition(": ")
                raise _REFUSALS[name](message)
            if kind != "ready":
                raise EngineError(f"the engine process failed to start: {rest[0] if rest else kind}")
        except BaseException:
            self._forget_child()
            raise
        self.sampling, self.memory = rest
        publish_memory(self.memory)
        # ~640 ms of every call's audio may wait for the pipe.
        self._sender = ParentSender(ours, "audio", 8 * self.max_calls, name="kame-engine")
        self.alive = True
        metrics.ENGINE_SLOTS.set(self.max_calls)
        self._reader = threading.Thread(target=self._read_forever, name="kame-engine-reader", daemon=True)
        self._reader.start()
        log.info("engine process %d ready: %d slots; %s", self._process.pid, self.max_calls, self.memory.describe())

    def _await_start(self, conn: Connection, timeout: float) -> tuple[str, list[Any]]:
        """The child's first answer after its checkpoint is fetched ("ready" or "failed"): a download from
        the Hugging Face Hub has its own deadline, the load and warm-up `timeout`. Polled in slices: a stop
        while loading must not wait out a 7B load."""
        process = self._process
        assert process is not None
        # A local directory or random weights: nothing to download, the load's deadline (from the spawn, and
        # again from "fetched", seconds later).
        fetching = _downloads(self.spec.checkpoint)
        limit = FETCH_TIMEOUT_S if fetching else timeout
        deadline = time.monotonic() + limit
        while True:
            if conn.poll(0.25):
                try:
                    kind, *rest = conn.recv()
                except EOFError:
                    end_child(process, 5)  # closed its pipe, but may hang on the way out (CUDA teardown)
                    raise EngineError(f"the engine process died while starting (exit code {process.exitcode})"
                                      ) from None  # fmt: skip
                if kind != "fetched":
                    return kind, rest
                if fetching:
                    log.info("engine process: checkpoint %s is on disk; loading it", self.spec.checkpoint)
                fetching, limit = False, timeout
                deadline = time.monotonic() + timeout
                continue
            aborted = self._abort_start.is_set()
            if aborted or time.monotonic() > deadline:
                process.kill()
                process.join()
                what = "fetch its checkpoint" if fetching else "come up"
                raise EngineError("the engine process was stopped while starting" if aborted
                                  else f"the engine process did not {what} in {limit:.0f}s")  # fmt: skip

    def _forget_child(self) -> None:
        """After a failed start: the child waited for (a CUDA out-of-memory child may still be letting go of its
        memory, which a next start beside it would need) and forgotten, its pipe closed; `start` may run again."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is not None:
            end_child(process, 5)
        if conn is not None:
            conn.close()

    def abort_start(self) -> None:
        """From any thread: a `start` still waiting for the child kills it and raises EngineError."""
        self._abort_start.set()

    def stop(self) -> None:
        with self._lock:
            self._closed = True
        self._send(("stop",))
        if self._sender is not None:
            self._sender.close()  # after the stop message
        process, conn = self._process, self._conn  # once: a failed start's thread may forget them meanwhile
        if process is not None:
            end_child(process, 10)
        if self._reader is not None:
            self._reader.join(5)
        if conn is not None:
            conn.close()

    # ---- FrameLoop's methods (any thread; never block) ----

    @property
    def free_slots(self) -> int:
        with self._lock:
            return sum(r is None for r in self._rows) if self.alive else 0

    def join(
        self, call_id: str, sink: SlotSink | None, on_reset: ResetHook | None = None,
        forced_delay_ms: float | None = None,
    ) -> int:
        if sink is not None:
            raise ValueError("a child-process frame loop delivers through its tick sink only")
        with self._lock:
            if self._closed or not self.alive:
                raise EngineClosed("engine process is not running")
            for row, taken in enumerate(self._rows):
                if taken is None:
                    self._rows[row] = _Row(call_id, on_reset)
                    busy = sum(r is not None for r in self._rows)
                    metrics.ENGINE_SLOTS_BUSY.set(busy)
                    self.stats.seated(busy)
                    self._send_locked(("join", row, call_id, forced_delay_ms))
                    return row
        raise EngineFull(f"all {self.max_calls} call slots are busy")

    def leave(self, row: int, call_id: str) -> None:
        with self._lock:
            taken = self._rows[row]
            if taken is not None and taken.call_id == call_id:
                self._rows[row] = None
                self._send_locked(("leave", row, call_id))
            busy = sum(r is not None for r in self._rows)
            metrics.ENGINE_SLOTS_BUSY.set(busy)
            self.stats.seated(busy)
            if not busy:  # the child's idle ticks send nothing: no call, no backlog
                metrics.ENGINE_INPUT_BACKLOG.set(0)

    def push_audio(self, row: int, call_id: str, pcm: np.ndarray) -> np.ndarray:
        pcm = checked_frame(pcm)  # here: an error is the caller's, at once
        self._send(("audio", row, call_id, pcm))
        return pcm

    def set_oracle(
        self,
        row: int,
        call_id: str,
        candidate_id: int,
        text: str,
        triggered_at: float | None = None,
        *,
        complete: bool,
    ) -> None:
        self._send(("oracle", row, call_id, candidate_id, text, triggered_at, complete))

    def caller_turn(self, row: int, call_id: str, speaking: bool) -> None:
        self._send(("turn", row, call_id, speaking))

    # ---- the pipe ----

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._send_locked(message)

    def _send_locked(self, message: tuple[Any, ...]) -> None:
        """Queue a message for the sender (never blocks); audio is shed when too much is unsent."""
        if not self.alive or self._sender is None:
            return
        if not self._sender.put(message):
            self.audio_shed += 1
            metrics.ENGINE_OVERRUNS.inc()

    def _read_forever(self) -> None:
        assert self._conn is not None
        while True:
            try:
                kind, *body = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(kind, body)
            except Exception:  # a broken consumer must not stop the pipe
                log.exception("engine process message %r could not be handled", kind)
        self.alive = False
        metrics.ENGINE_SLOTS.set(0)
        if not self._closed:
            if self._process is not None:
                self._process.join(1)
            code = self._process.exitcode if self._process is not None else None
            log.error("the engine process died (exit code %s): its calls are lost", code)
            self.died = True
            if self.on_death is not None:
                self.on_death()

    def _dispatch(self, kind: str, body: list[Any]) -> None:
        if kind == "broken":  # the child exits next: its death is handled when the pipe closes
            log.critical("the engine process is broken: %s", body[0])
        elif kind == "tick":
            delivered, fed, counters, ended_at = body
            self.oracle_fed.extend(fed)
            for item in fed:
                item.observe()  # in this process's metrics: the child's registry is nobody's to scrape
            self._count(counters)
            if self.on_tick is not None and delivered:
                self.on_tick(delivered, ended_at)
        elif kind == "timing":
            self.stats.record_tick(*body)
        elif kind == "beat":
            self.stats.beat()
        elif kind == "reset":
            (rows,) = body
            with self._lock:
                seated = [self._rows[row] for row, call_id in rows]
                hooks = [
                    r.on_reset
                    for r, (_, call_id) in zip(seated, rows, strict=True)
                    if r is not None and r.call_id == call_id and r.on_reset is not None
                ]
            for hook in hooks:
                hook()

    def _count(self, counters: tuple[int, int, int, int]) -> None:
        underruns, overruns, catchups, backlog = counters
        du, do, dc = (now - before for now, before in zip(counters[:3], self._counted, strict=True))
        if du > 0:
            metrics.ENGINE_UNDERRUNS.inc(du)
        if do > 0:
            metrics.ENGINE_OVERRUNS.inc(do)
        if dc > 0:
            metrics.ENGINE_INPUT_CATCHUPS.inc(dc)
        metrics.ENGINE_INPUT_BACKLOG.set(backlog)
        self._counted = (underruns, overruns, catchups)
        self.stats.underruns, self.stats.overruns, self.stats.catchups = underruns, overruns, catchups
        self.stats.input_backlog = backlog


def _downloads(checkpoint: str) -> bool:
    """Whether starting on `checkpoint` may download it: a Hugging Face repo id, not a directory or random."""
    from .checkpoint import RANDOM_PREFIX

    return not checkpoint.startswith(RANDOM_PREFIX) and not Path(checkpoint).expanduser().is_dir()


# ---------------------------------------------------------------------------------------------------------
# The child


def _child_main(
    conn: Connection, spec: ChildSpec, warmup_ticks: int, tick_signal: Any = None, log_setup: LogSetup | None = None
) -> None:
    import signal

    if log_setup is not None:
        log_setup.apply()

    import torch

    # Ctrl-C reaches the whole process group: the parent drains its calls and then stops us over the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from .batch import KameBatch
    from .checkpoint import RANDOM_PREFIX, load_kame, resolve_checkpoint
    from .heap import freeze_startup_heap

    if spec.torch_threads > 0:
        torch.set_num_threads(spec.torch_threads)
    send = PipeSender(conn, name="engine-child")
    try:
        # A first start downloads it here, apart from the load's deadline; the load then reads these files (not
        # the Hub again: a revision moved meanwhile would download inside the load's deadline).
        files = None if spec.checkpoint.startswith(RANDOM_PREFIX) else resolve_checkpoint(spec.checkpoint)
        send(("fetched",))
        bundle = load_kame(spec.checkpoint, spec.device, None, spec.context, weights_dtype=spec.weights_dtype,
                           files=files)  # fmt: skip
        loop = _ChildFrameLoop(
            send,
            KameBatch(bundle.lm, bundle.mimi, spec.max_calls, spec.sampling.resolve(bundle.lm_gen_config),
                      kv_dtype=spec.kv_dtype, compile_mode=spec.compile_mode),
            bundle.tokenizer,
            max_queued_frames=spec.max_queued_frames,
            forced_delay_ms=spec.forced_delay_ms,
        )
        loop.tick_signal = tick_signal
        loop.start(warmup_ticks)
    except Exception as e:
        # An operator's error (a bad checkpoint, a node sized past its GPU) is raised again in the parent as
        # itself: one clear line there, no traceback.
        send(("failed", f"{type(e).__name__}: {e}", type(e).__name__ in _REFUSALS))
        send.close()
        return
    # This process's heap is mostly torch and the model; a full collection over it stalls every call's tick.
    freeze_startup_heap()
    send(("ready", loop.sampling, loop.batch.memory))
    loop.announced = True
    _serve_commands(conn, loop)
    send.close()


def _serve_commands(conn: Connection, loop: _ChildFrameLoop) -> None:
    for kind, body in commands(conn):
        try:
            _dispatch(loop, kind, body)
        except Exception:  # one call's bad command must not end this process, and with it every call here
            call_id = body[1] if len(body) > 1 and isinstance(body[1], str) else "?"
            log.exception("engine: a %r command for call %s failed; the loop goes on", kind, call_id)
    loop.stop()


def _dispatch(loop: _ChildFrameLoop, kind: str, body: list[Any]) -> None:
    if kind == "audio":
        loop.push_audio(*body)
    elif kind == "oracle":
        *args, complete = body
        loop.set_oracle(*args, complete=complete)
    elif kind == "turn":
        loop.caller_turn(*body)
    elif kind == "join":
        loop.join_row(*body)
    elif kind == "leave":
        loop.leave(*body)


class _ChildFrameLoop(FrameLoop):
    """The real loop, in the child: seats calls in the rows the parent chose, and after each tick forwards
    what the parent needs (outputs, oracle-fed samples, counters, resets, timing)."""

    def __init__(self, send: PipeSender, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.send = send
        self._beat_sent_at = 0.0
        self.announced = False  # "ready" sent: the parent's start reads nothing else before it
        self.pending_resets: list[tuple[int, str]] = []
        self.on_tick = self._forward_tick
        self.on_broken = self._exit_broken
        self.tick_signal: Any = None  # set first after each tick: the GPU is free for the STT's step now

    def _exit_broken(self) -> None:
        """Every tick failing: say why, then end the process, so the parent's death path ends the calls,
        fails health and the device's memory goes back for the restart."""
        with contextlib.suppress(Exception):
            self.send(("broken", self.broken))
            self.send.close()
        logging.shutdown()
        os._exit(EXIT_BROKEN)

    def join_row(self, row: int, call_id: str, forced_delay_ms: float | None) -> None:
        def reset_hook() -> None:  # called inside safe_tick; sent once the tick is over
            self.pending_resets.append((row, call_id))

        lm = self.batch.lm
        with self._lock:
            oracle = OracleBuffer(lm.oracle_start_token_id, lm.text_padding_token_id)
            self._slots[row] = Slot(row, call_id, None, oracle, reset_hook,
                                    forced_delay_frames=self._delay_frames(forced_delay_ms))

    def _forward_tick(self, delivered: list[tuple[str, SlotOutput]], ended_at: float) -> None:
        if self.tick_signal is not None:
            self.tick_signal.set()
        fed = []
        while self.oracle_fed:
            fed.append(self.oracle_fed.popleft())
        stats = self.stats
        counters = (stats.underruns, stats.overruns, stats.catchups, stats.input_backlog)
        self.send(("tick", delivered, fed, counters, ended_at))

    def safe_tick(self) -> bool:
        ok = super().safe_tick()
        if self.pending_resets:
            resets, self.pending_resets = self.pending_resets, []
            self.send(("reset", resets))
        return ok

    def _record_timing(self, elapsed: float, late: bool) -> None:
        super()._record_timing(elapsed, late)
        if not self._idle:
            self.send(("timing", elapsed, late))
        elif self.announced and time.monotonic() - self._beat_sent_at >= BEAT_EVERY_S:
            # Idle: a beat now and then says the loop is not hung (a stall its last calls left clears on it).
            self._beat_sent_at = time.monotonic()
            self.send(("beat",))
