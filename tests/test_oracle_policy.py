"""OraclePolicy with a fake clock: times are plain numbers, nothing sleeps."""

from __future__ import annotations

import random

import pytest

from knowledge.oracle_policy import OraclePolicy, OraclePolicyConfig, TriggerReason

CFG = OraclePolicyConfig()  # the paper's knobs: 250 ms polls, +2 words, 5 per sliding 2 s
STEP = CFG.poll_interval_s


def polls(policy: OraclePolicy, start: float, end: float, step: float = STEP) -> list[tuple[float, TriggerReason]]:
    """Poll at start, start+step, ... < end; return the (time, reason) of every fire."""
    fired = []
    n = 0
    while (t := round(start + n * step, 6)) < end:
        reason = policy.poll(t)
        if reason is not None:
            fired.append((t, reason))
        n += 1
    return fired


def test_silence_never_fires() -> None:
    p = OraclePolicy(CFG)
    assert polls(p, 0.0, 30.0) == []
    p.on_partial(0)
    p.on_final(0)  # the STT retracted a partial: nothing was said
    assert polls(p, 30.0, 40.0) == []


def test_first_word_fires_once_then_needs_growth() -> None:
    p = OraclePolicy(CFG)
    p.on_partial(1)
    assert p.poll(0.0) is TriggerReason.FIRST
    assert p.poll(0.25) is None  # nothing new
    p.on_partial(2)  # +1: below min_word_delta
    assert polls(p, 0.5, 5.0) == []
    p.on_partial(3)  # +2 since the request
    assert p.poll(5.0) is TriggerReason.GROWTH
    assert p.poll(5.25) is None


def test_first_event_final_fires_as_final() -> None:
    p = OraclePolicy(CFG)
    p.on_final(3)
    assert p.poll(1.0) is TriggerReason.FINAL
    assert p.poll(1.25) is None


def test_growth_is_measured_from_the_last_request() -> None:
    p = OraclePolicy(OraclePolicyConfig(min_word_delta=3))
    p.on_partial(1)
    assert p.poll(0.0) is TriggerReason.FIRST  # baseline 1
    p.on_partial(3)
    assert p.poll(0.25) is None  # +2 < 3
    p.on_partial(4)
    assert p.poll(0.5) is TriggerReason.GROWTH  # baseline 4
    p.on_partial(6)
    assert p.poll(0.75) is None
    p.on_partial(7)
    assert p.poll(1.0) is TriggerReason.GROWTH


def test_shrinking_partial_does_not_lower_the_count() -> None:
    p = OraclePolicy(CFG)
    p.on_partial(4)
    assert p.poll(0.0) is TriggerReason.FIRST  # asked at 4
    p.on_partial(2)  # the decoder re-segmented: "can you tell" -> "canute"
    assert p.word_count == 4
    p.on_partial(5)
    assert p.poll(0.25) is None  # 5 - 4 < 2: measured against the max, not the dip
    p.on_partial(6)
    assert p.poll(0.5) is TriggerReason.GROWTH


def test_word_count_is_committed_plus_pending() -> None:
    p = OraclePolicy(CFG)
    p.on_partial(3)
    p.on_final(4)
    assert p.word_count == 4
    p.on_partial(2)
    assert p.word_count == 6
    p.on_partial(1)
    assert p.word_count == 6  # max pending since the final
    p.on_final(1)
    assert p.word_count == 5  # the final replaces the pending words
    p.on_partial(0)
    assert p.word_count == 5


def test_final_fires_without_growth() -> None:
    p = OraclePolicy(CFG)
    p.on_partial(3)
    assert p.poll(0.0) is TriggerReason.FIRST
    p.on_final(3)  # same words, now final
    assert p.poll(0.25) is TriggerReason.FINAL
    assert p.poll(0.5) is None


def test_final_takes_precedence_over_growth() -> None:
    p = OraclePolicy(CFG)
    p.on_partial(1)
    p.poll(0.0)
    p.on_final(5)
    assert p.poll(0.25) is TriggerReason.FINAL


def test_empty_final_does_not_fire() -> None:
    p = OraclePolicy(CFG)
    p.on_partial(2)
    assert p.poll(0.0) is TriggerReason.FIRST
    p.on_final(0)
    assert polls(p, 0.25, 5.0) == []


def test_rate_cap_is_five_per_sliding_two_seconds() -> None:
    p = OraclePolicy(CFG)
    fired = []
    words = 0
    for n in range(40):  # 10 s of a caller adding 2 words every poll
        t = n * STEP
        words += 2
        p.on_partial(words)
        if p.poll(t) is not None:
            fired.append(t)
    assert fired[:6] == [0.0, 0.25, 0.5, 0.75, 1.0, 2.0]
    # In steady state the window lets one request through each time the oldest one ages out.
    assert fired == [0.0, 0.25, 0.5, 0.75, 1.0, 2.0, 2.25, 2.5, 2.75, 3.0, 4.0, 4.25, 4.5, 4.75, 5.0,
                     6.0, 6.25, 6.5, 6.75, 7.0, 8.0, 8.25, 8.5, 8.75, 9.0]  # fmt: skip


def test_a_final_is_not_held_by_the_rate_cap() -> None:
    """The official server consumes its 'final' flag when capped; here the partials' requests filled the window
    and the final waited up to 0.8 s behind them. Now it fires at once, and counts in the window."""
    p = OraclePolicy(CFG)
    for n in range(5):
        p.on_partial(2 * (n + 1))
        assert p.poll(n * STEP) is not None  # 0.0 .. 1.0: the window is full
    p.on_final(10)  # no new words, just the final, at 1.1
    assert p.poll(1.25) is TriggerReason.FINAL
    assert p.poll(1.5) is None
    p.on_partial(2)  # growth after it waits for the window: 0.0 and 0.25 leave it
    assert polls(p, 1.75, 2.25) == []
    assert p.poll(2.25) is TriggerReason.GROWTH


def test_growth_while_capped_fires_when_the_window_frees() -> None:
    p = OraclePolicy(CFG)
    for n in range(5):
        p.on_partial(2 * (n + 1))
        p.poll(n * STEP)
    p.on_partial(12)
    assert p.poll(1.9) is None
    assert p.poll(2.0) is TriggerReason.GROWTH


def test_window_is_sliding_not_fixed() -> None:
    p = OraclePolicy(CFG)
    times = [0.0, 1.5, 1.6, 1.7, 1.8]
    for i, t in enumerate(times):
        p.on_partial(2 * (i + 1))
        assert p.poll(t) is not None
    p.on_partial(20)
    assert p.poll(1.99) is None
    assert p.poll(2.0) is TriggerReason.GROWTH  # 0.0 aged out
    p.on_partial(30)
    assert p.poll(3.4) is None  # 1.5 .. 2.0 are still inside (3.4 - 2 = 1.4)
    assert p.poll(3.5) is TriggerReason.GROWTH


def test_failure_backs_off_then_retries_without_new_words() -> None:
    p = OraclePolicy(OraclePolicyConfig(backoff_initial_s=0.5, backoff_max_s=4.0, max_auto_retries=3))
    p.on_final(4)
    assert p.poll(0.0) is TriggerReason.FINAL
    p.on_failure(0.1)
    assert p.poll(0.5) is None  # blocked until 0.6
    assert p.poll(0.6) is TriggerReason.RETRY
    p.on_failure(0.7)  # second failure: 1.0 s
    assert p.poll(1.6) is None
    assert p.poll(1.7) is TriggerReason.RETRY
    p.on_success()
    assert polls(p, 1.75, 10.0) == []  # succeeded: nothing to retry


def test_backoff_doubles_up_to_the_max() -> None:
    p = OraclePolicy(OraclePolicyConfig(backoff_initial_s=0.5, backoff_max_s=3.0, max_auto_retries=100,
                                        max_requests=100))  # fmt: skip
    p.on_final(2)
    t = 0.0
    assert p.poll(t) is TriggerReason.FINAL
    waits = []
    for _ in range(6):
        p.on_failure(t)
        wait = next(i * 0.125 for i in range(1, 100) if p.poll(t + i * 0.125) is not None)
        waits.append(wait)
        t += wait
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_success_resets_the_backoff() -> None:
    p = OraclePolicy(OraclePolicyConfig(backoff_initial_s=0.5, backoff_max_s=8.0))
    p.on_final(2)
    p.poll(0.0)
    p.on_failure(0.0)
    assert p.poll(0.5) is TriggerReason.RETRY
    p.on_failure(0.5)  # 1.0 s
    assert p.poll(1.5) is TriggerReason.RETRY
    p.on_success()
    p.on_final(2)
    assert p.poll(1.75) is TriggerReason.FINAL
    p.on_failure(1.75)
    assert p.poll(2.25) is TriggerReason.RETRY  # back to 0.5 s


def test_auto_retries_are_bounded_until_new_input() -> None:
    p = OraclePolicy(OraclePolicyConfig(backoff_initial_s=0.25, backoff_max_s=0.25, max_auto_retries=2))
    p.on_final(3)
    t = 0.0
    assert p.poll(t) is TriggerReason.FINAL
    reasons = []
    for _ in range(6):
        p.on_failure(t)
        fired = polls(p, t + 0.25, t + 20.0)
        if not fired:
            break
        t, reason = fired[0]
        reasons.append(reason)
    assert reasons == [TriggerReason.RETRY, TriggerReason.RETRY]  # then it waits for the caller
    p.on_partial(2)  # new words: a fresh trigger, and a fresh retry budget
    t += 1.0
    assert p.poll(t) is TriggerReason.GROWTH
    p.on_failure(t)
    assert p.poll(t + 0.25) is TriggerReason.RETRY


def test_final_during_backoff_fires_after_it() -> None:
    p = OraclePolicy(OraclePolicyConfig(backoff_initial_s=2.0, backoff_max_s=2.0))
    p.on_partial(2)
    p.poll(0.0)
    p.on_failure(0.0)
    p.on_final(2)
    assert polls(p, 0.25, 2.0) == []
    assert p.poll(2.0) is TriggerReason.FINAL


def test_retries_count_toward_the_rate_cap() -> None:
    p = OraclePolicy(OraclePolicyConfig(max_requests=2, window_s=10.0, backoff_initial_s=0.1, backoff_max_s=0.1))
    p.on_final(2)
    assert p.poll(0.0) is TriggerReason.FINAL
    p.on_failure(0.0)
    assert p.poll(0.25) is TriggerReason.RETRY
    p.on_failure(0.25)
    assert polls(p, 0.5, 10.0) == []  # two requests in the window already
    assert p.poll(10.0) is TriggerReason.RETRY


@pytest.mark.parametrize("seed", range(25))
def test_random_streams_respect_every_rule(seed: int) -> None:
    """Random partials, finals and failures against the policy's invariants."""
    rng = random.Random(seed)
    cfg = OraclePolicyConfig(max_requests=rng.choice([1, 2, 5]), window_s=rng.choice([1.0, 2.0]),
                             min_word_delta=rng.choice([1, 2, 3]), backoff_initial_s=0.25,
                             backoff_max_s=1.0)  # fmt: skip
    p = OraclePolicy(cfg)
    fired: list[float] = []
    committed, pending, max_pending = 0, 0, 0
    asked_at: int | None = None
    final_waiting = False
    blocked_until = -1.0
    for n in range(400):
        t = n * STEP
        event = rng.random()
        if event < 0.35:
            pending = max(0, pending + rng.choice([-1, 1, 1, 2]))
            max_pending = max(max_pending, pending)
            p.on_partial(pending)
        elif event < 0.45:
            words = rng.choice([0, pending, pending + 1])
            committed += words
            pending = max_pending = 0
            final_waiting = final_waiting or words > 0
            if asked_at is not None:  # words the final retracted no longer count toward growth
                asked_at = min(asked_at, committed)
            p.on_final(words)
        elif event < 0.5 and fired:
            p.on_failure(t)
            blocked_until = t + 0.25  # at least the initial back-off
        count = committed + max(pending, max_pending)
        assert p.word_count == count
        recent = [f for f in fired if f > t - cfg.window_s]
        reason = p.poll(t)
        if reason is None:
            # It may stay quiet only when capped, backing off, or when nothing warrants a request.
            grew = asked_at is None and count > 0 or asked_at is not None and count - asked_at >= cfg.min_word_delta
            if (final_waiting or grew) and t >= blocked_until + cfg.backoff_max_s:
                assert not final_waiting, f"a final held at t={t}"  # finals are not capped
                assert len(recent) >= cfg.max_requests, f"lost a trigger at t={t}"
            continue
        if reason is not TriggerReason.FINAL:
            assert len(recent) < cfg.max_requests, f"cap broken at t={t}"
        if reason is TriggerReason.FINAL:
            assert final_waiting
        elif reason is TriggerReason.GROWTH:
            assert asked_at is not None and count - asked_at >= cfg.min_word_delta
        elif reason is TriggerReason.FIRST:
            assert asked_at is None and count > 0
        fired.append(t)
        asked_at = count
        final_waiting = False


def test_config_rejects_nonsense() -> None:
    with pytest.raises(AssertionError):
        OraclePolicyConfig(max_requests=0)
    with pytest.raises(AssertionError):
        OraclePolicyConfig(min_word_delta=0)
    with pytest.raises(AssertionError):
        OraclePolicyConfig(backoff_initial_s=2.0, backoff_max_s=1.0)


def test_an_empty_final_lowers_the_growth_baseline() -> None:
    p = OraclePolicy(CFG)
    p.on_partial(3)  # noise decoded as "uh the a"
    assert p.poll(0.0) is TriggerReason.FIRST  # asked at 3 words
    p.on_final(0)  # the STT retracts them: nothing was said
    assert p.poll(3.0) is None and p.word_count == 0
    p.on_partial(1)  # the caller's real utterance
    assert p.poll(6.0) is None
    p.on_partial(2)  # +2 words since what was really said: an early request, as for any utterance
    assert p.poll(6.25) is TriggerReason.GROWTH
    p.on_partial(3)
    assert p.poll(6.5) is None  # and growth is measured from there again


def test_a_final_shorter_than_its_partials_lowers_the_baseline_too() -> None:
    p = OraclePolicy(CFG)
    p.on_final(2)
    assert p.poll(0.0) is TriggerReason.FINAL  # baseline 2
    p.on_partial(5)
    assert p.poll(0.25) is TriggerReason.GROWTH  # baseline 7
    p.on_final(1)  # re-decoded to one word: 3 in all, and a final to answer
    assert p.poll(0.5) is TriggerReason.FINAL  # baseline 3
    p.on_partial(2)
    assert p.poll(0.75) is TriggerReason.GROWTH


def test_a_failure_after_words_went_out_backs_off_but_does_not_retry() -> None:
    """A stream that broke mid-answer: what was said stands; a retry would replay the answer from its start."""
    p = OraclePolicy(CFG)
    p.on_final(3)
    assert p.poll(0.0) is TriggerReason.FINAL
    p.on_failure(0.5, retry=False)
    assert p.poll(0.75) is None  # still backing off
    assert polls(p, 1.0, 20.0) == []  # and no retry after it
    p.on_partial(2)  # the caller's new words still ask
    assert p.poll(20.0) is TriggerReason.GROWTH


def test_retry_after_lengthens_the_back_off() -> None:
    """A 429's Retry-After of 5 s: nothing is asked before it, not even a final; the retry comes after it."""
    p = OraclePolicy(CFG)
    p.on_final(3)
    assert p.poll(0.0) is TriggerReason.FINAL
    p.on_failure(0.0, retry_after_s=5.0)
    p.on_final(2)
    assert polls(p, 0.25, 5.0) == []
    assert p.poll(5.0) is TriggerReason.FINAL


def test_a_request_the_back_end_makes_itself_counts_and_waits_out_a_back_off() -> None:
    """A tool's result (or a failed call action) is asked about by the back-end itself: a caller's final heard
    meanwhile is in that request's history, so the next poll must not ask again (the answer restarted from its
    first word); and while the policy backs off after a failure, the back-end does not ask: a retry follows
    once the back-off lifts (review, session 22)."""
    p = OraclePolicy(CFG)
    p.on_final(4)  # the caller spoke while the tool ran (the action's quiet window: no poll)
    assert p.ask_now(10.0)
    assert polls(p, 10.25, 12.0) == []  # not asked twice
    p.on_failure(12.0)
    assert not p.ask_now(12.1)  # backed off: not now
    fired = polls(p, 12.25, 20.0)
    assert fired and fired[0][1] is TriggerReason.RETRY and fired[0][0] >= 12.0 + CFG.backoff_initial_s


def test_a_very_long_outage_backs_off_without_overflowing() -> None:
    """2 ** 1024 overflows a float: the back-off died with it after 1024 failures in a row (hours of one long
    call with the LLM down), and requests came at the full rate from then on (review, session 22)."""
    p = OraclePolicy(CFG)
    for i in range(1100):
        p.on_failure(float(i))
    assert p.poll(1100.0) is None  # still backed off, at most backoff_max_s


def test_a_request_the_back_end_makes_itself_keeps_to_the_rate_cap() -> None:
    """Tool results were asked about past the window's cap (10 in one 2 s window with a cap of 5, in the
    review): one waits for the window now, and is asked at the first poll it allows."""
    p = OraclePolicy(CFG)
    granted = [t for t in (10.0 + 0.1 * i for i in range(10)) if p.ask_now(t)]
    assert granted == [10.0, 10.1, 10.2, 10.3, 10.4]
    fired = polls(p, 11.0, 13.0)
    assert fired[0] == (12.0, TriggerReason.RETRY)  # when the window's first request (10.0) leaves it


def test_an_ask_the_cap_deferred_survives_the_request_in_flight_failing() -> None:
    """Capped, the tool's result waited as a retry, and the request in flight then breaking after some words
    (no retry: the caller would hear the start again) wiped it: the answer was never asked for. Owed, it is
    asked once the window and the back-off allow."""
    p = OraclePolicy(CFG)
    for n in range(5):  # growth requests fill the window
        p.on_partial(2 * (n + 1))
        assert p.poll(10.0 + n * STEP) is not None
    assert not p.ask_now(11.25)
    p.on_failure(11.3, retry=False)
    fired = polls(p, 11.5, 20.0)
    assert fired and fired[0][1] is TriggerReason.RETRY
