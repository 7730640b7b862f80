"""The STT + LLM back-end against real parts: flite speech through pocketsphinx, and a real local
OpenAI-compatible streaming server (aiohttp, SSE) that can be slow, fail, rate-limit or break."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import subprocess
import threading
import wave
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from engine.backend import BackendConfig, BackendServices, CallBackend
from engine.conversation import Conversation
from engine.interface import FRAME_SAMPLES
from engine.llm import LlmClient, LlmConfig, LlmError
from engine.oracle_policy import OraclePolicyConfig
from engine.stt import (
    TELEPHONE_CMN,
    DecoderPool,
    NullSTT,
    PocketsphinxSTT,
    SttResult,
    make_stt,
)

from .llm_server import FakeLlm, answer_for

API_KEY = "sk-test-SECRET-0123456789"
FAST_POLICY = OraclePolicyConfig(backoff_initial_s=0.05, backoff_max_s=0.2)


def make_llm(server: FakeLlm, timeout_s: float = 10.0) -> LlmClient:
    return LlmClient(LlmConfig(model="kame-test", base_url=server.base_url, api_key=API_KEY, timeout_s=timeout_s))


def llm_errors(kind: str) -> float:
    return REGISTRY.get_sample_value("kame_llm_errors_total", {"kind": kind}) or 0.0


def llm_requests() -> float:
    return REGISTRY.get_sample_value("kame_llm_requests_total") or 0.0


def stt_errors() -> float:
    return REGISTRY.get_sample_value("kame_stt_errors_total") or 0.0


def stt_dropped_frames() -> float:
    return REGISTRY.get_sample_value("kame_stt_dropped_frames_total") or 0.0


# --- helpers ----------------------------------------------------------------------------------------
async def wait_until(pred: Callable[[], bool], limit_s: float = 60.0) -> None:
    """Wait for a condition (a guard against hangs, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not pred():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def speech(tmp_path: Path, text: str) -> np.ndarray:
    """`text` spoken by flite's rms voice and sent down a phone line (8 kHz mu-law), as the engine gets
    it: float32 mono 24 kHz."""
    slug = re.sub(r"\W+", "_", text.lower()).strip("_")[:40]
    raw, phone, out = (tmp_path / f"{slug}{suffix}.wav" for suffix in ("", ".8k", ".24k"))
    subprocess.run(["flite", "-voice", "rms", "-t", text, "-o", str(raw)], check=True)
    # -D: no dither, so the same text always gives the same samples (sox dithers randomly by default)
    subprocess.run(["sox", "-D", str(raw), "-r", "8000", "-e", "mu-law", str(phone)], check=True)
    subprocess.run(
        ["sox", "-D", str(phone), "-r", "24000", "-e", "signed", "-b", "16", "-c", "1", str(out)], check=True
    )
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24_000 and w.getsampwidth() == 2
        data = w.readframes(w.getnframes())
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def frames_of(pcm: np.ndarray, lead_s: float = 0.3, tail_s: float = 1.2) -> list[np.ndarray]:
    """Cut audio into engine frames, with silence before and after (the final needs ~0.6 s of it)."""
    lead, tail = np.zeros(int(lead_s * 24_000), np.float32), np.zeros(int(tail_s * 24_000), np.float32)
    x = np.concatenate([lead, pcm, tail])
    x = np.concatenate([x, np.zeros(-len(x) % FRAME_SAMPLES, np.float32)])
    return list(x.reshape(-1, FRAME_SAMPLES))


async def feed_frames(backend: CallBackend, frames: list[np.ndarray]) -> None:
    for f in frames:
        backend.feed_audio(f)
        await asyncio.sleep(0.002)  # faster than real time, but in several STT batches


@dataclass
class Recorder:
    transcripts: list[tuple[str, bool]] = field(default_factory=list)
    oracles: list[tuple[str, int]] = field(default_factory=list)  # (text, candidate_id)
    errors: list[tuple[str, str]] = field(default_factory=list)
    loop_thread: int = field(default_factory=threading.get_ident)

    def on_transcript(self, text: str, final: bool, at: float) -> None:
        assert threading.get_ident() == self.loop_thread, "callbacks run on the event loop"
        self.transcripts.append((text, final))

    def on_oracle(self, text: str, triggered_at: float, candidate_id: int) -> None:
        assert threading.get_ident() == self.loop_thread
        self.oracles.append((text, candidate_id))

    def on_error(self, kind: str, detail: str) -> None:
        self.errors.append((kind, detail))

    @property
    def finals(self) -> list[str]:
        return [t for t, final in self.transcripts if final]


class ScriptedSTT:
    """Stands in for a recogniser: a frame filled with k/100 yields script[k] (or raises it)."""

    def __init__(self, script: dict[int, SttResult | Exception]) -> None:
        self.script = script
        self.closed = False

    def feed(self, pcm24k: np.ndarray) -> list[SttResult]:
        out = []
        for i in range(0, len(pcm24k), FRAME_SAMPLES):
            item = self.script.get(round(float(pcm24k[i]) * 100))
            if isinstance(item, Exception):
                raise item
            if item is not None:
                out.append(item)
        return out

    def flush(self) -> list[SttResult]:
        return []

    def reset(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def frame(k: int) -> np.ndarray:
    return np.full(FRAME_SAMPLES, k / 100, np.float32)


@pytest.fixture
def executor():
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-stt")
    yield pool
    pool.shutdown(wait=True)


def backend_for(rec: Recorder, executor, *, stt_factory, llm: LlmClient | None, call_id: str = "call-1"):
    return CallBackend(
        call_id,
        stt_factory=stt_factory,
        llm=llm,
        executor=executor,
        on_transcript=rec.on_transcript,
        on_oracle=rec.on_oracle,
        on_error=rec.on_error,
        policy=FAST_POLICY,
        stt_restart_backoff_s=0.01,
    )


# --- PocketsphinxSTT on real speech -----------------------------------------------------------------
def run_stt(stt, chunks: list[np.ndarray]) -> list[SttResult]:
    out: list[SttResult] = []
    for c in chunks:
        out.extend(stt.feed(c))
    return out


def test_pocketsphinx_transcribes_the_first_utterance_of_a_fresh_decoder(tmp_path: Path) -> None:
    pcm = speech(tmp_path, "I need to change my password please.")
    stt = PocketsphinxSTT(pool=DecoderPool(max_idle=0))  # cold: nothing decoded before
    results = run_stt(stt, frames_of(pcm))
    stt.close()
    partials = [r.text for r in results if not r.final]
    finals = [r.text for r in results if r.final]
    assert len(finals) == 1 and results[-1].final
    assert {"change", "password"} <= set(finals[0].split())
    assert len(partials) >= 3  # streamed, not just one result at the end
    assert all(a != b for a, b in zip(partials, partials[1:], strict=False))  # only when it changed
    assert any("change" in p for p in partials)


def test_pocketsphinx_does_not_depend_on_chunking(tmp_path: Path) -> None:
    pcm = np.concatenate(frames_of(speech(tmp_path, "My flight to Boston was cancelled this morning.")))
    pool = DecoderPool()
    a = PocketsphinxSTT(pool=pool)
    by_frame = [r for r in run_stt(a, list(pcm.reshape(-1, FRAME_SAMPLES))) if r.final]
    a.close()
    rng = np.random.default_rng(7)
    cuts = np.cumsum(rng.integers(1, 3000, size=len(pcm) // 1000)) + 7
    cuts = np.concatenate([[0, 7], cuts[cuts < len(pcm)], [len(pcm)]])
    b = PocketsphinxSTT(pool=pool)
    chunks = []
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):  # a 7-sample first chunk, empties in between
        chunks += [pcm[s:e], pcm[:0]]
    by_chunk = [r for r in run_stt(b, chunks) if r.final]
    b.close()
    assert by_frame == by_chunk
    assert "boston" in by_frame[0].text


def test_pocketsphinx_segments_utterances_and_flushes(tmp_path: Path) -> None:
    one = speech(tmp_path, "I would like to order a large pizza with cheese.")
    two = speech(tmp_path, "My flight to Boston was cancelled this morning.")
    stt = PocketsphinxSTT()
    finals = [r.text for r in run_stt(stt, frames_of(one) + frames_of(two, tail_s=0.2)) if r.final]
    assert len(finals) == 1 and "pizza" in finals[0]  # the second one has not ended yet
    (last,) = stt.flush()  # end of call: close it now
    assert last.final and "boston" in last.text
    assert run_stt(stt, frames_of(np.zeros(0, np.float32), tail_s=2.0)) == []  # silence: nothing
    stt.close()


def test_pocketsphinx_reset_drops_the_utterance(tmp_path: Path) -> None:
    stt = PocketsphinxSTT()
    run_stt(stt, frames_of(speech(tmp_path, "I need to change my password please."), tail_s=0.1))
    stt.reset()
    assert run_stt(stt, frames_of(np.zeros(0, np.float32), tail_s=1.5)) == []
    assert stt.flush() == []
    stt.close()


def test_decoders_are_pooled_and_restart_from_the_phone_cmn(tmp_path: Path) -> None:
    pool = DecoderPool(max_idle=2)
    stt = PocketsphinxSTT(pool=pool)
    run_stt(stt, frames_of(speech(tmp_path, "Can I speak to the manager about my bill?")))
    decoder = stt._decoder
    assert decoder is not None
    phone_cmn = [float(v) for v in TELEPHONE_CMN.split(",")]
    assert not np.allclose([float(v) for v in decoder.get_cmn().split(",")], phone_cmn, atol=0.01)  # adapted
    stt.close()
    stt.close()  # idempotent
    assert (pool.created, pool.idle) == (1, 1)
    again = pool.acquire()
    assert again is decoder and pool.created == 1  # reused, not rebuilt
    assert np.allclose([float(v) for v in again.get_cmn().split(",")], phone_cmn, atol=0.01)


def test_make_stt_kinds() -> None:
    assert isinstance(make_stt("pocketsphinx")(), PocketsphinxSTT)
    null = make_stt("none")()
    assert isinstance(null, NullSTT) and null.feed(frame(5)) == []
    with pytest.raises(ValueError, match="whisper"):
        make_stt("whisper")


# --- conversation -----------------------------------------------------------------------------------
def test_conversation_rebuilds_bot_words_and_renders_chat_turns() -> None:
    conv = Conversation(system_prompt="SYS")
    for piece in ["▁Hel", "lo", "", "▁there", "<pad>", ""]:
        conv.bot_piece(piece)
    conv.caller_partial("i want to")
    conv.caller_final("i want to book a table")
    conv.bot_piece("▁Sure")
    conv.bot_piece(",")
    conv.caller_final("for two")  # a caller final lands in the middle of the bot's word...
    conv.bot_piece("▁what")
    conv.caller_partial("at seven")
    assert conv.bot_text == "Hello there Sure, what"
    assert conv.messages() == [
        {"role": "system", "content": "SYS"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "i want to book a table"},
        {"role": "assistant", "content": "Sure,"},
        {"role": "user", "content": "for two"},
        {"role": "assistant", "content": "what"},
        {"role": "user", "content": "at seven"},  # the pending partial is the last user text
    ]
    assert (conv.committed_words, conv.pending_words) == (8, 2)


def test_conversation_merges_partial_into_the_open_user_turn_and_continues_split_words() -> None:
    conv = Conversation()
    conv.bot_piece("▁Hel")
    conv.caller_final("hi")
    conv.bot_piece("lo")  # the rest of "Hello", after the caller's final
    conv.caller_final("um")
    conv.caller_partial("  what   time ")
    msgs = conv.messages()
    assert msgs[0]["role"] == "system" and "30 words" in msgs[0]["content"]
    assert msgs[1:] == [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "hi um what time"}]
    conv.caller_final("")  # an empty final drops the partial only
    assert conv.messages()[-1] == {"role": "user", "content": "hi um"}


# --- LLM client against the real server -------------------------------------------------------------
async def test_stream_draft_yields_growing_drafts(llm_server: FakeLlm) -> None:
    llm = make_llm(llm_server)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "what time do you open"}]
    requests_before = llm_requests()
    drafts = [d async for d in llm.stream_draft(messages, call_id="c1")]
    await llm.aclose()
    assert llm_requests() == requests_before + 1  # one request, however many chunks
    answer = answer_for(messages)
    assert drafts[-1] == answer and len(drafts) == len(answer.split(" "))
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(drafts, drafts[1:], strict=False))
    (req,) = llm_server.requests
    assert req["model"] == "kame-test" and req["stream"] is True and req["messages"] == messages


@pytest.mark.parametrize(
    ("mode", "status", "kind"),
    [
        ("status", 500, "server_error"),
        ("status", 503, "server_error"),
        ("status", 429, "rate_limited"),
        ("status", 401, "other"),
        ("malformed", 0, "malformed"),
        ("broken", 0, "malformed"),
        ("error_event", 0, "server_error"),
    ],
)
async def test_stream_draft_classifies_failures(
    llm_server: FakeLlm, caplog: pytest.LogCaptureFixture, mode: str, status: int, kind: str
) -> None:
    llm_server.mode, llm_server.status = mode, status
    llm = make_llm(llm_server)
    before, requests_before = llm_errors(kind), llm_requests()
    caplog.set_level(logging.DEBUG)
    got: list[str] = []
    with pytest.raises(LlmError) as err:
        async for draft in llm.stream_draft([{"role": "user", "content": "hello"}], call_id="call-xyz"):
            got.append(draft)
    await llm.aclose()
    assert err.value.kind == kind
    assert llm_errors(kind) == before + 1
    assert llm_requests() == requests_before + 1  # a failed request is a request: errors / requests
    assert "call-xyz" in caplog.text and kind in caplog.text
    assert API_KEY not in caplog.text and API_KEY not in str(err.value)
    if mode in ("malformed", "broken"):
        assert got and got[-1] == "Sure, about hello,"  # what came before the break was delivered


async def test_stream_draft_timeouts(llm_server: FakeLlm) -> None:
    before = llm_errors("timeout")
    llm_server.delay_s = 2.0  # no response headers in time
    llm = make_llm(llm_server, timeout_s=0.3)
    with pytest.raises(LlmError, match="timeout"):
        async for _ in llm.stream_draft([{"role": "user", "content": "x"}]):
            pass
    llm_server.delay_s, llm_server.chunk_delay_s = 0.0, 2.0  # a stream that stalls
    got = []
    with pytest.raises(LlmError, match="timeout"):
        async for draft in llm.stream_draft([{"role": "user", "content": "x"}]):
            got.append(draft)
    await llm.aclose()
    assert got == ["Sure,"]
    assert llm_errors("timeout") == before + 2


async def test_stream_draft_slow_stream_within_timeout_completes(llm_server: FakeLlm) -> None:
    llm_server.chunk_delay_s = 0.05
    llm = make_llm(llm_server, timeout_s=2.0)
    messages = [{"role": "user", "content": "slow please"}]
    drafts = [d async for d in llm.stream_draft(messages)]
    await llm.aclose()
    assert drafts[-1] == answer_for(messages)


async def test_stream_draft_connection_refused() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before, requests_before = llm_errors("connection"), llm_requests()
    llm = LlmClient(LlmConfig(model="m", base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY))
    with pytest.raises(LlmError) as err:
        async for _ in llm.stream_draft([{"role": "user", "content": "x"}]):
            pass
    await llm.aclose()
    assert err.value.kind == "connection" and llm_errors("connection") == before + 1
    assert llm_requests() == requests_before + 1  # counted before it was sent: it never reached a server


async def test_abandoning_a_draft_closes_the_stream(llm_server: FakeLlm) -> None:
    llm_server.chunk_delay_s = 0.05
    llm = make_llm(llm_server)
    drafts = llm.stream_draft([{"role": "user", "content": "long answer"}])
    assert await anext(drafts) == "Sure,"
    await drafts.aclose()
    await wait_until(lambda: llm_server.disconnects == 1)
    await llm.aclose()


# --- the back-end, end to end -----------------------------------------------------------------------
def last_user(request: dict) -> str:
    return next(m["content"] for m in reversed(request["messages"]) if m["role"] == "user")


async def run_call(
    tmp_path: Path, server: FakeLlm, llm: LlmClient, executor, sentence: str, call_id: str, pool: DecoderPool
) -> tuple[Recorder, CallBackend]:
    rec = Recorder()
    backend = backend_for(rec, executor, stt_factory=lambda: PocketsphinxSTT(pool=pool), llm=llm, call_id=call_id)
    await backend.start()
    await feed_frames(backend, frames_of(speech(tmp_path, sentence)))
    await wait_until(lambda: bool(rec.finals))
    final = rec.finals[0]
    # The server was asked with the caller's final words, and that request's answer became the oracle.
    await wait_until(lambda: any(final in last_user(r) for r in server.requests))
    request = next(r for r in server.requests if final in last_user(r))
    await wait_until(lambda: bool(rec.oracles) and rec.oracles[-1][0] == answer_for(request["messages"]))
    return rec, backend


async def test_speech_reaches_the_llm_and_its_answer_becomes_the_oracle(
    tmp_path: Path, llm_server: FakeLlm, executor
) -> None:
    llm = make_llm(llm_server)
    pool = DecoderPool()
    rec, backend = await run_call(
        tmp_path, llm_server, llm, executor, "My flight to Boston was cancelled this morning.", "call-A", pool
    )
    assert {"boston", "morning"} <= set(rec.finals[0].split())
    assert [t for t, final in rec.transcripts if not final]  # partials came first
    request = llm_server.requests[-1]
    assert request["messages"][0]["role"] == "system"
    assert "boston" in last_user(request)
    # Drafts of one candidate grow; a new candidate id starts a new text.
    last_id = rec.oracles[-1][1]
    texts = [t for t, cid in rec.oracles if cid == last_id]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert [cid for _, cid in rec.oracles] == sorted(cid for _, cid in rec.oracles)
    await backend.aclose()
    await backend.aclose()  # idempotent
    assert (pool.created, pool.idle) == (1, 1)  # the decoder went back for the next call
    await llm.aclose()


async def test_two_calls_at_once_each_get_their_own_answer(tmp_path: Path, llm_server: FakeLlm, executor) -> None:
    llm = make_llm(llm_server)
    pool = DecoderPool()
    (rec_a, a), (rec_b, b) = await asyncio.gather(
        run_call(tmp_path, llm_server, llm, executor, "I would like to order a large pizza with cheese.", "A", pool),
        run_call(tmp_path, llm_server, llm, executor, "I need to change my password please.", "B", pool),
    )
    assert "pizza" in rec_a.finals[0] and "password" in rec_b.finals[0]
    assert "pizza" in rec_a.oracles[-1][0] and "password" not in rec_a.oracles[-1][0]
    assert "password" in rec_b.oracles[-1][0] and "pizza" not in rec_b.oracles[-1][0]
    assert not any("password" in t for t, _ in rec_a.transcripts)
    await asyncio.gather(a.aclose(), b.aclose())
    assert pool.created == 2 and pool.idle == 2
    await llm.aclose()


@pytest.mark.parametrize(("mode", "status", "kind"), [("status", 500, "server_error"), ("status", 429, "rate_limited"),
                                                      ("broken", 0, "malformed")])  # fmt: skip
async def test_llm_failure_is_counted_the_call_goes_on_and_retries(
    llm_server: FakeLlm, executor, mode: str, status: int, kind: str
) -> None:
    llm_server.mode, llm_server.status, llm_server.failures_left = mode, status, 1
    llm = make_llm(llm_server)
    rec = Recorder()
    script: dict[int, SttResult | Exception] = {
        2: SttResult("what are your opening hours", final=True),
        3: SttResult("please", final=False),  # one word: not enough to trigger a request by itself
    }
    backend = backend_for(rec, executor, stt_factory=lambda: ScriptedSTT(script), llm=llm)
    before = llm_errors(kind)
    await backend.start()
    backend.feed_audio(frame(2))
    await wait_until(lambda: llm_errors(kind) == before + 1)
    assert ("llm_error", kind) in rec.errors
    backend.feed_audio(frame(3))  # the call goes on: the caller is still heard
    await wait_until(lambda: ("please", False) in rec.transcripts)
    # With no new trigger, the back-end retries on its own once the back-off has passed.
    await wait_until(lambda: len(llm_server.requests) == 2 and bool(rec.oracles))
    await wait_until(lambda: rec.oracles[-1][0] == answer_for(llm_server.requests[1]["messages"]))
    assert all("opening hours" in last_user(r) for r in llm_server.requests)
    assert len(llm_server.requests) == 2
    await backend.aclose()
    await llm.aclose()


async def test_a_final_is_answered_at_once_not_at_the_next_poll(llm_server: FakeLlm, executor) -> None:
    llm = make_llm(llm_server)
    rec = Recorder()
    script: dict[int, SttResult | Exception] = {1: SttResult("what time do you open", final=True)}
    slow_poll = OraclePolicyConfig(poll_interval_s=30.0)  # the periodic poll alone would wait 30 s
    backend = CallBackend(
        "call-1", stt_factory=lambda: ScriptedSTT(script), llm=llm, executor=executor,
        on_transcript=rec.on_transcript, on_oracle=rec.on_oracle, policy=slow_poll,
    )
    await backend.start()
    backend.feed_audio(frame(1))
    await wait_until(lambda: bool(rec.oracles), limit_s=10)
    assert len(llm_server.requests) == 1
    await backend.aclose()
    await llm.aclose()
    # With the paper's exact timing, nothing is asked before the poll.
    rec2, llm2 = Recorder(), make_llm(llm_server)
    paper = CallBackend(
        "call-2", stt_factory=lambda: ScriptedSTT(script), llm=llm2, executor=executor,
        on_transcript=rec2.on_transcript, on_oracle=rec2.on_oracle,
        policy=OraclePolicyConfig(poll_interval_s=30.0, react_to_updates=False),
    )
    await paper.start()
    paper.feed_audio(frame(1))
    await wait_until(lambda: bool(rec2.transcripts), limit_s=10)
    await asyncio.sleep(0.3)
    assert len(llm_server.requests) == 1 and not rec2.oracles
    await paper.aclose()
    await llm2.aclose()


async def test_a_new_request_cancels_the_superseded_stream(llm_server: FakeLlm, executor) -> None:
    llm_server.chunk_delay_s = 1.0  # the first answer would take ~13 s
    llm = make_llm(llm_server)
    rec = Recorder()
    script: dict[int, SttResult | Exception] = {
        1: SttResult("hello there", final=False),
        2: SttResult("hello there i need help with my order", final=True),
    }
    backend = backend_for(rec, executor, stt_factory=lambda: ScriptedSTT(script), llm=llm)
    await backend.start()
    backend.feed_audio(frame(1))
    await wait_until(lambda: bool(rec.oracles))
    first_id = rec.oracles[0][1]
    llm_server.chunk_delay_s = 0.0
    backend.feed_audio(frame(2))
    second_answer = "Sure, about hello there i need help with my order, let me help you with that right away."
    await wait_until(lambda: bool(rec.oracles) and rec.oracles[-1][0] == second_answer)
    await wait_until(lambda: llm_server.disconnects >= 1)  # the old stream was closed, not drained
    ids = [cid for _, cid in rec.oracles]
    switch = ids.index(rec.oracles[-1][1])
    assert rec.oracles[-1][1] > first_id
    assert all(cid == rec.oracles[-1][1] for cid in ids[switch:])  # nothing stale after the switch
    old_texts = [t for t, cid in rec.oracles if cid == first_id]
    assert old_texts[-1] != answer_for([{"role": "user", "content": "hello there"}])  # cut short
    assert len(llm_server.requests) == 2
    await backend.aclose()
    await llm.aclose()


async def test_stt_failure_is_counted_and_the_stt_restarted(executor) -> None:
    made: list[ScriptedSTT] = []

    def factory() -> ScriptedSTT:
        made.append(ScriptedSTT({1: SttResult("hello", final=False), 9: RuntimeError("decoder exploded"),
                                 2: SttResult("i need a taxi", final=False)}))  # fmt: skip
        return made[-1]

    rec = Recorder()
    backend = backend_for(rec, executor, stt_factory=factory, llm=None)
    before = stt_errors()
    await backend.start()
    backend.feed_audio(frame(1))
    await wait_until(lambda: ("hello", False) in rec.transcripts)
    backend.feed_audio(frame(9))
    await wait_until(lambda: stt_errors() == before + 1)
    assert ("hello", True) in rec.transcripts  # what was heard stays heard
    assert rec.errors and rec.errors[0][0] == "stt_error" and "decoder exploded" in rec.errors[0][1]
    await wait_until(lambda: made[0].closed)
    await asyncio.sleep(0.05)  # past the restart back-off
    backend.feed_audio(frame(2))
    await wait_until(lambda: ("i need a taxi", False) in rec.transcripts)
    assert len(made) == 2
    await backend.aclose()
    assert made[1].closed


async def test_a_lagging_stt_drops_the_oldest_caller_frames_and_counts_them() -> None:
    """The real recogniser falls behind because every STT worker thread is busy: the call keeps only the
    newest audio, counts what it dropped, and goes on once a worker is free."""
    busy = threading.Event()
    release = threading.Event()
    one_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-stt-busy")
    rec = Recorder()
    backend = CallBackend(
        "lag",
        stt_factory=make_stt("pocketsphinx"),
        llm=None,
        executor=one_worker,
        on_transcript=rec.on_transcript,
        on_oracle=rec.on_oracle,
        max_pending_audio_s=0.24,  # 3 frames of 80 ms
    )
    try:
        one_worker.submit(lambda: (busy.set(), release.wait(30)))  # the only worker is taken
        assert busy.wait(5)
        await backend.start()
        before = stt_dropped_frames()
        for k in range(1, 11):  # 10 frames while no worker can take them: only the newest 3 can wait
            backend.feed_audio(frame(k))
        assert stt_dropped_frames() == before + 7
        release.set()
        await wait_until(lambda: not backend._audio)  # the STT drained what was kept
        backend.feed_audio(frame(11))  # caught up: nothing more is dropped
        await wait_until(lambda: not backend._audio)
        assert stt_dropped_frames() == before + 7
    finally:
        release.set()
        await backend.aclose()
        one_worker.shutdown(wait=True)


async def test_stt_only_without_llm_and_feeding_from_another_thread(executor) -> None:
    rec = Recorder()
    calls = 0

    def flaky_transcript(text: str, final: bool, at: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("engine bug")  # must not stop the call's STT
        rec.on_transcript(text, final, at)

    script = {
        1: SttResult("one", final=False),
        2: SttResult("one two", final=True),
        3: SttResult("three", final=False),
        4: SttResult("", final=True),  # the recogniser took "three" back: the turn still ended
    }
    stt = ScriptedSTT(script)  # type: ignore[arg-type]
    backend = CallBackend("t", stt_factory=lambda: stt, llm=None, executor=executor,
                          on_transcript=flaky_transcript, on_oracle=rec.on_oracle)  # fmt: skip
    await backend.start()
    feeder = threading.Thread(target=lambda: [backend.feed_audio(frame(k)) for k in (1, 2, 0, 3)])
    feeder.start()
    feeder.join()
    await wait_until(lambda: ("three", False) in rec.transcripts)
    assert rec.transcripts == [("one two", True), ("three", False)]  # "one" hit the failing callback
    assert backend.conversation.messages()[-1] == {"role": "user", "content": "one two three"}
    backend.feed_audio(frame(4))
    await wait_until(lambda: ("", True) in rec.transcripts)
    assert backend.conversation.messages()[-1] == {"role": "user", "content": "one two"}
    assert rec.oracles == []
    await backend.aclose()
    assert stt.closed


async def test_services_wire_config_into_calls(llm_server: FakeLlm) -> None:
    cfg = BackendConfig.from_env(
        {"OPENAI_BASE_URL": llm_server.base_url, "OPENAI_API_KEY": API_KEY, "KAME_LLM_MODEL": "my-model"},
        stt="none",
        policy=FAST_POLICY,
    )
    assert (cfg.llm_base_url, cfg.llm_api_key, cfg.llm_model) == (llm_server.base_url, API_KEY, "my-model")
    assert API_KEY not in repr(cfg)
    services = BackendServices(cfg)
    rec = Recorder()
    call = services.open_call("svc", rec.on_transcript, rec.on_oracle, rec.on_error)
    await call.start()
    call.feed_bot_text("▁Hi")
    for _ in range(5):
        call.feed_audio(frame(1))
    await asyncio.sleep(0.1)
    assert rec.transcripts == [] and call.conversation.bot_text == "Hi"  # --stt none hears nothing
    await call.aclose()
    await services.aclose()
    assert BackendConfig.from_env({}).llm_model == "gpt-4.1"
    stt_only = BackendServices(BackendConfig(stt="none", llm_enabled=False))
    assert stt_only.llm is None
    await stt_only.aclose()


async def test_services_warm_up_prebuilds_pooled_decoders() -> None:
    from engine.stt import DECODER_POOL

    services = BackendServices(BackendConfig(stt="pocketsphinx", llm_enabled=False))
    await services.warm_up(2)
    assert DECODER_POOL.idle >= 2
    await services.aclose()
