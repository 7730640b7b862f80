"""Golden tests for the Twilio wire layer: Media Streams messages, TwiML, and request signatures."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from twilio.request_validator import RequestValidator

from telephony import twilio_messages as tm
from telephony.signatures import (
    public_url_for,
    validate_webhook,
    validate_websocket,
    websocket_signature_url,
)
from telephony.twiml import busy_twiml, connect_stream_twiml, parse_connect_stream, xml_safe

SID = "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
CALL = "CAXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
ACCOUNT = "ACXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
AUDIO = bytes(range(256))[:160]  # one 20 ms frame, every byte distinct enough to catch mangling
AUDIO_B64 = base64.b64encode(AUDIO).decode()

# The examples on twilio.com/docs/voice/media-streams/websocket-messages, values and key order as
# published (whitespace condensed); only the abbreviated payload ("no+JhoaJjpzS...") is replaced by a real
# one, since the abbreviation is not valid base64.
DOC_CONNECTED = """{ "event": "connected", "protocol": "Call", "version": "1.0.0" }"""
DOC_START = """{
  "event": "start", "sequenceNumber": "1",
  "start": {
    "accountSid": "ACXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",
    "streamSid": "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",
    "callSid": "CAXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",
    "tracks": [ "inbound" ],
    "mediaFormat": { "encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1 },
    "customParameters": { "FirstName": "Jane", "LastName": "Doe", "RemoteParty": "Bob" }
  },
  "streamSid": "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"
}"""
DOC_MEDIA = (
    """{ "event": "media", "sequenceNumber": "4",
 "media": { "track": "inbound", "chunk": "2", "timestamp": "5", "payload": "%s" },
"streamSid": "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX" }"""
    % AUDIO_B64
)
DOC_STOP = """{ "event": "stop", "sequenceNumber": "5",
 "stop": { "accountSid": "ACXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX", "callSid": "CAXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX" },
  "streamSid": "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX" }"""
DOC_DTMF = """{ "event": "dtmf", "streamSid":"MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX", "sequenceNumber":"5",
  "dtmf": { "track":"inbound_track", "digit": "1" } }"""
DOC_MARK = """{ "event": "mark", "sequenceNumber": "4", "streamSid": "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",
 "mark": { "name": "my label" } }"""
# Messages we send (same page, "Send WebSocket messages to Twilio").
DOC_OUT_MEDIA = (
    """{ "event": "media", "streamSid": "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX",
  "media": { "payload": "%s" } }"""
    % AUDIO_B64
)
DOC_OUT_MARK = (
    """{ "event": "mark", "streamSid": "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX", "mark": { "name": "my label" } }"""
)
DOC_OUT_CLEAR = """{ "event": "clear", "streamSid": "MZXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX" }"""


def compact(doc: str) -> str:
    """The doc example as one compact line, key order kept."""
    return json.dumps(json.loads(doc), separators=(",", ":"))


# --------------------------------------------------------------------------------------------------------
# Inbound: builders == documented wire format, parser reads the documented form, and they round-trip.

BUILT = {
    "connected": (DOC_CONNECTED, tm.connected_msg()),
    "start": (
        DOC_START,
        tm.start_msg(SID, CALL, ACCOUNT, {"FirstName": "Jane", "LastName": "Doe", "RemoteParty": "Bob"}),
    ),
    "media": (DOC_MEDIA, tm.media_msg(SID, 4, 2, 5, AUDIO)),
    "stop": (DOC_STOP, tm.stop_msg(SID, 5, CALL, ACCOUNT)),
    "dtmf": (DOC_DTMF, tm.dtmf_msg(SID, 5, "1")),
    "mark": (DOC_MARK, tm.mark_msg(SID, 4, "my label")),
}


@pytest.mark.parametrize("event", list(BUILT))
def test_inbound_builder_matches_doc_byte_for_byte(event: str) -> None:
    doc, built = BUILT[event]
    assert built == compact(doc)


@pytest.mark.parametrize("event", list(BUILT))
def test_parser_round_trips_doc_and_builder(event: str) -> None:
    doc, built = BUILT[event]
    from_doc = tm.parse_twilio_message(doc)
    assert from_doc == tm.parse_twilio_message(built)
    assert from_doc.event == event
    # Dumping by alias gives back the wire form: every field was read, none renamed or retyped.
    assert from_doc.model_dump_json(by_alias=True) == compact(doc)


def test_parsed_fields_are_typed() -> None:
    start = tm.parse_twilio_message(DOC_START)
    assert isinstance(start, tm.StartMessage)
    assert start.sequence_number == 1
    assert start.stream_sid == SID and start.start.stream_sid == SID
    assert start.start.call_sid == CALL and start.start.account_sid == ACCOUNT
    assert start.start.tracks == ("inbound",)
    assert start.start.custom_parameters == {"FirstName": "Jane", "LastName": "Doe", "RemoteParty": "Bob"}
    assert start.start.media_format.sample_rate == 8000

    media = tm.parse_twilio_message(DOC_MEDIA)
    assert isinstance(media, tm.MediaMessage)
    assert media.media.payload == AUDIO  # decoded to raw µ-law bytes
    assert (media.sequence_number, media.media.chunk, media.media.timestamp) == (4, 2, 5)
    assert media.media.track == "inbound"

    dtmf = tm.parse_twilio_message(DOC_DTMF)
    assert isinstance(dtmf, tm.DtmfMessage) and dtmf.dtmf.digit == "1"
    mark = tm.parse_twilio_message(DOC_MARK)
    assert isinstance(mark, tm.MarkMessage) and mark.mark.name == "my label"
    stop = tm.parse_twilio_message(DOC_STOP)
    assert isinstance(stop, tm.StopMessage) and stop.stop.call_sid == CALL


def test_parser_accepts_bytes_and_ignores_extra_fields() -> None:
    msg = json.loads(DOC_MEDIA)
    msg["futureField"] = {"x": 1}
    msg["media"]["someNewThing"] = "y"
    parsed = tm.parse_twilio_message(json.dumps(msg).encode())
    assert isinstance(parsed, tm.MediaMessage) and parsed.media.payload == AUDIO


def test_start_without_custom_parameters_is_empty_dict() -> None:
    msg = json.loads(DOC_START)
    del msg["start"]["customParameters"]
    parsed = tm.parse_twilio_message(json.dumps(msg))
    assert isinstance(parsed, tm.StartMessage) and parsed.start.custom_parameters == {}


def test_payload_at_cap_is_accepted() -> None:
    parsed = tm.parse_twilio_message(tm.media_msg(SID, 1, 1, 0, b"\x7f" * tm.MAX_MEDIA_PAYLOAD_BYTES))
    assert isinstance(parsed, tm.MediaMessage) and len(parsed.media.payload) == tm.MAX_MEDIA_PAYLOAD_BYTES


# --------------------------------------------------------------------------------------------------------
# Every bad input the parser owns raises ProtocolError with its kind.


def _mutated(doc: str, change) -> str:
    msg = json.loads(doc)
    change(msg)
    return json.dumps(msg)


BAD_INPUTS = [
    pytest.param('{"event": "media", ', tm.MALFORMED_JSON, id="truncated-json"),
    pytest.param("not json", tm.MALFORMED_JSON, id="not-json"),
    pytest.param(b"\xff\x00\x81\x80" * 40, tm.BINARY_FRAME, id="binary-bytes"),
    pytest.param(_mutated(DOC_MEDIA, lambda m: m.update(event="transcript")), tm.UNKNOWN_EVENT, id="unknown"),
    pytest.param('{"event": "clear", "streamSid": "MZ1"}', tm.UNKNOWN_EVENT, id="outbound-only-event"),
    pytest.param(_mutated(DOC_MEDIA, lambda m: m.pop("streamSid")), tm.INVALID_MESSAGE, id="no-streamSid"),
    pytest.param(_mutated(DOC_STOP, lambda m: m.pop("streamSid")), tm.INVALID_MESSAGE, id="stop-no-sid"),
    pytest.param(_mutated(DOC_MARK, lambda m: m["mark"].pop("name")), tm.INVALID_MESSAGE, id="mark-no-name"),
    pytest.param('{"protocol": "Call"}', tm.INVALID_MESSAGE, id="no-event"),
    pytest.param("[1, 2]", tm.INVALID_MESSAGE, id="not-an-object"),
    pytest.param(
        _mutated(DOC_MEDIA, lambda m: m.update(sequenceNumber=4)), tm.INVALID_MESSAGE, id="seq-as-number"
    ),
    pytest.param(
        _mutated(DOC_MEDIA, lambda m: m["media"].update(timestamp="5.0")), tm.INVALID_MESSAGE, id="ts-not-int"
    ),
    pytest.param(
        _mutated(DOC_MEDIA, lambda m: m["media"].update(track="both")), tm.INVALID_MESSAGE, id="bad-track"
    ),
    pytest.param(
        _mutated(DOC_START, lambda m: m["start"]["mediaFormat"].update(sampleRate=16000)),
        tm.INVALID_MESSAGE,
        id="not-8khz",
    ),
    pytest.param(
        _mutated(DOC_START, lambda m: m["start"].update(streamSid="MZother")),
        tm.INVALID_MESSAGE,
        id="start-two-sids",
    ),
    pytest.param(
        _mutated(DOC_START, lambda m: m["start"]["customParameters"].update(n=1)),
        tm.INVALID_MESSAGE,
        id="param-not-string",
    ),
    pytest.param(_mutated(DOC_DTMF, lambda m: m["dtmf"].update(digit="12")), tm.INVALID_MESSAGE, id="dtmf-2"),
    pytest.param(
        _mutated(DOC_MEDIA, lambda m: m["media"].update(payload="no+JhoaJjpzS...")),
        tm.INVALID_BASE64,
        id="doc-abbreviated-payload",
    ),
    pytest.param(
        _mutated(DOC_MEDIA, lambda m: m["media"].update(payload="AAA")), tm.INVALID_BASE64, id="bad-padding"
    ),
    pytest.param(
        _mutated(DOC_MEDIA, lambda m: m["media"].update(payload=12)), tm.INVALID_MESSAGE, id="payload-number"
    ),
    pytest.param(tm.media_msg(SID, 1, 1, 0, b"\0" * 8001), tm.OVERSIZE, id="payload-8001"),
    pytest.param(tm.media_msg(SID, 1, 1, 0, b"\0" * 100_000), tm.OVERSIZE, id="payload-100k"),
    pytest.param(" " * (tm.MAX_FRAME_CHARS + 1), tm.OVERSIZE, id="frame-too-big"),
]


@pytest.mark.parametrize(("raw", "kind"), BAD_INPUTS)
def test_bad_input_raises_protocol_error_of_kind(raw: str | bytes, kind: str) -> None:
    with pytest.raises(tm.ProtocolError) as info:
        tm.parse_twilio_message(raw)
    assert info.value.kind == kind
    assert info.value.detail  # something a log line can say


def test_protocol_error_detail_does_not_echo_payload() -> None:
    secretish = base64.b64encode(b"caller audio " * 10).decode() + "!"
    with pytest.raises(tm.ProtocolError) as info:
        tm.parse_twilio_message(_mutated(DOC_MEDIA, lambda m: m["media"].update(payload=secretish)))
    assert info.value.kind == tm.INVALID_BASE64
    assert secretish[:20] not in str(info.value)


def test_protocol_error_kinds_are_fixed() -> None:
    assert tm.PROTOCOL_ERROR_KINDS == {
        "malformed_json",
        "binary_frame",
        "unknown_event",
        "invalid_message",
        "invalid_base64",
        "oversize",
        "media_before_start",
        "wrong_stream_sid",
        "flooding",
        "silent_socket",
        "duplicate_start",
        "no_start",
    }
    err = tm.ProtocolError(tm.WRONG_STREAM_SID, "MZa != MZb")
    assert (err.kind, err.detail) == ("wrong_stream_sid", "MZa != MZb")
    with pytest.raises(ValueError):
        tm.ProtocolError("made_up", "labels must stay a fixed set")


# --------------------------------------------------------------------------------------------------------
# Outbound builders: exact compact JSON in the documented key order.


def test_outbound_builders_exact() -> None:
    assert tm.media_message(SID, AUDIO) == compact(DOC_OUT_MEDIA)
    assert tm.mark_message(SID, "my label") == compact(DOC_OUT_MARK)
    assert tm.clear_message(SID) == compact(DOC_OUT_CLEAR)
    assert tm.clear_message("MZ1") == '{"event":"clear","streamSid":"MZ1"}'
    assert tm.mark_message("MZ1", 'a"b') == '{"event":"mark","streamSid":"MZ1","mark":{"name":"a\\"b"}}'


def test_outbound_media_payload_is_plain_base64_of_the_bytes() -> None:
    payload = json.loads(tm.media_message(SID, b"\xff\x7f\x00"))["media"]["payload"]
    assert payload == "/38A"


# --------------------------------------------------------------------------------------------------------
# TwiML

STREAM_URL = "wss://voice.example.com/twilio/media"
STATUS_URL = "https://voice.example.com/twilio/stream-status"


def test_connect_stream_twiml_golden() -> None:
    xml = connect_stream_twiml(STREAM_URL, STATUS_URL, {"tenant": "acme", "session": "9f3c&<\"'"})
    assert xml == (
        '<?xml version="1.0" encoding="UTF-8"?><Response><Connect>'
        '<Stream statusCallback="https://voice.example.com/twilio/stream-status" statusCallbackMethod="POST"'
        ' url="wss://voice.example.com/twilio/media">'
        '<Parameter name="tenant" value="acme" />'
        '<Parameter name="session" value="9f3c&amp;&lt;&quot;\'" />'
        "</Stream></Connect></Response>"
    )


def test_connect_stream_parse_round_trip() -> None:
    params = {"tenant": "acme", "session": "9f3c&<\"'", "empty": "", "ünï": "cödé\nline"}
    parsed = parse_connect_stream(connect_stream_twiml(STREAM_URL, STATUS_URL, params))
    assert parsed == (STREAM_URL, STATUS_URL, params, None)
    assert list(parsed.parameters) == list(params)  # order kept
    url, status, got, action = parsed  # plain tuple unpacking works too
    assert (url, status, got, action) == (STREAM_URL, STATUS_URL, params, None)
    action_url = "https://voice.example.com/twilio/connect-action?agent=sales"
    with_action = connect_stream_twiml(STREAM_URL, STATUS_URL, params, action_url=action_url)
    assert parse_connect_stream(with_action).action == action_url


def test_parameter_length_rule() -> None:
    name = "token"
    ok = "v" * (500 - len(name) - 1)  # 499 in all: under 500
    assert parse_connect_stream(connect_stream_twiml(STREAM_URL, STATUS_URL, {name: ok})).parameters == {
        name: ok
    }
    with pytest.raises(ValueError, match="under 500"):
        connect_stream_twiml(STREAM_URL, STATUS_URL, {name: ok + "v"})  # exactly 500


@pytest.mark.parametrize(
    "url",
    [
        "https://voice.example.com/twilio/media",
        "ws://voice.example.com/twilio/media",
        "wss://voice.example.com/twilio/media?session=1",
        "/twilio/media",
    ],
)
def test_stream_url_rules(url: str) -> None:
    with pytest.raises(ValueError):
        connect_stream_twiml(url, STATUS_URL, {})


def test_ws_allowed_only_for_local_dev() -> None:
    for url in ("ws://127.0.0.1:8080/twilio/media", "ws://localhost/twilio/media", "ws://[::1]:80/m"):
        assert parse_connect_stream(connect_stream_twiml(url, STATUS_URL, {})).url == url
    xml = connect_stream_twiml("ws://kame:8080/m", STATUS_URL, {}, allow_insecure_ws=True)
    assert parse_connect_stream(xml).url == "ws://kame:8080/m"


def test_bad_parameters_and_callback_rejected() -> None:
    with pytest.raises(ValueError):
        connect_stream_twiml(STREAM_URL, STATUS_URL, {"": "x"})
    with pytest.raises(ValueError):
        connect_stream_twiml(STREAM_URL, STATUS_URL, {"k": "bell\x07"})
    with pytest.raises(ValueError):
        connect_stream_twiml(STREAM_URL, "/twilio/stream-status", {})


@pytest.mark.parametrize("bad", ["bell\x07", "lone \ud800 surrogate", "\ufffe"])
def test_text_xml_cannot_carry_is_refused_or_dropped(bad: str) -> None:
    """Ours to refuse (a parameter we set) is a ValueError; not ours (a caller id) is dropped, and what is left
    makes a TwiML answer that encodes (a lone surrogate made the UTF-8 encode raise: a 500)."""
    with pytest.raises(ValueError):
        connect_stream_twiml(STREAM_URL, STATUS_URL, {"k": bad})
    safe = xml_safe(bad)
    assert len(safe) == len(bad) - 1
    twiml = connect_stream_twiml(STREAM_URL, STATUS_URL, {"k": safe})
    twiml.encode("utf-8")  # as the webhook sends it
    assert parse_connect_stream(twiml).parameters == {"k": safe}


def test_busy_twiml() -> None:
    xml = busy_twiml("All lines are busy & we're sorry.")
    assert xml == (
        '<?xml version="1.0" encoding="UTF-8"?><Response>'
        "<Say>All lines are busy &amp; we're sorry.</Say><Hangup /></Response>"
    )
    with pytest.raises(ValueError, match="Connect"):
        parse_connect_stream(xml)  # no stream is opened for a busy line


# --------------------------------------------------------------------------------------------------------
# Signatures, checked against the real twilio RequestValidator as Twilio's signer.

TOKEN = "12345678901234567890123456789012"
BASE = "https://voice.example.com"
FORM = {"CallSid": CALL, "AccountSid": ACCOUNT, "From": "+15551234567", "To": "+15557654321"}


def twilio_signs(url: str, params: dict[str, str] | None = None, token: str = TOKEN) -> str:
    return RequestValidator(token).compute_signature(url, params or {})


def test_public_url_for() -> None:
    assert (
        public_url_for("/twilio/voice?a=1&b=%20", BASE) == "https://voice.example.com/twilio/voice?a=1&b=%20"
    )
    assert public_url_for("/twilio/voice", BASE + "/") == "https://voice.example.com/twilio/voice"
    assert (
        public_url_for("/twilio/voice", "https://h.example:8443/kame")
        == "https://h.example:8443/kame/twilio/voice"
    )
    with pytest.raises(ValueError):
        public_url_for("twilio/voice", BASE)
    with pytest.raises(ValueError):
        public_url_for("/twilio/voice", "voice.example.com")


def test_webhook_good_signature_accepted() -> None:
    url = public_url_for("/twilio/voice?tenant=acme", BASE)
    sig = twilio_signs("https://voice.example.com/twilio/voice?tenant=acme", FORM)
    assert validate_webhook(TOKEN, url, FORM, sig)


@pytest.mark.parametrize("sig", [None, ""])
def test_webhook_missing_signature_rejected(sig: str | None) -> None:
    assert not validate_webhook(TOKEN, public_url_for("/twilio/voice", BASE), FORM, sig)


def test_webhook_forged_signature_rejected() -> None:
    url = public_url_for("/twilio/voice", BASE)
    assert not validate_webhook(TOKEN, url, FORM, twilio_signs(url, FORM, token="0" * 32))
    assert not validate_webhook(TOKEN, url, FORM, "bm90IGEgcmVhbCBzaWduYXR1cmU=")
    tampered = {**FORM, "From": "+15550000000"}
    assert not validate_webhook(TOKEN, url, tampered, twilio_signs(url, FORM))
    assert not validate_webhook("", url, FORM, twilio_signs(url, FORM, token=""))


@pytest.mark.parametrize(
    "signed_url",
    [
        "http://voice.example.com/twilio/voice",  # scheme differs
        "https://other.example.com/twilio/voice",  # host differs
        "https://voice.example.com/twilio/other",  # path differs
        "https://voice.example.com/twilio/voice?x=1",  # query differs
    ],
)
def test_webhook_wrong_url_rejected(signed_url: str) -> None:
    url = public_url_for("/twilio/voice", BASE)
    assert not validate_webhook(TOKEN, url, FORM, twilio_signs(signed_url, FORM))


def test_webhook_port_443_variant_accepted() -> None:
    # Twilio's signer sometimes includes the default port; RequestValidator tries both forms.
    sig = twilio_signs("https://voice.example.com:443/twilio/voice", FORM)
    assert validate_webhook(TOKEN, public_url_for("/twilio/voice", BASE), FORM, sig)
    assert validate_webhook(
        TOKEN,
        public_url_for("/twilio/voice", BASE + ":443"),
        FORM,
        twilio_signs("https://voice.example.com/twilio/voice", FORM),
    )


def test_webhook_accepts_multidict_form() -> None:
    multidict = pytest.importorskip("multidict")
    form = multidict.MultiDict([("Digits", "1"), ("Digits", "2"), ("CallSid", CALL)])
    url = public_url_for("/twilio/gather", BASE)
    signed = RequestValidator(TOKEN).compute_signature(url, form)
    assert validate_webhook(TOKEN, url, form, signed)
    assert not validate_webhook(TOKEN, url, multidict.MultiDict([("Digits", "1"), ("CallSid", CALL)]), signed)


def test_websocket_signature_url() -> None:
    assert websocket_signature_url(BASE, "/twilio/media") == "wss://voice.example.com/twilio/media"
    assert (
        websocket_signature_url("http://127.0.0.1:8080", "/twilio/media")
        == "ws://127.0.0.1:8080/twilio/media"
    )
    assert (
        websocket_signature_url(BASE + "/kame/", "/twilio/media")
        == "wss://voice.example.com/kame/twilio/media"
    )
    with pytest.raises(ValueError):
        websocket_signature_url("ftp://voice.example.com", "/twilio/media")


def test_websocket_wss_signature_accepted_and_https_form_rejected() -> None:
    ws_url = websocket_signature_url(BASE, "/twilio/media")
    assert validate_websocket(TOKEN, ws_url, twilio_signs("wss://voice.example.com/twilio/media"))
    # Signed over https:// (the twilio-aspnet #162 mistake) is a different URL.
    assert not validate_websocket(TOKEN, ws_url, twilio_signs("https://voice.example.com/twilio/media"))
    assert not validate_websocket(TOKEN, ws_url, twilio_signs("wss://other.example.com/twilio/media"))
    assert not validate_websocket(TOKEN, ws_url, twilio_signs("wss://voice.example.com/twilio/other"))
    assert not validate_websocket(TOKEN, ws_url, twilio_signs(ws_url, token="0" * 32))
    assert not validate_websocket(TOKEN, ws_url, None)
    assert not validate_websocket(TOKEN, ws_url, "")


def test_websocket_port_443_variant_accepted() -> None:
    # RequestValidator alone adds :80 to wss URLs, so this case is ours.
    ws_url = websocket_signature_url(BASE, "/twilio/media")
    assert validate_websocket(TOKEN, ws_url, twilio_signs("wss://voice.example.com:443/twilio/media"))
    assert not RequestValidator(TOKEN).validate(
        ws_url, {}, twilio_signs("wss://voice.example.com:443/twilio/media")
    )
    assert not validate_websocket(TOKEN, ws_url, twilio_signs("wss://voice.example.com:8443/twilio/media"))


def test_websocket_query_params_are_signed() -> None:
    ws_url = websocket_signature_url(BASE, "/twilio/media")
    sig = twilio_signs(ws_url, {"session": "abc"})
    assert validate_websocket(TOKEN, ws_url, sig, {"session": "abc"})
    assert not validate_websocket(TOKEN, ws_url, sig, {"session": "abd"})
    assert not validate_websocket(TOKEN, ws_url, sig)


def test_token_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = public_url_for("/twilio/voice", BASE)
    validate_webhook(TOKEN, url, FORM, "forged")
    validate_webhook(TOKEN, url, FORM, twilio_signs(url, FORM))
    validate_websocket(TOKEN, websocket_signature_url(BASE, "/twilio/media"), "forged")
    assert TOKEN not in caplog.text
