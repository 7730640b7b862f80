"""Every Prometheus metric the phone edge exports, in one place. Call sites use these constants."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from engine.metrics import zero_series

from .audiosocket_wire import PROTOCOL_ERROR_KINDS as AUDIOSOCKET_ERROR_KINDS
from .twilio_messages import PROTOCOL_ERROR_KINDS

# 1200: the turn-latency alert's threshold is a bucket edge (between 1000 and 1500 its p95 was interpolated).
_LATENCY_BUCKETS_MS = (20, 40, 80, 120, 160, 240, 320, 480, 640, 800, 1000, 1200, 1500, 2000, 3000, 5000)
_MEDIA_BUCKETS_MS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 40, 50, 100)
# Up to the 4 h a call may last by default (--max-call-minutes): calls held open to the limit show as such.
_CALL_DURATION_BUCKETS_S = (5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)

FIRST_AUDIO_SECONDS = Histogram(
    "kame_first_audio_seconds",
    "From the stream's start event to the bot's first audible audio (above -38 dBFS) sent to the carrier.",
    buckets=[b / 1000 for b in _LATENCY_BUCKETS_MS],
)
TURN_LATENCY_SECONDS = Histogram(
    "kame_turn_latency_seconds",
    "From the end of the caller's turn to the bot's next voiced audio.",
    buckets=[b / 1000 for b in _LATENCY_BUCKETS_MS],
)
TURNS_UNANSWERED_SECONDS = Histogram(
    "kame_turn_unanswered_seconds",
    "Caller turns the bot never answered: from the turn's end to the caller speaking again or hanging up "
    "(dead air that kame_turn_latency_seconds cannot see).",
    buckets=(0.8, 1, 1.5, 2, 3, 5, 10, 30, 60),
)
TURN_OVERLAPS = Counter(
    "kame_turn_overlaps_total",
    "Turns where the bot started speaking before the caller's turn ended.",
)
CALLS_ACTIVE = Gauge("kame_calls_active", "Calls with an open media stream.")
# Every outcome a call can end with (the voice webhook's, then the stream's end reasons); tests scan the
# telephony code for any other.
CALL_OUTCOMES = (
    "completed", "busy", "misconfigured", "rejected", "engine_full", "oversize", "socket_error", "silent_socket",
    "stalled_peer", "engine_lost", "flooding", "no_start", "drain_timeout", "transferred", "ended_by_agent",
    "no_stream", "node_lost", "max_duration",
)  # fmt: skip
CALLS_TOTAL = zero_series(
    Counter("kame_calls_total", "Calls by outcome and by the agent that answered.", ["outcome", "agent"]),
    outcome=CALL_OUTCOMES, agent=("default",),
)  # fmt: skip
CALL_DURATION_SECONDS = Histogram(
    "kame_call_duration_seconds",
    "Streamed call length, from the stream's start to its end.",
    buckets=_CALL_DURATION_BUCKETS_S,
)
TWILIO_PROTOCOL_ERRORS = zero_series(
    Counter("kame_twilio_protocol_errors_total", "Bad or unexpected Media Streams input by kind.", ["kind"]),
    kind=sorted(PROTOCOL_ERROR_KINDS),
)
AUDIOSOCKET_PROTOCOL_ERRORS = zero_series(
    Counter("kame_audiosocket_protocol_errors_total", "Bad or unexpected Asterisk AudioSocket input by kind.",
            ["kind"]),
    kind=sorted({*AUDIOSOCKET_ERROR_KINDS, "no_start", "silent_socket"}),
)  # fmt: skip
WEBHOOK_REJECTIONS = zero_series(
    Counter(
        "kame_webhook_rejections_total",
        "HTTP webhooks, WebSocket upgrades and admin API requests refused, by reason.",
        ["endpoint", "reason"],
    ),
    endpoint=("voice", "stream_status", "call_status", "media", "connect_action"),
    reason=("missing_signature", "bad_signature"),
)
zero_series(WEBHOOK_REJECTIONS, endpoint=("voice",), reason=("replayed",))  # signatures carry no nonce
# A body that is not a form Twilio sends, or one that does not arrive in time (before any signature check).
zero_series(WEBHOOK_REJECTIONS, endpoint=("voice", "stream_status", "call_status", "connect_action"),
            reason=("malformed", "slow_body", "oversize"))
# A stream's start (not a signature): a token that is not the call's, a second socket for a live call, a start
# for another call than its URL's. Before the upgrade: the fixed URL once every node gives per-call URLs, a
# call's URL whose stream has started (a replayed upgrade), a second socket on one call's URL.
zero_series(WEBHOOK_REJECTIONS, endpoint=("media",),
            reason=("bad_token", "second_stream", "wrong_url", "unstarted_cap", "unstarted_evicted", "fixed_url",
                    "replayed", "second_socket"))
# AudioSocket connections (no signatures: addresses): outside --audiosocket-allow, no engine, over the cap of
# connections awaiting their call's UUID, the UUID of a call already streaming here, or of one with a record.
zero_series(WEBHOOK_REJECTIONS, endpoint=("audiosocket",),
            reason=("not_allowed", "engine_down", "unstarted_cap", "unstarted_evicted", "second_stream", "replayed"))
# The admin API (/calls, /agents): no bearer token, the wrong one, or none set on this node (ADMIN_TOKEN unset).
zero_series(WEBHOOK_REJECTIONS, endpoint=("admin",), reason=("missing_token", "bad_token", "disabled"))
STREAM_MESSAGES_DROPPED = zero_series(
    Counter(
        "kame_stream_messages_dropped_total",
        "Media Streams messages dropped over their per-stream limit (telephony/stream_limits.py): control "
        "messages and pings over their rate, media past real time or its message rate, text frames over the "
        "stream's text rate (refused unparsed: event text); a stream far past its limits is ended as flooding.",
        ["event"],
    ),
    event=("connected", "start", "stop", "mark", "dtmf", "media", "invalid", "audio", "media_msgs", "ping", "text"),
)
MEDIA_UNSTARTED_SOCKETS = Gauge(
    "kame_media_unstarted_sockets",
    "Media connections whose call has not started: Twilio sockets upgraded (signature checked) without their "
    "start, AudioSocket connections without their UUID; capped per carrier, and closed after the start timeout.",
)
CALL_FALLBACKS = zero_series(
    Counter(
        "kame_call_fallbacks_total",
        "Streams that ended with the caller still on the line (engine lost, drain timeout, ...), by what the "
        "caller got instead: dial (the agent's transfer_to) or apology.",
        ["action"],
    ),
    action=("dial", "apology"),
)
CALL_ACTIONS = zero_series(
    Counter(
        "kame_call_actions_total",
        "Call actions carried out through Twilio's REST API: transfer (to a person) or end (hang up), by trigger "
        "(dtmf: the agent's dtmf_transfer key; tool: the agent's LLM called transfer_call or end_call; "
        "max_duration: the call reached --max-call-minutes) and result (ok, error, unavailable: no REST credentials).",
        ["action", "trigger", "result"],
    ),
    action=("transfer", "end"), trigger=("dtmf", "tool", "max_duration"), result=("ok", "error", "unavailable"),
)  # fmt: skip
HTTP_CONNECTIONS_REFUSED = Counter(
    "kame_http_connections_refused_total",
    "Connections to a listener aborted at once: the cap of connections without a call was full, every one of "
    "them in a request.",
)
HTTP_CONNECTIONS_EVICTED = Counter(
    "kame_http_connections_evicted_total",
    "Idle connections (no request in flight) to a listener closed for a new one: the cap of connections without "
    "a call was full (silent sockets, a flood of connections, or many idle keep-alives).",
)
REDIS_ERRORS = Counter("kame_redis_errors_total", "Failed writes or reads against Redis.")
CALL_STORE_DROPPED_OPS = Counter(
    "kame_call_store_dropped_ops_total",
    "Call-store writes lost: the write-behind buffer was full (Redis down or slow), or the store was closed.",
)
CALL_STORE_UNAPPLIED_OPS = Counter(
    "kame_call_store_unapplied_ops_total",
    "Call-store writes Redis could not apply: their call is not there (expired, or lost with a Redis that "
    "came back empty) and this node holds no copy of it to write back.",
)
CALL_STORE_UNREADABLE = zero_series(
    Counter(
        "kame_call_store_unreadable_total",
        "Call records, or items of their lists (turns, oracle notes, tool notes), in Redis that could not be "
        "read (written by another version, or edited by hand): left out of the admin API's answers.",
        ["what"],
    ),
    what=("record", "item"),
)
CALL_STORE_RESTORED_RECORDS = Counter(
    "kame_call_store_restored_records_total",
    "Live calls' whole records written back to a Redis that had lost them (restarted without persistence).",
)
CALL_STORE_PENDING_OPS = Gauge(
    "kame_call_store_pending_ops",
    "Call-store writes buffered in process, not yet acknowledged by Redis.",
)
MEDIA_INBOUND_SECONDS = Histogram(
    "kame_media_inbound_seconds",
    "From a frame's last inbound packet to its 80 ms frame handed to the engine.",
    buckets=[b / 1000 for b in _MEDIA_BUCKETS_MS],
)
MEDIA_OUTBOUND_SECONDS = Histogram(
    "kame_media_outbound_seconds",
    "From engine output (the tick's end, in the engine's own process when it has one) to the outbound media"
    " message being sent.",
    buckets=[b / 1000 for b in _MEDIA_BUCKETS_MS],
)
FANOUT_PHASES = ("wait", "resample", "encode", "send")
MEDIA_FANOUT_SECONDS = zero_series(
    Histogram(
        "kame_media_fanout_seconds",
        "One engine tick on its way out of this edge, by phase: wait (engine output to the fan-out running: the"
        " engine process's pipe, when it has one, and this event loop),"
        " resample (24 to 8 kHz, every call), encode (mu-law and levels), send (every call's message, back to"
        " back). The last call of a tick waits for all four.",
        ["phase"],
        buckets=[b / 1000 for b in _MEDIA_BUCKETS_MS],
    ),
    phase=FANOUT_PHASES,
)
MEDIA_OUTBOUND_DROPPED = Counter(
    "kame_media_outbound_dropped_frames_total",
    "Bot frames not sent because the peer was not reading its socket (its unsent backlog was full).",
)
AUDIOSOCKET_QUEUE_DROPPED = Counter(
    "kame_audiosocket_queue_dropped_messages_total",
    "AudioSocket bot messages (20 ms each) dropped from the pacer's queue, the oldest first: more than a second "
    "was queued (a stall's burst), so the caller hears the bot's newest audio instead of a second late.",
)
AUDIOSOCKET_UNCHECKED = Counter(
    "kame_audiosocket_unchecked_calls_total",
    "AudioSocket calls answered without their replay check: the call store (Redis) was down or slower than "
    "200 ms, so a UUID seen before (or answered by another node) could not be ruled out.",
)
MEDIA_PLAYOUT_DELAY_SECONDS = Histogram(
    "kame_media_playout_delay_seconds",
    "From sending a playout mark to Twilio's echo of it: the bot audio queued ahead of it at Twilio, plus the "
    "round trip. A stall's burst shows here; it should stay near the round trip.",
    buckets=[0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0],
)
MEDIA_PLAYOUT_DRAINED = Counter(
    "kame_media_playout_drained_frames_total",
    "Silent bot frames (pauses, under -50 dBFS) not sent because Twilio's queue was deeper than two frames: a "
    "stall's backlog drained through the bot's pauses.",
)
MEDIA_PLAYOUT_CLEARS = Counter(
    "kame_media_playout_clears_total",
    "Twilio playout queues cleared because the caller talked (half a second of voice) over more than 250 ms of "
    "queued bot speech.",
)
# Twilio's call status callback (the number's StatusCallback, set by `kame-phone twilio setup`).
CALL_STATUSES = ("queued", "initiated", "ringing", "in-progress", "completed", "busy", "failed", "no-answer",
                 "canceled", "unknown")  # fmt: skip
FINAL_CALL_STATUSES = ("completed", "busy", "failed", "no-answer", "canceled")
CALL_STATUS_EVENTS = zero_series(
    Counter("kame_twilio_call_status_total", "Call status callbacks from Twilio by CallStatus.", ["status"]),
    status=CALL_STATUSES,
)
STREAM_EVENT_KINDS = ("stream-started", "stream-stopped", "stream-error", "unknown")  # anything else: unknown
STREAM_EVENTS = zero_series(
    Counter(
        "kame_twilio_stream_events_total",
        "Media Stream status callbacks from Twilio by event (stream-started, stream-stopped, stream-error).",
        ["event"],
    ),
    event=STREAM_EVENT_KINDS,
)
