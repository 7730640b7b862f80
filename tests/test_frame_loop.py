"""The batched frame loop on the tiny model: slots joining and leaving, per-call oracles, underruns,
the forced response delay, and the real-time thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.batch import UNGENERATED, KameBatch
from engine.frame_loop import (
    CATCHUP_AFTER_TICKS,
    CATCHUP_FLOOR_FRAMES,
    CATCHUP_FORCE_AFTER_TICKS,
    FrameLoop,
    SlotOutput,
)
from engine.interface import FRAME_SAMPLES, EngineFull
from engine.oracle_buffer import DraftTokens
from engine.sampling import SamplingConfig

from .phone_fixtures import metric

GREEDY = SamplingConfig(use_sampling=False)


def _loop(bundle, slots: int = 3, **kw) -> FrameLoop:
    return FrameLoop(KameBatch(bundle.lm, bundle.mimi, slots, GREEDY), bundle.tokenizer, **kw)


def _caller_audio(seed: int, frames: int) -> list[np.ndarray]:
    """A different, deterministic 'voice' per call: a few tones plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(frames * FRAME_SAMPLES) / 24_000
    f = rng.uniform(150, 900, size=3)
    x = sum(np.sin(2 * np.pi * fi * t) for fi in f) / 3 + 0.05 * rng.standard_normal(t.shape)
    return [x[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES].astype(np.float32) for i in range(frames)]


class Recorder:
    def __init__(self) -> None:
        self.outputs: list[SlotOutput] = []

    def __call__(self, out: SlotOutput) -> None:
        self.outputs.append(out)


def test_first_frame_of_a_call_is_never_decoded(tiny_bundle) -> None:
    loop = _loop(tiny_bundle)
    rec = Recorder()
    row = loop.join("CA1", rec)
    for frame in _caller_audio(1, 3):
        loop.push_audio(row, "CA1", frame)
        loop.tick()
    first, second = rec.outputs[0], rec.outputs[1]
    assert first.token == UNGENERATED and not first.voiced and not first.pcm.any()
    assert second.voiced and second.pcm.shape == (FRAME_SAMPLES,) and second.pcm.any()


def _script(loop: FrameLoop, events: dict[int, list[tuple]], ticks: int) -> dict[str, Recorder]:
    """Drive the loop tick by tick; events[t] = [("join", call, audio, oracle_text) | ("leave", call)]."""
    rows: dict[str, int] = {}
    recs: dict[str, Recorder] = {}
    feeds: dict[str, list[np.ndarray]] = {}
    for t in range(ticks):
        for ev in events.get(t, []):
            if ev[0] == "join":
                _, call, audio, oracle = ev
                recs[call] = Recorder()
                rows[call] = loop.join(call, recs[call])
                feeds[call] = list(audio)
                loop.set_oracle(rows[call], call, 1, oracle, complete=True)
            else:
                loop.leave(rows[ev[1]], ev[1])
                feeds.pop(ev[1])
        for call, audio in feeds.items():
            if audio:
                loop.push_audio(rows[call], call, audio.pop(0))
        loop.tick()
    return recs


def test_join_and_leave_mid_stream_leave_other_calls_untouched(tiny_bundle, tiny_checkpoint) -> None:
    from engine.checkpoint import load_kame

    n = 14
    x_audio = _caller_audio(7, n)
    # Reference: call X alone in row 0 of a 3-slot engine.
    alone = _script(_loop(tiny_bundle), {0: [("join", "X", x_audio, "What time do you open on Monday?")]}, n)
    # Same call, now joining while Y runs, Y leaving and Z joining in the middle of X's call.
    busy = _loop(load_kame(str(tiny_checkpoint)))
    events = {
        0: [("join", "Y", _caller_audio(8, 30), "Your order shipped yesterday.")],
        3: [("join", "X", x_audio, "What time do you open on Monday?")],
        7: [("leave", "Y")],
        9: [("join", "Z", _caller_audio(9, 30), "Please hold.")],
    }
    recs = _script(busy, events, n + 3)
    ref, got = alone["X"].outputs, recs["X"].outputs
    assert len(got) == n
    # X sat in row 1 this time; its tokens and audio must match the run alone exactly.
    assert [o.token for o in got] == [o.token for o in ref]
    assert [o.oracle_token for o in got] == [o.oracle_token for o in ref]
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a.pcm, b.pcm, rtol=0, atol=1e-6)
    # And Y's run was not disturbed by X joining: compare Y with Y alone.
    y_alone = _script(_loop(load_kame(str(tiny_checkpoint))),
                      {0: [("join", "Y", _caller_audio(8, 30), "Your order shipped yesterday.")]}, 7)
    assert [o.token for o in recs["Y"].outputs] == [o.token for o in y_alone["Y"].outputs]


def test_each_slot_feeds_only_its_own_oracle(tiny_bundle) -> None:
    loop = _loop(tiny_bundle)
    lm, sp = tiny_bundle.lm, tiny_bundle.tokenizer
    seen: list[np.ndarray] = []
    hook = lm.oracle_emb.register_forward_hook(lambda _m, args, _o: seen.append(args[0][:, 0].clone().numpy()))
    a, b = Recorder(), Recorder()
    row_a = loop.join("A", a)
    loop.join("idle", Recorder())
    loop.leave(1, "idle")
    row_c = loop.join("C", b)
    assert (row_a, row_c) == (0, 1)
    toks_a = loop.set_oracle(row_a, "A", 1, "Thank you for calling.", complete=True)
    toks_c = loop.set_oracle(row_c, "C", 1, "Your card is now blocked.", complete=True)
    assert toks_a == sp.encode("Thank you for calling.") and toks_a != toks_c
    ticks = max(len(toks_a), len(toks_c)) + 3
    for _ in range(ticks):
        loop.tick()
    hook.remove()
    fed = np.stack(seen)  # [ticks, B]
    start, pad = lm.oracle_start_token_id, lm.text_padding_token_id
    expect_a = [start, *toks_a] + [pad] * (ticks - len(toks_a) - 1)
    expect_c = [start, *toks_c] + [pad] * (ticks - len(toks_c) - 1)
    assert fed[:, 0].tolist() == expect_a
    assert fed[:, 1].tolist() == expect_c
    assert set(fed[:, 2].tolist()) == {pad}  # the empty slot never sees anyone's oracle
    assert [o.oracle_token for o in a.outputs] == expect_a


def test_newest_candidate_wins_and_growing_draft_continues_without_gaps(tiny_bundle) -> None:
    loop = _loop(tiny_bundle)
    lm, sp = tiny_bundle.lm, tiny_bundle.tokenizer
    start, pad = lm.oracle_start_token_id, lm.text_padding_token_id
    rec = Recorder()
    row = loop.join("A", rec)
    first = sp.encode("The store opens at nine")
    loop.set_oracle(row, "A", 1, "The store", complete=False)
    for _ in range(len(sp.encode("The store")) + 3):  # drains, then pads
        loop.tick()
    loop.set_oracle(row, "A", 1, "The store opens at nine", complete=True)  # same candidate grew
    for _ in range(len(first)):
        loop.tick()
    fed = [o.oracle_token for o in rec.outputs]
    real = [t for t in fed if t != pad]
    assert real == [start, *first]  # one boundary, every token once, in order, none skipped
    loop.set_oracle(row, "A", 2, "Sorry, we open at ten", complete=True)  # a new candidate supersedes
    loop.tick()
    loop.tick()
    assert [o.oracle_token for o in rec.outputs[-2:]] == [start, sp.encode("Sorry, we open at ten")[0]]


def test_late_frames_get_silence_and_count_underruns(tiny_bundle) -> None:
    loop = _loop(tiny_bundle)
    rec = Recorder()
    row = loop.join("A", rec)
    loop.tick()  # caller audio not started yet: not an underrun
    before = metric("kame_engine_underruns_total")
    audio = _caller_audio(3, 8)
    loop.push_audio(row, "A", audio[0])
    loop.tick()
    loop.tick()
    loop.tick()
    assert loop._slots[row].underruns == 2
    assert metric("kame_engine_underruns_total") - before == 2
    over_before = metric("kame_engine_input_overruns_total")
    for frame in audio:  # 8 frames at once: more than the queue bound of 4
        loop.push_audio(row, "A", frame)
    assert loop._slots[row].overruns == 4
    assert metric("kame_engine_input_overruns_total") - over_before == 4


def test_a_standing_input_backlog_is_worked_off_but_the_jitter_cushion_is_kept(tiny_bundle) -> None:
    """After a stall the caller's frames arrive in a burst; one is taken a tick, so without catching up
    the model would hear the caller that much late for the rest of the call."""
    loop = _loop(tiny_bundle, slots=2)
    row = loop.join("A", Recorder())
    slot = loop._slots[row]
    audio = iter(_caller_audio(5, 300))
    before = metric("kame_engine_input_catchups_total")
    loop.push_audio(row, "A", next(audio))
    loop.push_audio(row, "A", next(audio))  # one frame early: the jitter cushion
    for _ in range(3 * CATCHUP_AFTER_TICKS):
        loop.tick()
        loop.push_audio(row, "A", next(audio))
    # A steady single frame left after each take is kept, never dropped.
    assert slot.catchups == 0 and loop.stats.input_backlog == 1 == metric("kame_engine_input_backlog_frames")

    loop.push_audio(row, "A", next(audio))  # a stall's burst: two frames more, 4 queued (the bound)
    loop.push_audio(row, "A", next(audio))
    ticks = 0
    while slot.catchups < 2:
        loop.tick()
        ticks += 1
        if slot.catchups == 1 and ticks == CATCHUP_AFTER_TICKS:
            assert all(float(np.abs(f).max()) > 1e-3 for f in slot.inbox)  # the pause went, no word did
        if slot.standing_backlog == CATCHUP_AFTER_TICKS - 1 and slot.catchups == 0:
            loop.push_audio(row, "A", np.full(FRAME_SAMPLES, 1e-4, dtype=np.float32))  # a pause between words
        else:
            loop.push_audio(row, "A", next(audio))
        assert ticks <= CATCHUP_AFTER_TICKS + CATCHUP_FORCE_AFTER_TICKS + 2
    # The pause went after a second; then, the caller talking on with no pause, a word's frame only after
    # the backlog had stood ~5 s (no speech is dropped while a pause may yet come).
    assert ticks == CATCHUP_AFTER_TICKS + CATCHUP_FORCE_AFTER_TICKS
    # Worked down to the cushion, and no further.
    for _ in range(2 * CATCHUP_AFTER_TICKS):
        loop.tick()
        loop.push_audio(row, "A", next(audio))
    assert slot.catchups == 2 and loop.stats.catchups == 2 and slot.overruns == 0
    assert metric("kame_engine_input_catchups_total") - before == 2
    assert metric("kame_engine_input_backlog_frames") == loop.stats.input_backlog == 1


def test_a_soft_spoken_callers_words_are_not_taken_for_pauses(tiny_bundle) -> None:
    """A caller talking softly (about -30 dBFS, a quiet voice or a far-off handset) behind a stall's backlog
    before their line's floor is known (the call's first ~6 s): their frames are words, so none goes before the
    backlog has stood the forced ~5 s. (Later, a line that never falls quieter than this sets its own floor.)"""
    loop = _loop(tiny_bundle, slots=1)
    row = loop.join("A", Recorder())
    slot = loop._slots[row]
    audio = iter(0.08 * f for f in _caller_audio(7, 100))
    assert -33 < 10 * np.log10(float(np.square(next(audio)).mean())) < -27
    for _ in range(4):  # the burst: the inbox at its bound
        loop.push_audio(row, "A", next(audio))
    for _ in range(CATCHUP_FORCE_AFTER_TICKS - 2):
        loop.tick()
        loop.push_audio(row, "A", next(audio))
    assert slot.standing_backlog > CATCHUP_AFTER_TICKS and slot.catchups == 0


def _noisy_caller(seed: int, frames: int) -> list[tuple[np.ndarray, bool]]:
    """(frame, is_pause): a line with white noise at -35 dBFS under it (a speakerphone, a street), and words
    at -15 dBFS over it: eight frames talking, three pausing, over and over."""
    rng = np.random.default_rng(seed)
    t = np.arange(FRAME_SAMPLES) / 24_000
    out = []
    for i in range(frames):
        noise = 10 ** (-35 / 20) * rng.standard_normal(FRAME_SAMPLES)
        pause = i % 11 >= 8
        word = 0.0 if pause else 0.25 * np.sin(2 * np.pi * (220 + 20 * (i % 11)) * t)
        out.append(((noise + word).astype(np.float32), pause))
    return out


def test_on_a_noisy_line_the_catch_up_finds_the_callers_pauses(tiny_bundle) -> None:
    """A pause on a noisy line is as loud as the noise (-35 dBFS here, above the -40 dBFS that is quiet on a
    clean one): the catch-up takes it relative to the caller's own noise floor, within a few seconds, and
    no word's frame; without that it waited ~5 s for the forced drop and then took a word."""
    loop = _loop(tiny_bundle, slots=2)
    row = loop.join("A", Recorder())
    slot = loop._slots[row]
    audio = iter(_noisy_caller(7, 400))
    pauses = set()

    def push() -> None:
        frame, pause = next(audio)
        if pause:
            pauses.add(id(frame))
        loop.push_audio(row, "A", frame)

    push()
    push()  # the jitter cushion
    for _ in range(CATCHUP_FLOOR_FRAMES + 10):  # the caller talks a while: its noise floor is heard
        loop.tick()
        push()
    assert slot.catchups == 0 and loop.stats.input_backlog == 1
    push()  # a stall's burst: two frames more, 4 queued (the bound)
    push()
    taken = []
    ticks = 0
    while slot.catchups < 2 and ticks < CATCHUP_FORCE_AFTER_TICKS:
        queued = list(slot.inbox)
        loop.tick()
        ticks += 1
        left = {id(f) for f in slot.inbox}
        taken += [id(f) for f in queued[1:] if id(f) not in left]  # the head is the tick's own frame
        push()
    # Both frames over the cushion went within ~3 s (each after the backlog stood CATCHUP_AFTER_TICKS), and
    # both were the caller's pauses: no word was cut.
    assert slot.catchups == 2 and ticks <= 3 * CATCHUP_AFTER_TICKS
    assert len(taken) == 2 and all(f in pauses for f in taken)
    for _ in range(CATCHUP_AFTER_TICKS):
        loop.tick()
        push()
    assert loop.stats.input_backlog == 1 and slot.catchups == 2


def test_capacity_and_bad_frames(tiny_bundle) -> None:
    loop = _loop(tiny_bundle, slots=2)
    loop.join("A", Recorder())
    loop.join("B", Recorder())
    with pytest.raises(EngineFull):
        loop.join("C", Recorder())
    with pytest.raises(ValueError, match="1920"):
        loop.push_audio(0, "A", np.zeros(100, dtype=np.float32))
    loop.leave(0, "A")
    assert loop.free_slots == 1
    loop.push_audio(0, "A", np.zeros(FRAME_SAMPLES, dtype=np.float32))  # after leave: ignored


def test_a_callers_bad_samples_never_reach_the_next_call_on_the_seat(tiny_bundle) -> None:
    """NaN, inf or huge samples from one call went into the Mimi encoder's attention cache, which a row's reset
    does not clear: the next caller on that seat was not heard for up to 10 s (review, session 26). They are
    silenced and clipped on the way in; integer samples (32767x too loud) are refused."""

    def next_call_on_the_seat(bad) -> list[SlotOutput]:  # type: ignore[no-untyped-def]
        loop = _loop(tiny_bundle, slots=1)
        row = loop.join("A", Recorder())
        for t, frame in enumerate(_caller_audio(5, 10)):
            loop.push_audio(row, "A", bad(frame) if bad is not None and t >= 3 else frame)
            loop.safe_tick()
        loop.leave(row, "A")
        rec = Recorder()
        row = loop.join("C", rec)
        for frame in _caller_audio(9, 25):
            loop.push_audio(row, "C", frame)
            assert loop.safe_tick()
        loop.batch.close()
        return rec.outputs

    clean = next_call_on_the_seat(None)
    for name, bad in (("nan", lambda f: np.full_like(f, np.nan)), ("inf", lambda f: np.full_like(f, np.inf)),
                      ("huge", lambda f: np.full_like(f, 1e30))):  # fmt: skip
        after = next_call_on_the_seat(bad)
        assert [o.token for o in after] == [o.token for o in clean], name
        assert all(np.array_equal(x.pcm, y.pcm) for x, y in zip(after, clean, strict=True)), name
    loop = _loop(tiny_bundle, slots=1)
    row = loop.join("A", Recorder())
    with pytest.raises(ValueError, match="float samples"):
        loop.push_audio(row, "A", (_caller_audio(5, 1)[0] * 32767).astype(np.int16))
    loop.batch.close()


def test_forced_response_delay_holds_silence_and_padding(tiny_bundle) -> None:
    loop = _loop(tiny_bundle, forced_delay_ms=240)  # 3 frames
    lm = tiny_bundle.lm
    start, pad = lm.oracle_start_token_id, lm.text_padding_token_id
    rec = Recorder()
    row = loop.join("A", rec)
    loop.caller_turn(row, "A", True)
    toks = loop.set_oracle(row, "A", 1, "We open at nine", complete=True)
    for _ in range(4):
        loop.tick()
    loop.caller_turn(row, "A", False)  # the caller's turn ends here
    for _ in range(3 + 2):
        loop.tick()
    held = [o.held for o in rec.outputs]
    assert held == [True] * 7 + [False] * 2
    assert all(not o.voiced and not o.pcm.any() and o.piece == "" for o in rec.outputs[:7])
    assert [o.oracle_token for o in rec.outputs] == [pad] * 7 + [start, toks[0]]
    assert rec.outputs[8].voiced


def test_no_forced_delay_by_default(tiny_bundle) -> None:
    loop = _loop(tiny_bundle)
    rec = Recorder()
    row = loop.join("A", rec)
    loop.caller_turn(row, "A", True)
    loop.set_oracle(row, "A", 1, "Hello", complete=True)
    loop.tick()
    loop.tick()
    assert not any(o.held for o in rec.outputs)
    assert rec.outputs[0].oracle_token == tiny_bundle.lm.oracle_start_token_id


def test_real_time_thread_streams_and_reports_ticks(tiny_bundle) -> None:
    loop = _loop(tiny_bundle)
    got = threading.Event()
    outs: list[SlotOutput] = []

    def sink(out: SlotOutput) -> None:
        outs.append(out)
        if len(outs) >= 10:
            got.set()

    ticks_before = metric("kame_engine_tick_seconds_count")
    loop.start(warmup_ticks=2)
    try:
        row = loop.join("A", sink)
        for frame in _caller_audio(5, 12):
            loop.push_audio(row, "A", frame)
            time.sleep(0.08)
            if got.is_set():
                break
        assert got.wait(10)
    finally:
        loop.stop()
    assert [o.index for o in outs[:10]] == list(range(10))
    assert loop.stats.ticks >= 10
    assert metric("kame_engine_tick_seconds_count") - ticks_before >= 10
    assert metric("kame_engine_slots_busy") == 1


def test_oracle_lag_is_measured_when_the_boundary_token_is_fed(tiny_bundle) -> None:
    loop = _loop(tiny_bundle)
    row = loop.join("A", Recorder())
    before = metric("kame_oracle_lag_seconds_count")
    waits_before = metric("kame_oracle_slot_wait_seconds_count")
    queued = loop.clock()
    loop.set_oracle(row, "A", 7, "Hello", triggered_at=queued - 0.5, complete=True)
    time.sleep(0.05)  # the candidate waits in its slot for the next tick
    loop.tick()
    loop.tick()  # the second token of the same candidate is not a new lag sample
    assert metric("kame_oracle_lag_seconds_count") == before + 1
    assert metric("kame_oracle_slot_wait_seconds_count") == waits_before + 1
    ((call, cid, fed_at, lag, wait),) = list(loop.oracle_fed)
    assert (call, cid) == ("A", 7) and 0.5 <= lag < 5.0
    assert 0.05 <= wait <= fed_at - queued and wait < lag  # the slot's share: from arrival to the feeding tick


def test_a_failing_tick_resets_every_slot_and_the_loop_goes_on(tiny_bundle) -> None:
    loop = _loop(tiny_bundle)
    resets: list[str] = []
    a, b = Recorder(), Recorder()
    row_a = loop.join("A", a, on_reset=lambda: resets.append("A"))
    loop.join("B", b, on_reset=lambda: resets.append("B"))
    for _ in range(3):
        assert loop.safe_tick()
    # A token outside the oracle vocabulary (a tokenizer that does not match the model) makes the
    # real embedding lookup fail inside the batched step.
    loop._slots[row_a].oracle.set_candidate(99, DraftTokens([10**6], settled=1))
    assert loop.safe_tick()  # the candidate's boundary token
    assert not loop.safe_tick()
    assert sorted(resets) == ["A", "B"]
    assert loop.safe_tick()  # the next tick runs, every row restarted from a clean state
    assert not a.outputs[-1].voiced and not b.outputs[-1].voiced  # a reset row's first frame
    assert loop.safe_tick() and a.outputs[-1].voiced


def test_a_failing_tick_leaves_a_call_that_joined_during_it_alone(tiny_bundle, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A call seated while a tick runs (its greeting set at once) was not in that tick: when the tick failed,
    its greeting was cleared with the stepped calls' oracles, and it was told of a reset it never had."""
    loop = _loop(tiny_bundle)
    resets: list[str] = []
    row_a = loop.join("A", Recorder(), on_reset=lambda: resets.append("A"))
    assert loop.safe_tick()
    loop._slots[row_a].oracle.set_candidate(99, DraftTokens([10**6], settled=1))  # the step fails on it
    assert loop.safe_tick()  # its boundary token
    joined: dict[str, int] = {}
    real_step = loop.batch.step

    def step_while_b_joins(*args, **kwargs):  # type: ignore[no-untyped-def]
        # The asyncio thread seats B meanwhile, and B's back-end sets its greeting at once.
        joined["B"] = loop.join("B", Recorder(), on_reset=lambda: resets.append("B"))
        loop.set_oracle(joined["B"], "B", 1, "Hello, thanks for calling!", complete=True)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop.batch, "step", step_while_b_joins)
    assert not loop.safe_tick()
    assert resets == ["A"]
    assert loop._slots[joined["B"]].oracle.candidate_id == 1  # its greeting is still to be said
    assert loop._slots[row_a].oracle.candidate_id != 99


def test_the_tick_sink_gets_every_slot_at_once_and_fresh_marks_restarts(tiny_bundle) -> None:
    ticks: list[list[tuple[str, SlotOutput]]] = []
    ended: list[float] = []

    def on_tick(delivered: list[tuple[str, SlotOutput]], ended_at: float) -> None:
        ticks.append(delivered)
        ended.append(ended_at)

    loop = _loop(tiny_bundle, on_tick=on_tick)
    row_a = loop.join("A", None)  # no per-slot sink: the tick sink takes it
    before = time.monotonic()
    loop.tick()
    loop.join("B", None)
    loop.tick()
    assert [[(c, o.fresh) for c, o in t] for t in ticks] == [[("A", True)], [("A", False), ("B", True)]]
    assert before < ended[0] < ended[1] <= time.monotonic()  # each tick's end, on the machine's one clock
    loop._slots[row_a].oracle.set_candidate(99, DraftTokens([10**6], settled=1))  # as above: the step fails on it
    assert loop.safe_tick()
    assert not loop.safe_tick()
    assert loop.safe_tick()
    assert [(c, o.fresh) for c, o in ticks[-1]] == [("A", True), ("B", True)]  # both restarted
    assert loop.safe_tick()
    assert [(c, o.fresh) for c, o in ticks[-1]] == [("A", False), ("B", False)]


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds a thread of this process has used (Linux /proc; utime + stime in clock ticks)."""
    import os

    fields = open(f"/proc/self/task/{native_id}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_engine_runs_no_model_step(tiny_bundle) -> None:
    """With nobody seated the loop keeps its clock but steps no model (it took ~45 % of a core)."""
    loop = _loop(tiny_bundle, slots=8)
    loop.start(warmup_ticks=1)
    try:
        thread = loop._ticker._thread
        assert thread is not None and thread.native_id is not None
        ticks, cpu = metric("kame_engine_tick_seconds_count"), _thread_cpu_s(thread.native_id)
        time.sleep(2.0)  # 25 frames
        idle_cpu = _thread_cpu_s(thread.native_id) - cpu
        assert metric("kame_engine_tick_seconds_count") == ticks and loop.stats.ticks == 0
        assert idle_cpu < 0.1  # < 5 % of a core (a tiny batch-8 step alone is ~20 ms of every 80)
        row = loop.join("A", None)  # and a call that comes is served at once
        deadline = time.monotonic() + 5
        while loop.stats.ticks < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert loop.stats.ticks >= 3
        loop.leave(row, "A")
    finally:
        loop.stop()


def test_a_call_can_have_its_own_forced_delay(tiny_bundle) -> None:
    """An agent's forced_delay_ms (CallSetup) holds its own call only; the others keep the loop's (none)."""
    loop = _loop(tiny_bundle)
    delayed, plain = Recorder(), Recorder()
    a = loop.join("A", delayed, forced_delay_ms=240)  # 3 frames
    b = loop.join("B", plain)
    for row, call in ((a, "A"), (b, "B")):
        loop.caller_turn(row, call, True)
        loop.set_oracle(row, call, 1, "Hello", complete=True)
        loop.caller_turn(row, call, False)
    for _ in range(4):
        loop.tick()
    assert [o.held for o in delayed.outputs] == [True] * 3 + [False]
    assert not any(o.held for o in plain.outputs)


@pytest.mark.parametrize("how", ["stop", "abort"])
def test_a_loop_stopped_while_warming_up_never_starts_ticking(tiny_bundle, how: str) -> None:
    """A SIGTERM during the warm-up (minutes under --compile) stops the in-process loop before it ticks; the
    warm-up then ended and started the ticker anyway, ticking a stopped engine with no one left to stop it.
    Now the start gives up (EngineError, at the next warm-up tick for an abort) and no tick follows."""
    from engine.interface import EngineError

    loop = _loop(tiny_bundle, slots=2)
    ticks = 0
    step = loop.batch.step

    def counted_step(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        nonlocal ticks
        ticks += 1
        time.sleep(0.02)  # a slow warm-up tick: the stop lands inside the warm-up
        return step(*args, **kw)

    loop.batch.step = counted_step  # type: ignore[method-assign]
    failed: list[BaseException] = []

    def start() -> None:
        try:
            loop.start(warmup_ticks=100)
        except EngineError as e:
            failed.append(e)

    starting = threading.Thread(target=start)
    starting.start()
    while ticks < 3:
        time.sleep(0.005)
    (loop.stop if how == "stop" else loop.abort_start)()
    starting.join(10)
    assert not starting.is_alive() and failed, "the start went on"
    if how == "abort":
        assert ticks < 100  # gave up at the next tick, not after the whole warm-up
    after = ticks
    time.sleep(0.3)  # ~4 frames: a ticker started would have stepped
    assert ticks == after and not loop._ticker.running
    loop.stop()
