"""Every Prometheus metric the knowledge path (STT, LLM) exports, in one place."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# The same buckets as the oracle lag: the LLM's share of it compares directly.
from engine.metrics import LAG_BUCKETS_MS, TICK_BUCKETS_MS, zero_series

LLM_TTFT_SECONDS = Histogram(
    "kame_llm_ttft_seconds",
    "LLM time to first streamed token.",
    buckets=[b / 1000 for b in LAG_BUCKETS_MS],
)
LLM_REQUESTS = Counter("kame_llm_requests_total", "LLM draft requests started.")
LLM_REQUESTS_CANCELLED = Counter(
    "kame_llm_requests_cancelled_total",
    "LLM draft requests cancelled before they ended: superseded by a newer draft (the caller said more), or "
    "stopped by a call action or the call's end. No outcome: the error ratio is errors / (started - cancelled).",
)
# Every `kind` knowledge/llm.py's ErrorKind can take (tests check the two agree).
# too_long: a reply cut at LlmConfig.max_draft_chars (delivered, but the server ignored max_tokens); empty: a
# reply with neither text nor a tool call.
LLM_ERROR_KINDS = ("timeout", "rate_limited", "server_error", "connection", "malformed", "other", "too_long", "empty")
LLM_ERRORS = zero_series(
    Counter("kame_llm_errors_total", "LLM request failures by kind.", ["kind"]), kind=LLM_ERROR_KINDS
)
STT_ERRORS = Counter("kame_stt_errors_total", "Speech-to-text failures.")
STT_DROPPED_FRAMES = Counter(
    "kame_stt_dropped_frames_total",
    "Caller frames dropped because the STT fell behind real time.",
)
# The batched Kyutai STT's GPU work, beside the engine's tick on the same GPU: what it takes from the engine.
STT_STEP_SECONDS = Histogram(
    "kame_stt_step_seconds",
    "Wall time of one batched Kyutai STT step (every row at once).",
    buckets=[b / 1000 for b in TICK_BUCKETS_MS],
)
STT_CATCHUP_STEPS = Counter(
    "kame_stt_catchup_steps_total",
    "Batched Kyutai STT steps beyond one a tick, taken to work off a backlog (each a whole-batch step).",
)
STT_PROCESS_RESTARTS = Counter(
    "kame_stt_process_restarts_total",
    "Deaths of the Kyutai STT's own process (--stt-process): its calls lost their transcript until it was back.",
)
STT_PARTIAL_SECONDS = Histogram(
    "kame_stt_partial_latency_seconds",
    "From the end of a caller frame to the partial transcript that includes it.",
    buckets=[b / 1000 for b in LAG_BUCKETS_MS],
)
# An agent's tool calls (knowledge/tools.py). `requested`: a call action handed to the phone edge, which
# counts what became of it in kame_call_actions_total.
TOOL_OUTCOMES = ("ok", "error", "timeout", "too_large", "bad_arguments", "unknown_tool", "requested")
TOOL_CALLS = zero_series(
    Counter("kame_tool_calls_total", "Tool calls the agents' LLM made, by tool and outcome.", ["tool", "outcome"]),
    tool=("transfer_call", "end_call", "unknown"), outcome=TOOL_OUTCOMES,
)  # fmt: skip


def zero_tool_series(tool: str) -> None:
    """An agent's own tool gets its series at 0 when a call first offers it (tool names come from the file)."""
    for outcome in TOOL_OUTCOMES:
        TOOL_CALLS.labels(tool=tool, outcome=outcome)
