"""TwiML answers for the voice webhook, built with the twilio library, plus a parser for tests and the
simulated caller. Pure, no I/O."""

from __future__ import annotations

import ipaddress
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

from twilio.twiml.voice_response import Connect, Dial, Stream, VoiceResponse

# Twilio: each <Parameter>'s name and value together must be under 500 characters.
MAX_PARAMETER_CHARS = 500
# Twilio refuses TwiML responses over 64 kB (error 11750).
MAX_TWIML_BYTES = 64_000
# Characters XML 1.0 cannot carry at all; ElementTree would write them and Twilio would reject the TwiML.
# Lone surrogates too (a JSON "\ud800" decodes to one): the UTF-8 encode of the answer raised on them.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_safe(text: str) -> str:
    """`text` without the characters XML 1.0 cannot carry (for values that are not ours to refuse)."""
    return _XML_INVALID.sub("", text)


def _check_text(what: str, text: str) -> None:
    if _XML_INVALID.search(text):
        raise ValueError(f"{what} contains characters XML cannot carry")


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_stream_url(stream_url: str, allow_insecure_ws: bool) -> None:
    parts = urlsplit(stream_url)
    if not parts.netloc:
        raise ValueError("stream url must be absolute (wss://host/path)")
    if parts.query or parts.fragment:
        # <Stream url> does not support query strings; per-call data goes in <Parameter>.
        raise ValueError("stream url must not carry a query string; use parameters")
    if parts.scheme == "wss":
        return
    # Twilio itself only connects to wss://. Plain ws:// is for a simulated caller on this machine.
    if parts.scheme == "ws" and (allow_insecure_ws or _is_loopback(parts.hostname)):
        return
    raise ValueError(f"stream url scheme must be wss (ws only for local dev), got {parts.scheme!r}")


def connect_stream_twiml(
    stream_url: str,
    status_callback_url: str,
    parameters: Mapping[str, str],
    *,
    allow_insecure_ws: bool = False,
    action_url: str | None = None,
) -> str:
    """`<Response><Connect><Stream url statusCallback statusCallbackMethod="POST"><Parameter/>…` as XML.

    ws:// is accepted for loopback hosts, or anywhere with `allow_insecure_ws` (local dev only).
    """
    _check_stream_url(stream_url, allow_insecure_ws)
    if urlsplit(status_callback_url).scheme not in ("https", "http"):
        raise ValueError("statusCallback must be an absolute http(s) URL")
    stream = Stream(url=stream_url, status_callback=status_callback_url, status_callback_method="POST")
    for name, value in parameters.items():
        if not name:
            raise ValueError("parameter name must not be empty")
        if len(name) + len(value) >= MAX_PARAMETER_CHARS:
            raise ValueError(f"parameter {name!r}: name + value must be under {MAX_PARAMETER_CHARS} chars")
        _check_text(f"parameter {name!r}", name + value)
        stream.parameter(name=name, value=value)
    # Twilio requests `action_url` when the stream ends while the caller is still on the line (our engine
    # was lost, a drain ran out, ...): what it answers is what the caller hears next, not dead air.
    connect = Connect(action=action_url, method="POST") if action_url else Connect()
    connect.append(stream)
    response = VoiceResponse()
    response.append(connect)
    xml = response.to_xml()
    if len(xml.encode("utf-8")) > MAX_TWIML_BYTES:
        raise ValueError(f"TwiML over {MAX_TWIML_BYTES} bytes")
    return xml


def busy_twiml(message: str) -> str:
    """Say `message`, then hang up: the answer when no stream can be opened (at capacity)."""
    _check_text("message", message)
    response = VoiceResponse()
    response.say(message)
    response.hangup()
    return response.to_xml()


def hangup_twiml() -> str:
    """Hang up at once, saying nothing: the answer to a replayed webhook (the caller, if any, is on the call
    whose stream already runs; a replayer learns nothing)."""
    response = VoiceResponse()
    response.hangup()
    return response.to_xml()


def at_capacity_twiml(policy: str, message: str, transfer_to: str | None = None) -> str:
    """The answer when no stream can be opened, by the agent's busy policy: `reject` (a busy signal,
    the call is never answered or billed), `say` (the message, then hang up), `dial` (to `transfer_to`),
    `enqueue:NAME` (a Twilio queue)."""
    response = VoiceResponse()
    if policy == "reject":
        response.reject(reason="busy")
    elif policy == "say":
        _check_text("message", message)
        response.say(message)
        response.hangup()
    elif policy == "dial" and transfer_to:
        response.append(dial_twiml_verb(transfer_to))
    elif policy.startswith("enqueue:"):
        response.enqueue(policy.removeprefix("enqueue:"))
    else:
        raise ValueError(f"busy policy {policy!r}")
    return response.to_xml()


def dial_twiml_verb(target: str) -> Dial:
    """`<Dial>` to an E.164 number or a sip: URI (the agent's `transfer_to`)."""
    dial = Dial()
    if target.startswith(("sip:", "sips:")):
        dial.sip(target)
    else:
        dial.number(target)
    return dial


def fallback_twiml(transfer_to: str | None, apology: str) -> str:
    """What a caller whose stream ended hears: a `<Dial>` to the agent's `transfer_to`, else an apology."""
    response = VoiceResponse()
    if transfer_to:
        response.append(dial_twiml_verb(transfer_to))
    else:
        _check_text("apology", apology)
        response.say(apology)
        response.hangup()
    return response.to_xml()


class ConnectStream(NamedTuple):
    url: str
    status_callback: str | None
    parameters: dict[str, str]
    action: str | None = None  # <Connect action>: requested when the stream ends


def parse_connect_stream(twiml: str) -> ConnectStream:
    """Read <Response><Connect><Stream> back: url, statusCallback and the <Parameter>s, in order.

    For tests and the simulated caller, on TwiML from our own server (not hardened for hostile XML).
    """
    root = ET.fromstring(twiml)
    if root.tag != "Response":
        raise ValueError(f"root element is <{root.tag}>, not <Response>")
    stream = root.find("./Connect/Stream")
    if stream is None:
        raise ValueError("no <Connect><Stream> in TwiML")
    url = stream.get("url")
    if not url:
        raise ValueError("<Stream> has no url")
    parameters: dict[str, str] = {}
    for param in stream.findall("./Parameter"):
        name, value = param.get("name"), param.get("value")
        if name is None or value is None:
            raise ValueError("<Parameter> needs name and value")
        parameters[name] = value
    connect = root.find("./Connect")
    action = connect.get("action") if connect is not None else None
    return ConnectStream(url, stream.get("statusCallback"), parameters, action)
