"""Every Prometheus metric the engine exports, in one place (the knowledge path's are in knowledge/metrics.py)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TypeVar

from prometheus_client import Counter, Gauge, Histogram

_Labelled = TypeVar("_Labelled", Counter, Gauge, Histogram)


def zero_series(metric: _Labelled, **label_values: Iterable[str]) -> _Labelled:
    """Create `metric`'s series for every combination of the given label values, at 0, and return it.

    A labelled metric has no series until its first event, and rate()/increase() see no increase in a
    series born at 1: the first error of a kind would never fire an alert. So every value a label can take
    is listed where the metric is defined, and exported from the start."""
    names = list(label_values)
    for values in itertools.product(*label_values.values()):
        metric.labels(**dict(zip(names, values, strict=True)))
    return metric


# Buckets sized around the 80 ms frame: a tick that passes 80 ms is a deadline miss.
TICK_BUCKETS_MS = (2, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 100, 150, 250, 500, 1000)
# Fine from 200 to 1000 ms, where an LLM's time to first token puts the oracle lag: with 250/400/600 the p99
# was the bucket layout's (a true 419 ms read 591), and it is `bench node`'s headline figure.
LAG_BUCKETS_MS = (10, 20, 40, 80, 120, 160, 200, 250, 300, 350, 400, 450, 500, 550, 600, 700, 800, 900, 1000, 1250,
                  1500, 2000, 5000)

ENGINE_TICK_SECONDS = Histogram(
    "kame_engine_tick_seconds",
    "Wall time of one batched 80 ms engine tick (encode + LM step + decode).",
    buckets=[b / 1000 for b in TICK_BUCKETS_MS],
)
ENGINE_DEADLINE_MISSES = Counter(
    "kame_engine_deadline_misses_total",
    "Ticks that finished after the end of their 80 ms frame (the loop fell behind real time).",
)
ENGINE_SLOTS_BUSY = Gauge("kame_engine_slots_busy", "Call slots in use.")
# A gauge: no `_total` suffix (Prometheus reserves it for counters; `promtool check metrics` refuses it).
ENGINE_SLOTS = Gauge("kame_engine_slots", "Call slots configured (--max-calls).")
ENGINE_MODEL_BYTES = zero_series(
    Gauge(
        "kame_engine_model_bytes",
        "What the model holds on its device: part=weights (as served: int8 codes and scales with "
        "--weights-dtype int8), part=kv_cache (the main transformer's, every slot at --context).",
        ["part"],
    ),
    part=("weights", "kv_cache"),
)
ENGINE_FALLING_BEHIND = Gauge(
    "kame_engine_falling_behind",
    "1 while over a fifth of the last 2 s of ticks missed their 80 ms frame (the node takes no new calls).",
)
ENGINE_UNDERRUNS = Counter(
    "kame_engine_underruns_total",
    "Slot-ticks where the caller's frame had not arrived in time and silence was fed instead.",
)
ENGINE_OVERRUNS = Counter(
    "kame_engine_input_overruns_total",
    "Caller frames dropped because a slot's input queue was full (audio faster than real time).",
)
ENGINE_INPUT_CATCHUPS = Counter(
    "kame_engine_input_catchups_total",
    "Caller frames skipped (the quietest queued) because a call's input backlog stood past the jitter cushion "
    "for a second: the model was hearing that caller late after a stall.",
)
ENGINE_INPUT_BACKLOG = Gauge(
    "kame_engine_input_backlog_frames",
    "The deepest caller input backlog over the seated calls after the last tick's take, in 80 ms frames: "
    "0-1 is normal (1 is the jitter cushion); more is audio the model will hear that much late.",
)
ORACLE_LAG_SECONDS = Histogram(
    "kame_oracle_lag_seconds",
    "From the transcript update that triggered an LLM request to its first oracle token in the slot.",
    buckets=[b / 1000 for b in LAG_BUCKETS_MS],
)
ORACLE_SLOT_WAIT_SECONDS = Histogram(
    "kame_oracle_slot_wait_seconds",
    "The frame loop's share of the oracle lag: from a new candidate reaching its call's slot to the tick that "
    "feeds its boundary token (0-80 ms when ticks keep time; more means late ticks).",
    buckets=[b / 1000 for b in LAG_BUCKETS_MS],
)
# The engine link (engine/link_server.py, engine/remote.py): edges served over a socket by `kame-phone engine-serve`.
ENGINE_LINK_EDGES = Gauge("kame_engine_link_edges", "Edge processes connected to this engine server.")
ENGINE_LINK_ERRORS = zero_series(
    Counter(
        "kame_engine_link_errors_total",
        "Engine link failures: bad_hello (none, too big or too slow), bad_token, bad_version (protocol mismatch), "
        "unauthenticated_cap (too many peers before their hello), bad_message (a peer dropped), bad_audio (a "
        "frame dropped), lost (the edge lost its engine).",
        ["kind"],
    ),
    kind=("bad_hello", "bad_token", "bad_version", "unauthenticated_cap", "bad_message", "bad_audio", "lost"),
)
ENGINE_LINK_DROPPED = zero_series(
    Counter(
        "kame_engine_link_dropped_total",
        "Messages shed because the other side of the engine link was not reading: bot_frames (ticks) and "
        "events (transcripts, drafts) on the engine side, caller_audio (frames) on the edge side.",
        ["what"],
    ),
    what=("bot_frames", "events", "caller_audio"),
)
