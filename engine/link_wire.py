"""The engine link's wire: message framing and bodies, addresses and TLS, shared by both ends
(engine/link_server.py, engine/remote.py).

Wire: every message is a 4-byte big-endian length, one kind byte, a body. Control bodies are JSON; audio
is raw 16-bit PCM (little-endian, 24 kHz): half of float32's bytes, which mattered (at 100 calls a tick is
384 KB, and every copy and socket wake-up of it is latency), and far finer than the 8-bit μ-law the phone
line carries. Nothing is unpickled: a peer can send bad bytes, never code. Timestamps cross as ages
(seconds before sending), as two nodes' monotonic clocks do not compare.

  edge -> engine   H hello {version, token, seats, name}   O open {call_id, setup}   C close {call_id}
                   A audio: u16 id length, call id, 1920 int16
                   X a call action the edge could not carry out {call_id, action, result}
                   D draining {}: the edge is going away; its seats no call uses go back to the engine now,
                     each other one as its call ends (5)
  engine -> edge   W welcome {version, seats} | {error, permanent, full}   R open result {call_id, ok, error}
                   G seats {seats}: the edge's grant changed: given back (D), or more of what it asked for (5)
                   E call event {call_id, type: transcript|oracle|notice|end, ...}
                   F bot frames: u32 header length, header {call_ids, texts, voiced, indices, fresh, age}, pcm
                   S status {draining, behind}: the engine is going away, or is missing its 80 ms frames
                     (seated calls go on, no new ones); sent every STATUS_EVERY_S too, as the link's heartbeat (6)

A close (C) frees the seat at once; the call's events go on until it has said what it says as it closes
(the caller's last words, made final by its back-end, within LAST_WORDS_WAIT_S), then its E end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np

from .interface import (
    FRAME_SAMPLES,
    MAX_SETUP_TEXT,
    BotFrames,
    CallAction,
    CallerTranscript,
    CallSetup,
    EngineError,
    EngineNotice,
    EngineOutput,
    OracleUpdate,
    ToolUse,
    is_forced_delay_ms,
)

log = logging.getLogger(__name__)

_PREFIX = struct.Struct(">I")
_U16 = struct.Struct(">H")
MAX_MESSAGE_BYTES = 32 << 20  # a tick of 256 calls is 2 MB; anything far larger is a broken peer
# 2: hello/welcome carry "version"; call ids are per edge. A v1 peer sends no version and is refused.
# 3: a call's setup carries the actions the edge can carry out; "tool" events (the agent's tool calls).
# 4: "X": a call action the edge could not carry out, for the call's back-end.
# 5: "D" (a draining edge gives back the seats it does not use) and "G" (an edge's grant changed).
# 6: "S" every STATUS_EVERY_S with "behind" (the engine not keeping time, as its own /readyz says): the edges
#    admit no new call meanwhile, and one that hears nothing for SILENT_LINK_S takes the link for lost (a
#    partition, a frozen host: no reset comes, and an idle edge never wrote anything that could fail).
PROTOCOL_VERSION = 6
STATUS_EVERY_S = 1.0
SILENT_LINK_S = 5.0
# What either side still speaks, so a rolling upgrade does not cut edges off: a link at 3 is 4 without "X"
# (the edge does not send it; the engine never needs it), a link at 4 is 5 without "D" and "G" (a draining
# edge holds its seats until it leaves, as before). The welcome names the version the link speaks.
COMPATIBLE_VERSIONS = (3, 4, 5, 6)
_PCM = np.dtype("<i2")
_FRAME_BYTES = FRAME_SAMPLES * _PCM.itemsize
SOCKET_BUFFER_BYTES = 1 << 20  # a whole tick in one send where the kernel allows (it caps at wmem_max)




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


class LinkFull(LinkError):
    """The engine has no seat left for us now (other edges hold them all): they come back as edges leave or
    drain, so ask again soon."""


class LinkRefused(LinkError):
    """The engine server will never take us as configured (a wrong token): retrying is pointless."""


# ---------------------------------------------------------------------------------------------------------
# Messages


def _message(kind: bytes, *parts: bytes) -> bytes:
    """One message from its body's parts, joined once (a tick's audio is not copied per part)."""
    return b"".join((_PREFIX.pack(1 + sum(map(len, parts))), kind, *parts))


def json_message(kind: bytes, obj: dict[str, Any]) -> bytes:
    return _message(kind, json.dumps(obj, separators=(",", ":")).encode())


async def read_message(reader: asyncio.StreamReader, limit: int = MAX_MESSAGE_BYTES) -> tuple[bytes, memoryview]:
    """(kind, body); raises IncompleteReadError at EOF and LinkError on a length no peer of ours sends."""
    (n,) = _PREFIX.unpack(await reader.readexactly(_PREFIX.size))
    if not 1 <= n <= limit:
        raise LinkError(f"message of {n} bytes")
    data = await reader.readexactly(n)
    return data[:1], memoryview(data)[1:]  # a view: a tick's audio is not copied once more


def setup_from_wire(raw: Any) -> CallSetup | None:
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
    return json_message(b"E", body)


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


def frames_message(
    frames: BotFrames, rows: list[int], now: float, call_ids: list[str] | None = None,
    fresh: Sequence[bool] | None = None,
) -> bytes:
    """The tick's `rows`, named by `call_ids` (the receiving edge's own ids) or else by the tick's; `fresh`, the
    rows' marks with those of ticks the edge missed (else the tick's)."""
    header = json.dumps(
        {
            "call_ids": call_ids if call_ids is not None else [frames.call_ids[i] for i in rows],
            "texts": [frames.texts[i] for i in rows],
            "voiced": [frames.voiced[i] for i in rows],
            "indices": [frames.indices[i] for i in rows],
            "fresh": list(fresh) if fresh is not None else [frames.fresh[i] for i in rows],
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
        if int(port) > 65535:  # a bind or connect refused it only after the model had loaded, with a traceback
            raise ValueError(f"engine address {text!r}: the port must be 0-65535")
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


# A link whose peer is gone without a word (a partition, a dead host) is dropped after this long: the engine
# writes its state every second, and data unacknowledged this long aborts the connection (TCP_USER_TIMEOUT).
# Left to TCP's retries, an engine kept a vanished edge's seats for many minutes, refusing its reconnect "full".
PEER_GONE_S = 20
# An idle link (nothing unacknowledged) is probed after this long, every PEER_PROBE_S, PEER_PROBES times.
PEER_IDLE_S, PEER_PROBE_S, PEER_PROBES = 10, 5, 3


def tune_socket(writer: asyncio.StreamWriter, buffer_bytes: int = SOCKET_BUFFER_BYTES) -> None:
    """Socket buffers big enough for a tick in one send (fewer wake-ups on both sides); TCP is no-delay, and
    a peer gone silently is noticed (PEER_GONE_S)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # small messages must not wait for Nagle
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (("TCP_USER_TIMEOUT", PEER_GONE_S * 1000), ("TCP_KEEPIDLE", PEER_IDLE_S),
                                  ("TCP_KEEPINTVL", PEER_PROBE_S), ("TCP_KEEPCNT", PEER_PROBES)):  # fmt: skip
                if hasattr(socket, option):  # Linux's; elsewhere the system's defaults
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def backlogged(writer: asyncio.StreamWriter, limit: int) -> bool:
    transport = writer.transport
    return transport.is_closing() or transport.get_write_buffer_size() > limit
