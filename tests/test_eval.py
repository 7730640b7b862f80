"""`kame-phone eval` (issue 14): the real command dials the tiny model over the phone path, flite speaks the
questions, pocketsphinx transcribes the replies, a local OpenAI-compatible judge grades them; the report,
the plots, the audio and `eval compare` are checked. Plus the pieces: questions, judge, the line's timeline,
the OpenAI speech/transcription clients, usage errors."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from evaluation.compare import compare
from evaluation.judge import NO_RATING, NOT_A_COMPLETION, Judge, parse_rating
from evaluation.line_caller import (
    AskAndListen,
    Listening,
    answer_latency,
    speech_spans,
    talk_after_barge_in,
    took_turn_in_pause,
)
from evaluation.questions import Question, QuestionError, load_file, load_suite, narrow
from evaluation.report import Result, build_report
from evaluation.runner import EvalPlan, Target, file_stems, run_eval
from evaluation.transcribe import AsrError, OpenAITranscriber, PocketsphinxTranscriber
from evaluation.voices import FliteVoice, OpenAIVoice, VoiceError
from kame_phone.throwaway_env import DEPLOYMENT_VARIABLES, throwaway_env
from telephony import sim_playout as sp

from .eval_servers import FakeJudge, FakeLine, serve_fake_judge, serve_fake_line, silence, tone
from .llm_server import serve_fake_llm
from .phone_fixtures import running_phone
from .polling import until
from .redis_support import REDIS_URL

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
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    finally:
        if proc.returncode is None:  # timed out (or the test was cancelled): no command outlives its test
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_a_throwaway_service_gets_the_operators_settings_but_none_of_the_deployments() -> None:
    base = {name: "prod" for name in DEPLOYMENT_VARIABLES} | {"OPENAI_BASE_URL": "http://llm", "KAME_STT": "kyutai"}
    env = throwaway_env(base, PUBLIC_URL="http://127.0.0.1:9")
    assert env == {"OPENAI_BASE_URL": "http://llm", "KAME_STT": "kyutai", "KAME_ENV_FILE": "",
                   "PUBLIC_URL": "http://127.0.0.1:9"}  # fmt: skip


def _short_listening() -> list[str]:
    return ["--lead-in-s", "0.5", "--quiet-s", "1", "--no-answer-s", "3", "--max-reply-s", "4"]


@pytest.mark.slow
async def test_eval_sweeps_delays_on_the_tiny_model_and_reports(tiny_checkpoint: Path, tmp_path: Path) -> None:
    questions = _write_questions(tmp_path / "q.jsonl")
    out = tmp_path / "run"
    prefix = f"evaltest:{uuid.uuid4().hex[:8]}:"
    async with serve_fake_llm() as llm, serve_fake_judge(no_rating_first=("train",), always_fail=("Romeo",)) as judge:
        rc, stdout, stderr = await _kame([
            "eval", "--checkpoint", str(tiny_checkpoint), "--questions", str(questions), "--judge-model", "judge-1",
            "--judge-base-url", judge.base_url, "--forced-delay-ms", "0,500", "--concurrency", "3", "--probes", "1",
            "--serve-arg=--max-calls=2",  # 3 calls at once on 2 seats: one is answered busy, and dialled again
            "--out", str(out), *_short_listening(),
        ], {"OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": "none",
            # A production box's settings: the eval's own service must not join that deployment.
            "REDIS_URL": REDIS_URL, "KAME_REDIS_PREFIX": prefix, "KAME_NODE_URL": "https://prod.example.com",
            "TWILIO_ACCOUNT_SID": "AC" + "9" * 32, "TWILIO_API_KEY": "SK" + "9" * 32, "TWILIO_API_SECRET": "s"})
    assert rc == 0, stderr[-3000:]
    raw = aioredis.Redis.from_url(REDIS_URL)
    try:
        assert not await raw.keys(prefix + "*"), "the eval's service wrote into the deployment's Redis"
    finally:
        await raw.aclose()
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
    ckpt = "acme/kame"  # shaped as a Hugging Face repo id: never fetched, every case is refused before
    cases = [
        (["--checkpoint", ckpt, "--url", url, "--questions", str(questions)], "one of --checkpoint"),
        (["--url", url, "--questions", str(questions), "--forced-delay-ms", "0,500"], "need --checkpoint"),
        (["--checkpoint", ckpt, "--questions", str(questions), "--forced-delay-ms", "fast"], "comma-separated"),
        (["--checkpoint", ckpt], "--questions FILE or --suite"),
        (["--checkpoint", ckpt, "--questions", str(questions), "--categories", "math"], "no question in categories"),
        (["--checkpoint", ckpt, "--questions", str(questions), "--busy-redials", "-1"], "--busy-redials at least 0"),
    ]
    agents = tmp_path / "agents.toml"
    agents.write_text('[agents.sales]\ninstructions = "Sell."\nnumbers = ["+15005550001"]\nforced_delay_ms = 300\n')
    cases.append((["--checkpoint", ckpt, "--questions", str(questions), "--agents", str(agents)],
                  "agent 'sales' (answering +15005550001) sets forced_delay_ms = 300"))  # fmt: skip
    cases.append((["--checkpoint", ckpt, "--questions", str(questions), f"--serve-arg=--agents={agents}"],
                  "it would override every delay of the sweep"))  # fmt: skip
    cases.append((["--checkpoint", ckpt, "--questions", str(questions), "--serve-arg=--forced-delay-ms=2000"],
                  "--serve-arg=--forced-delay-ms would override every delay of the sweep"))  # fmt: skip
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "x", "turns": ["ok?"]}\n{"question_id": 2, "turns": []}\n')
    cases.append((["--checkpoint", ckpt, "--questions", str(bad)], "line 2: 'turns' must be a list"))
    # A path that is not there: said at once, not after every question was spoken (review, session 29).
    cases.append((["--checkpoint", str(tmp_path / "no-such-ckpt"), "--questions", str(questions)],
                  "is neither a checkpoint directory nor a Hugging Face repo id"))  # fmt: skip
    a_file = tmp_path / "a-file"
    a_file.write_text("")  # --out at a file: a traceback once every question was spoken (review, session 29)
    cases.append((["--url", url, "--questions", str(questions), "--out", str(a_file)], "cannot write there"))
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
    assert took_turn_in_pause(heard, 3.0, 4.5) is True and took_turn_in_pause(heard, 2.7, 3.9) is False
    assert talk_after_barge_in(spans, 5.0, 5.5, 8.0) == (pytest.approx(1.0), True)
    assert talk_after_barge_in(spans, 3.0, 3.5, 8.0) == (0.0, True)
    assert talk_after_barge_in(speech_spans(_tone(3.0, [(0.5, 3.0)])), 1.0, 1.5, 3.0)[1] is False  # never stopped


def test_pocketsphinx_transcribes_a_reply_with_word_times(question_wav: Path) -> None:
    from telephony.sim_playout import read_wav, to_line_rate

    audio, rate = read_wav(question_wav)
    pcm = (to_line_rate(audio, rate) * 32767).astype(np.int16)
    silent = np.concatenate([np.zeros(8000, dtype=np.int16), pcm])  # a second of silence first
    transcriber = PocketsphinxTranscriber()
    try:
        t = transcriber.transcribe(silent)
    finally:
        transcriber.close()
    assert len(t.text.split()) >= 3 and t.first_word_s is not None and 0.8 < t.first_word_s < 2.0


async def test_transcribing_a_long_reply_leaves_the_calls_in_flight_running(question_wav: Path) -> None:
    """eval transcribes a finished call while others still stream from the same event loop: pocketsphinx holds
    the GIL for each of its calls, so one call over a whole reply froze the loop for as long as it decoded
    (20-30 s for a 30 s reply on 2 cores) and the service ended the calls in flight as silent sockets. Fed in
    0.2 s pieces, its second pass still held it 0.6 s here (several seconds on a slow box, where one caller
    reached the socket 10.9 s after its TwiML, refused): it decodes in another process now."""
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
    try:
        t = await asyncio.to_thread(transcriber.transcribe, reply)
    finally:
        beat.cancel()
        transcriber.close()
    assert len(t.text.split()) >= 20  # it did transcribe the reply
    # Another process decodes: the loop only waits for its share of the cores (0.64 s held in-process here).
    assert max(gaps) < 0.25, max(gaps)


def _children_named(word: str) -> list[int]:
    """This process's children whose command line holds `word` (Linux /proc: no psutil here)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == os.getpid() and word.encode() in cmdline:
            pids.append(int(stat.parent.name))
    return pids


async def test_a_transcription_worker_that_dies_fails_its_reply_alone(question_wav: Path) -> None:
    """A worker killed mid-decode (the OOM killer) is that reply's ASR error; the next reply gets new workers."""
    from telephony.sim_playout import read_wav, to_line_rate

    audio, rate = read_wav(question_wav)
    pcm = (to_line_rate(audio, rate) * 32767).astype(np.int16)
    transcriber = PocketsphinxTranscriber()
    try:
        await asyncio.to_thread(transcriber.transcribe, pcm[:8000])  # the worker up
        workers = _children_named("spawn_main")
        assert workers, "no worker process"
        decoding = asyncio.create_task(asyncio.to_thread(transcriber.transcribe, np.tile(pcm, 20)))
        await asyncio.sleep(0.5)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(AsrError, match="worker process died"):
            await asyncio.wait_for(decoding, 60)
        t = await asyncio.to_thread(transcriber.transcribe, pcm)
        assert len(t.text.split()) >= 3
    finally:
        transcriber.close()
    assert not _children_named("spawn_main")  # closed: no worker left behind


async def test_openai_speech_and_transcription_clients() -> None:
    async with serve_fake_judge() as fake:
        audio, rate = await asyncio.to_thread(
            OpenAIVoice(fake.base_url, "k", "tts-1", "nova").speak, "Hello, what time is it?")
        assert rate == 16000 and len(audio) > rate  # the stand-in speaks with flite, as a WAV
        assert fake.speech_requests[0] | {} == {"model": "tts-1", "voice": "nova", "input": "Hello, what time is it?",
                                                "response_format": "wav"}
        t = await asyncio.to_thread(OpenAITranscriber(fake.base_url, "k").transcribe, np.zeros(16000, np.int16))
        assert t.text == "hello there friend" and t.first_word_s == 0.5 and fake.transcription_requests == 1
        # gpt-4o-transcribe refuses verbose_json (word timings): asked for json, its text scores without a time.
        t = await asyncio.to_thread(OpenAITranscriber(fake.base_url, "k", "gpt-4o-transcribe").transcribe,
                                    np.zeros(16000, np.int16))  # fmt: skip
        assert t.text == "hello there friend" and t.first_word_s is None and fake.transcription_requests == 2
        fake.untimed_models = ("local-asr",)  # a server's model that refuses it too: asked again, for json
        local = OpenAITranscriber(fake.base_url, "k", "local-asr")
        t = await asyncio.to_thread(local.transcribe, np.zeros(16000, np.int16))
        assert t.text == "hello there friend" and fake.transcription_requests == 4
        await asyncio.to_thread(local.transcribe, np.zeros(16000, np.int16))  # json at once: it said so before
        assert fake.transcription_requests == 5
        assert local.describe() == "openai:local-asr"  # the model is in the report's settings


def _results(delay: float, scores: list[float], latency: float) -> list[Result]:
    return [Result(str(i), "stem", "q", delay, outcome="completed", score=s, latency_s=latency + 0.01 * i)
            for i, s in enumerate(scores)]


def test_compare_says_when_the_runs_were_measured_differently(tmp_path: Path) -> None:
    """Two runs judged by different models (or asked other questions, or heard by another ASR) differ for that
    reason alone: compare says so instead of putting the change down to the service."""
    def write(name: str, **settings: object) -> Path:
        base = {"source": "builtin", "questions": 6, "judge_model": "gpt-4.1", "asr": "pocketsphinx", "tts": "flite"}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(build_report(_results(0.0, [5, 5, 6, 5, 6, 5], 0.3), [], target={"url": "x"},
                                                settings=base | settings, random_weights=False)))  # fmt: skip
        return path

    same = compare(write("a"), write("b"))
    assert "differ in" not in same
    differs = compare(write("c"), write("d", judge_model="gpt-4o-mini", asr="openai"))
    assert "note: the runs differ in judge (A: gpt-4.1; B: gpt-4o-mini)" in differs
    assert "note: the runs differ in ASR (A: pocketsphinx; B: openai)" in differs and "caller voice" not in differs
    # How long a reply is listened to cuts replies (and scores); calls at once change latency (review, session 29).
    cut = compare(write("e", listening={"max_reply_s": 60.0}, concurrency=1),
                  write("f", listening={"max_reply_s": 5.0}, concurrency=16))  # fmt: skip
    assert "note: the runs differ in listening (A: {'max_reply_s': 60.0}; B: {'max_reply_s': 5.0})" in cut
    assert "note: the runs differ in calls at once (A: 1; B: 16)" in cut


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
    # B failed most of its calls: its few completed ones read better, and compare says what they are.
    failing = _results(0.0, [9, 9, 8, 9, 8, 9], 0.1)
    for r in failing[2:]:
        r.outcome, r.score, r.latency_s = "error", None, None
    text = compare(a, write("f", failing))
    assert "calls completed 6/6 -> 2/6: the figures below are of completed calls only, and not comparable" in text
    # B stopped after 5 of its 6 questions: 5/5 read as comparable, and better (review, session 29).
    stopped = tmp_path / "stopped.json"
    stopped.write_text(json.dumps(build_report(_results(0.0, [9, 9, 8, 9, 8], 0.2), [], target={"url": "x"},
                                               settings={}, random_weights=False,
                                               notes=["The run stopped early (TimeoutError: x)"])))  # fmt: skip
    text = compare(a, stopped)
    assert "calls completed 6/6 -> 5/5: the figures below are of completed calls only, and not comparable" in text
    assert "note: B: The run stopped early (TimeoutError: x)" in text


def test_eval_fails_when_a_barge_in_probe_call_failed(capsys: pytest.CaptureFixture[str]) -> None:
    """Failed probe calls exited 0, unsaid: the barge-in figures were of the probes that completed."""
    from evaluation.command import exit_code
    from evaluation.report import Probe

    good = build_report(_results(0.0, [5, 6], 0.3), [Probe("0", 0.0, outcome="completed")], target={"url": "x"},
                        settings={}, random_weights=False)  # fmt: skip
    assert exit_code(good) == 0
    bad = build_report(_results(0.0, [5, 6], 0.3), [Probe("0", 0.0, outcome="completed"), Probe("1", 0.0)],
                       target={"url": "x"}, settings={}, random_weights=False)  # fmt: skip
    assert exit_code(bad) == 1
    assert "1 of 2 barge-in probe calls did not complete" in capsys.readouterr().err


def test_a_password_in_the_target_url_stays_out_of_the_report() -> None:
    """Twilio takes https://user:pass@host webhook URLs; eval --url copied one into report.md and report.json."""
    from evaluation.runner import Target

    assert Target(url="https://kame:s3cretpass@voice.example.com:8443/x").describe() == {
        "url": "https://kame:***@voice.example.com:8443/x"}
    assert Target(url="https://voice.example.com").describe() == {"url": "https://voice.example.com"}


# ---------------------------------------------------------------------------------------------------------
# run_eval on a stand-in line (tests/eval_servers.py): flite speaks, the stand-in APIs transcribe and judge


def _line_plan(out: Path, questions: list[Question], line: FakeLine, api: FakeJudge, **kw: Any) -> EvalPlan:
    listening = kw.pop("listening", Listening(lead_in_s=0.2, quiet_s=0.5, no_answer_s=2.0, max_reply_s=4.0))
    return EvalPlan(
        questions=questions, source="test", out=out, voice=FliteVoice(),
        transcriber=OpenAITranscriber(api.base_url, "k"), judge=Judge("judge-1", api.base_url, "k", attempts=1),
        target=Target(url=line.base_url), delays=[None], listening=listening,
        **{"probes": 0, "busy_redials": 0, **kw},
    )  # fmt: skip


def _files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_a_question_never_voiced_still_ends_its_call() -> None:
    """flite speaks silence for text it cannot read (Japanese): with no voiced packet the question's end was
    never set, so neither --no-answer-s nor --max-reply-s fired and the call went on for ever."""
    listening = Listening(lead_in_s=0.2, quiet_s=0.5, no_answer_s=1.0, max_reply_s=3.0)
    for packets in ([sp.SILENCE_PACKET] * 50, []):  # silence; a TTS that gave no samples at all
        script, playout = AskAndListen(packets, listening), sp.Playout()
        ticks = 0
        while script.next_packet(ticks * sp.PACKET_SECONDS, playout) is not None and ticks < 50 * 30:
            ticks += 1
        asked_end = 0.2 + len(packets) * sp.PACKET_SECONDS
        assert script.hung_up_because == "no_answer", (len(packets), ticks)
        assert ticks * sp.PACKET_SECONDS == pytest.approx(asked_end + 1.0, abs=0.03)


async def test_unvoiced_question_audio_is_refused_when_spoken_naming_the_question(tmp_path: Path) -> None:
    async with serve_fake_line() as line, serve_fake_judge(empty_speech=("empty",)) as api:
        japanese = [Question("ja-1", "stem", "東京の人口はどのくらいですか。")]
        with pytest.raises(VoiceError, match=r"question ja-1: the flite TTS spoke no audible speech.*--tts openai"):
            await asyncio.wait_for(run_eval(_line_plan(tmp_path / "ja", japanese, line, api), progress=False), 20)
        empty = [Question("e-2", "stem", "An empty answer, please.")]
        plan = _line_plan(tmp_path / "empty", empty, line, api)
        plan.voice = OpenAIVoice(api.base_url, "k")  # answers a WAV with no samples
        with pytest.raises(VoiceError, match="question e-2: the openai TTS spoke no audible speech"):
            await asyncio.wait_for(run_eval(plan, progress=False), 20)
        assert line.calls == 0  # refused before dialling


async def test_the_judge_turns_any_odd_reply_into_a_missing_score() -> None:
    def completion(choice: dict[str, Any]) -> tuple[str, str]:
        body = {"id": "c", "object": "chat.completion", "created": 0, "model": "j", "choices": [choice]}
        return "application/json", json.dumps(body)

    odd = {
        "html": ("text/html", "<html><body>Bad gateway, try later</body></html>"),  # a proxy's page, HTTP 200
        "no-message": completion({"index": 0, "finish_reason": "stop"}),
        "numbers": completion({"index": 0, "message": {"role": "assistant", "content": [1, 2]}}),
        "not-json-object": ("application/json", "[1, 2, 3]"),
    }
    parts = {"index": 0, "message": {"role": "assistant", "content": [{"type": "text", "text": "Fine. [[6]]"}]}}
    async with serve_fake_judge(odd_reply={**odd, "parts": completion(parts)}) as fake:
        judge = Judge("j", fake.base_url, "k", attempts=2, backoff_s=0.01)
        for key in odd:
            verdict = await judge.grade(Question(key, "stem", f"Say {key}?"), "an answer")
            assert verdict.score is None and verdict.attempts == 2, (key, verdict)
            assert verdict.error in (NOT_A_COMPLETION, NO_RATING), (key, verdict)
        verdict = await judge.grade(Question("p", "stem", "Say parts?"), "an answer")  # content as parts: read
        assert (verdict.score, verdict.error) == (6.0, None)
        await judge.aclose()


async def test_a_reasoning_model_as_judge_is_asked_as_it_takes_it() -> None:
    """o-series and gpt-5 judges refuse max_tokens and temperature 0 with a 400 each: every score was missing.
    Asked again without them (max_completion_tokens instead), once, and the scores come."""
    async with serve_fake_judge(rating=9, refuse_params=("max_tokens", "temperature")) as fake:
        judge = Judge("o4-mini", fake.base_url, "k", attempts=1, backoff_s=0.01)
        first = await judge.grade(Question("1", "stem", "Say one?"), "one")
        second = await judge.grade(Question("2", "stem", "Say two?"), "two")
        await judge.aclose()
    assert (first.score, first.error, first.attempts) == (9.0, None, 1)
    assert (second.score, second.error) == (9.0, None)
    sent = [{k for k in ("max_tokens", "max_completion_tokens", "temperature") if k in r} for r in fake.requests]
    assert sent == [{"max_tokens", "temperature"}, {"max_completion_tokens", "temperature"},
                    {"max_completion_tokens"}, {"max_completion_tokens"}]  # fmt: skip


async def test_one_questions_odd_judge_reply_costs_its_score_not_the_run(tmp_path: Path) -> None:
    questions = [Question("1", "stem", "What is two plus two?"), Question("2", "stem", "Who wrote Hamlet?")]
    html = {"Hamlet": ("text/html", "<html>proxy error</html>")}
    async with serve_fake_line() as line, serve_fake_judge(rating=8, odd_reply=html) as api:
        report = await run_eval(_line_plan(tmp_path / "run", questions, line, api, concurrency=2), progress=False)
    by_q = {r["question_id"]: r for r in json.loads((tmp_path / "run" / "report.json").read_text())["results"]}
    assert by_q["1"]["score"] == 8.0 and by_q["1"]["outcome"] == "completed"
    assert by_q["2"]["score"] is None and by_q["2"]["judge_error"] == "the judge's answer was not a chat completion"
    assert report["summary"]["by_delay"][0]["all"]["missing_scores"] == 1


async def test_an_unexpected_failure_is_that_questions_error_and_the_report_is_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    questions = [Question("q-7", "stem", "What is two plus two?")]
    odd_asr = {"text": "four", "words": [{"word": "four"}]}  # a word without its start time
    async with serve_fake_line() as line, serve_fake_judge(transcription=odd_asr) as api:
        await run_eval(_line_plan(tmp_path / "run", questions, line, api), progress=False)
    [r] = json.loads((tmp_path / "run" / "report.json").read_text())["results"]
    assert r["score"] is None and r["errors"] and r["errors"][0].startswith("TypeError")
    assert any("question q-7" in m and "TypeError" in m for m in caplog.messages)
    assert "TypeError" in (tmp_path / "run" / "report.md").read_text()


async def test_a_call_the_service_hangs_up_mid_question_is_not_scored(tmp_path: Path) -> None:
    question = Question("1", "stem", "If a train leaves at noon and travels for two hours, when does it arrive?")
    async with serve_fake_line(hang_up_after_s=1.0) as line, serve_fake_judge() as api:
        report = await run_eval(_line_plan(tmp_path / "run", [question], line, api), progress=False)
    [r] = report["results"]
    assert r["outcome"] == "hung_up" and r["hung_up_because"] == "server" and r["server_hung_up"] is True
    assert r["score"] is None and "before the question had been played in full" in r["errors"][0]
    assert api.requests == []  # nothing was graded
    assert report["summary"]["by_delay"][0]["all"]["hung_up_mid_question"] == 1
    md = (tmp_path / "run" / "report.md").read_text()
    assert "The service hung up 1 call(s) before the question had been played in full" in md
    assert "| the service hung up mid-question (not scored)" in md


async def test_question_ids_become_safe_unique_file_names_inside_out(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "run"
    questions = [Question("stem/1", "stem", "What is two plus two?"), Question("../x", "stem", "Who wrote Hamlet?")]
    async with serve_fake_line() as line, serve_fake_judge() as api:
        report = await run_eval(_line_plan(out, questions, line, api, concurrency=2), progress=False)
    assert _files_under(tmp_path) == _files_under(out)  # nothing written outside --out
    for r in report["results"]:
        assert r["outcome"] == "completed" and r["score"] == 7.0
        for name in (r["question_wav"], r["reply_wav"]):
            assert (out / name).is_file() and (out / name).resolve().parent == (out / "audio").resolve()
    assert len({r["reply_wav"] for r in report["results"]}) == 2

    assert file_stems(["101", "stem_2", "a.b-c"]) == {"101": "101", "stem_2": "stem_2", "a.b-c": "a.b-c"}  # readable
    stems = file_stems(["stem/1", "stem_1", "stem:1", "../x", "..", "A", "a"])
    assert len({s.lower() for s in stems.values()}) == 7 and stems["stem_1"] == "stem_1"  # unique, case-blind too
    assert all("/" not in s and not s.startswith(".") for s in stems.values())
    assert stems["stem/1"].startswith("stem_1-") and stems["../x"].startswith("x-")


async def test_probe_counts_only_sound_in_the_pause_and_talk_over_a_barge_in_after_a_pause(tmp_path: Path) -> None:
    """Short noises in the caller's pause are not a turn (the 0.5 s gaps speech_spans bridges are silence);
    a bot that goes quiet for 0.4 s right after the barge-in and then talks on over it has not stopped."""
    text = "Name a city in France, and then say why."  # the probe cuts it at the comma
    first, _ = await asyncio.to_thread(FliteVoice().speak, "Name a city in France,")
    lead_in, pause_s = 0.2, 0.8
    chirps_until = lead_in + len(first) / 16000 + pause_s + 0.5  # flite speaks at 16 kHz
    chirp = np.concatenate([tone(0.04), silence(0.26)])  # 13% sound, in gaps the 0.5 s bridging closes
    timeline = np.tile(chirp, int(chirps_until / 0.3) + 1)
    reply = np.concatenate([tone(1.1), silence(0.4), tone(8.0)])  # barge-in lands near 1.0 s into it
    listening = Listening(lead_in_s=lead_in, quiet_s=0.5, no_answer_s=3.0, max_reply_s=3.0)
    async with serve_fake_line(timeline=timeline, reply=reply, end_of_turn_s=1.2) as line, \
            serve_fake_judge() as api:  # fmt: skip
        plan = _line_plan(tmp_path / "run", [Question("1", "stem", text)], line, api, probes=1, pause_s=pause_s,
                          listening=listening, concurrency=2)
        report = await run_eval(plan, progress=False)
    [p] = report["probes"]
    assert p["outcome"] == "completed" and (tmp_path / "run" / p["call_wav"]).is_file()
    assert p["took_turn_in_pause"] is False, p
    assert p["barge_in_talk_s"] is not None and p["barge_in_talk_s"] > 1.5, p  # it talked on after its pause
    assert p["barge_in_stopped"] is False, p  # and was still talking when the caller hung up


def test_kame_kills_the_command_when_it_times_out(tmp_path: Path) -> None:
    marker = f"kame-timeout-{os.getpid()}-{id(tmp_path)}"

    def still_running() -> list[int]:
        pids = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                if marker.encode() in cmdline.read_bytes():
                    pids.append(int(cmdline.parent.name))
        return pids

    async def run() -> None:
        async with serve_fake_line(reply=None) as line:  # a line that never answers: the call runs 60 s
            with pytest.raises(TimeoutError):
                await _kame(["eval", "--url", line.base_url, "--questions", str(_write_questions(tmp_path / "q.jsonl")),
                             "--probes", "0", "--no-progress", "--no-answer-s", "60", "--out", str(tmp_path / marker)],
                            {}, limit_s=3)  # fmt: skip

    try:
        asyncio.run(run())
        assert still_running() == []
    finally:
        for pid in still_running():  # what the old _kame left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_bad_url_is_a_usage_error_before_any_question_is_spoken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from evaluation.command import add_eval_arguments, run_from_args

    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    questions = _write_questions(tmp_path / "q.jsonl")
    for url in ("ftp://line.example", "line.example", "https://line.example/?x=1"):
        args = parser.parse_args(["--url", url, "--questions", str(questions), "--out", str(tmp_path / "out"),
                                  "--no-progress"])  # fmt: skip
        assert run_from_args(args) == 2
        err = capsys.readouterr().err
        assert "--url must be https://host[/prefix]" in err and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()  # nothing spoken, nothing written


async def test_a_call_that_never_streamed_points_at_no_audio(tmp_path: Path) -> None:
    async with serve_fake_line(busy=True) as line, serve_fake_judge() as api:
        report = await run_eval(_line_plan(tmp_path / "run", [Question("1", "stem", "Hello?")], line, api, probes=0),
                                progress=False)
    [r] = report["results"]
    assert r["outcome"] == "busy" and r["reply_wav"] == "" and r["score"] is None
    assert (tmp_path / "run" / r["question_wav"]).is_file()
    assert "busy" in (tmp_path / "run" / "report.md").read_text()


def test_the_services_own_delay_is_named_not_minus_one_and_a_missing_score_is_not_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.axes

    from evaluation.plots import write_plots
    from evaluation.report import render_markdown

    results = _results(-1.0, [7, 8, 7], 0.5) + [Result("h", "humanities", "q", -1.0, outcome="completed")]
    report = build_report(results, [], target={"url": "x"}, settings={}, random_weights=False)
    bars: list[tuple[list[float], str]] = []
    texts: list[str] = []
    real_bar, real_text = matplotlib.axes.Axes.bar, matplotlib.axes.Axes.text

    def bar(self: Any, x: Any, height: Any, *args: Any, **kwargs: Any) -> Any:
        bars.append(([float(h) for h in np.atleast_1d(height)], kwargs.get("label", "")))
        return real_bar(self, x, height, *args, **kwargs)

    def text(self: Any, x: float, y: float, s: str, *args: Any, **kwargs: Any) -> Any:
        texts.append(s)
        return real_text(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    monkeypatch.setattr(matplotlib.axes.Axes, "text", text)
    plots = write_plots(report, tmp_path)
    # humanities has no score: no bar of 0 for it (only stem's 7.33), and the plot says so.
    bars = [b for b in bars if b[1]]  # the category plot's (the histogram draws unlabelled bars too)
    assert bars == [([pytest.approx(22 / 3)], "the service's own")] and "no score" in texts
    md = render_markdown(report, plots)
    assert "| the service's own | **all** | 4 | 3 |" in md and "-1 ms" not in md and "| -1 |" not in md

    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    text_out = compare(path, path)
    assert "forced delay the service's own" in text_out and "-1 ms" not in text_out


def test_compare_says_no_difference_for_identical_constant_scores(tmp_path: Path) -> None:
    def write(name: str, scores: list[float]) -> Path:
        path = tmp_path / f"{name}.json"
        report = build_report(_results(0.0, scores, 0.5), [], target={"url": "x"}, settings={}, random_weights=False)
        path.write_text(json.dumps(report))
        return path

    text = compare(write("a", [7.0] * 6), write("b", [7.0] * 6))
    assert "score 7.00 -> 7.00 (+0.00; no difference (the same value throughout))" in text and "nan" not in text
    assert "nan" not in compare(write("c", [3.0] * 6), write("d", [8.0] * 6))


async def test_an_interrupted_run_still_reports_the_calls_that_finished(tmp_path: Path) -> None:
    """Ctrl-C (a cancelled run) skipped the report: a long run's finished calls went unreported (review,
    session 22). The report is written with them, then the run stops."""
    questions = [Question(str(i), "stem", f"What is {i} plus {i}?") for i in range(3)]
    async with serve_fake_line() as line, serve_fake_judge() as api:
        run = asyncio.create_task(run_eval(_line_plan(tmp_path / "run", questions, line, api, concurrency=1),
                                           progress=False))  # fmt: skip
        # The third call under way and a second grading asked for: the first graded is kept by then. (Which
        # questions those are is not fixed: the calls queue for their turn in whatever order they get there.)
        await until(lambda: line.calls >= 3 and len(api.requests) >= 2, "a call graded, the last one on", within=90)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    finished = [r["question_id"] for r in report["results"]]
    assert 1 <= len(finished) < 3 and len(set(finished)) == len(finished) and set(finished) <= {"0", "1", "2"}
    assert "interrupted" in json.dumps(report)  # the call under way is not in it
