"""Run an eval: speak the questions, dial each as a call (own service per forced delay, or a running one),
transcribe and judge the replies, write the report, the plots and every call's audio."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import random
import re
import secrets
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from tqdm import tqdm

from telephony import sim_playout as sp
from telephony.config import hide_password
from telephony.sim_caller import CallReport, simulate_call

from .judge import Judge
from .line_caller import AskAndListen, Listening, answer_latency, speech_spans, talk_after_barge_in, took_turn_in_pause
from .plots import write_plots
from .questions import Question
from .report import HUNG_UP, SERVICE_OWN_DELAY, Probe, Result, build_report, render_markdown
from .transcribe import AsrError, Transcriber
from .voices import Voice, VoiceError, write_float_wav

log = logging.getLogger("kame-phone.eval")
BARGE_IN_TEXT = "Sorry, wait a second, can I ask something else?"
# A busy answer (the line at capacity, or its engine falling behind) measures the line's load, not the
# bot: dial again after a pause that grows, as a person testing the number would, before giving up.
REDIAL_FIRST_PAUSE_S = 2.0
REDIAL_MAX_PAUSE_S = 20.0


@dataclass
class Target:
    """Where the calls go: a running service (--url), or one this run starts (--checkpoint)."""

    checkpoint: str | None = None
    url: str | None = None  # https://host[/prefix] or http://127.0.0.1:port
    auth_token: str | None = None  # signs like Twilio (url: TWILIO_AUTH_TOKEN)
    public_url: str | None = None  # what the service calls itself (url: PUBLIC_URL, else the url)
    serve_args: list[str] = field(default_factory=list)  # flags for the started service
    random_weights: bool = False

    def describe(self) -> dict[str, Any]:
        """What the report says of the target: never a password the URL carries (https://user:pass@host)."""
        if self.checkpoint:
            return {"checkpoint": self.checkpoint}
        return {"url": hide_password(self.url)}


@dataclass
class EvalPlan:
    questions: list[Question]
    source: str  # the file or suite they came from
    out: Path
    voice: Voice
    transcriber: Transcriber
    judge: Judge
    target: Target
    delays: list[float | None]  # None: the service's own setting (a --url run)
    concurrency: int = 1
    probes: int = 3  # the first N questions also get an interaction probe call per delay
    pause_s: float = 1.5
    listening: Listening = field(default_factory=Listening)
    from_number: str = "+15005550006"
    to_number: str = "+15005550001"
    busy_redials: int = 5  # dial again this many times at most after a busy answer


@dataclass(frozen=True)
class _Spoken:
    question: Question
    stem: str  # the question's part of its file names (file_stems)
    packets: list[bytes]
    first_half: list[bytes] | None  # the probe's two parts, split mid-sentence
    second_half: list[bytes] | None


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def file_stems(question_ids: list[str]) -> dict[str, str]:
    """A file-name part per question id, unique (also on case-blind disks): a readable id is kept as it
    is; any other ("stem/1", "../x", "質問") is made safe and tagged with a hash of the id, so no id can
    reach outside --out or collide with another."""
    stems: dict[str, str] = {}
    used: set[str] = set()
    for qid in question_ids:
        safe = _UNSAFE.sub("_", qid).strip("._")[:60]
        stem = qid if safe == qid else f"{safe or 'q'}-{hashlib.sha1(qid.encode()).hexdigest()[:8]}"
        base, n = stem, 1
        while stem.lower() in used:
            n += 1
            stem = f"{base}-{n}"
        used.add(stem.lower())
        stems[qid] = stem
    return stems


def _split_mid_sentence(text: str) -> tuple[str, str] | None:
    """Cut a question near its middle, at a comma if one is close: the probe's pause goes there."""
    words = text.split()
    if len(words) < 6:
        return None
    mid = len(words) // 2
    near = [i + 1 for i, w in enumerate(words[:-2]) if w.endswith(",") and i >= 1 and abs(i + 1 - mid) <= 3]
    cut = min(near, key=lambda c: abs(c - mid)) if near else mid
    return " ".join(words[:cut]), " ".join(words[cut:])


def _packets(audio: np.ndarray, rate: int) -> list[bytes]:
    return sp.caller_packets(audio, rate) if len(audio) else []


def _audible(packets: list[bytes]) -> bool:
    return any(sp.packet_rms(p) > sp.SOUND_RMS for p in packets)


def _speech(voice: Voice, audio: np.ndarray, rate: int, what: str) -> list[bytes]:
    """The line's packets for spoken audio; a VoiceError when the TTS gave nothing audible (an empty answer,
    or flite's silence for text it cannot read): the call could never tell when the question ended."""
    packets = _packets(audio, rate)
    if not _audible(packets):
        hint = " (flite reads only Latin-script text: try --tts openai)" if voice.name == "flite" else ""
        raise VoiceError(f"{what}: the {voice.name} TTS spoke no audible speech{hint}")
    return packets


async def _speak_all(plan: EvalPlan, audio_dir: Path) -> tuple[list[_Spoken], list[bytes]]:
    stems = file_stems([q.question_id for q in plan.questions])

    async def one(i: int, q: Question) -> _Spoken:
        audio, rate = await asyncio.to_thread(plan.voice.speak, q.text)
        packets = _speech(plan.voice, audio, rate, f"question {q.question_id}")
        stem = stems[q.question_id]
        await asyncio.to_thread(write_float_wav, audio_dir / f"q{stem}.wav", audio, rate)
        halves: tuple[list[bytes] | None, list[bytes] | None] = (None, None)
        parts = _split_mid_sentence(q.text) if i < plan.probes else None
        if parts is not None:
            a = _packets(*await asyncio.to_thread(plan.voice.speak, parts[0]))
            b = _packets(*await asyncio.to_thread(plan.voice.speak, parts[1]))
            if _audible(a) and _audible(b):
                halves = (a, b)
            else:  # the probe needs both halves heard; the question itself is still asked
                log.warning("question %s: a half of it spoke no sound; no interaction probe for it", q.question_id)
        return _Spoken(q, stem, packets, *halves)

    sem = asyncio.Semaphore(4)

    async def bounded(i: int, q: Question) -> _Spoken:
        async with sem:
            return await one(i, q)

    spoken = await asyncio.gather(*(bounded(i, q) for i, q in enumerate(plan.questions)))
    barge: list[bytes] = []
    if any(s.first_half is not None for s in spoken):
        barge = _speech(plan.voice, *await asyncio.to_thread(plan.voice.speak, BARGE_IN_TEXT), "the barge-in phrase")
    return list(spoken), barge


@dataclass
class _Line:
    ws_url: str
    voice_url: str | None
    public_url: str | None
    token: str | None


def check_url(url: str) -> None:
    """A ValueError unless `url` can be dialled (checked before any question is spoken)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"--url must be https://host[/prefix] (http:// for loopback), got {url!r}")


def _line_for_url(t: Target) -> _Line:
    assert t.url is not None
    check_url(t.url)
    parts = urlsplit(t.url)
    prefix = parts.path.rstrip("/")
    ws = ("wss" if parts.scheme == "https" else "ws") + f"://{parts.netloc}{prefix}/twilio/media"
    return _Line(ws, f"{parts.scheme}://{parts.netloc}{prefix}/twilio/voice", t.public_url or t.url, t.auth_token)


@contextlib.asynccontextmanager
async def _own_service(plan: EvalPlan, delay: float, log_dir: Path) -> AsyncIterator[_Line]:
    from kame_phone.serve_process import free_port, serve_process
    from kame_phone.throwaway_env import throwaway_env

    t = plan.target
    assert t.checkpoint is not None
    port, metrics_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    token = secrets.token_hex(16)  # signatures are checked, as in production
    argv = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
            "--checkpoint", t.checkpoint, "--forced-delay-ms", f"{delay:g}"]
    if not any(a == "--max-calls" or a.startswith("--max-calls=") for a in t.serve_args):
        argv += ["--max-calls", str(max(2, plan.concurrency))]
    argv += t.serve_args
    env = throwaway_env(TWILIO_AUTH_TOKEN=token, PUBLIC_URL=base)  # never joined to a deployment
    async with serve_process(argv, env, base, log_dir / f"serve_{delay:g}ms.log"):
        yield _Line(base.replace("http://", "ws://") + "/twilio/media", None, base, token)


@dataclass
class _Finished:
    """What the run has so far: the report is written from it whatever stops the run."""

    results: list[Result] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)


async def run_eval(plan: EvalPlan, progress: bool = True) -> dict[str, Any]:
    if plan.target.checkpoint is None:
        check_url(plan.target.url or "")  # before any question is spoken
    out = plan.out
    audio_dir = out / "audio"
    audio_dir.mkdir(parents=True, exist_ok=True)
    try:
        spoken, barge = await _speak_all(plan, audio_dir)
    except BaseException:
        await _close_clients(plan)
        raise
    probes_per_delay = sum(s.first_half is not None for s in spoken)
    total = len(plan.delays) * (len(spoken) + probes_per_delay)
    bar = tqdm(total=total, desc="eval calls", unit="call", disable=not progress, file=sys.stderr)
    got = _Finished()

    def done(score: float | None = None) -> None:
        if score is not None:
            got.scores.append(score)
        bar.update(1)
        bar.set_postfix_str(f"mean score {np.mean(got.scores):.2f}" if got.scores else "mean score –")

    stopped: Exception | None = None
    try:
        for delay in plan.delays:
            async with _line(plan, delay, out) as line:
                await _calls(plan, line, delay, spoken, barge, audio_dir, done, got)
    except Exception as exc:  # noqa: BLE001 - e.g. a service that would not start: report what finished first
        stopped = exc
        log.error("the run stopped early: %s: %s; the report holds the %d call(s) that finished",
                  type(exc).__name__, exc, len(got.results) + len(got.probes))  # fmt: skip
    except asyncio.CancelledError:  # Ctrl-C: the calls that finished are still reported, then it stops
        log.error("the run was interrupted; the report holds the %d call(s) that finished",
                  len(got.results) + len(got.probes))  # fmt: skip
        await _write_report(plan, got, probes_per_delay, RuntimeError("interrupted"))
        raise
    finally:
        bar.close()
        await _close_clients(plan)
    report = await _write_report(plan, got, probes_per_delay, stopped)
    if stopped is not None:
        raise stopped
    return report


async def _close_clients(plan: EvalPlan) -> None:
    """The judge's HTTP client and the transcriber's workers: once, however the run ends."""
    await plan.judge.aclose()
    await asyncio.to_thread(plan.transcriber.close)


async def _calls(
    plan: EvalPlan, line: _Line, delay: float | None, spoken: list[_Spoken], barge: list[bytes], audio_dir: Path,
    done: Callable[[float | None], None], got: _Finished,
) -> None:
    """Every question's call (and probe) at one delay; each finished one is kept in `got` as it ends."""
    sem = asyncio.Semaphore(plan.concurrency)

    async def keep(qid: str, call: Coroutine[Any, Any, Result | Probe]) -> None:
        try:
            item = await call
        except Exception as exc:  # noqa: BLE001 - _ask and _probe record their own errors; this is the last guard
            log.error("question %s: the call failed: %s: %s", qid, type(exc).__name__, exc)
            return
        (got.results if isinstance(item, Result) else got.probes).append(item)  # type: ignore[arg-type]

    tasks = [keep(s.question.question_id, _ask(plan, line, delay, s, audio_dir, sem, done)) for s in spoken]
    tasks += [keep(s.question.question_id, _probe(plan, line, delay, s, barge, audio_dir, sem, done))
              for s in spoken if s.first_half is not None]  # fmt: skip
    await asyncio.gather(*tasks)


async def _write_report(
    plan: EvalPlan, got: _Finished, probes_per_delay: int, stopped: Exception | None
) -> dict[str, Any]:
    notes = []
    if stopped is not None:
        notes.append(f"The run stopped early ({type(stopped).__name__}: {str(stopped)[:200]}): this report holds "
                     f"only the {len(got.results)} question call(s) and {len(got.probes)} probe(s) that finished.")
    report = build_report(
        got.results, got.probes, target=plan.target.describe(), random_weights=plan.target.random_weights,
        notes=notes, settings={
            "questions": len(plan.questions), "source": plan.source, "tts": plan.voice.name,
            "asr": plan.transcriber.describe(), "judge_model": plan.judge.model, "concurrency": plan.concurrency,
            "forced_delays_ms": [d for d in plan.delays if d is not None], "probes": probes_per_delay,
            "pause_s": plan.pause_s, "listening": dataclasses.asdict(plan.listening),
        },
    )
    out = plan.out
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plots = await asyncio.to_thread(write_plots, report, out)
    (out / "report.md").write_text(render_markdown(report, plots))
    return report


@contextlib.asynccontextmanager
async def _line(plan: EvalPlan, delay: float | None, out: Path) -> AsyncIterator[_Line]:
    if plan.target.checkpoint is None:
        yield _line_for_url(plan.target)
        return
    async with _own_service(plan, delay or 0.0, out) as line:
        yield line


def _delay_of(delay: float | None) -> float:
    return SERVICE_OWN_DELAY if delay is None else delay


async def _dial(
    plan: EvalPlan, line: _Line, make_script: Callable[[], AskAndListen], wav: Path, sem: asyncio.Semaphore
) -> tuple[CallReport, AskAndListen, np.ndarray, int]:
    """One call, dialled again after a busy answer (up to plan.busy_redials times; the pause is taken
    outside the semaphore, so the other calls go on). Returns the last call's report, its script, the
    audio heard and how many times it was redialled."""
    await asyncio.to_thread(wav.unlink, missing_ok=True)  # an earlier run's file in this --out is not this call's
    for redials in range(plan.busy_redials + 1):
        script = make_script()  # each dial plays its own timeline
        async with sem:
            # Bounded: a service that accepts the socket and then stops reading (a frozen loop) held the send,
            # and the run, for ever. Its question, every listening allowance, and a margin.
            listen = plan.listening
            most = (listen.lead_in_s + len(script.question) * 0.02 + listen.no_answer_s + listen.max_reply_s
                    + listen.quiet_s + CALL_MARGIN_S)  # fmt: skip
            try:
                async with asyncio.timeout(most):
                    report = await simulate_call(
                        line.ws_url, script, auth_token=line.token, public_url=line.public_url, out_wav=wav,
                        voice_url=line.voice_url, from_number=plan.from_number, to_number=plan.to_number,
                    )
            except TimeoutError:
                why = f"the call did not end within {most:.0f} s (the service stopped answering?)"
                raise TimeoutError(why) from None
        if report.outcome != "busy" or redials == plan.busy_redials:
            break
        pause = min(REDIAL_MAX_PAUSE_S, REDIAL_FIRST_PAUSE_S * 2**redials) * random.uniform(0.8, 1.2)
        log.info("%s: the line was busy (call %s); dialling again in %.1f s (%d of %d)", wav.stem,
                 report.call_sid, pause, redials + 1, plan.busy_redials)  # fmt: skip
        await asyncio.sleep(pause)
    return report, script, await asyncio.to_thread(_read_heard, wav), redials


CALL_MARGIN_S = 60.0  # a call's bound beyond its question and listening allowances (a probe's second part, set-up)


def _read_heard(wav: Path) -> np.ndarray:
    """The call as the caller heard it (int16, 8 kHz); empty when the call never streamed."""
    if not wav.is_file():
        return np.zeros(0, dtype=np.int16)
    audio, _ = sp.read_wav(wav)
    return np.round(audio * 32768.0).astype(np.int16)


def _hung_up_early(qid: str, report: CallReport, script: AskAndListen, errors: list[str]) -> bool:
    """Did the service end the call before the whole question went out? Then there is no answer to grade:
    the call's outcome is HUNG_UP, with the reason in `errors`."""
    if report.outcome != "completed" or not report.server_hung_up or script.asked:
        return False
    why = f"the service hung up at {report.call_seconds:.2f} s, before the question had been played in full"
    errors.append(why)
    log.warning("question %s: %s (call %s); not scored", qid, why, report.call_sid)
    return True


def _wav_name(wav: Path) -> str:
    """The report's pointer to a call's audio: "" when the call never streamed, so nothing was written."""
    return f"audio/{wav.name}" if wav.is_file() else ""


async def _ask(
    plan: EvalPlan, line: _Line, delay: float | None, s: _Spoken, audio_dir: Path, sem: asyncio.Semaphore,
    done: Callable[[float | None], None],
) -> Result:
    q = s.question
    wav = audio_dir / f"d{_delay_of(delay):g}_q{s.stem}_call.wav"
    r = Result(q.question_id, q.category, q.text, _delay_of(delay), question_wav=f"audio/q{s.stem}.wav")
    try:
        report, script, heard, r.busy_redials = await _dial(
            plan, line, lambda: AskAndListen(s.packets, plan.listening), wav, sem
        )
        r.reply_wav = _wav_name(wav)
        r.outcome, r.call_sid, r.errors = report.outcome, report.call_sid, list(report.errors)
        r.first_audio_s, r.server_hung_up = report.first_audio_latency_s, report.server_hung_up
        r.hung_up_because = "server" if report.server_hung_up else script.hung_up_because
        if _hung_up_early(q.question_id, report, script, r.errors):
            r.outcome = HUNG_UP
        elif report.outcome == "completed" and script.question_end_s is not None:
            await _grade(plan, q, r, script, heard)
    except (AsrError, OSError, ValueError) as exc:
        r.errors.append(f"{type(exc).__name__}: {exc}")
        log.warning("question %s: %s: %s", q.question_id, type(exc).__name__, exc)
    except Exception as exc:  # noqa: BLE001 - one question's failure is its error, not the run's end
        r.errors.append(f"{type(exc).__name__}: {exc}")
        log.error("question %s: failed: %s: %s; recorded as its error", q.question_id, type(exc).__name__, exc)
    finally:
        done(r.score)
    return r


async def _grade(plan: EvalPlan, q: Question, r: Result, script: AskAndListen, heard: np.ndarray) -> None:
    """Transcribe the reply and have the judge score it (a judge failure is a missing score, not 0)."""
    assert script.question_end_s is not None
    start = round((script.question_start_s or 0.0) * sp.RATE)
    reply = heard[start:]
    r.reply_s = float(len(reply) / sp.RATE)
    r.latency_s = answer_latency(speech_spans(heard), script.question_end_s)
    transcript = await asyncio.to_thread(plan.transcriber.transcribe, reply)
    r.transcript = transcript.text
    if transcript.first_word_s is not None:
        heard_at = (script.question_start_s or 0.0) + transcript.first_word_s
        r.first_word_latency_s = heard_at - script.question_end_s
    verdict = await plan.judge.grade(q, r.transcript or "(the assistant said nothing)")
    r.score, r.judge_explanation, r.judge_error = verdict.score, verdict.explanation, verdict.error
    if verdict.error:
        log.warning("question %s: no score from the judge after %d tries: %s", q.question_id,
                    verdict.attempts, verdict.error)


async def _probe(
    plan: EvalPlan, line: _Line, delay: float | None, s: _Spoken, barge: list[bytes], audio_dir: Path,
    sem: asyncio.Semaphore, done: Callable[[float | None], None],
) -> Probe:
    q = s.question
    wav = audio_dir / f"d{_delay_of(delay):g}_q{s.stem}_probe.wav"
    p = Probe(q.question_id, _delay_of(delay), pause_s=plan.pause_s)
    assert s.first_half is not None and s.second_half is not None
    first, second = s.first_half, s.second_half

    def new_script() -> AskAndListen:
        return AskAndListen(first, plan.listening, second_part=second, pause_s=plan.pause_s, barge_in=barge)

    try:
        report, script, heard, p.busy_redials = await _dial(plan, line, new_script, wav, sem)
        p.call_wav = _wav_name(wav)
        p.outcome, p.call_sid, p.errors = report.outcome, report.call_sid, list(report.errors)
        p.server_hung_up = report.server_hung_up
        if _hung_up_early(q.question_id, report, script, p.errors):
            p.outcome = HUNG_UP
        elif report.outcome == "completed":
            _measure_probe(p, script, heard)
    except (OSError, ValueError) as exc:
        p.errors.append(f"{type(exc).__name__}: {exc}")
        log.warning("question %s (probe): %s: %s", q.question_id, type(exc).__name__, exc)
    except Exception as exc:  # noqa: BLE001 - one probe's failure is its error, not the run's end
        p.errors.append(f"{type(exc).__name__}: {exc}")
        log.error("question %s (probe): failed: %s: %s; recorded as its error", q.question_id, type(exc).__name__, exc)
    finally:
        done(None)
    return p


def _measure_probe(p: Probe, script: AskAndListen, heard: np.ndarray) -> None:
    if script.pause_start_s is not None and script.pause_end_s is not None:
        p.took_turn_in_pause = took_turn_in_pause(heard, script.pause_start_s, script.pause_end_s)
    if script.barge_in_start_s is not None:
        barge_end = script.barge_in_end_s if script.barge_in_end_s is not None else script.barge_in_start_s
        p.barge_in_talk_s, p.barge_in_stopped = talk_after_barge_in(
            speech_spans(heard, merge_gap_s=0.3), script.barge_in_start_s, barge_end, len(heard) / sp.RATE
        )
