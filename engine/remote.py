"""The `Engine` boundary over a socket: one engine server, any number of phone edges.

`EngineServer` wraps a loaded engine (`kame-phone engine-serve`) and listens on a Unix socket or TCP;
`RemoteEngine` is the edge's `Engine` for it (`kame-phone serve --engine ADDRESS`). One edge process
holds ~100 calls within its latency budget (docs/benchmarks.md), so a node that serves more runs several
edge processes against one GPU engine, and the engine can sit on another node than its edges.

Each edge asks for a number of seats in its hello and is granted at most what the engine has left; the
seats are its `max_calls`, so cluster admission never books a seat another edge holds. Off loopback the
hello carries a shared token; `tls://host:port` wraps the link in TLS (the edge checks the engine's
certificate), since it carries the callers' audio.

Wire: every message is a 4-byte big-endian length, one kind byte, a body. Control bodies are JSON; audio
is raw 16-bit PCM (little-endian, 24 kHz): half of float32's bytes, which mattered (at 100 calls a tick is
384 KB, and every copy and socket wake-up of it is latency), and far finer than the 8-bit μ-law the phone
line carries. Nothing is unpickled: a peer can send bad bytes, never code. Timestamps cross as ages
(seconds before sending), as two nodes' monotonic clocks do not compare.

Before its hello a peer is nobody: the hello is capped at a few KB and 2 s, and only a few such peers are
held at once, so a flood of connections costs the engine nothing. Once welcomed, an edge's call ids are its
own: the engine seats them as "<call id>@e<edge number>", so an edge holding the shared token still cannot
open, close or hear another edge's call. Both sides name their PROTOCOL_VERSION and refuse a mismatch.

  edge -> engine   H hello {version, token, seats, name}   O open {call_id, setup}   C close {call_id}
                   A audio: u16 id length, call id, 1920 int16
  engine -> edge   W welcome {version, seats} | {error, permanent}   R open result {call_id, ok, error}
                   E call event {call_id, type: transcript|oracle|notice|end, ...}
                   F bot frames: u32 header length, header {call_ids, texts, voiced, indices, fresh, age}, pcm
                   S status {draining}: the engine is going away; seated calls go on, no new ones
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import json
import logging
import socket
import ssl
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, get_args

import numpy as np

from . import metrics
from .interface import (
    FRAME_SAMPLES,
    MAX_SETUP_TEXT,
    BotFrames,
    CallAction,
    CallerTranscript,
    CallSession,
    CallSetup,
    Engine,
    EngineClosed,
    EngineError,
    EngineFull,
    EngineNotice,
    EngineOutput,
    OracleUpdate,
    ToolUse,
    is_forced_delay_ms,
)
from .queues import put_dropping_oldest

log = logging.getLogger(__name__)

_PREFIX = struct.Struct(">I")
_U16 = struct.Struct(">H")
MAX_MESSAGE_BYTES = 32 << 20  # a tick of 256 calls is 2 MB; anything far larger is a broken peer
# 2: hello/welcome carry "version"; call ids are per edge. A v1 peer sends no version and is refused.
# 3: a call's setup carries the actions the edge can carry out; "tool" events (the agent's tool calls).
PROTOCOL_VERSION = 3
HELLO_MAX_BYTES = 4096  # a hello is ~100 bytes; before it the peer is unauthenticated
HELLO_TIMEOUT_S = 2.0  # from accept (after TLS) to a whole hello; TLS handshakes get the same
MAX_UNAUTHENTICATED = 8  # peers between accept and welcome held at once; edges reconnect one at a time
WELCOME_TIMEOUT_S = 5.0  # the edge's wait for the engine's answer
EDGE_EVENTS_QUEUE = 64  # a call's outputs waiting for its media session, on the edge (a local engine's too)
SEAT_ANSWER_TIMEOUT_S = 10.0  # the edge's wait for a seat (a join waits for the tick in progress: ms)
_PCM = np.dtype("<i2")
_FRAME_BYTES = FRAME_SAMPLES * _PCM.itemsize
_SOCKET_BUFFER_BYTES = 1 << 20  # a whole tick in one send where the kernel allows (it caps at wmem_max)


def pcm_to_wire(pcm: np.ndarray) -> bytes:
    """float audio in [-1, 1] -> int16 LE bytes (clipped; NaN as silence, so a bad frame is never a click)."""
    x = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)  # the one copy: ±inf clip to ±1, NaN stays
    np.nan_to_num(x, copy=False, nan=0.0)
    x *= np.float32(32767.0)
    return np.rint(x, out=x).astype(_PCM).tobytes()


def pcm_from_wire(data: bytes | memoryview, rows: int | None = None, offset: int = 0) -> np.ndarray:
    """int16 LE bytes -> float32 in [-1, 1] ([rows, FRAME_SAMPLES] when `rows` is given)."""
    pcm = np.frombuffer(data, dtype=_PCM, offset=offset).astype(np.float32) * np.float32(1 / 32767)
    return pcm if rows is None else pcm.reshape(rows, FRAME_SAMPLES)


class LinkError(EngineError):
    """The engine link refused us (for now: not ready, no seats left) or broke."""


class LinkRefused(LinkError):
    """The engine server will never take us as configured (a wrong token): retrying is pointless."""


# ---------------------------------------------------------------------------------------------------------
# Messages


def _message(kind: bytes, *parts: bytes) -> bytes:
    """One message from its body's parts, joined once (a tick's audio is not copied per part)."""
    return b"".join((_PREFIX.pack(1 + sum(map(len, parts))), kind, *parts))


def _json(kind: bytes, obj: dict[str, Any]) -> bytes:
    return _message(kind, json.dumps(obj, separators=(",", ":")).encode())


async def _read_message(reader: asyncio.StreamReader, limit: int = MAX_MESSAGE_BYTES) -> tuple[bytes, memoryview]:
    """(kind, body); raises IncompleteReadError at EOF and LinkError on a length no peer of ours sends."""
    (n,) = _PREFIX.unpack(await reader.readexactly(_PREFIX.size))
    if not 1 <= n <= limit:
        raise LinkError(f"message of {n} bytes")
    data = await reader.readexactly(n)
    return data[:1], memoryview(data)[1:]  # a view: a tick's audio is not copied once more


def _setup_from_wire(raw: Any) -> CallSetup | None:
    """An open's call setup, checked: strings of sane length only (an edge's bug must not reach a prompt)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("call setup must be an object")
    fields = {k: raw.get(k) for k in ("agent", "to_number", "from_number")}
    if not all(v is None or (isinstance(v, str) and len(v) <= MAX_SETUP_TEXT) for v in fields.values()):
        raise ValueError("call setup fields must be short strings")
    actions = raw.get("actions") or []
    if not isinstance(actions, list) or not set(actions) <= set(get_args(CallAction)):
        raise ValueError(f"call setup actions must be a list of {get_args(CallAction)}")
    delay = raw.get("forced_delay_ms")
    if delay is not None and not is_forced_delay_ms(delay):
        raise ValueError("call setup forced_delay_ms must be a number of milliseconds, 0 to 10000")
    return CallSetup(**{k: v for k, v in fields.items() if v is not None}, actions=tuple(actions),
                     forced_delay_ms=None if delay is None else float(delay))  # fmt: skip


def audio_message(call_id: str, pcm: np.ndarray) -> bytes:
    cid = call_id.encode()
    return _message(b"A", _U16.pack(len(cid)), cid, pcm_to_wire(pcm))


def parse_audio(body: bytes | memoryview) -> tuple[str, np.ndarray]:
    (n,) = _U16.unpack_from(body)
    call_id = bytes(body[2 : 2 + n]).decode()
    pcm = body[2 + n :]
    if len(pcm) != _FRAME_BYTES:
        raise ValueError(f"audio of {len(pcm)} bytes, want {_FRAME_BYTES}")
    return call_id, pcm_from_wire(pcm)


def event_message(call_id: str, output: EngineOutput | None, now: float) -> bytes:
    """A call's event; None says its outputs ended (the engine closed or replaced the seat)."""
    body: dict[str, Any] = {"call_id": call_id}
    if output is None:
        body["type"] = "end"
    elif isinstance(output, CallerTranscript):
        body.update(type="transcript", text=output.text, final=output.final, age=now - output.at)
    elif isinstance(output, OracleUpdate):
        body.update(type="oracle", text=output.text, candidate=output.candidate, age=now - output.at)
    elif isinstance(output, ToolUse):
        body.update(type="tool", name=output.name, arguments=output.arguments, outcome=output.outcome,
                    action=output.action, say=output.say)  # fmt: skip
    else:
        body.update(type="notice", kind=output.kind, detail=output.detail)
    return _json(b"E", body)


def parse_event(body: bytes | memoryview, now: float) -> tuple[str, EngineOutput | None]:
    d = json.loads(bytes(body))
    kind = d["type"]
    if kind == "transcript":
        return d["call_id"], CallerTranscript(str(d["text"]), bool(d["final"]), now - float(d["age"]))
    if kind == "oracle":
        return d["call_id"], OracleUpdate(str(d["text"]), now - float(d["age"]), int(d["candidate"]))
    if kind == "notice":
        return d["call_id"], EngineNotice(d["kind"], str(d["detail"]))
    if kind == "tool":
        action = d.get("action")
        if action is not None and action not in get_args(CallAction):
            raise ValueError(f"unknown call action {action!r}")
        return d["call_id"], ToolUse(str(d["name"]), str(d["arguments"]), str(d["outcome"]), action, str(d["say"]))
    if kind == "end":
        return d["call_id"], None
    raise ValueError(f"unknown event type {kind!r}")


def frames_message(frames: BotFrames, rows: list[int], now: float, call_ids: list[str] | None = None) -> bytes:
    """The tick's `rows`, named by `call_ids` (the receiving edge's own ids) or else by the tick's."""
    header = json.dumps(
        {
            "call_ids": call_ids if call_ids is not None else [frames.call_ids[i] for i in rows],
            "texts": [frames.texts[i] for i in rows],
            "voiced": [frames.voiced[i] for i in rows],
            "indices": [frames.indices[i] for i in rows],
            "fresh": [frames.fresh[i] for i in rows],
            "age": now - frames.produced_at,
        },
        separators=(",", ":"),
    ).encode()
    return _message(b"F", _PREFIX.pack(len(header)), header, pcm_to_wire(frames.pcm[rows]))


def parse_frames(body: bytes | memoryview, now: float) -> BotFrames:
    (n,) = _PREFIX.unpack_from(body)
    h = json.loads(bytes(body[4 : 4 + n]))
    rows = len(h["call_ids"])
    pcm = pcm_from_wire(body, rows, offset=4 + n)
    return BotFrames(
        call_ids=tuple(h["call_ids"]),
        pcm=pcm,
        texts=tuple(h["texts"]),
        voiced=tuple(bool(v) for v in h["voiced"]),
        indices=tuple(int(i) for i in h["indices"]),
        fresh=tuple(bool(f) for f in h["fresh"]),
        produced_at=now - float(h["age"]),
    )


@dataclass(frozen=True)
class Address:
    """`unix:/path/engine.sock`, `tcp://host:port` (or `host:port`), or `tls://host:port` (TCP in TLS)."""

    unix_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    tls: bool = False

    @classmethod
    def parse(cls, text: str) -> Address:
        if text.startswith("unix:"):
            path = text[len("unix:") :]
            if not path:
                raise ValueError("unix: address without a path")
            return cls(unix_path=path)
        tls = text.startswith("tls://")
        hostport = text.removeprefix("tls://").removeprefix("tcp://")
        host, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"engine address {text!r}: want unix:/path, tcp://host:port or tls://host:port")
        return cls(host=host.strip("[]") or "127.0.0.1", port=int(port), tls=tls)

    @property
    def local_only(self) -> bool:
        """Only this machine can reach it (a Unix socket or a loopback port): a token is not required."""
        return self.unix_path is not None or self.host in ("127.0.0.1", "::1", "localhost")

    def __str__(self) -> str:
        if self.unix_path:
            return f"unix:{self.unix_path}"
        return f"{'tls' if self.tls else 'tcp'}://{self.host}:{self.port}"


def server_tls(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The engine server's TLS: its certificate chain and key (PEM). Raises OSError/ssl.SSLError if unusable."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


def edge_tls(ca_file: str | None = None) -> ssl.SSLContext:
    """An edge's TLS: verifies the engine's certificate against `ca_file` (PEM), else the system's CAs."""
    return ssl.create_default_context(cafile=ca_file)


def _tune_socket(writer: asyncio.StreamWriter, buffer_bytes: int = _SOCKET_BUFFER_BYTES) -> None:
    """Socket buffers big enough for a tick in one send (fewer wake-ups on both sides); TCP is no-delay."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # small messages must not wait for Nagle
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _backlogged(writer: asyncio.StreamWriter, limit: int) -> bool:
    transport = writer.transport
    return transport.is_closing() or transport.get_write_buffer_size() > limit


# ---------------------------------------------------------------------------------------------------------
# Server: the engine's side


@dataclass(eq=False)
class _Edge:
    name: str
    writer: asyncio.StreamWriter
    seats: int
    number: int  # this connection's, on this engine: the namespace of its call ids
    calls: dict[str, CallSession] = field(default_factory=dict)
    pumps: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # Seating a call can take a while (its back-end starts: an STT decoder, an LLM client), so it runs beside
    # the edge's message loop, never in it: the edge's other calls keep streaming audio meanwhile.
    opening: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    frames_dropped: int = 0

    def engine_id(self, call_id: str) -> str:
        """The call's id on the engine: the edge's own id can clash with (or be chosen as) another edge's."""
        return f"{call_id}@e{self.number}"


class EngineServer:
    """Serves one loaded `Engine` to edges over a socket. Consumes the engine's `bot_frames()`."""

    def __init__(
        self, engine: Engine, *, token: str | None, backlog_bytes: int = 8 << 20,
        socket_buffer_bytes: int = _SOCKET_BUFFER_BYTES, tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.token = token
        self.tls = tls  # used on a tls:// address (server_tls)
        self.backlog_bytes = backlog_bytes  # unsent bytes to one edge beyond which its ticks are dropped
        self.socket_buffer_bytes = socket_buffer_bytes
        self._edges: set[_Edge] = set()
        self._owner: dict[str, tuple[_Edge, str]] = {}  # engine call id -> (its edge, the edge's call id)
        self._edge_numbers = itertools.count(1)
        self._unauthenticated = 0  # connections accepted and not yet welcomed
        self._server: asyncio.Server | None = None
        self._fanout: asyncio.Task[None] | None = None
        self.draining = False
        self._no_calls = asyncio.Event()  # set while no call is seated: what a drain waits for
        self._no_calls.set()

    def _disown(self, edge: _Edge, call_id: str) -> None:
        self._owner.pop(edge.engine_id(call_id), None)
        if not self._owner:
            self._no_calls.set()

    @property
    def seats_granted(self) -> int:
        return sum(edge.seats for edge in self._edges)

    async def listen(self, address: Address) -> Address:
        """Start serving; returns the bound address (the real port when `address.port` is 0)."""
        if address.unix_path is not None:
            self._server = await asyncio.start_unix_server(self._serve_edge, path=address.unix_path)
            bound = address
        else:
            if address.tls and self.tls is None:
                raise ValueError(f"{address} needs a certificate and key (engine-serve --tls-cert/--tls-key)")
            ssl_context = self.tls if address.tls else None
            self._server = await asyncio.start_server(
                self._serve_edge, address.host, address.port, ssl=ssl_context,
                ssl_handshake_timeout=HELLO_TIMEOUT_S if ssl_context else None,
            )  # fmt: skip
            bound = Address(host=address.host, port=self._server.sockets[0].getsockname()[1], tls=address.tls)
        self._fanout = asyncio.create_task(self._fan_out_frames(), name="engine-link-frames")
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
                edge.writer.write(_json(b"S", {"draining": True}))
        log.info("draining: %d calls on %d edges", self.calls, len(self._edges))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._no_calls.wait(), timeout_s)
        return self.calls

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for edge in list(self._edges):
            edge.writer.close()
        if self._fanout is not None:
            self._fanout.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._fanout
        for edge in list(self._edges):
            await self._drop_edge(edge)

    async def _serve_edge(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or "unix socket"
        edge: _Edge | None = None
        if self._unauthenticated >= MAX_UNAUTHENTICATED:  # a flood of connections: refuse before reading a byte
            metrics.ENGINE_LINK_ERRORS.labels(kind="unauthenticated_cap").inc()
            log.warning("engine link from %s: %d connections await their hello already; refused",
                        peer, self._unauthenticated)  # fmt: skip
            writer.write(_json(b"W", {"error": "too many connections awaiting their hello; retry"}))
            writer.close()
            return
        try:
            self._unauthenticated += 1
            try:
                edge = await self._welcome(reader, writer, peer)
            finally:
                self._unauthenticated -= 1
            if edge is None:
                return
            _tune_socket(writer, self.socket_buffer_bytes)  # large buffers only for a welcomed edge
            while True:
                kind, body = await _read_message(reader)
                if kind == b"A":
                    self._on_audio(edge, body)
                elif kind == b"O":
                    opened = json.loads(bytes(body))
                    call_id, setup = str(opened["call_id"]), _setup_from_wire(opened.get("setup"))
                    if call_id not in edge.opening:
                        edge.opening[call_id] = asyncio.create_task(self._on_open(edge, call_id, setup))
                elif kind == b"C":
                    call_id = str(json.loads(bytes(body))["call_id"])
                    asyncio.create_task(self._close_when_seated(edge, call_id))  # noqa: RUF006 - short, self-ending
                else:
                    raise LinkError(f"unknown message kind {kind!r}")
        except (asyncio.IncompleteReadError, OSError):
            pass  # the edge went away (reset, timed out, unreachable, TLS torn)
        # A broken or hostile peer (deep JSON nesting, a number past float range included): drop it, not us.
        except (LinkError, ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_message").inc()
            log.warning("engine link from %s: %s; closing it", peer, e)
        finally:
            if edge is not None:
                await self._drop_edge(edge)
            writer.close()

    async def _welcome(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: object) -> _Edge | None:
        try:
            kind, body = await asyncio.wait_for(_read_message(reader, HELLO_MAX_BYTES), HELLO_TIMEOUT_S)
            hello = json.loads(bytes(body)) if kind == b"H" else {}
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, LinkError, ValueError, RecursionError):
            hello = {}  # RecursionError: 4 KB of nesting ("[[[[...") is enough for the JSON parser
        if isinstance(hello, dict):
            try:  # before the token: a hello that says nothing sane gets the same answer either way
                asked = int(hello.get("seats", 0))
            except (TypeError, ValueError, OverflowError):  # "many", 1e400, null
                hello = {}
        if not hello or not isinstance(hello, dict):
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_hello").inc()
            log.warning("engine link from %s: no hello; closing it", peer)
            return None
        given = str(hello.get("token", "")).encode()  # bytes: compare_digest refuses non-ASCII str
        if self.token is not None and not hmac.compare_digest(given, self.token.encode()):
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_token").inc()
            log.warning("engine link from %s: wrong token; refused", peer)
            writer.write(_json(b"W", {"error": "wrong token", "permanent": True}))
            return None
        version = hello.get("version", 1)
        if version != PROTOCOL_VERSION:
            metrics.ENGINE_LINK_ERRORS.labels(kind="bad_version").inc()
            why = (f"engine link protocol version mismatch: this engine speaks {PROTOCOL_VERSION}, the edge "
                   f"{str(version)[:20]}; run the same kame-phone release on both")  # fmt: skip
            log.warning("engine link from %s: %s; refused", peer, why)
            writer.write(_json(b"W", {"error": why, "permanent": True, "version": PROTOCOL_VERSION}))
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
            writer.write(_json(b"W", {"error": reason}))
            return None
        edge = _Edge(name, writer, seats, next(self._edge_numbers))
        self._edges.add(edge)
        metrics.ENGINE_LINK_EDGES.set(len(self._edges))
        writer.write(_json(b"W", {"version": PROTOCOL_VERSION, "seats": seats}))
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

    async def _close_when_seated(self, edge: _Edge, call_id: str) -> None:
        """A close that overtakes its open waits for it, so the seat it was opening is freed, not leaked."""
        opening = edge.opening.get(call_id)
        if opening is not None:
            await asyncio.wait({opening})
        await self._close_call(edge, call_id)

    async def _on_open(self, edge: _Edge, call_id: str, setup: CallSetup | None) -> None:
        try:
            await self._seat(edge, call_id, setup)
        finally:
            edge.opening.pop(call_id, None)

    async def _seat(self, edge: _Edge, call_id: str, setup: CallSetup | None) -> None:
        error = None
        others = (set(edge.calls) | set(edge.opening)) - {call_id}  # seated, or being seated beside this one
        if self.draining:
            error = "closed: the engine is draining"
        elif call_id not in edge.calls and len(others) >= edge.seats:
            error = "full"
        else:
            engine_id = edge.engine_id(call_id)
            if engine_id in self._owner:  # the edge opens the call again (its stream came back): the old seat goes
                await self._close_call(edge, call_id)
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
            edge.writer.write(_json(b"R", {"call_id": call_id, "ok": error is None, "error": error}))

    async def _pump(self, edge: _Edge, call_id: str, session: CallSession) -> None:
        async for output in session.outputs():
            if edge.writer.transport.is_closing():
                continue
            if isinstance(output, (OracleUpdate, CallerTranscript)) and _backlogged(edge.writer, self.backlog_bytes):
                metrics.ENGINE_LINK_DROPPED.labels(what="events").inc()  # an edge not reading: shed the chatter
                continue
            edge.writer.write(event_message(call_id, output, time.monotonic()))
        if edge.calls.get(call_id) is session:  # the engine ended it (not the edge): tell the edge
            del edge.calls[call_id]
            self._disown(edge, call_id)
            edge.pumps.pop(call_id, None)
            if not edge.writer.transport.is_closing():
                edge.writer.write(event_message(call_id, None, time.monotonic()))

    async def _close_call(self, edge: _Edge, call_id: str) -> None:
        session = edge.calls.pop(call_id, None)
        pump = edge.pumps.pop(call_id, None)
        self._disown(edge, call_id)
        if session is not None:
            await session.close()
        if pump is not None:
            pump.cancel()

    async def _drop_edge(self, edge: _Edge) -> None:
        if edge not in self._edges:
            return
        self._edges.discard(edge)
        metrics.ENGINE_LINK_EDGES.set(len(self._edges))
        if edge.opening:  # let seatings under way finish, then free those seats with the rest
            await asyncio.wait(set(edge.opening.values()))
        for call_id in list(edge.calls):
            await self._close_call(edge, call_id)
        log.info("edge %s left; its seats are free", edge.name)

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
            if _backlogged(edge.writer, self.backlog_bytes):  # an edge that stopped reading loses ticks
                edge.frames_dropped += 1
                metrics.ENGINE_LINK_DROPPED.labels(what="bot_frames").inc()
                if edge.frames_dropped in (1, 100) or edge.frames_dropped % 1000 == 0:
                    log.warning("edge %s is not reading: %d ticks dropped", edge.name, edge.frames_dropped)
                continue
            edge.writer.write(frames_message(frames, mine, now, ids))


# ---------------------------------------------------------------------------------------------------------
# Client: the edge's side


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

    async def close(self) -> None:
        if self.closed:
            return
        self._end()
        self.engine._forget(self)

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
        self.name = name or socket.gethostname()
        self.backlog_bytes = backlog_bytes  # ~130 frames of caller audio unsent: the link is stuck, drop
        self._seats = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._calls: dict[str, RemoteCallSession] = {}
        self._opening: dict[str, asyncio.Future[str | None]] = {}
        self._frames: asyncio.Queue[BotFrames | None] = asyncio.Queue(maxsize=frames_queue_ticks)
        self._receiver: asyncio.Task[None] | None = None
        self._failed = False
        self._stopping = False
        self.draining = False  # the engine said it is going away: its calls go on, no new ones
        self.audio_dropped = 0

    @classmethod
    async def connect(cls, address: Address, *, token: str | None, seats: int, **kwargs: Any) -> RemoteEngine:
        engine = cls(address, token=token, seats=seats, **kwargs)
        await engine.start()
        return engine

    async def start(self) -> None:
        """Connect and be granted seats; raises LinkError (refused) or OSError (nobody listening)."""
        a = self.address
        if a.unix_path is not None:
            reader, writer = await asyncio.open_unix_connection(a.unix_path)
        elif a.tls:
            try:
                reader, writer = await asyncio.open_connection(
                    a.host, a.port, ssl=self.tls or edge_tls(), server_hostname=a.host
                )
            except ssl.SSLCertVerificationError as e:  # retrying will not make it trusted
                raise LinkRefused(
                    f"engine at {a}: its TLS certificate is not trusted ({e.verify_message}); "
                    "set KAME_ENGINE_CA to the CA that signed it"
                ) from None
        else:
            reader, writer = await asyncio.open_connection(a.host, a.port)
        hello = {"version": PROTOCOL_VERSION, "token": self.token or "", "seats": self.requested_seats,
                 "name": self.name}  # fmt: skip
        writer.write(_json(b"H", hello))
        try:
            kind, body = await asyncio.wait_for(_read_message(reader), WELCOME_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            writer.close()
            raise LinkError(f"engine at {a} did not welcome us") from e
        welcome = json.loads(bytes(body)) if kind == b"W" else {"error": f"unexpected {kind!r}"}
        if "error" in welcome:
            writer.close()
            error = LinkRefused if welcome.get("permanent") else LinkError
            raise error(f"engine at {a} refused us: {welcome['error']}")
        if welcome.get("version", 1) != PROTOCOL_VERSION:  # an older engine ignores the hello's version
            writer.close()
            raise LinkRefused(
                f"engine at {a}: engine link protocol version mismatch: this edge speaks {PROTOCOL_VERSION}, the "
                f"engine {str(welcome.get('version', 1))[:20]}; run the same kame-phone release on both"
            )
        self._seats = int(welcome["seats"])
        self._reader, self._writer = reader, writer
        _tune_socket(writer)
        self._receiver = asyncio.create_task(self._receive(), name="engine-link")
        log.info("engine link to %s up: %d seats", a, self._seats)

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
        return 0 if not self.ready else max(0, self._seats - len(self._calls) - len(self._opening))

    @property
    def ready(self) -> bool:
        return self._writer is not None and not self._failed and not self._stopping and not self.draining

    @property
    def failed(self) -> bool:
        return self._failed

    async def open_call(self, call_id: str, setup: CallSetup | None = None) -> RemoteCallSession:
        if self.draining:
            raise EngineClosed("the engine is draining")
        if not self.ready or self._writer is None:
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
            self._writer.write(_json(b"O", opened))
            try:
                error = await asyncio.wait_for(waiter, SEAT_ANSWER_TIMEOUT_S)
            except TimeoutError:  # an engine that reads but never answers: the caller is not held forever
                self._writer.write(_json(b"C", {"call_id": call_id}))  # a seat it grants later goes back
                raise EngineClosed(f"the engine did not answer in {SEAT_ANSWER_TIMEOUT_S:g} s") from None
            except asyncio.CancelledError:  # whoever opened it is gone: a seat granted meanwhile goes back
                if (seated := self._calls.get(call_id)) is not None:
                    self._forget(seated)
                    seated._end()
                raise
        finally:
            self._opening.pop(call_id, None)
        if error == "full":
            raise EngineFull("every seat of this edge is taken")
        if error is not None:
            raise EngineClosed(error)
        return self._calls[call_id]

    async def bot_frames(self) -> AsyncIterator[BotFrames]:
        while (frames := await self._frames.get()) is not None:
            yield frames

    def _send_audio(self, call_id: str, pcm: np.ndarray) -> None:
        writer = self._writer
        if writer is None or self._failed:
            return
        if _backlogged(writer, self.backlog_bytes):  # the engine is not reading: shed, never buffer without end
            self.audio_dropped += 1
            metrics.ENGINE_LINK_DROPPED.labels(what="caller_audio").inc()
            return
        writer.write(audio_message(call_id, pcm))

    def _forget(self, session: RemoteCallSession) -> None:
        if self._calls.get(session.call_id) is session:
            del self._calls[session.call_id]
            if self._writer is not None and not self._failed:
                self._writer.write(_json(b"C", {"call_id": session.call_id}))

    def _put_frames(self, item: BotFrames | None) -> None:
        put_dropping_oldest(self._frames, item)  # a consumer behind loses the oldest ticks, as with a local engine

    async def _receive(self) -> None:
        assert self._reader is not None
        why = "closed by the engine"
        try:
            while True:
                kind, body = await _read_message(self._reader)
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
                elif kind == b"S":
                    self.draining = bool(json.loads(bytes(body)).get("draining"))
                    if self.draining:
                        log.warning("the engine at %s is draining: no new calls here until it is back", self.address)
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
