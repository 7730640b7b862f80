"""`kame-phone eval` (issue 14): the real command dials the tiny model over the phone path, flite speaks the
questions, pocketsphinx transcribes the replies, a local OpenAI-compatible judge grades them; the report,
the plots, the audio and `eval compare` are checked. Plus the pieces: questions, judge, the line's timeline,
the OpenAI speech/transcription clients, usage errors."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from evaluation.compare import compare
from evaluation.judge import Judge, parse_rating
from evaluation.line_caller import answer_latency, speech_spans, talk_after_barge_in, took_turn_in_pause
from evaluation.questions import Question, QuestionError, load_file, load_suite, narrow
from evaluation.report import Result, build_report
from evaluation.transcribe import OpenAITranscriber, PocketsphinxTranscriber
from evaluation.voices import OpenAIVoice

from .eval_servers import serve_fake_judge
from .llm_server import serve_fake_llm
from .phone_fixtures import running_phone

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    {"question_id": 1, "category": "reasoning", "reference": ["At two in the afternoon."],
     "turns": ["If a train leaves at noon and travels for two hours, when does it arrive?", "And back?"]},
    {"question_id": 2, "category": "stem", "turns": ["What is the boiling point of water at sea level, in degrees?"]},
    {"question_id": 3, "category": "humanities",
     "turns": ["Who wrote the play Romeo and Juliet, and when was it written?"]},
]


def _write_questions(path: Path, rows: list[dict] = QUESTIONS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def _kame(args: list[str], env: dict[str, str], limit_s: float = 280) -> tuple[int, str, str]:
    """The real `kame-phone` in its own process, while this loop serves the stand-ins."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TWILIO_", "PUBLIC_URL", "OPENAI_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kame_phone.cli", *args, cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT), **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _short_listening() -> list[str]:
    return ["--lead-in-s", "0.5", "--quiet-s", "1", "--no-answer-s", "3", "--max-reply-s", "4"]


@pytest.mark.slow
async def test_eval_sweeps_delays_on_the_tiny_model_and_reports(tiny_checkpoint: Path, tmp_path: Path) -> None:
    questions = _write_questions(tmp_path / "q.jsonl")
    out = tmp_path / "run"
    async with serve_fake_llm() as llm, serve_fake_judge(no_rating_first=("train",), always_fail=("Romeo",)) as judge:
        rc, stdout, stderr = await _kame([
            "eval", "--checkpoint", str(tiny_checkpoint), "--questions", str(questions), "--judge-model", "judge-1",
            "--judge-base-url", judge.base_url, "--forced-delay-ms", "0,500", "--concurrency", "3", "--probes", "1",
            "--serve-arg=--max-calls=2",  # 3 calls at once on 2 seats: one is answered busy, and dialled again
            "--out", str(out), *_short_listening(),
        ], {"OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": "none"})  # fmt: skip
    assert rc == 0, stderr[-3000:]
    assert "eval calls" in stderr and "mean score 7.00" in stderr  # the progress bar and its running mean
    report = json.loads((out / "report.json").read_text())

    # One result per question and delay, each a completed call with its figures.
    results = report["results"]
    assert sorted((r["forced_delay_ms"], r["question_id"]) for r in results) == [
        (d, q) for d in (0.0, 500.0) for q in ("1", "2", "3")
    ]
    for r in results:
        required = {"question_id", "category", "question", "transcript", "score", "latency_s", "judge_explanation"}
        assert required <= set(r)
        assert r["outcome"] == "completed" and r["first_audio_s"] is not None and r["reply_s"] > 0
        brief = {k: r[k] for k in ("forced_delay_ms", "question_id", "outcome", "reply_s", "errors", "transcript")}
        assert r["hung_up_because"] in ("quiet", "no_answer", "max_reply"), brief
        assert r["latency_s"] is None or -30 < r["latency_s"] < 10
        with wave.open(str(out / r["reply_wav"])) as w:  # the whole call as heard, 8 kHz
            assert w.getframerate() == 8000 and w.getnframes() > 8000 * 2
        assert (out / r["question_wav"]).is_file()
    by_q = {(r["forced_delay_ms"], r["question_id"]): r for r in results}
    # The judge answered without a rating once for q1: retried, then rated. q3's judge always failed:
    # its score is missing, not zero, and the failure is kept.
    assert by_q[(0.0, "1")]["score"] == 7.0 and "Rating: [[7]]" in by_q[(0.0, "1")]["judge_explanation"]
    assert by_q[(0.0, "3")]["score"] is None and "judge overloaded" in by_q[(0.0, "3")]["judge_error"]
    prompts = [m["messages"][-1]["content"] for m in judge.requests]
    ref_prompts = [p for p in prompts if "train leaves at noon" in p]
    assert len(ref_prompts) == 3  # q1 once per delay, plus the retry: graded against its reference answer
    assert all("[The Start of Reference Answer]\nAt two in the afternoon." in p for p in ref_prompts)
    assert all(m["model"] == "judge-1" and m["temperature"] == 0 for m in judge.requests)
    assert llm.requests, "the service's back-end never asked its LLM: the knowledge path did not run"

    # Summary: per delay, all and per category; a missing score counts as missing.
    blocks = report["summary"]["by_delay"]
    assert [b["forced_delay_ms"] for b in blocks] == [0.0, 500.0]
    for b in blocks:
        assert set(b["categories"]) == {"reasoning", "stem", "humanities"}
        assert b["all"]["questions"] == 3 and b["all"]["scored"] == 2 and b["all"]["missing_scores"] == 1
        assert b["all"]["mean_score"] == 7.0
        assert b["interaction"]["probes"] == 1
    probes = report["probes"]
    assert len(probes) == 2 and all(isinstance(p["took_turn_in_pause"], bool) for p in probes), probes
    # Busy answers were dialled again until they got through: every call above completed, and each delay's
    # run counted its redials (at least the one call that found both seats taken).
    for b in blocks:
        assert b["interaction"]["completed_calls"] == 1
        assert b["all"]["busy_redials"] + b["interaction"]["busy_redials"] >= 1, b
    assert all((out / p["call_wav"]).is_file() for p in probes)
    assert report["random_weights"] is True and "random weights" in report["notes"][0]
    assert report["settings"]["forced_delays_ms"] == [0.0, 500.0]

    md = (out / "report.md").read_text()
    assert "random weights" in md and "| 0 ms | **all** | 3 | 2 | 7.00 |" in md and "| 500 ms | stem |" in md
    assert "The line answered busy" in md
    for png in ("score_vs_latency.png", "latency_histogram.png", "category_scores.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"]({png})" in md
    assert "mean score 7.00 (2/3 scored)" in stdout

    # compare: the same run against itself changes nothing, and 2 scores a side are too few to tell.
    rc, text, err = await _kame(["eval", "compare", str(out), str(out / "report.json")], {})
    assert rc == 0, err
    assert "forced delay 0 ms" in text and "score 7.00 -> 7.00 (+0.00; too few to tell (n=2 vs 2" in text


async def test_eval_over_url_signs_like_twilio_and_a_wrong_token_is_refused(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    questions = _write_questions(tmp_path / "q.jsonl", QUESTIONS[1:2])
    async with running_phone(tiny_checkpoint) as phone, serve_fake_judge() as judge:
        base = phone.handle.http_url
        args = ["eval", "--url", base, "--questions", str(questions), "--judge-base-url", judge.base_url,
                "--probes", "0", "--no-progress", *_short_listening()]
        rc, out, err = await _kame([*args, "--out", str(tmp_path / "good")],
                                   {"TWILIO_AUTH_TOKEN": phone.token, "PUBLIC_URL": base})
        assert rc == 0, err[-2000:]
        [r] = json.loads((tmp_path / "good" / "report.json").read_text())["results"]
        assert r["outcome"] == "completed" and r["forced_delay_ms"] == -1.0  # the service's own delay
        await phone.store.flush()
        assert (await phone.store.get(r["call_sid"])) is not None  # the service took the call
        report = json.loads((tmp_path / "good" / "report.json").read_text())
        assert report["target"] == {"url": base} and report["random_weights"] is False

        # A wrong token: the service refuses the webhook (403), as it would a forger; every call failed.
        rc, out, err = await _kame([*args, "--out", str(tmp_path / "bad")],
                                   {"TWILIO_AUTH_TOKEN": "0" * 32, "PUBLIC_URL": base})
        assert rc == 1
        [r] = json.loads((tmp_path / "bad" / "report.json").read_text())["results"]
        assert r["outcome"] == "rejected" and r["score"] is None
        assert phone.token not in out + err


async def test_usage_errors_are_one_line(tmp_path: Path) -> None:
    questions = _write_questions(tmp_path / "q.jsonl")
    url = "https://a.example"
    cases = [
        (["--checkpoint", "x", "--url", url, "--questions", str(questions)], "one of --checkpoint"),
        (["--url", url, "--questions", str(questions), "--forced-delay-ms", "0,500"], "need --checkpoint"),
        (["--checkpoint", "x", "--questions", str(questions), "--forced-delay-ms", "fast"], "comma-separated"),
        (["--checkpoint", "x"], "--questions FILE or --suite"),
        (["--checkpoint", "x", "--questions", str(questions), "--categories", "math"], "no question in categories"),
        (["--checkpoint", "x", "--questions", str(questions), "--busy-redials", "-1"], "--busy-redials at least 0"),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "x", "turns": ["ok?"]}\n{"question_id": 2, "turns": []}\n')
    cases.append((["--checkpoint", "x", "--questions", str(bad)], "line 2: 'turns' must be a list"))
    for args, message in cases:
        rc, out, err = await _kame(["eval", *args], {})
        assert rc == 2 and message in err and "Traceback" not in err, (args, err)
    rc, out, err = await _kame(["eval", "compare", str(tmp_path), str(tmp_path)], {})
    assert rc == 2 and "cannot read" in err


# ---------------------------------------------------------------------------------------------------------
# The pieces


def test_questions_file_and_the_papers_suite(tmp_path: Path) -> None:
    qs = load_file(_write_questions(tmp_path / "q.jsonl"))
    assert [q.question_id for q in qs] == ["1", "2", "3"]
    assert qs[0].text.startswith("If a train") and qs[0].reference == "At two in the afternoon."
    assert qs[1].reference is None
    assert [q.question_id for q in narrow(qs, ["STEM", "humanities"], 1)] == ["2"]
    (tmp_path / "dup.jsonl").write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 1, "turns": ["b"]}\n')
    with pytest.raises(QuestionError, match="line 2: question_id 1 appears twice"):
        load_file(tmp_path / "dup.jsonl")
    (tmp_path / "junk.jsonl").write_text("not json\n")
    with pytest.raises(QuestionError, match="line 1: not JSON"):
        load_file(tmp_path / "junk.jsonl")

    suite = load_suite("mt-bench-speech")  # MT-Bench's questions from the installed data package
    assert len(suite) == 30
    assert {q.category for q in suite} == {"reasoning", "stem", "humanities"}
    assert sum(q.category == "reasoning" for q in suite) == 10
    assert all(q.reference for q in suite if q.category == "reasoning")
    assert "overtaken the second person" in suite[0].text and suite[0].reference == "You are in second place."


def test_rating_parse() -> None:
    assert parse_rating("Good. Rating: [[8]]") == 8.0
    assert parse_rating("Rating: [[8.5]] and [[2]]") == 8.5
    assert parse_rating("Rating: [6]") == 6.0  # single brackets, as FastChat accepts
    assert parse_rating("Rating: [[11]]") is None and parse_rating("Rating: [[0]]") is None
    assert parse_rating("no rating here") is None


async def test_judge_retries_then_records_a_missing_score() -> None:
    q = Question("7", "stem", "What is the speed of light?", None)
    async with serve_fake_judge(rating=9, no_rating_first=("light",)) as fake:
        judge = Judge("j", fake.base_url, "k", attempts=3, backoff_s=0.01)
        verdict = await judge.grade(q, "About three hundred thousand kilometres a second.")
        assert (verdict.score, verdict.attempts, verdict.error) == (9.0, 2, None)
        prompt = fake.requests[0]["messages"][-1]["content"]
        assert "[Question]\nWhat is the speed of light?" in prompt and "three hundred thousand" in prompt
        assert "[[rating]]" in prompt and "Reference Answer" not in prompt
        await judge.aclose()
    async with serve_fake_judge(always_fail=("light",)) as fake:
        judge = Judge("j", fake.base_url, "k", attempts=2, backoff_s=0.01)
        verdict = await judge.grade(q, "hm")
        assert verdict.score is None and verdict.attempts == 2 and "judge overloaded" in (verdict.error or "")
        await judge.aclose()


def _tone(seconds: float, spans: list[tuple[float, float]]) -> np.ndarray:
    pcm = np.zeros(int(seconds * 8000), dtype=np.int16)
    for a, b in spans:
        t = np.arange(int(a * 8000), int(b * 8000))
        pcm[t] = (8000 * np.sin(2 * np.pi * 440 * t / 8000)).astype(np.int16)
    return pcm


def test_the_lines_timeline() -> None:
    heard = _tone(8.0, [(1.0, 2.0), (2.2, 2.6), (4.0, 6.0)])
    spans = speech_spans(heard)  # 2.0-2.2 is a pause between words: bridged
    assert [(round(s.start_s, 2), round(s.end_s, 2)) for s in spans] == [(1.0, 2.6), (4.0, 6.0)]
    assert answer_latency(spans, 3.0) == pytest.approx(1.0)  # answered a second after the question ended
    assert answer_latency(spans, 2.0) == pytest.approx(-1.0)  # already talking when it ended
    assert answer_latency(spans, 6.5) is None
    assert took_turn_in_pause(spans, 3.0, 4.5) is True and took_turn_in_pause(spans, 2.7, 3.9) is False
    assert talk_after_barge_in(spans, 5.0, 8.0) == (pytest.approx(1.0), True)
    assert talk_after_barge_in(spans, 3.0, 8.0) == (0.0, True)
    assert talk_after_barge_in(speech_spans(_tone(3.0, [(0.5, 3.0)])), 1.0, 3.0)[1] is False  # never stopped


def test_pocketsphinx_transcribes_a_reply_with_word_times(question_wav: Path) -> None:
    from telephony.sim_playout import read_wav, to_line_rate

    audio, rate = read_wav(question_wav)
    pcm = (to_line_rate(audio, rate) * 32767).astype(np.int16)
    silent = np.concatenate([np.zeros(8000, dtype=np.int16), pcm])  # a second of silence first
    t = PocketsphinxTranscriber().transcribe(silent)
    assert len(t.text.split()) >= 3 and t.first_word_s is not None and 0.8 < t.first_word_s < 2.0


async def test_transcribing_a_long_reply_leaves_the_calls_in_flight_running(question_wav: Path) -> None:
    """eval transcribes a finished call while others still stream from the same event loop: pocketsphinx holds
    the GIL for each of its calls, so one call over a whole reply froze the loop for as long as it decoded
    (20-30 s for a 30 s reply on 2 cores) and the service ended the calls in flight as silent sockets."""
    from telephony.sim_playout import read_wav, to_line_rate

    audio, rate = read_wav(question_wav)
    pcm = (to_line_rate(audio, rate) * 32767).astype(np.int16)
    reply = np.tile(np.concatenate([pcm, np.zeros(4000, dtype=np.int16)]), 8)  # ~30 s of speech
    transcriber = PocketsphinxTranscriber()
    await asyncio.to_thread(transcriber.transcribe, pcm[:8000])  # its decoder made, as after the first call
    gaps: list[float] = []

    async def heartbeat() -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.02)
            gaps.append(loop.time() - last - 0.02)
            last = loop.time()

    beat = asyncio.create_task(heartbeat())
    started = asyncio.get_running_loop().time()
    t = await asyncio.to_thread(transcriber.transcribe, reply)
    took = asyncio.get_running_loop().time() - started
    beat.cancel()
    assert len(t.text.split()) >= 20  # it did transcribe the reply
    # A caller stalled this long misses its 20 ms packets but is not cut off (the service allows 10 s).
    assert max(gaps) < min(2.5, 0.5 * took), (max(gaps), took)


async def test_openai_speech_and_transcription_clients() -> None:
    async with serve_fake_judge() as fake:
        audio, rate = await asyncio.to_thread(
            OpenAIVoice(fake.base_url, "k", "tts-1", "nova").speak, "Hello, what time is it?")
        assert rate == 16000 and len(audio) > rate  # the stand-in speaks with flite, as a WAV
        assert fake.speech_requests[0] | {} == {"model": "tts-1", "voice": "nova", "input": "Hello, what time is it?",
                                                "response_format": "wav"}
        t = await asyncio.to_thread(OpenAITranscriber(fake.base_url, "k").transcribe, np.zeros(16000, np.int16))
        assert t.text == "hello there friend" and t.first_word_s == 0.5 and fake.transcription_requests == 1


def _results(delay: float, scores: list[float], latency: float) -> list[Result]:
    return [Result(str(i), "stem", "q", delay, outcome="completed", score=s, latency_s=latency + 0.01 * i)
            for i, s in enumerate(scores)]


def test_compare_says_when_a_change_is_real(tmp_path: Path) -> None:
    def write(name: str, results: list[Result]) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(build_report(results, [], target={"url": "x"}, settings={}, random_weights=False)))
        return path

    a = write("a", _results(0.0, [3, 3, 4, 3, 4, 3], 0.2))
    b = write("b", _results(0.0, [8, 9, 8, 9, 8, 9], 1.2))
    text = compare(a, b)
    assert "score 3.33 -> 8.50 (+5.17; p=0.000)" in text and "median latency 0.23 s -> 1.23 s (+1.00 s; p=0.00" in text
    small = write("s", _results(0.0, [9, 9], 1.0))
    assert "too few to tell (n=6 vs 2" in compare(a, small)
