"""The `Engine` boundary over a socket: one engine server, any number of phone edges.

`EngineServer` wraps a loaded engine (`kame-phone engine-serve`) and listens on a Unix socket or TCP;
`RemoteEngine` is the edge's `Engine` for it (`kame-phone serve --engine ADDRESS`). One edge process
holds ~100 calls within its latency budget (docs/benchmarks.md), so a node that serves more runs several
edge processes against one GPU engine, and the engine can sit on another node than its edges.

Each edge asks for a number of seats in its hello and is granted at most what the engine has left; the
seats are its `max_calls`, so cluster admission never books a seat another edge holds. A draining edge
(`give_back_seats`, on SIGTERM) tells the engine, which grants the seats its calls do not use to another edge
at once (a rollout's new edge) and each other one as its call ends. Off loopback the
hello carries a shared token; `tls://host:port` wraps the link in TLS (the edge checks the engine's
certificate), since it carries the callers' audio.

The wire (messages, framing, addresses, TLS) is engine/link_wire.py; the server side engine/link_server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from . import metrics
from .interface import (
    LAST_WORDS_WAIT_S,
    BotFrames,
    CallAction,
    CallSetup,
    EngineClosed,
    EngineError,
    EngineFull,
    EngineNotice,
    EngineOutput,
)
from .link_wire import (
    COMPATIBLE_VERSIONS,
    PROTOCOL_VERSION,
    SILENT_LINK_S,
    Address,
    LinkError,
    LinkFull,
    LinkRefused,
    audio_message,
    backlogged,
    edge_tls,
    json_message,
    parse_event,
    parse_frames,
    read_message,
    tune_socket,
)
from .queues import FreshCarry, put_dropping_oldest, with_carried_fresh

log = logging.getLogger(__name__)

WELCOME_TIMEOUT_S = 5.0  # the edge's wait for the engine's answer
EDGE_EVENTS_QUEUE = 64  # a call's outputs waiting for its media session, on the edge (a local engine's too)
SEAT_ANSWER_TIMEOUT_S = 10.0  # the edge's wait for a seat (a join waits for the tick in progress: ms)



class _OlderEngine(Exception):
    """The engine refused our version and speaks an older one we still speak (COMPATIBLE_VERSIONS)."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


class RemoteCallSession:
    """A call seated on a remote engine (a `CallSession`)."""

    def __init__(self, engine: RemoteEngine, call_id: str) -> None:
        self.engine = engine
        self.call_id = call_id
        # Bounded as a local engine's call outputs are: a consumer behind loses the oldest, never stalls the
        # link's reader or grows without end (drafts come up to 12.5 a second).
        self._events: asyncio.Queue[EngineOutput | None] = asyncio.Queue(maxsize=EDGE_EVENTS_QUEUE)
        self.dropped = 0
        self.closed = False

    def _put(self, item: EngineOutput | None) -> None:
        if put_dropping_oldest(self._events, item):
            self.dropped += 1
            if self.dropped in (1, 100, 1000):
                log.warning("call %s: output consumer is behind, %d outputs dropped", self.call_id, self.dropped)

    def push_audio(self, pcm: np.ndarray) -> None:
        if not self.closed:
            self.engine._send_audio(self.call_id, pcm)

    async def outputs(self) -> AsyncIterator[EngineOutput]:
        while (item := await self._events.get()) is not None:
            yield item

    def action_failed(self, action: CallAction, result: str) -> None:
        if not self.closed:
            self.engine._send_action_failed(self.call_id, action, result)

    async def close(self) -> None:
        """No more audio; `outputs()` ends once the engine has sent what the call says as it closes (the
        caller's last words) and its end, or after LAST_WORDS_WAIT_S and a little more without them."""
        if self.closed:
            return
        self.closed = True
        self.engine._hang_up(self)

    def _end(self) -> None:
        self.closed = True
        self._put(None)


class RemoteEngine:
    """The edge's `Engine` for an `EngineServer` at `address` (see the module docstring)."""

    def __init__(
        self, address: Address, *, token: str | None, seats: int, name: str | None = None,
        backlog_bytes: int = 1 << 20, frames_queue_ticks: int = 8, tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        self.address = address
        self.token = token
        self.tls = tls  # on a tls:// address; None: the system's CAs (edge_tls())
        self.requested_seats = seats
        self.link_version = PROTOCOL_VERSION  # what the link speaks once welcomed (an older engine: older)
        self.name = name or socket.gethostname()
        self.backlog_bytes = backlog_bytes  # ~130 frames of caller audio unsent: the link is stuck, drop
        self._seats = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._calls: dict[str, RemoteCallSession] = {}
        self._opening: dict[str, asyncio.Future[str | None]] = {}
        self._frames: asyncio.Queue[BotFrames | None] = asyncio.Queue(maxsize=frames_queue_ticks)
        self._fresh_carry = FreshCarry()
        self._receiver: asyncio.Task[None] | None = None
        self._failed = False
        self._stopping = False
        self.draining = False  # the engine said it is going away: its calls go on, no new ones
        self.engine_behind = False  # the engine said it is not keeping time: no new calls until it is (6)
        self.leaving = False  # this edge drains (give_back_seats): it takes no new calls
        self.audio_dropped = 0

    @classmethod
    async def connect(cls, address: Address, *, token: str | None, seats: int, **kwargs: Any) -> RemoteEngine:
        engine = cls(address, token=token, seats=seats, **kwargs)
        await engine.start()
        return engine

    async def start(self) -> None:
        """Connect and be granted seats; raises LinkError (refused) or OSError (nobody listening)."""
        try:
            await self._hello(*await self._connect(), PROTOCOL_VERSION)
        except _OlderEngine as older:  # mid-upgrade: an engine that still speaks an older version we speak
            log.info("engine at %s speaks link protocol %d: using it", self.address, older.version)
            await self._hello(*await self._connect(), older.version)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        a = self.address
        if a.unix_path is not None:
            return await asyncio.open_unix_connection(a.unix_path)
        if a.tls:
            try:
                return await asyncio.open_connection(a.host, a.port, ssl=self.tls or edge_tls(), server_hostname=a.host)
            except ssl.SSLCertVerificationError as e:  # retrying will not make it trusted
                raise LinkRefused(
                    f"engine at {a}: its TLS certificate is not trusted ({e.verify_message}); "
                    "set KAME_ENGINE_CA to the CA that signed it"
                ) from None
        return await asyncio.open_connection(a.host, a.port)

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, version: int) -> None:
        a = self.address
        hello = {"version": version, "token": self.token or "", "seats": self.requested_seats, "name": self.name}
        writer.write(json_message(b"H", hello))
        try:
            kind, body = await asyncio.wait_for(read_message(reader), WELCOME_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            writer.close()
            raise LinkError(f"engine at {a} did not welcome us") from e
        welcome = json.loads(bytes(body)) if kind == b"W" else {"error": f"unexpected {kind!r}"}
        theirs = welcome.get("version", 1)  # an older engine ignores the hello's version
        if "error" in welcome:
            writer.close()
            if welcome.get("permanent") and theirs != version and theirs in COMPATIBLE_VERSIONS:
                raise _OlderEngine(theirs)
            # No seats left (other edges hold them): "full" from protocol 5, the words from an older engine.
            full = welcome.get("full") or str(welcome["error"]).startswith("no seats left")
            error = LinkRefused if welcome.get("permanent") else LinkFull if full else LinkError
            raise error(f"engine at {a} refused us: {welcome['error']}")
        if theirs not in COMPATIBLE_VERSIONS:
            writer.close()
            raise LinkRefused(
                f"engine at {a}: engine link protocol version mismatch: this edge speaks {PROTOCOL_VERSION}, the "
                f"engine {str(theirs)[:20]}; run the same kame-phone release on both"
            )
        self.link_version = int(theirs)
        self._seats = int(welcome["seats"])
        self._reader, self._writer = reader, writer
        tune_socket(writer)
        self._receiver = asyncio.create_task(self._receive(), name="engine-link")
        log.info("engine link to %s up: %d seats (protocol %d)", a, self._seats, self.link_version)

    async def stop(self) -> None:
        self._stopping = True
        for session in list(self._calls.values()):
            await session.close()
        if self._writer is not None:
            self._writer.close()
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self._put_frames(None)

    @property
    def max_calls(self) -> int:
        return self._seats

    @property
    def free_slots(self) -> int:
        if not self.ready or self.leaving or self.engine_behind:  # behind: no new call would keep time
            return 0
        return max(0, self._seats - len(self._calls) - len(self._opening))

    def give_back_seats(self) -> None:
        """This edge drains (it takes no new calls): the engine may give the seats its calls do not use to
        another edge now, and each other one as its call ends. A call reserved here before the drain still
        opens (the engine seats it if a seat is free). An engine of protocol < 5 is not told: the edge keeps
        its seats until it leaves, as before."""
        if self.leaving:
            return
        self.leaving = True
        if self._writer is None or self._failed:
            return
        if self.link_version < 5:
            log.info("draining: the engine at %s speaks link protocol %d and holds our %d seats until we leave",
                     self.address, self.link_version, self._seats)  # fmt: skip
            return
        self._writer.write(json_message(b"D", {}))
        log.info("draining: giving back to the engine at %s the seats our %d calls do not use (of %d)",
                 self.address, len(self._calls) + len(self._opening), self._seats)  # fmt: skip

    @property
    def ready(self) -> bool:
        # Not `engine_behind`: every edge shares the one engine, so all would leave the load balancer at once
        # (Twilio's "application error" for every call); in rotation, an edge answers busy (free_slots 0).
        return self._linked and not self.draining

    @property
    def _linked(self) -> bool:
        return self._writer is not None and not self._failed and not self._stopping

    @property
    def failed(self) -> bool:
        return self._failed

    async def open_call(self, call_id: str, setup: CallSetup | None = None) -> RemoteCallSession:
        if self.draining:
            raise EngineClosed("the engine is draining")
        # Not `ready`: a call its webhook answered still gets its stream from an engine that is behind (the
        # engine seats it; only new admissions wait), as a local engine does.
        if not self._linked or self._writer is None:
            raise EngineClosed("the engine link is down")
        old = self._calls.get(call_id)
        if old is not None:  # the same call reconnecting: the server swaps the seat over
            old._end()
            del self._calls[call_id]
        if call_id in self._opening:
            raise EngineError(f"call {call_id} is already being seated")
        waiter: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._opening[call_id] = waiter
        try:
            opened: dict[str, Any] = {"call_id": call_id}
            if setup is not None:
                opened["setup"] = dataclasses.asdict(setup)
            self._writer.write(json_message(b"O", opened))
            try:
                error = await asyncio.wait_for(waiter, SEAT_ANSWER_TIMEOUT_S)
            except TimeoutError:  # an engine that reads but never answers: the caller is not held forever
                self._writer.write(json_message(b"C", {"call_id": call_id}))  # a seat it grants later goes back
                raise EngineClosed(f"the engine did not answer in {SEAT_ANSWER_TIMEOUT_S:g} s") from None
            except asyncio.CancelledError:  # whoever opened it is gone: a seat granted meanwhile goes back
                if (seated := self._calls.get(call_id)) is not None:
                    self._forget(seated)
                    seated._end()
                elif self._writer is not None and not self._failed:  # one granted later: held until we go
                    self._writer.write(json_message(b"C", {"call_id": call_id}))
                raise
        finally:
            self._opening.pop(call_id, None)
        if error == "full":
            raise EngineFull("every seat of this edge is taken")
        if error is not None:
            raise EngineClosed(error)
        session = self._calls.get(call_id)
        if session is None:  # seated, then the link was lost in the same read: the seat went with it
            raise EngineClosed("the engine link was lost while seating the call")
        return session

    async def bot_frames(self) -> AsyncIterator[BotFrames]:
        while (frames := await self._frames.get()) is not None:
            yield with_carried_fresh(frames, self._fresh_carry)

    def _send_audio(self, call_id: str, pcm: np.ndarray) -> None:
        writer = self._writer
        if writer is None or self._failed:
            return
        if backlogged(writer, self.backlog_bytes):  # the engine is not reading: shed, never buffer without end
            self.audio_dropped += 1
            metrics.ENGINE_LINK_DROPPED.labels(what="caller_audio").inc()
            return
        writer.write(audio_message(call_id, pcm))

    def _send_action_failed(self, call_id: str, action: CallAction, result: str) -> None:
        if self.link_version < 4:  # an engine of protocol 3 (mid-upgrade) knows no "X": it would drop the link
            return
        if self._writer is not None and not self._failed and call_id in self._calls:
            self._writer.write(json_message(b"X", {"call_id": call_id, "action": action, "result": result}))

    def _hang_up(self, session: RemoteCallSession) -> None:
        if self._calls.get(session.call_id) is not session or self._writer is None or self._failed:
            self._forget(session)
            session._end()
            return
        self._writer.write(json_message(b"C", {"call_id": session.call_id}))  # its last words, then its end

        def give_up() -> None:  # an engine that never sends the end (or a link that hangs): not held for good
            if self._calls.get(session.call_id) is session:
                del self._calls[session.call_id]
                session._end()

        asyncio.get_running_loop().call_later(LAST_WORDS_WAIT_S + 1.0, give_up)

    def _forget(self, session: RemoteCallSession) -> None:
        if self._calls.get(session.call_id) is session:
            del self._calls[session.call_id]
            if self._writer is not None and not self._failed:
                self._writer.write(json_message(b"C", {"call_id": session.call_id}))

    def _put_frames(self, item: BotFrames | None) -> None:
        # A consumer behind loses the oldest ticks, as with a local engine (their fresh marks carried).
        put_dropping_oldest(self._frames, item, self._fresh_carry.dropped_frames)

    async def _receive(self) -> None:
        assert self._reader is not None
        why = "closed by the engine"
        try:
            while True:
                if self.link_version >= 6:  # the engine speaks at least every STATUS_EVERY_S
                    try:
                        kind, body = await asyncio.wait_for(read_message(self._reader), SILENT_LINK_S)
                    except TimeoutError:
                        why = f"nothing from the engine for {SILENT_LINK_S:.0f} s (a partition, a frozen host)"
                        break
                else:
                    kind, body = await read_message(self._reader)
                now = time.monotonic()
                if kind == b"F":
                    self._put_frames(parse_frames(body, now))
                elif kind == b"E":
                    call_id, output = parse_event(body, now)
                    session = self._calls.get(call_id)
                    if session is None:
                        continue
                    if output is None:
                        del self._calls[call_id]
                        session._end()
                    else:
                        session._put(output)
                elif kind == b"G":  # our grant changed: seats given back (draining) or more of what we asked
                    seats = int(json.loads(bytes(body))["seats"])
                    if seats != self._seats:
                        log.info("engine at %s: %d seats now (were %d)", self.address, seats, self._seats)
                    self._seats = seats
                elif kind == b"S":
                    status = json.loads(bytes(body))
                    draining, behind = bool(status.get("draining")), bool(status.get("behind"))
                    if draining and not self.draining:
                        log.warning("the engine at %s is draining: no new calls here until it is back", self.address)
                    if behind != self.engine_behind:
                        log.warning("the engine at %s %s", self.address, "is not keeping time: no new calls here "
                                    "until it does" if behind else "keeps time again: taking calls")  # fmt: skip
                    self.draining, self.engine_behind = draining, behind
                elif kind == b"R":
                    result = json.loads(bytes(body))
                    waiter = self._opening.get(result["call_id"])
                    if waiter is not None and not waiter.done():
                        if result["ok"]:  # seated here at once: its first events may follow in this very read
                            call_id = str(result["call_id"])
                            self._calls[call_id] = RemoteCallSession(self, call_id)
                        waiter.set_result(None if result["ok"] else str(result["error"]))
                else:
                    raise LinkError(f"unknown message kind {kind!r}")
        except asyncio.CancelledError:
            raise
        # OSError, not only ConnectionError: a partition ends the read with ETIMEDOUT or EHOSTUNREACH, and a
        # TLS link with ssl.SSLError; none is a ConnectionError.
        except (asyncio.IncompleteReadError, OSError) as e:
            why = f"connection lost ({type(e).__name__})"
        except (LinkError, ValueError, KeyError, TypeError) as e:
            why = f"bad message: {e}"
        except Exception as e:  # anything else (a message of a shape no engine of ours sends): still lost, said
            log.exception("engine link to %s: unexpected failure reading the engine", self.address)
            why = f"unexpected {type(e).__name__}"
        if not self._stopping:
            self._lose_engine(why)

    def _lose_engine(self, why: str) -> None:
        """The link is gone and every seat with it: calls are told (`engine_lost`), health fails."""
        self._failed = True
        metrics.ENGINE_LINK_ERRORS.labels(kind="lost").inc()
        log.error("engine link to %s lost: %s; %d calls end", self.address, why, len(self._calls))
        for session in list(self._calls.values()):
            session._put(EngineNotice("engine_lost", f"the engine link was lost: {why}"))
            session._end()
        self._calls.clear()
        for waiter in self._opening.values():
            if not waiter.done():
                waiter.set_result("the engine link was lost")
        if self._writer is not None:
            self._writer.close()
        self._put_frames(None)
