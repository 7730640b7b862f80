"""When to (re)ask the LLM for a new draft: a pure, clock-injected policy object, one per call.

It reproduces the trigger of the official KAME server (`LLMStreamManager` in server_oracle.py): the
back-end polls it every `poll_interval_s`; it fires when the caller's word count (committed final words
plus the pending partial, never shrinking until the next final) grew by `min_word_delta` since the last
request, or when an STT final arrived, at most `max_requests` times per sliding `window_s` (finals excepted).

Differences from the official code, on purpose:
- a final is never held by the rate cap (the official code consumes its "final" flag when capped, so that
  final never triggers); growth seen while capped is kept and fires as soon as the window frees up;
- after a failed request it backs off exponentially and then retries by itself a few times, so a call
  whose caller has stopped talking still gets a draft once the LLM recovers (not after a failure that
  came mid-answer: what was said stands, and a retry would start the answer over).

Times are plain floats (seconds on any monotonic clock); nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True, slots=True)
class OraclePolicyConfig:
    poll_interval_s: float = 0.25  # the official class default (its server passes 0.5)
    min_word_delta: int = 2
    max_requests: int = 5  # per sliding window
    window_s: float = 2.0
    backoff_initial_s: float = 0.5  # after the first failure; doubles per consecutive failure
    backoff_max_s: float = 8.0
    max_auto_retries: int = 3  # retries without new caller words before waiting for new input
    # Also decide the moment a transcript update arrives, not only at the next poll: the same rules
    # and rate cap, minus up to one poll interval of waiting (a caller's final is answered at once).
    # False gives the paper's exact timing.
    react_to_updates: bool = True

    def __post_init__(self) -> None:
        assert self.poll_interval_s > 0, "poll_interval_s must be positive"
        assert self.min_word_delta >= 1, "min_word_delta must be >= 1"
        assert self.max_requests >= 1 and self.window_s > 0, "rate cap must allow some requests"
        assert 0 < self.backoff_initial_s <= self.backoff_max_s, "backoff bounds out of order"
        assert self.max_auto_retries >= 0


class TriggerReason(str, Enum):
    """Why `poll` fired."""

    FIRST = "first"  # first words of the call
    FINAL = "final"  # the STT closed an utterance
    GROWTH = "growth"  # the word count grew by min_word_delta
    RETRY = "retry"  # the previous request failed and the back-off has passed
    TOOL_RESULT = "tool_result"  # a tool the LLM called has answered (not from `poll`: the back-end asks)


@dataclass
class _PolicyState:
    committed_words: int = 0  # words in the caller's finals so far
    pending_words: int = 0  # words in the current partial
    max_pending_since_final: int = 0  # partials may shrink when re-decoded; the count must not
    final_pending: bool = False  # a non-empty final arrived since the last request
    asked_at_words: int | None = None  # word count when the last request started; None: never asked
    request_times: deque[float] = field(default_factory=deque)  # starts inside the window
    failures: int = 0  # consecutive failed requests
    blocked_until: float = -math.inf  # back-off after a failure
    retry_pending: bool = False
    # The back-end has something to ask about (a tool's result) that it could not ask yet: unlike a retry, a
    # failure of the request in flight does not cancel it; only a request that starts does.
    ask_owed: bool = False
    auto_retries: int = 0  # retries fired since the last new-input trigger


class OraclePolicy:
    """Decides, at each poll, whether a new LLM request should start now."""

    def __init__(self, config: OraclePolicyConfig | None = None) -> None:
        self.config = config or OraclePolicyConfig()
        self._s = _PolicyState()

    # --- transcript events -------------------------------------------------------------------------
    def on_partial(self, words: int) -> None:
        """The caller's current (unfinished) utterance now has `words` words."""
        s = self._s
        s.pending_words = words
        s.max_pending_since_final = max(s.max_pending_since_final, words)

    def on_final(self, words: int) -> None:
        """The STT closed an utterance of `words` words (0: it heard nothing after all)."""
        s = self._s
        s.committed_words += words
        s.pending_words = 0
        s.max_pending_since_final = 0
        if words > 0:
            s.final_pending = True
        if s.asked_at_words is not None and s.asked_at_words > s.committed_words:
            # The final retracted words the last request counted (an empty final after noise's partials):
            # growth is measured from what was really said, or the next utterance would need those words too.
            s.asked_at_words = s.committed_words

    @property
    def word_count(self) -> int:
        s = self._s
        return s.committed_words + max(s.pending_words, s.max_pending_since_final)

    # --- request outcomes --------------------------------------------------------------------------
    def on_success(self) -> None:
        """The current request streamed to its end."""
        self._s.failures = 0
        self._s.auto_retries = 0

    def on_failure(self, now: float, *, retry: bool = True, retry_after_s: float | None = None) -> None:
        """The current request failed at `now`: back off, then retry (a bounded number of times).

        `retry` False: the failure came after some of the answer was delivered (a broken stream); a retry
        would be a new answer from its first word, so the caller would hear the start again.
        `retry_after_s`: the server's Retry-After (429/503); the back-off lasts at least that long (asking
        sooner only earns another refusal)."""
        s = self._s
        s.failures += 1
        cfg = self.config
        # The exponent capped: past 1023 it overflows a float (an LLM down for hours of one long call).
        backoff = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2 ** min(s.failures - 1, 30))
        s.blocked_until = now + max(backoff, retry_after_s or 0.0)
        s.retry_pending = retry and s.auto_retries < cfg.max_auto_retries

    # --- the decision ------------------------------------------------------------------------------
    def ask_now(self, now: float) -> bool:
        """The back-end asks on its own (a tool's result, a call action that failed): whether it may, now.
        Counted as a request, with what the caller said so far (a final heard meanwhile is in its history: the
        next poll must not ask the same again, which restarted the answer from its first word). Not while
        backed off after a failure: a retry is then due when it lifts, with the same history."""
        s = self._s
        if now < s.blocked_until:
            s.ask_owed = True
            return False
        self._forget_old_requests(now)
        if len(s.request_times) >= self.config.max_requests:
            # The window's cap holds here too: a model answering every final with a tool call that resolves at
            # once (an unknown name, bad arguments) asked past it, ~4 requests a final. Asked at the first poll
            # the window allows, as a retry.
            s.ask_owed = True
            return False
        self._asked(now)
        return True

    def ask_later(self) -> None:
        """The back-end has something to ask about (a tool's result) but may not ask now (a call action's line
        is being said): asked at the first poll that may, with what the caller says meanwhile."""
        self._s.ask_owed = True

    def _forget_old_requests(self, now: float) -> None:
        """Drop the request starts that fell out of the rate cap's window."""
        s = self._s
        while s.request_times and s.request_times[0] <= now - self.config.window_s:
            s.request_times.popleft()

    def _asked(self, now: float) -> None:
        """A request starts at `now`: counted in the window, with what the caller said so far."""
        s = self._s
        s.request_times.append(now)
        s.asked_at_words = self.word_count
        s.final_pending = False
        s.retry_pending = False
        s.ask_owed = False

    def poll(self, now: float) -> TriggerReason | None:
        """Call every `poll_interval_s`. Returns why a request must start now, or None.

        A returned reason counts as a started request (rate cap, baseline word count).
        """
        s = self._s
        cfg = self.config
        if now < s.blocked_until:
            return None
        count = self.word_count
        reason: TriggerReason | None = None
        if s.asked_at_words is None:
            if s.final_pending:
                reason = TriggerReason.FINAL
            elif count > 0:
                reason = TriggerReason.FIRST
        elif s.final_pending:
            reason = TriggerReason.FINAL
        elif count - s.asked_at_words >= cfg.min_word_delta:
            reason = TriggerReason.GROWTH
        elif s.retry_pending or s.ask_owed:
            reason = TriggerReason.RETRY
        if reason is None:
            return None
        self._forget_old_requests(now)
        # Capped: keep every flag, fire at the first poll after the window frees. Not a final: partials' requests
        # filled the window while the caller spoke, and the answer to what they said in the end waited up to
        # 0.8 s behind them. A final still counts in the window (finals come at most every ~0.6 s of silence).
        if len(s.request_times) >= cfg.max_requests and reason is not TriggerReason.FINAL:
            return None
        automatic = reason is TriggerReason.RETRY and s.retry_pending  # (an owed ask is not a failure's retry)
        self._asked(now)
        s.auto_retries = s.auto_retries + 1 if automatic else 0
        return reason
