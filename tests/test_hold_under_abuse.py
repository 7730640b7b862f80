"""Holding under load and abuse: a clean Prometheus exposition, with every labelled series there from the
start (a series born at its first event is invisible to rate() and increase())."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from prometheus_client import Counter, Gauge, Histogram

import engine.metrics
import telephony.metrics
from engine.llm import ErrorKind
from telephony.twilio_messages import PROTOCOL_ERROR_KINDS

ROOT = Path(__file__).resolve().parents[1]


# --- C: metric hygiene -------------------------------------------------------------------------------------


def _labelled_metrics() -> dict[str, Counter | Gauge | Histogram]:
    """Every labelled metric the two metrics modules define, by family name."""
    found = {}
    for module in (engine.metrics, telephony.metrics):
        for value in vars(module).values():
            if isinstance(value, Counter | Gauge | Histogram) and value._labelnames:
                found[value._name] = value
    return found


def test_every_labelled_metric_has_its_series_before_any_event() -> None:
    labelled = _labelled_metrics()
    assert {"kame_calls", "kame_llm_errors", "kame_twilio_protocol_errors", "kame_webhook_rejections",
            "kame_twilio_stream_events", "kame_engine_link_errors", "kame_media_fanout_seconds"} <= set(labelled)
    for name, m in labelled.items():
        assert m._metrics, f"{name} has no series until its first event: list its label values (zero_series)"
    # The label values are the ones the code uses.
    assert set(get_args(ErrorKind)) == set(engine.metrics.LLM_ERROR_KINDS)
    assert {k for (k,) in telephony.metrics.TWILIO_PROTOCOL_ERRORS._metrics} == set(PROTOCOL_ERROR_KINDS)


def test_every_call_outcome_in_the_code_is_a_known_label_value() -> None:
    """kame_calls_total's outcomes are listed up front (telephony.metrics.CALL_OUTCOMES): an outcome the code
    uses but the list lacks would again be a series born at its first call."""
    pattern = re.compile(r'(?:_end_reason = |\.end\(|outcome=|store\.end\(call_sid, )"([a-z_]+)"')
    used = {m for path in (ROOT / "telephony").glob("*.py") for m in pattern.findall(path.read_text())}
    assert {"completed", "busy", "rejected", "drain_timeout"} <= used
    assert used <= set(telephony.metrics.CALL_OUTCOMES), sorted(used - set(telephony.metrics.CALL_OUTCOMES))
