"""The engine's side of the link (`kame-phone engine-serve`): welcomes edges, seats their calls, fans out
the ticks' bot frames.

Before its hello a peer is nobody: the hello is capped at a few KB and 2 s, and only a few such peers are
held at once, TLS handshakes included, so a flood of connections costs the engine nothing. Once welcomed, an
edge's call ids are its own: the engine seats them as "<call id>@e<edge number>", so an edge holding the shared
token still cannot open, close or hear another edge's call. Both sides name their PROTOCOL_VERSION and refuse a
mismatch.

Seats are a hard partition: an edge's grant is never given to another edge while it holds it. A draining edge
(protocol 5, "D") gives back the seats its calls do not use at once, and each other one as its call ends, so a
rollout's new edge is seated within seconds instead of after the old edge's longest call. Seats that come
free go to a connected edge of protocol 5 that was granted less than it asked ("G"), else to the next hello.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hmac
import itertools
import json
import logging
import os
import socket
import ssl
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any, get_args

from . import metrics
from .interface import (
    LAST_WORDS_WAIT_S,
    BotFrames,
    CallAction,
    CallerTranscript,
    CallSession,
    CallSetup,
    Engine,
    EngineError,
    EngineFull,
    OracleUpdate,
)
from .link_wire import (
    COMPATIBLE_VERSIONS,
    PROTOCOL_VERSION,
    SOCKET_BUFFER_BYTES,
    STATUS_EVERY_S,
    Address,
    LinkError,
    backlogged,
    event_message,
    frames_message,
    json_message,
    parse_audio,
    read_message,
    setup_from_wire,
    tune_socket,
)
from .log_sampler import LogSampler
from .queues import FreshCarry

log = logging.getLogger(__name__)

HELLO_MAX_BYTES = 4096  # a hello is ~100 bytes; before it the peer is unauthenticated
HELLO_TIMEOUT_S = 2.0  # for a TLS handshake, then again from it (or accept) to a whole hello
MAX_UNAUTHENTICATED = 8  # peers between accept and welcome held at once; edges reconnect one at a time
MAX_HANDSHAKES = 64  # TLS handshakes under way at once (before the hello's cap)



@dataclass(eq=False)
class _Edge:
    name: str
    writer: asyncio.StreamWriter
    seats: int  # granted: the most calls it may hold (seated or being seated)
    number: int  # this connection's, on this engine: the namespace of its call ids
    asked: int = 0  # in its hello: it is offered seats that come free up to this
    version: int = PROTOCOL_VERSION  # the link's
    draining: bool = False  # it said "D": it keeps only the seats its calls use
    calls: dict[str, CallSession] = field(default_factory=dict)
    pumps: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # Seating a call can take a while (its back-end starts: an STT decoder, an LLM client), so it runs beside
    # the edge's message loop, never in it: the edge's other calls keep streaming audio meanwhile.
    opening: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    closing: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # closes waiting for their call's seat
    queued: set[str] = field(default_factory=set)  # calls whose open waits for an earlier open or close
    frames_dropped: int = 0
    fresh_carry: FreshCarry = field(default_factory=FreshCarry)  # restarts of its calls in ticks it missed
    dropped: asyncio.Event = field(default_factory=asyncio.Event)  # gone, and its engine seats all free

    def engine_id(self, call_id: str) -> str:
        """The call's id on the engine: the edge's own id can clash with (or be chosen as) another edge's."""
        return f"{call_id}@e{self.number}"

    @property
    def in_use(self) -> int:
        """Seats its calls hold: seated, or being seated (a call opened again is in both: one seat)."""
        return len(self.calls.keys() | self.opening.keys())


class EngineServer:
    """Serves one loaded `Engine` to edges over a socket. Consumes the engine's `bot_frames()`."""

    def __init__(
        self, engine: Engine, *, token: str | None, backlog_bytes: int = 8 << 20,
        socket_buffer_bytes: int = SOCKET_BUFFER_BYTES, tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.token = token
        self.tls = tls  # used on a tls:// address (server_tls)
        self.backlog_bytes = backlog_bytes  # unsent bytes to one edge beyond which its ticks are dropped
        self.socket_buffer_bytes = socket_buffer_bytes
        self._edges: set[_Edge] = set()
        # Edges gone whose calls are still being seated or closed: their seats still count as granted until the
        # engine has them back. Freed at once, they went to a new edge whose opens the engine then refused.
        self._leaving: set[_Edge] = set()
        self._owner: dict[str, tuple[_Edge, str]] = {}  # engine call id -> (its edge, the edge's call id)
        self._edge_numbers = itertools.count(1)
        # Connections accepted and not yet welcomed, oldest first (a dict's insertion order).
        self._awaiting_hello: dict[asyncio.StreamWriter, None] = {}  # peers before their hello, oldest first
        self._handshaking: dict[asyncio.StreamWriter, asyncio.Task[None]] = {}  # peers in their TLS handshake
        self._evicted: set[asyncio.Task[None]] = set()  # handshakes cancelled for a newer peer
        self._sampled = LogSampler()  # anyone reaching the port can repeat these: a sample of each kind is logged
        self._listen_tls: ssl.SSLContext | None = None
        self._closing: set[asyncio.Task[None]] = set()  # calls the edges hung up, still saying their last words
        self._server: asyncio.Server | None = None
        # The socket file we made: its path and identity (device, inode, and its creation's ctime, since a file
        # made right after ours was deleted may reuse our inode number).
        self._unix_socket: tuple[str, tuple[int, int, int]] | None = None
        self._fanout: asyncio.Task[None] | None = None
        self._status: asyncio.Task[None] | None = None
        self.draining = False
        self._no_calls = asyncio.Event()  # set while no call is seated: what a drain waits for
        self._no_calls.set()

    def _disown(self, edge: _Edge, call_id: str) -> None:
        self._owner.pop(edge.engine_id(call_id), None)
        if not self._owner:
            self._no_calls.set()

    @property
    def seats_granted(self) -> int:
        return sum(edge.seats for edge in self._edges | self._leaving)

    async def listen(self, address: Address) -> Address:
        """Start serving; returns the bound address (the real port when `address.port` is 0)."""
        if address.unix_path is not None:
            path = address.unix_path
            # asyncio removes a socket file in the way: a second engine-serve on the path of a live one took it
            # over silently (the first's edges then reconnected to the wrong engine). A stale one (nothing
            # accepting) is still replaced.
            if await asyncio.to_thread(_unix_socket_answers, path):
                raise OSError(errno.EADDRINUSE, f"another process is listening on {path}")
            self._server = await asyncio.start_unix_server(self._serve_edge, path=path)
            self._unix_socket = (path, _identity(os.stat(path)))
            bound = address
        else:
            if address.tls and self.tls is None:
                raise ValueError(f"{address} needs a certificate and key (engine-serve --tls-cert/--tls-key)")
            # TLS is started by `_serve_edge`, inside the cap on peers before their hello: done by the server, each
            # handshake was a socket (and its key exchange) held for 2 s outside any cap, as many as a peer opened.
            self._listen_tls = self.tls if address.tls else None
            self._server = await asyncio.start_server(self._serve_edge, address.host, address.port)
            bound = Address(host=address.host, port=self._server.sockets[0].getsockname()[1], tls=address.tls)
        self._fanout = asyncio.create_task(self._fan_out_frames(), name="engine-link-frames")
        self._status = asyncio.create_task(self._send_status(), name="engine-link-status")
        log.info("engine link listening on %s (%d seats)", bound, self.engine.max_calls)
        return bound

    @property
    def calls(self) -> int:
        return len(self._owner)

    async def drain(self, timeout_s: float) -> int:
        """Stop seating calls (edges are told, and turn not-ready) and wait for the seated ones to end, up to
        `timeout_s`; returns how many are still up. A restart then cuts no call that could finish."""
        self.draining = True
        for edge in self._edges:
            if not edge.writer.transport.is_closing():
                edge.writer.write(json_message(b"S", {"draining": True}))
        log.info("draining: %d calls on %d edges", self.calls, len(self._edges))
        # Opens past their draining check are seated: waited for too, or the drain ended at "0 calls" while one
        # was still being seated, and the restart cut it. Any open from now on is refused.
        opening = {task for edge in self._edges | self._leaving for task in edge.opening.values()}

        async def settled() -> None:
            if opening:
                await asyncio.wait(opening)
            await self._no_calls.wait()

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(settled(), timeout_s)
        return self.calls

    def remove_socket(self) -> None:
        """Remove the Unix socket this server made, if it is still ours: another engine-serve started on the
        path since (after this one stopped listening) owns the file now, and removing it cut its edges off."""
        if self._unix_socket is None:
            return
        path, ours = self._unix_socket
        self._unix_socket = None
        with contextlib.suppress(FileNotFoundError):
            if _identity(os.stat(path)) == ours:
                os.unlink(path)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for edge in list(self._edges):
            edge.writer.close()
        for task in (self._fanout, self._status):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for edge in list(self._edges | self._leaving):  # those leaving already too: the engine stops after this
            await self._drop_edge(edge)

    async def _send_status(self) -> None:
        """Every STATUS_EVERY_S, to each edge of protocol 6: whether the engine is behind (not keeping its 80 ms
        frames, or stalled: `ready` false while not draining) and draining. The edges read only the engine's
        state at their hello before, and went on admitting calls to an engine its own /readyz called not ready.
        Also the link's heartbeat: an edge that hears nothing for SILENT_LINK_S drops the link."""
        was_behind = False
        while True:
            behind = not self.draining and not self.engine.ready
            if behind != was_behind:
                log.warning("engine %s: edges told to admit no new calls" if behind else
                            "engine %s: edges told to admit calls again",
                            "not keeping time" if behind else "keeping time again")  # fmt: skip
                was_behind = behind
                if not behind:
                    # Seats freed while it was not ready were kept back (`_offer_free_seats` gives none then):
                    # offered now, or an edge granted less than it asked stayed short until another left.
                    self._offer_free_seats()
            status = json_message(b"S", {"draining": self.draining, "behind": behind})
            for edge in list(self._edges):
                if edge.version >= 6 and not edge.writer.transport.is_closing():
                    edge.writer.write(status)
            await asyncio.sleep(STATUS_EVERY_S)

    async def _serve_edge(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or "unix socket"
        edge: _Edge | None = None
        tls = self._listen_tls
        try:
            if tls is not None and not await self._handshake(writer, tls, peer):
                return
            if len(self._awaiting_hello) >= MAX_UNAUTHENTICATED:
                # A flood of connections: the oldest that has not said hello goes (an edge says it at once), of
                # the host holding the most. Refusing the newest let a few silent sockets, reopened as they timed
                # out, keep every edge out; the oldest of all let one host's flood evict every edge's hello.
                oldest = _evictee(self._awaiting_hello)
                del self._awaiting_hello[oldest]
                metrics.ENGINE_LINK_ERRORS.labels(kind="unauthenticated_cap").inc()
                if n := self._sampled("hello_cap"):
                    log.warning("engine link: %d connections await their hello; the oldest (%s) closed for one from "
                                "%s (#%d)", MAX_UNAUTHENTICATED, oldest.get_extra_info("peername") or "unix socket",
                                peer, n)  # fmt: skip
                oldest.write(json_message(b"W", {"error": "too many connections awaiting their hello; retry"}))
                oldest.close()
            self._awaiting_hello[writer] = None
            try:
                edge = await self._welcome(reader, writer, peer)
            finally:
                self._awaiting_hello.pop(writer, None)
            if edge is None:
                return
            tune_socket(writer, self.socket_buffer_bytes)  # large buffers only for a welcomed edge
            while True:
                kind, body = await read_message(reader)
                if kind == b"A":
                    self._on_audio(edge, body)
                elif kind == b"O":
                    opened = json.loads(bytes(body))
                    call_id, setup = str(opened["call_id"]), setup_from_wire(opened.get("setup"))
                    closing = edge.closing.get(call_id)
                    if closing is None and call_id in edge.opening:
                        pass  # a twin of an open under way: its answer answers both
                    elif call_id in edge.queued:  # one open queued behind a close at most: no chain of tasks
                        edge.writer.write(json_message(b"R", {"call_id": call_id, "ok": False,
                                                              "error": "closed: already opening this call"}))
                    else:
                        # Opened again behind its close (an open the edge cancelled, then the call back): seated
                        # once the close is done, and answered. Ignored, the edge waited 10 s and failed the call.
                        before = [t for t in (edge.opening.get(call_id), closing) if t is not None]
                        if before:
                            edge.queued.add(call_id)  # here, not in the task: the next message may be its twin
                        edge.opening[call_id] = asyncio.create_task(self._on_open(edge, call_id, setup, before))
                elif kind == b"X":  # a call action the edge could not carry out: its back-end is told
                    failed = json.loads(bytes(body))
                    action, result = str(failed["action"]), str(failed["result"])[:32]
                    if action not in get_args(CallAction):
                        raise LinkError(f"unknown call action {action!r}")
                    if (session := edge.calls.get(str(failed["call_id"]))) is not None:
                        session.action_failed(action, result)  # type: ignore[arg-type]
                elif kind == b"D" and edge.version >= 5:  # the edge drains: what it does not use goes back
                    self._edge_drains(edge)
                elif kind == b"C":
                    call_id = str(json.loads(bytes(body))["call_id"])
                    # The open it closes, as of now: an open read after it waits for this close, not the reverse.
                    closing = asyncio.create_task(self._close_when_seated(edge, call_id, edge.opening.get(call_id)))
                    self._closing.add(closing)  # held: it waits up to LAST_WORDS_WAIT_S for the call's last words
                    closing.add_done_callback(self._closing.discard)
                    edge.closing[call_id] = closing
                    closing.add_done_callback(lambda t, c=call_id, e=edge: _forget(e.closing, c, t))
                else:
                    raise LinkError(f"unknown message kind {kind!r}")
        except (asyncio.IncompleteReadError, OSError):
            pass  # the edge went away (reset, timed out, unreachable, TLS torn)
        # A broken or hostile peer (deep JSON nesting, a number past float range included): drop it, not us.
        except (LinkError, ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_message").inc()
            if edge is not None or (n := self._sampled("bad_message")):  # a welcomed edge's is always said
                log.warning("engine link from %s: %s; closing it", peer, e)
        finally:
            if edge is not None:
                await self._drop_edge(edge)
            writer.close()
            if edge is None and tls is not None:
                # A TLS close waits up to 30 s for the peer's close_notify: a peer never welcomed gets a second.
                asyncio.get_running_loop().call_later(1.0, _abort, writer)

    async def _handshake(self, writer: asyncio.StreamWriter, tls: ssl.SSLContext, peer: object) -> bool:
        """TLS, started here (not by the server) so that handshakes have a cap of their own: done by the server,
        each was a socket and a key exchange held for up to 2 s, as many as a peer opened. The cap is wider than
        the hello's (an honest edge is exposed to eviction for its whole handshake, a round trip or two, not just
        for its hello, which comes in the same flight as the handshake's end): the oldest goes for a newer one."""
        if len(self._handshaking) >= MAX_HANDSHAKES:
            oldest = _evictee(self._handshaking)  # of the host holding the most, as for hellos
            task = self._handshaking.pop(oldest)
            metrics.ENGINE_LINK_ERRORS.labels(kind="unauthenticated_cap").inc()
            if n := self._sampled("handshake_cap"):
                log.warning("engine link: %d TLS handshakes under way; the oldest stopped for one from %s (#%d)",
                            MAX_HANDSHAKES, peer, n)  # fmt: skip
            # Its handshake is cancelled (which closes the socket): closed under it instead, the handshake
            # "succeeded" with no transport, and the writer failed on its way out.
            self._evicted.add(task)
            task.cancel()
        task = asyncio.current_task()
        assert task is not None
        self._handshaking[writer] = task
        try:
            await writer.start_tls(tls, ssl_handshake_timeout=HELLO_TIMEOUT_S)
        except asyncio.CancelledError:
            if task not in self._evicted:
                raise
            self._evicted.discard(task)
            return False  # stopped for a newer peer, and counted as such
        except (OSError, asyncio.TimeoutError) as e:  # (ssl.SSLError is an OSError)
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_hello").inc()
            if n := self._sampled("no_tls"):
                log.warning("engine link from %s: no TLS handshake (%s); closing it (#%d)", peer, type(e).__name__, n)
            return False
        finally:
            self._handshaking.pop(writer, None)
        return True

    async def _welcome(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: object) -> _Edge | None:
        try:
            kind, body = await asyncio.wait_for(read_message(reader, HELLO_MAX_BYTES), HELLO_TIMEOUT_S)
            hello = json.loads(bytes(body)) if kind == b"H" else {}
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, LinkError, ValueError, RecursionError):
            hello = {}  # RecursionError: 4 KB of nesting ("[[[[...") is enough for the JSON parser
        if isinstance(hello, dict):
            try:  # before the token: a hello that says nothing sane gets the same answer either way
                asked = int(hello.get("seats", 0))
            except (TypeError, ValueError, OverflowError):  # "many", 1e400, null
                hello = {}
        if not hello or not isinstance(hello, dict):
            if writer.is_closing():  # closed to make room for a newer connection: counted as such already
                return None
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_hello").inc()
            if n := self._sampled("no_hello"):
                log.warning("engine link from %s: no hello; closing it (#%d)", peer, n)
            return None
        given = str(hello.get("token", "")).encode()  # bytes: compare_digest refuses non-ASCII str
        if self.token is not None and not hmac.compare_digest(given, self.token.encode()):
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_token").inc()
            if n := self._sampled("bad_token"):
                log.warning("engine link from %s: wrong token; refused (#%d)", peer, n)
            writer.write(json_message(b"W", {"error": "wrong token", "permanent": True}))
            return None
        version = hello.get("version", 1)
        if version not in COMPATIBLE_VERSIONS:
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_version").inc()
            why = (f"engine link protocol version mismatch: this engine speaks {PROTOCOL_VERSION}, the edge "
                   f"{str(version)[:20]}; run the same kame-phone release on both")  # fmt: skip
            log.warning("engine link from %s: %s; refused", peer, why)
            writer.write(json_message(b"W", {"error": why, "permanent": True, "version": PROTOCOL_VERSION}))
            return None
        name = str(hello.get("name", "edge"))[:100]
        free = self.engine.max_calls - self.seats_granted
        seats = max(0, min(asked, free))
        if seats == 0 or not self.engine.ready or self.draining:
            reason = (
                "the engine is draining" if self.draining
                else "the engine is not ready" if not self.engine.ready
                else f"no seats left ({free} free)"
            )  # fmt: skip
            log.warning("engine link from %s (%s): refused, %s", peer, name, reason)
            # "full": the seats are held by other edges and come back as they leave or drain (the edge asks
            # again soon); an older edge reads only the error.
            full = free <= 0 and self.engine.ready and not self.draining
            writer.write(json_message(b"W", {"error": reason, **({"full": True} if full else {})}))
            return None
        edge = _Edge(name, writer, seats, next(self._edge_numbers), asked=asked, version=int(version))
        self._edges.add(edge)
        metrics.ENGINE_LINK_EDGES.set(len(self._edges))
        writer.write(json_message(b"W", {"version": version, "seats": seats}))  # the one this link speaks
        log.info("edge %s (%s) joined as e%d with %d seats (%d of %d granted)",
                 name, peer, edge.number, seats, self.seats_granted, self.engine.max_calls)  # fmt: skip
        return edge

    def _on_audio(self, edge: _Edge, body: bytes) -> None:
        try:
            call_id, pcm = parse_audio(body)
        except (ValueError, struct.error) as e:  # one bad frame is dropped; the edge's other calls go on
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_audio").inc()
            log.warning("engine link from %s: bad audio message (%s); dropped", edge.name, e)
            return
        session = edge.calls.get(call_id)
        if session is not None:  # audio racing a close is normal: dropped
            session.push_audio(pcm)

    async def _close_when_seated(self, edge: _Edge, call_id: str, opening: asyncio.Task[None] | None) -> None:
        """A close that overtakes its open waits for it, so the seat it was opening is freed, not leaked."""
        if opening is not None:
            await asyncio.wait({opening})
        await self._close_call(edge, call_id, last_words=True)

    async def _on_open(
        self, edge: _Edge, call_id: str, setup: CallSetup | None, before: list[asyncio.Task[None]]
    ) -> None:
        try:
            if before:
                try:
                    await asyncio.wait(before)
                finally:
                    edge.queued.discard(call_id)
            await self._seat(edge, call_id, setup)
        finally:
            _forget(edge.opening, call_id, asyncio.current_task())
            self._give_back(edge)  # a draining edge's call that was not seated: its seat goes back

    def _edge_drains(self, edge: _Edge) -> None:
        if edge.draining:
            return
        edge.draining = True
        log.info("edge %s (e%d) is draining with %d calls: it gives back the seats they do not use",
                 edge.name, edge.number, edge.in_use)  # fmt: skip
        self._give_back(edge)

    def _give_back(self, edge: _Edge) -> None:
        """A draining edge keeps the seats its calls use and no more: the others are free for another edge."""
        spare = edge.seats - edge.in_use
        if not edge.draining or spare <= 0 or edge not in self._edges:
            return
        edge.seats -= spare
        self._tell_seats(edge)
        log.info("edge %s (e%d, draining) gave back %d seat(s), keeps %d for its calls (%d of %d granted)",
                 edge.name, edge.number, spare, edge.seats, self.seats_granted, self.engine.max_calls)  # fmt: skip
        self._offer_free_seats()

    def _offer_free_seats(self) -> None:
        """Seats that came free go to connected edges granted less than they asked (oldest first), which
        hear it ("G", protocol 5). What is left waits for the next hello."""
        if self.draining or not self.engine.ready:
            return
        free = self.engine.max_calls - self.seats_granted
        for edge in sorted(self._edges, key=lambda e: e.number):
            if free <= 0:
                break
            if edge.draining or edge.version < 5 or edge.seats >= edge.asked or edge.writer.transport.is_closing():
                continue
            more = min(free, edge.asked - edge.seats)
            edge.seats += more
            free -= more
            self._tell_seats(edge)
            log.info("edge %s (e%d) granted %d more seat(s): %d of the %d it asked (%d of %d granted)",
                     edge.name, edge.number, more, edge.seats, edge.asked, self.seats_granted,
                     self.engine.max_calls)  # fmt: skip

    def _regrant(self, edge: _Edge) -> bool:
        """A draining edge opening a call beyond the seats it kept (a caller reserved on it before it began
        to drain): it takes a free seat back if there is one."""
        if not edge.draining or self.engine.max_calls - self.seats_granted <= 0:
            return False
        edge.seats += 1
        self._tell_seats(edge)
        log.info("edge %s (e%d, draining) took a free seat back for a call reserved on it", edge.name, edge.number)
        return True

    def _tell_seats(self, edge: _Edge) -> None:
        if edge.version >= 5 and not edge.writer.transport.is_closing():
            edge.writer.write(json_message(b"G", {"seats": edge.seats}))

    async def _seat(self, edge: _Edge, call_id: str, setup: CallSetup | None) -> None:
        error = None
        others = (set(edge.calls) | set(edge.opening)) - {call_id}  # seated, or being seated beside this one
        engine_id = edge.engine_id(call_id)
        if engine_id in self._owner:
            # The edge opens the call again (its stream came back) and has dropped its old session, sending no
            # close: the old seat goes whatever the answer. Refused while draining, it was held by a call the edge
            # no longer knows, and the drain waited out its whole timeout for it.
            await self._close_call(edge, call_id)
        if self.draining:
            error = "closed: the engine is draining"
        elif call_id not in edge.calls and len(others) >= edge.seats and not self._regrant(edge):
            error = "full"
        else:
            try:
                session = await self.engine.open_call(engine_id, setup)
            except EngineFull:
                error = "full"
            except EngineError as e:
                error = f"closed: {e}"
            else:
                edge.calls[call_id] = session
                self._owner[engine_id] = (edge, call_id)
                self._no_calls.clear()
                edge.pumps[call_id] = asyncio.create_task(self._pump(edge, call_id, session), name=f"link-{call_id}")
        if not edge.writer.transport.is_closing():
            edge.writer.write(json_message(b"R", {"call_id": call_id, "ok": error is None, "error": error}))

    async def _pump(self, edge: _Edge, call_id: str, session: CallSession) -> None:
        async for output in session.outputs():
            if edge.writer.transport.is_closing():
                continue
            if isinstance(output, (OracleUpdate, CallerTranscript)) and backlogged(edge.writer, self.backlog_bytes):
                metrics.ENGINE_LINK_DROPPED.labels(what="events").inc()  # an edge not reading: shed the chatter
                continue
            edge.writer.write(event_message(call_id, output, time.monotonic()))
        if edge.calls.get(call_id) is session:  # the engine ended it (not the edge): tell the edge
            del edge.calls[call_id]
            self._disown(edge, call_id)
            edge.pumps.pop(call_id, None)
            if not edge.writer.transport.is_closing():
                edge.writer.write(event_message(call_id, None, time.monotonic()))
            self._give_back(edge)

    async def _close_call(self, edge: _Edge, call_id: str, last_words: bool = False) -> None:
        """`last_words`: the edge hung up and still listens: what the call says as it closes (the caller's
        last utterance, made final) is sent, then its end. Not for an edge that is gone."""
        session = edge.calls.pop(call_id, None)
        pump = edge.pumps.pop(call_id, None)
        self._disown(edge, call_id)
        if session is not None:
            await session.close()
        self._give_back(edge)  # the engine's seat is free now (a call opened again keeps it: it is opening)
        if pump is not None:
            if last_words and not edge.writer.transport.is_closing():
                await asyncio.wait({pump}, timeout=LAST_WORDS_WAIT_S)
            pump.cancel()
        if last_words and session is not None and not edge.writer.transport.is_closing():
            edge.writer.write(event_message(call_id, None, time.monotonic()))  # nothing more will come

    async def _drop_edge(self, edge: _Edge) -> None:
        """The edge is gone: its calls end. Returns once the engine has every one of its seats back (a second
        caller, aclose, waits for the first's drop)."""
        if edge in self._leaving:
            await edge.dropped.wait()
            return
        if edge not in self._edges:
            return
        self._edges.discard(edge)
        self._leaving.add(edge)  # its seats stay granted until its calls are off the engine
        metrics.ENGINE_LINK_EDGES.set(len(self._edges))
        try:
            if edge.opening:  # let seatings under way finish, then free those seats with the rest
                await asyncio.wait(set(edge.opening.values()))
            for call_id in list(edge.calls):
                await self._close_call(edge, call_id)
        finally:
            self._leaving.discard(edge)
            edge.dropped.set()
        log.info("edge %s left; its %d seats are free", edge.name, edge.seats)
        self._offer_free_seats()

    async def _fan_out_frames(self) -> None:
        async for frames in self.engine.bot_frames():
            try:
                self._send_tick(frames)
            except Exception:  # one bad tick must not silence every edge from then on
                log.exception("engine link: a tick could not be sent")

    def _send_tick(self, frames: BotFrames) -> None:
        """Each edge gets its own calls' rows of the tick, in one message."""
        rows: dict[_Edge, tuple[list[int], list[str]]] = {}
        for i, engine_id in enumerate(frames.call_ids):
            owner = self._owner.get(engine_id)
            if owner is not None:
                mine, ids = rows.setdefault(owner[0], ([], []))
                mine.append(i)
                ids.append(owner[1])
        now = time.monotonic()
        for edge, (mine, ids) in rows.items():
            fresh = [frames.fresh[i] for i in mine]
            if backlogged(edge.writer, self.backlog_bytes):  # an edge that stopped reading loses ticks
                edge.fresh_carry.dropped(ids, fresh)  # its calls' restarts ride on their next tick sent
                edge.frames_dropped += 1
                metrics.ENGINE_LINK_DROPPED.labels(what="bot_frames").inc()
                if edge.frames_dropped in (1, 100) or edge.frames_dropped % 1000 == 0:
                    log.warning("edge %s is not reading: %d ticks dropped", edge.name, edge.frames_dropped)
                continue
            edge.writer.write(frames_message(frames, mine, now, ids, fresh=edge.fresh_carry.carry(ids, fresh)))


def _forget(tasks: dict[str, asyncio.Task[None]], call_id: str, task: asyncio.Task[Any] | None) -> None:
    """`call_id`'s entry off `tasks` if it is still `task` (a newer one for the call stays)."""
    if tasks.get(call_id) is task:
        del tasks[call_id]


def _abort(writer: asyncio.StreamWriter) -> None:
    """End a closed connection's transport for good: a TLS close still waiting for the peer's close_notify."""
    with contextlib.suppress(Exception):  # already gone
        writer.transport.abort()


def _unix_socket_answers(path: str) -> bool:
    """Whether something accepts connections on the Unix socket at `path` (False: none there, or stale)."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return False
    except FileNotFoundError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:  # ECONNREFUSED: a socket file its process left behind
            return False
    return True


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _peer_host(writer: asyncio.StreamWriter) -> str:
    """The peer's address without its port (a TCP peer's every connection has its own port); "" for a Unix
    socket's peers, all local."""
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


def _evictee(waiting: dict[asyncio.StreamWriter, Any]) -> asyncio.StreamWriter:
    """Who goes when too many peers are unauthenticated: the oldest connection (dicts keep insertion order) of
    the host that holds the most, so a flood from one host evicts its own connections, not an edge's."""
    hosts = collections.Counter(_peer_host(w) for w in waiting)
    most = max(hosts.values())
    return next(w for w in waiting if hosts[_peer_host(w)] == most)
