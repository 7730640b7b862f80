"""The STT + LLM back-end against real parts: flite speech through pocketsphinx, and a real local
OpenAI-compatible streaming server (aiohttp, SSE) that can be slow, fail, rate-limit or break."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import subprocess
import threading
import time
import wave
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from engine.interface import FRAME_SAMPLES, CallerTranscript
from engine.sampling import SamplingOverrides
from engine.service import EngineConfig, LocalEngine
from knowledge import backend as backend_module
from knowledge.agents import Agents
from knowledge.backend import BackendConfig, BackendServices, CallBackend
from knowledge.conversation import MAX_HISTORY_CHARS, TURN_SHARE, Conversation, ToolExchange
from knowledge.llm import LlmClient, LlmConfig, LlmError
from knowledge.oracle_policy import OraclePolicyConfig
from knowledge.stt import (
    TELEPHONE_CMN,
    DecoderPool,
    NullSTT,
    PocketsphinxConfig,
    PocketsphinxSTT,
    SttResult,
    make_stt,
)
from knowledge.tools import GOODBYE_LINE, MAX_RESULT_CHARS, CallTools, HttpSession

from .llm_server import FakeLlm, answer_for
from .polling import until

API_KEY = "sk-test-SECRET-0123456789"
FAST_POLICY = OraclePolicyConfig(backoff_initial_s=0.05, backoff_max_s=0.2)


def make_llm(server: FakeLlm, timeout_s: float = 10.0) -> LlmClient:
    return LlmClient(LlmConfig(model="kame-test", base_url=server.base_url, api_key=API_KEY, timeout_s=timeout_s))


def llm_errors(kind: str) -> float:
    return REGISTRY.get_sample_value("kame_llm_errors_total", {"kind": kind}) or 0.0


def llm_requests() -> float:
    return REGISTRY.get_sample_value("kame_llm_requests_total") or 0.0


def llm_cancelled() -> float:
    return REGISTRY.get_sample_value("kame_llm_requests_cancelled_total") or 0.0


def stt_errors() -> float:
    return REGISTRY.get_sample_value("kame_stt_errors_total") or 0.0


def stt_dropped_frames() -> float:
    return REGISTRY.get_sample_value("kame_stt_dropped_frames_total") or 0.0


# --- helpers ----------------------------------------------------------------------------------------
async def wait_until(pred: Callable[[], bool], limit_s: float = 60.0) -> None:
    """Wait for a condition of this back-end's threads and servers (a guard against hangs)."""
    await until(pred, within=limit_s, every=0.01)


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
    complete: list[bool] = field(default_factory=list)  # each draft's flag: its stream has ended
    triggered: list[float | None] = field(default_factory=list)  # each draft's triggered_at (oracle lag's start)
    errors: list[tuple[str, str]] = field(default_factory=list)
    loop_thread: int = field(default_factory=threading.get_ident)

    def on_transcript(self, text: str, final: bool, at: float) -> None:
        assert threading.get_ident() == self.loop_thread, "callbacks run on the event loop"
        self.transcripts.append((text, final))

    def on_oracle(self, text: str, triggered_at: float | None, candidate_id: int, complete: bool) -> None:
        assert threading.get_ident() == self.loop_thread
        self.oracles.append((text, candidate_id))
        self.triggered.append(triggered_at)
        self.complete.append(complete)

    def drafts_of(self, candidate_id: int) -> list[tuple[str, bool]]:
        return [(t, done) for (t, cid), done in zip(self.oracles, self.complete, strict=True) if cid == candidate_id]

    def on_error(self, kind: str, detail: str) -> None:
        self.errors.append((kind, detail))

    @property
    def finals(self) -> list[str]:
        return [t for t, final in self.transcripts if final]


@pytest.fixture
def executor():
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-stt")
    yield pool
    pool.shutdown(wait=True)


def backend_for(
    rec: Recorder,
    executor,
    *,
    stt_factory,
    llm: LlmClient | None,
    call_id: str = "call-1",
    policy: OraclePolicyConfig = FAST_POLICY,
):
    return CallBackend(
        call_id,
        stt_factory=stt_factory,
        llm=llm,
        executor=executor,
        on_transcript=rec.on_transcript,
        on_oracle=rec.on_oracle,
        on_error=rec.on_error,
        policy=policy,
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


def test_make_stt_kinds(tmp_path: Path) -> None:
    assert isinstance(make_stt("pocketsphinx")(), PocketsphinxSTT)
    null = make_stt("none")()
    assert isinstance(null, NullSTT) and null.feed(speech(tmp_path, "What time do you open?")) == []
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


def test_a_caller_talking_over_the_greeting_does_not_repeat_it() -> None:
    """The front-end goes on saying the greeting after the caller starts talking over it: the greeting turn
    already holds those words, so the rest of the greeting is not added again; what the bot says after the
    greeting (or instead of its rest) is."""
    greeting = "Thanks for calling Acme, how can I help you today?"
    conv = Conversation(system_prompt="S")
    conv.greet(greeting)
    for piece in ["▁Thanks", "▁for", "▁calling"]:
        conv.bot_piece(piece)
    conv.caller_partial("hi")  # the caller barges in mid-greeting
    for piece in ["▁Ac", "me", ",", "▁how", "▁can", "▁I", "▁help", "▁you", "▁today", "?"]:
        conv.bot_piece(piece)
    conv.caller_final("hi i need help")
    for piece in ["▁Sure", ",", "▁what", "▁with", "?"]:
        conv.bot_piece(piece)
    assert conv.messages()[1:] == [
        {"role": "assistant", "content": greeting},
        {"role": "user", "content": "hi i need help"},
        {"role": "assistant", "content": "Sure, what with?"},
    ]
    # The bot leaves the greeting for its own words once the caller has spoken: those are kept, and the
    # greeting turn holds what of it was said, not the rest the caller never heard (review, session 22).
    conv = Conversation(system_prompt="S")
    conv.greet(greeting)
    conv.bot_piece("▁Thanks")
    conv.caller_final("hello")
    for piece in ["▁for", "▁calling", "▁oh", "▁hi", "▁there"]:
        conv.bot_piece(piece)
    assert conv.messages()[1:] == [
        {"role": "assistant", "content": "Thanks for calling"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "oh hi there"},
    ]


def test_what_the_bot_says_after_the_whole_greeting_to_a_silent_caller_is_kept() -> None:
    """The greeting said to the end and the caller still silent: the bot's next words ("are you there?")
    were dropped as if they were the greeting again (review, session 22)."""
    conv = Conversation(system_prompt="S")
    conv.greet("Hello, how can I help?")
    for piece in ["▁Hello", ",", "▁how", "▁can", "▁I", "▁help", "?", "▁Are", "▁you", "▁there", "?"]:
        conv.bot_piece(piece)
    assert conv.messages()[1:] == [{"role": "assistant", "content": "Hello, how can I help? Are you there?"}]
    # Said in the front-end's own words, the greeting as written stands for them, whole.
    conv = Conversation(system_prompt="S")
    conv.greet("Hello, how can I help?")
    for piece in ["▁Hi", "▁there", ",", "▁what", "▁do", "▁you", "▁need"]:
        conv.bot_piece(piece)
    conv.caller_final("my order")
    conv.bot_piece("▁Sure")
    assert conv.messages()[1:] == [{"role": "assistant", "content": "Hello, how can I help?"},
                                   {"role": "user", "content": "my order"}, {"role": "assistant", "content": "Sure"}]


def test_the_bots_words_after_a_barge_in_on_the_greeting_reach_the_llm() -> None:
    """Once the caller starts talking (a partial is enough) the bot's new words are its own, not the greeting."""
    conv = Conversation(system_prompt="S")
    conv.greet("Hello, how can I help?")
    conv.caller_partial("I need")
    conv.bot_piece("▁Sure")
    assert any(m["role"] == "assistant" and "Sure" in m["content"] for m in conv.messages()), conv.messages()


def test_a_long_calls_requests_carry_only_the_newest_turns_that_fit() -> None:
    """Every request carries the history, several a second: a long call's must not grow without end (past a
    self-hosted model's context every request would fail). The newest turns within the bound are sent, the
    newest always, a tool exchange whole, and the caller's unfinished words on top."""
    conv = Conversation(max_history_chars=400)
    for i in range(50):
        conv.caller_final(f"question number {i} " + "x" * 20)
        conv.bot_piece(f"\u2581answer{i}")
    conv.tool_exchange(ToolExchange(calls=[{"id": "c1", "type": "function", "function": {"name": "f",
                                                                                         "arguments": "{}"}}],
                                    results=[("c1", "r" * 150)]))  # fmt: skip
    conv.caller_partial("and one more thing")
    msgs = conv.messages()
    assert msgs[0]["role"] == "system"
    history = msgs[1:]
    assert sum(len(str(m.get("content") or "")) for m in history[:-1]) <= 400  # the partial on top
    assert history[-1] == {"role": "user", "content": "and one more thing"}
    assert [m["role"] for m in history[-3:-1]] == ["assistant", "tool"]  # the exchange whole, newest
    assert history[-4]["content"] == "answer49" and "question number 49" in history[-5]["content"]
    assert not any("question number 0 " in str(m.get("content")) for m in history)
    assert history[0]["role"] != "tool"  # never half an exchange
    # A single turn over its share of the bound is sent clipped, its newest words kept from a word's start.
    big = Conversation(max_history_chars=100)
    big.caller_final("so " * 20 + "what time do you open")
    (only,) = big.messages()[1:]
    assert only["role"] == "user" and only["content"] == "… so what time do you open"


def test_a_turn_that_grows_without_end_keeps_the_prompt_bounded_and_the_history() -> None:
    """A caller who talks on with no reply (a recorded message, a dictation) builds one user turn; a bot
    that talks on alone, one assistant turn. Sent whole, every request grew with the call (210 KB after
    3000 finals) and one such turn crowded out every earlier one."""
    conv = Conversation()
    for i in range(30):
        conv.caller_final(f"order line {i} please add item {i}")
        conv.bot_piece(f"\u2581added{i}")
    for i in range(3000):
        conv.caller_final(f"and then the message goes on with words number {i}")
    conv.caller_partial("are you still there")
    msgs = conv.messages()
    history = msgs[1:]
    assert sum(len(str(m.get("content") or "")) for m in history) <= MAX_HISTORY_CHARS + 100
    last = history[-1]["content"]
    assert last.startswith("… ") and last.endswith("words number 2999 are you still there")
    assert len(last) <= MAX_HISTORY_CHARS // TURN_SHARE + 30
    assert any("order line 29" in str(m["content"]) for m in history)  # earlier turns still there
    assert any("order line 0 " in str(m["content"]) for m in history)  # all 30 fit beside the clipped one

    conv = Conversation()
    for i in range(30):
        conv.caller_final(f"order line {i} please add item {i}")
        conv.bot_piece(f"\u2581added{i}")
    for _ in range(4000):  # the caller went quiet; the bot talks on
        conv.bot_piece("\u2581blah")
    conv.caller_final("hello are you still there")
    history = conv.messages()[1:]
    assert history[-1] == {"role": "user", "content": "hello are you still there"}
    assert history[-2]["role"] == "assistant" and len(history[-2]["content"]) <= MAX_HISTORY_CHARS // TURN_SHARE + 2
    assert any("order line 29" in str(m["content"]) for m in history)


def test_an_old_oversized_tool_exchange_is_left_out_not_the_history_before_it() -> None:
    conv = Conversation(max_history_chars=2000)
    conv.caller_final("my order number is 12345")
    conv.bot_piece("\u2581checking")
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    conv.tool_exchange(ToolExchange(calls=[call], results=[("c1", "r" * 3000)]))
    history = conv.messages()[1:]
    assert history[-2]["role"] == "assistant" and history[-1]["role"] == "tool"  # the newest is sent whole
    conv.caller_final("thanks and when does it arrive")
    history = conv.messages()[1:]
    # Still the newest exchange, behind the caller's next words: whole (else the LLM calls the tool again).
    assert history[-1] == {"role": "user", "content": "thanks and when does it arrive"}
    assert history[-2]["role"] == "tool" and history[-3].get("tool_calls") == [call]
    conv.bot_piece("\u2581tomorrow")
    again = {"id": "c2", "type": "function", "function": {"name": "track", "arguments": "{}"}}
    conv.tool_exchange(ToolExchange(calls=[again], results=[("c2", "in transit")]))
    conv.caller_final("great thank you")
    history = conv.messages()[1:]
    assert not any(m.get("tool_calls") == [call] for m in history)  # the old oversized one: left out, whole
    assert all(m.get("tool_call_id") != "c1" for m in history)
    assert history[0] == {"role": "user", "content": "my order number is 12345"}  # older words still fit
    assert [m["role"] for m in history[-4:]] == ["assistant", "assistant", "tool", "user"]


def test_the_newest_tool_exchange_never_crowds_out_the_question_that_asked_for_it() -> None:
    """Four lookups answered at the tools' cap (4,000 characters each) spent the whole budget: the request about
    their results carried the system prompt, the calls and the results, and not the caller's question."""
    conv = Conversation()
    conv.caller_final("hello")
    conv.bot_piece("\u2581hi")
    conv.caller_final("what is the status of orders one to four")
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "order_status", "arguments": "{}"}}
             for i in range(4)]  # fmt: skip
    conv.tool_exchange(ToolExchange(calls=calls, results=[(f"c{i}", "r" * MAX_RESULT_CHARS) for i in range(4)]))
    history = conv.messages()[1:]
    assert [m["role"] for m in history][-5:] == ["assistant", "tool", "tool", "tool", "tool"]
    assert any(m["content"] == "what is the status of orders one to four" for m in history if m["role"] == "user")
    assert history[0] == {"role": "user", "content": "hello"}


def test_the_newest_tool_exchange_is_sent_after_much_talk_behind_it() -> None:
    """The newest exchange is sent whatever the budget, even when the talk after it fills the budget: the loop
    stopped at the budget before it reached the exchange, the result dropped out of the prompt, and the LLM
    could call the tool again (review, session 22)."""
    conv = Conversation(max_history_chars=300)
    conv.caller_final("where is my order 4217")
    call = {"id": "c1", "type": "function", "function": {"name": "order_status", "arguments": "{}"}}
    conv.tool_exchange(ToolExchange(calls=[call], results=[("c1", "shipped on Monday")]))
    for i in range(20):  # 20 exchanges of talk after it, far past the budget
        conv.caller_final(f"and another question number {i} about the delivery")
        conv.bot_piece(f"\u2581answer{i}")
    history = conv.messages()[1:]
    assert any(m.get("tool_calls") == [call] for m in history)
    tool = next(i for i, m in enumerate(history) if m["role"] == "tool")
    assert history[tool]["content"] == "shipped on Monday" and history[tool - 1].get("tool_calls") == [call]
    assert history[-1]["content"] == "answer19" and "question number 19" in history[-2]["content"]
    assert not any("question number 0 " in str(m.get("content")) for m in history)  # the middle left out


# --- LLM client against the real server -------------------------------------------------------------
async def test_stream_draft_yields_growing_drafts(llm_server: FakeLlm) -> None:
    llm = make_llm(llm_server)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "what time do you open"}]
    requests_before = llm_requests()
    drafts = [d async for d in llm.stream_draft(messages, call_id="c1", request_id="c1-7")]
    await llm.aclose()
    assert llm_requests() == requests_before + 1  # one request, however many chunks
    answer = answer_for(messages)
    assert drafts[-1] == answer and len(drafts) == len(answer.split(" "))
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(drafts, drafts[1:], strict=False))
    (req,) = llm_server.requests
    assert req["model"] == "kame-test" and req["stream"] is True and req["messages"] == messages
    assert llm_server.request_ids == ["c1-7"]  # so the LLM server's logs can be joined with ours


async def test_a_surrogate_pair_split_across_chunks_becomes_its_character(llm_server: FakeLlm) -> None:
    """JSON carries UTF-16 surrogates, and a server may split a pair across two chunks: joined as they come,
    those are two lone surrogates, which no UTF-8 encoder (SentencePiece's included) takes."""
    llm_server.mode = "split_pair"
    llm = make_llm(llm_server)
    drafts = [d async for d in llm.stream_draft([{"role": "user", "content": "hello"}], call_id="c1")]
    await llm.aclose()
    for draft in drafts:
        draft.encode("utf-8")  # every draft is valid Unicode
    assert any(d.endswith("\ufffd") for d in drafts)  # half a pair shows as U+FFFD until the other half comes
    assert "\U0001f600" in drafts[-1] and "\ufffd" not in drafts[-1]


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
    assert API_KEY[:12] not in caplog.text and API_KEY[:12] not in str(err.value)  # nor its first part
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


@pytest.mark.parametrize("mode", ["hang", "drip"])
async def test_a_server_that_never_sends_a_first_token_is_a_timeout(llm_server: FakeLlm, mode: str) -> None:
    """Headers, then no token: silence (hang), or keep-alives and text-less chunks every 100 ms (drip: each
    read succeeds, so the client's per-read timeout never fires). Either way an error, counted, at the
    request's timeout; and the stream is closed, not left dripping."""
    llm_server.mode = mode
    llm = make_llm(llm_server, timeout_s=0.5)
    before, requests_before = llm_errors("timeout"), llm_requests()
    started = time.monotonic()
    with pytest.raises(LlmError) as err:
        async for _ in llm.stream_draft([{"role": "user", "content": "x"}]):
            pass
    elapsed = time.monotonic() - started
    await llm.aclose()
    assert err.value.kind == "timeout" and 0.4 < elapsed < 3.0
    assert llm_errors("timeout") == before + 1 and llm_requests() == requests_before + 1
    if mode == "drip":
        assert "no first token within 0.5s" in str(err.value)
        await wait_until(lambda: llm_server.disconnects == 1)


async def test_a_stream_that_only_drips_after_its_first_words_times_out(llm_server: FakeLlm) -> None:
    """Three words, then keep-alives and text-less chunks every 100 ms: each read succeeds, so neither the
    first-token deadline (lifted) nor the per-read timeout ever fired, and the answer hung for good. Now a
    timeout after idle_timeout_s without progress, counted, with the words so far delivered; stream closed."""
    llm_server.drip_at_chunk = 3
    llm = LlmClient(LlmConfig(model="m", base_url=llm_server.base_url, api_key=API_KEY, idle_timeout_s=0.5))
    before = llm_errors("timeout")
    got: list[str] = []
    started = time.monotonic()
    with pytest.raises(LlmError) as err:
        async for draft in llm.stream_draft([{"role": "user", "content": "hello"}], call_id="c-drip"):
            got.append(draft)
    elapsed = time.monotonic() - started
    await llm.aclose()
    assert err.value.kind == "timeout" and "no progress for 0.5s" in str(err.value) and 0.4 < elapsed < 3.0
    assert llm_errors("timeout") == before + 1
    assert got[-1] == "Sure, about hello,"  # what came before the stall was delivered
    await wait_until(lambda: llm_server.disconnects == 1, limit_s=5)


async def test_a_request_that_trickles_past_its_cap_times_out(llm_server: FakeLlm) -> None:
    """A word every 100 ms, without end: never idle, so only the whole request's cap ends it."""
    llm_server.mode, llm_server.chunk_delay_s = "endless", 0.1
    llm = LlmClient(LlmConfig(model="m", base_url=llm_server.base_url, api_key=API_KEY, max_request_s=1.0))
    before = llm_errors("timeout")
    got: list[str] = []
    started = time.monotonic()
    with pytest.raises(LlmError) as err:
        async for draft in llm.stream_draft([{"role": "user", "content": "hello"}]):
            got.append(draft)
    elapsed = time.monotonic() - started
    await llm.aclose()
    assert err.value.kind == "timeout" and "not done within 1s" in str(err.value) and 0.9 < elapsed < 3.0
    assert llm_errors("timeout") == before + 1 and got and got[-1].startswith("word0 word1")
    await wait_until(lambda: llm_server.disconnects == 1, limit_s=5)


async def test_a_consumer_holding_a_draft_is_not_cut_off_by_the_idle_deadline(llm_server: FakeLlm) -> None:
    """The deadlines are lifted while the consumer holds a draft: its own slow work is not the server's stall."""
    llm = LlmClient(LlmConfig(model="m", base_url=llm_server.base_url, api_key=API_KEY, idle_timeout_s=0.2))
    got: list[str] = []
    async for draft in llm.stream_draft([{"role": "user", "content": "hello"}]):
        got.append(draft)
        if len(got) == 2:
            await asyncio.sleep(0.5)
    await llm.aclose()
    assert got[-1] == answer_for([{"role": "user", "content": "hello"}])


async def test_a_reply_without_end_is_cut_at_a_word_and_the_stream_closed(
    llm_server: FakeLlm, caplog: pytest.LogCaptureFixture
) -> None:
    """A server ignoring max_tokens streamed forever (each update re-tokenized whole by the engine). At
    max_draft_chars the reply ends: cut at a word, the stream closed, counted and logged once."""
    llm_server.mode = "endless"
    llm = LlmClient(LlmConfig(model="m", base_url=llm_server.base_url, api_key=API_KEY, max_draft_chars=100))
    before = llm_errors("too_long")
    caplog.set_level(logging.WARNING)
    drafts = [d async for d in llm.stream_draft([{"role": "user", "content": "hello"}], call_id="c-long")]
    await llm.aclose()
    last = drafts[-1]
    assert 90 < len(last) <= 100 and last == " ".join(f"word{i}" for i in range(len(last.split(" "))))
    assert llm_errors("too_long") == before + 1
    assert caplog.text.count("c-long") == 1 and "100 chars" in caplog.text
    await wait_until(lambda: llm_server.disconnects == 1, limit_s=5)


async def test_a_cut_reply_reaches_the_engine_complete(llm_server: FakeLlm, executor) -> None:
    llm_server.mode = "endless"
    llm = LlmClient(LlmConfig(model="m", base_url=llm_server.base_url, api_key=API_KEY, max_draft_chars=60))
    rec = Recorder()
    backend = backend_for(rec, executor, stt_factory=NullSTT, llm=llm)
    await backend.start()
    backend._handle_transcript(SttResult("tell me everything", final=True), time.monotonic())
    await wait_until(lambda: bool(rec.complete) and rec.complete[-1], limit_s=10)
    text, done = rec.drafts_of(1)[-1]
    assert done and text.endswith(f"word{len(text.split(' ')) - 1}") and len(text) <= 60
    assert not rec.errors and len(llm_server.requests) == 1
    await backend.aclose()
    await llm.aclose()


async def test_an_empty_reply_is_a_counted_error_that_is_retried(
    llm_server: FakeLlm, executor, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream that ends with no text and no tool call (a reasoning model that spent its whole budget,
    finish_reason "length") was a silent success: the caller got no answer and nothing asked again."""
    llm_server.mode, llm_server.failures_left = "empty", 1
    llm = make_llm(llm_server)
    caplog.set_level(logging.WARNING)
    before = llm_errors("empty")
    with pytest.raises(LlmError) as err:
        async for _ in llm.stream_draft([{"role": "user", "content": "hi"}], call_id="c-empty"):
            pass
    assert err.value.kind == "empty" and llm_errors("empty") == before + 1
    assert "c-empty" in caplog.text and "finish_reason length" in caplog.text
    # In a call: the policy's failure path, so it is retried and the answer comes.
    llm_server.failures_left = 1
    rec = Recorder()
    backend = backend_for(rec, executor, stt_factory=NullSTT, llm=llm)
    await backend.start()
    backend._handle_transcript(SttResult("are you there", final=True), time.monotonic())
    answer = answer_for([{"role": "user", "content": "are you there"}])
    await wait_until(lambda: bool(rec.oracles) and rec.oracles[-1][0] == answer, limit_s=10)
    assert ("llm_error", "empty") in rec.errors and llm_errors("empty") == before + 2
    await backend.aclose()
    await llm.aclose()


@pytest.mark.parametrize(("status", "header", "wait"), [(429, "3", 3.0), (503, "1.5", 1.5), (429, "3600", 60.0),
                                                      (429, "soon", None), (500, "3", None),
                                                      (429, "Wed, 21 Oct 99999999999 07:28:00 GMT", None)])  # fmt: skip
async def test_retry_after_is_carried_in_the_error(
    llm_server: FakeLlm, status: int, header: str, wait: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A date past datetime's years raised OverflowError out of the client: a crash, logged with the server's
    error body in its traceback, unscrubbed (this server echoes the API key in it, as some proxies do)."""
    caplog.set_level(logging.INFO)
    llm_server.mode, llm_server.status, llm_server.retry_after = "status", status, header
    llm = make_llm(llm_server)
    with pytest.raises(LlmError) as err:
        async for _ in llm.stream_draft([{"role": "user", "content": "hi"}]):
            pass
    await llm.aclose()
    assert err.value.retry_after_s == wait
    assert API_KEY not in caplog.text and API_KEY not in str(err.value)


async def test_a_429s_retry_after_holds_the_retry_back(llm_server: FakeLlm, executor) -> None:
    """Retry-After was ignored: the back-end asked again after its own 50 ms back-off, to be refused again."""
    llm_server.mode, llm_server.status, llm_server.retry_after, llm_server.failures_left = "status", 429, "1", 1
    llm = make_llm(llm_server)
    rec = Recorder()
    backend = backend_for(rec, executor, stt_factory=NullSTT, llm=llm)
    await backend.start()
    backend._handle_transcript(SttResult("are you open", final=True), time.monotonic())
    await wait_until(lambda: bool(rec.errors), limit_s=5)
    failed_at = time.monotonic()
    await wait_until(lambda: len(llm_server.requests) == 2, limit_s=5)
    assert time.monotonic() - failed_at >= 0.9
    await wait_until(lambda: bool(rec.oracles) and rec.complete[-1], limit_s=5)
    await backend.aclose()
    await llm.aclose()


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
    llm_server.chunk_delay_s = 0.02  # a word every 20 ms: faster than the engine's one token per 80 ms
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
    # The first word went at once; the growth reached the engine at most once per 80 ms frame, whole at the end.
    answer = answer_for(llm_server.requests[-1]["messages"])
    assert texts[0] == answer.split(" ")[0] and texts[-1] == answer
    assert 2 <= len(texts) < len(answer.split(" "))
    # Only the stream's end marks the draft complete (the engine holds the last word back until then).
    assert [done for _, done in rec.drafts_of(last_id)] == [False] * (len(texts) - 1) + [True]
    assert [cid for _, cid in rec.oracles] == sorted(cid for _, cid in rec.oracles)
    assert llm_server.request_ids[-1] == f"call-A-{last_id}"  # each request names its call and candidate
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
    tmp_path: Path,
    llm_server: FakeLlm,
    executor,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    status: int,
    kind: str,
) -> None:
    llm_server.mode, llm_server.status, llm_server.failures_left = mode, status, 1
    llm = make_llm(llm_server)
    pool = DecoderPool()
    rec = Recorder()
    # No growth trigger: after the first request, only a final or a retry can ask again.
    finals_only = replace(FAST_POLICY, min_word_delta=100)
    backend = backend_for(rec, executor, stt_factory=lambda: PocketsphinxSTT(pool=pool), llm=llm, policy=finals_only)
    caplog.set_level(logging.DEBUG, logger="knowledge.backend")  # the request log names its trigger
    before = llm_errors(kind)
    await backend.start()
    # The whole utterance at once (as after a stall): the STT decodes it in one batch and reports only its
    # final, so exactly one request is asked, and it is the one that fails.
    for f in frames_of(speech(tmp_path, "My flight to Boston was cancelled this morning.")):
        backend.feed_audio(f)
    await wait_until(lambda: llm_errors(kind) == before + 1)
    assert ("llm_error", kind) in rec.errors
    (final,) = rec.finals
    assert "boston" in final
    (failed,) = llm_server.requests
    assert last_user(failed) == final  # the caller's real words reached the LLM
    if mode == "broken":  # 3 words came before the break: the engine got all of them, none held back
        first_candidate = [text for text, cid in rec.oracles if cid == 1]
        assert first_candidate[-1] == " ".join(answer_for(failed["messages"]).split(" ")[:3])
        assert rec.drafts_of(1)[-1][1]  # the break ends the stream: its last word is settled too
    # The call goes on: the caller is still heard (an open utterance, so partials only, no new trigger).
    more = frames_of(speech(tmp_path, "I would like to order a large pizza with cheese."), tail_s=0.1)
    await feed_frames(backend, more)
    await wait_until(lambda: any("pizza" in t for t, is_final in rec.transcripts if not is_final))
    if mode == "broken":
        # Words went out before the break: a retry would start the answer over from "Sure," (the caller would
        # hear it twice). None comes, however long the back-off has passed.
        await asyncio.sleep(1.0)
        assert len(llm_server.requests) == 1 and "(retry)" not in caplog.text
        await backend.aclose()
        await llm.aclose()
        return
    # With no new trigger, the back-end retries on its own once the back-off has passed.
    await wait_until(lambda: len(llm_server.requests) >= 2)
    retry = llm_server.requests[1]
    await wait_until(lambda: bool(rec.oracles) and rec.oracles[-1][0] == answer_for(retry["messages"]))
    assert "LLM request 2 (retry)" in caplog.text
    assert final in last_user(retry)  # the retry asks about what was said (and what was heard since)
    assert len(llm_server.requests) == 2 and rec.finals == [final]
    await backend.aclose()
    await llm.aclose()


async def test_a_final_is_answered_at_once_not_at_the_next_poll(
    tmp_path: Path, llm_server: FakeLlm, executor, caplog: pytest.LogCaptureFixture
) -> None:
    frames = frames_of(speech(tmp_path, "What time do you open?"))
    llm = make_llm(llm_server)
    pool = DecoderPool()
    caplog.set_level(logging.DEBUG, logger="knowledge.backend")  # the request log names its trigger
    rec = Recorder()
    slow_poll = OraclePolicyConfig(poll_interval_s=30.0)  # the periodic poll alone would wait 30 s
    backend = backend_for(rec, executor, stt_factory=lambda: PocketsphinxSTT(pool=pool), llm=llm, policy=slow_poll)
    await backend.start()
    await feed_frames(backend, frames)
    await wait_until(lambda: bool(rec.finals), limit_s=10)
    final = rec.finals[0]
    assert "open" in final
    # The final itself was asked about (partials with the same words may have been too: the request log
    # tells which candidate the final started), and that answer became the oracle, long before any poll.
    await wait_until(lambda: "(final)" in caplog.text, limit_s=10)
    match = re.search(r"LLM request (\d+) \(final\)", caplog.text)
    assert match is not None
    final_id, answer = int(match[1]), answer_for([{"role": "user", "content": final}])
    await wait_until(lambda: bool(rec.oracles) and rec.oracles[-1] == (answer, final_id), limit_s=10)
    assert last_user(llm_server.requests[-1]) == final
    await backend.aclose()
    asked_before = len(llm_server.requests)
    # With the paper's exact timing, nothing is asked before the poll, however much is heard.
    rec2 = Recorder()
    paper = backend_for(
        rec2,
        executor,
        stt_factory=lambda: PocketsphinxSTT(pool=pool),
        llm=llm,
        call_id="call-2",
        policy=OraclePolicyConfig(poll_interval_s=30.0, react_to_updates=False),
    )
    await paper.start()
    await feed_frames(paper, frames)
    await wait_until(lambda: bool(rec2.finals), limit_s=10)
    await asyncio.sleep(0.3)
    assert [t for t, is_final in rec2.transcripts if not is_final]  # partials and a final: none asked about
    assert len(llm_server.requests) == asked_before and not rec2.oracles
    await paper.aclose()
    await llm.aclose()


async def test_a_new_request_cancels_the_superseded_stream(tmp_path: Path, llm_server: FakeLlm, executor) -> None:
    frames = frames_of(speech(tmp_path, "I would like to order a large pizza with cheese."))
    head, rest = frames[:16], frames[16:]  # the first second of speech: a few words of partials, no final
    llm_server.chunk_delay_s = 1.0  # an answer to those early partials would take ~13 s
    started, cancelled = llm_requests(), llm_cancelled()
    llm = make_llm(llm_server)
    pool = DecoderPool()
    rec = Recorder()
    backend = backend_for(rec, executor, stt_factory=lambda: PocketsphinxSTT(pool=pool), llm=llm)
    await backend.start()
    await feed_frames(backend, head)
    await wait_until(lambda: bool(rec.oracles))  # a slow answer to an early partial is streaming
    assert not rec.finals and "pizza" not in last_user(llm_server.requests[0])
    first_id = rec.oracles[0][1]
    slow_ids = {cid for _, cid in rec.oracles}  # candidates that drafted so far all stream at 1 s a chunk
    llm_server.chunk_delay_s = 0.0  # requests from here on answer at once
    await feed_frames(backend, rest)
    await wait_until(lambda: bool(rec.finals))
    final = rec.finals[0]
    assert "pizza" in final
    await wait_until(lambda: any(last_user(r) == final for r in llm_server.requests))
    answer = answer_for(next(r for r in llm_server.requests if last_user(r) == final)["messages"])
    await wait_until(lambda: rec.oracles[-1][0] == answer)
    # Every slow stream was closed, not drained: the server saw each client go (at its next chunk, <= 1 s).
    await wait_until(lambda: llm_server.disconnects >= len(slow_ids))
    ids = [cid for _, cid in rec.oracles]
    assert ids[-1] > first_id
    assert ids == sorted(ids)  # once a newer candidate has drafted, no older one drafts again
    old_texts = [t for t, cid in rec.oracles if cid == first_id]
    assert old_texts[-1] not in {answer_for(r["messages"]) for r in llm_server.requests}  # cut short
    assert len(llm_server.requests) >= 2
    # Each superseded request is counted as cancelled, not as an outcome: the error ratio's denominator is
    # started - cancelled (else an outage while callers talk reads as a fraction of what fails).
    assert llm_cancelled() - cancelled >= len(slow_ids)
    assert llm_requests() - started - (llm_cancelled() - cancelled) >= 1  # the final's answer ended
    await backend.aclose()
    await llm.aclose()


async def test_a_held_draft_reaches_the_engine_within_a_frame_while_the_llm_stalls(
    llm_server: FakeLlm, executor
) -> None:
    """A draft that came < 80 ms after the last one sent is held back, but only until its frame has passed:
    an LLM that stalls mid-answer does not keep the words it already sent away from the engine."""
    llm_server.stall_at_chunk, llm_server.stall_s = 3, 2.0  # three words at once, then 2 s of nothing
    llm = make_llm(llm_server)
    rec = Recorder()
    backend = backend_for(rec, executor, stt_factory=NullSTT, llm=llm)
    await backend.start()
    said = "is my flight ok"
    backend._handle_transcript(SttResult(said, final=True), time.monotonic())  # as the STT pump reports it
    answer = answer_for([{"role": "user", "content": said}]).split(" ")
    held = " ".join(answer[:3])
    started = time.monotonic()
    await wait_until(lambda: bool(rec.oracles) and rec.oracles[-1][0] == held, limit_s=1.5)
    assert time.monotonic() - started < 1.5  # long before the stall ends
    assert rec.oracles[0][0] == answer[0] and not rec.complete[-1]  # the first word at once; more to come
    await wait_until(lambda: rec.oracles[-1][0] == " ".join(answer) and rec.complete[-1], limit_s=10)
    texts = [t for t, _ in rec.oracles]
    assert texts.count(held) == 1  # sent once, by the timer
    await backend.aclose()
    await llm.aclose()


async def test_a_final_heard_during_a_call_actions_quiet_window_is_answered_after_it(
    llm_server: FakeLlm, executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After end_call/transfer_call no draft may replace the action's line for a while; should the action fail,
    what the caller said meanwhile is asked about once the window is over, not lost."""
    monkeypatch.setattr(backend_module, "ACTION_QUIET_S", 1.0)
    llm_server.tool_triggers = {"goodbye": ("end_call", {})}
    llm = make_llm(llm_server)
    rec = Recorder()
    http = HttpSession()
    backend = CallBackend(
        "call-q", stt_factory=NullSTT, llm=llm, executor=executor, on_transcript=rec.on_transcript,
        on_oracle=rec.on_oracle, on_error=rec.on_error, policy=FAST_POLICY,
        tools=CallTools(Agents.builtin().get(None), ("end",), http),
    )  # fmt: skip
    await backend.start()
    backend._handle_transcript(SttResult("thanks goodbye", final=True), time.monotonic())
    await wait_until(lambda: backend._quiet_until > 0, limit_s=10)  # the end_call's line is being said
    # The action's line was made by no request: no oracle lag is measured for it (the LLM's drafts have one).
    assert rec.oracles[-1][0] == GOODBYE_LINE and rec.triggered[-1] is None
    assert all(t is not None for t in rec.triggered[:-1])
    line_at = time.monotonic()
    asked = len(llm_server.requests)
    said = "no wait I still have a question"  # the hang-up failed; the caller goes on
    backend._handle_transcript(SttResult(said, final=True), time.monotonic())
    await asyncio.sleep(0.5)
    assert len(llm_server.requests) == asked  # nothing replaces the action's line inside the window
    await wait_until(lambda: any(said in last_user(r) for r in llm_server.requests), limit_s=5)
    assert time.monotonic() - line_at >= 0.9
    answer = answer_for(next(r for r in llm_server.requests if said in last_user(r))["messages"])
    await wait_until(lambda: rec.oracles[-1][0] == answer, limit_s=5)
    await backend.aclose()
    await http.aclose()
    await llm.aclose()


async def test_of_two_call_actions_in_one_answer_the_second_is_told_as_not_done(
    llm_server: FakeLlm, executor
) -> None:
    """One answer asking to hang up twice (or to transfer and hang up): the first is carried out, and the history
    said "requested" for both, so the model believed in an action never taken. The second is "not done" now,
    in the history and to the edge (no action)."""
    llm_server.tool_triggers = {"goodbye": ("end_call", {})}
    llm_server.also_call = ("end_call", {"reason": "the caller said goodbye"})
    llm = make_llm(llm_server)
    rec = Recorder()
    uses: list = []  # type: ignore[type-arg]
    http = HttpSession()
    backend = CallBackend(
        "call-2a", stt_factory=NullSTT, llm=llm, executor=executor, on_transcript=rec.on_transcript,
        on_oracle=rec.on_oracle, on_error=rec.on_error, policy=FAST_POLICY, on_tool=uses.append,
        tools=CallTools(Agents.builtin().get(None), ("end",), http),
    )  # fmt: skip
    await backend.start()
    backend._handle_transcript(SttResult("thanks goodbye", final=True), time.monotonic())
    await wait_until(lambda: len(uses) == 2, limit_s=10)
    assert [(u.outcome, u.action) for u in uses] == [("requested", "end"), ("error", None)]
    (exchange,) = [t for t in backend.conversation.turns if isinstance(t, ToolExchange)]
    assert exchange.results[0][1].startswith("requested: ")
    assert exchange.results[1][1].startswith("not done: end_call was asked for in the same answer")
    await backend.aclose()
    await http.aclose()
    await llm.aclose()


async def test_the_greeting_is_not_an_oracle_lag(executor) -> None:
    """The greeting goes to the engine as the call starts, made by no LLM request: its ~0 s was counted as an
    oracle lag and pulled the dashboard's LLM figure down on every call with a greeting."""
    rec = Recorder()
    backend = CallBackend("call-g", stt_factory=NullSTT, llm=None, executor=executor, on_transcript=rec.on_transcript,
                          on_oracle=rec.on_oracle, greeting="Acme, how can I help?")  # fmt: skip
    await backend.start()
    await backend.aclose()
    assert rec.oracles == [("Acme, how can I help?", rec.oracles[0][1])] and rec.triggered == [None]


async def test_an_utterance_cut_by_the_hang_up_still_becomes_a_final(tmp_path: Path, executor) -> None:
    """A caller who hangs up right after speaking leaves no trailing silence to end the utterance: closing the
    back-end ends it, so the last words reach on_transcript and the conversation."""
    pool = DecoderPool()
    rec = Recorder()
    backend = backend_for(rec, executor, stt_factory=lambda: PocketsphinxSTT(pool=pool), llm=None)
    await backend.start()
    await feed_frames(backend, frames_of(speech(tmp_path, "I would like to cancel my order please goodbye"),
                                         tail_s=0.0))  # fmt: skip
    await wait_until(lambda: any("cancel" in t for t, _ in rec.transcripts))
    assert not rec.finals  # no silence after the words: the STT has not ended the utterance
    await backend.aclose()
    (final,) = rec.finals
    assert {"cancel", "order"} <= set(final.split())
    assert rec.transcripts[-1] == (final, True)
    assert [(t.role, t.text) for t in backend.conversation.turns] == [("user", final)]
    assert (pool.created, pool.idle) == (1, 1)


async def test_a_hung_up_calls_last_final_reaches_the_calls_outputs(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Through the real engine service: the session is closed at once (its seat free), and the final its
    back-end makes of the cut-off utterance while closing still comes out of the call's outputs before they end
    (the phone edge records the caller's turns from them)."""
    services = BackendServices(BackendConfig(stt="pocketsphinx", llm_enabled=False))
    engine = await LocalEngine.load(
        EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", max_calls=1, warmup_ticks=1,
                     sampling=SamplingOverrides(greedy=True)),
        services,
    )  # fmt: skip
    await engine.start()
    try:
        call = await engine.open_call("CA-cut-off")
        heard: list[tuple[str, bool]] = []

        async def read() -> None:
            async for out in call.outputs():
                if isinstance(out, CallerTranscript):
                    heard.append((out.text, out.final))

        reader = asyncio.create_task(read())
        for frame in frames_of(speech(tmp_path, "I would like to cancel my order please goodbye"), tail_s=0.0):
            call.push_audio(frame)
            await asyncio.sleep(0.002)
        await wait_until(lambda: any("cancel" in t for t, _ in heard))
        assert not any(final for _, final in heard)
        await call.close()
        # The seat went at once (the frame loop's count: the engine's own reads 0 while a busy box has it behind).
        assert engine.frame_loop.free_slots == 1
        await asyncio.wait_for(reader, 30)  # outputs end once the back-end has closed
        finals = [t for t, final in heard if final]
        assert len(finals) == 1 and {"cancel", "order"} <= set(finals[0].split())
    finally:
        await engine.stop()


async def feed_silence_until(backend: CallBackend, pred: Callable[[], bool], limit_s: float = 30.0) -> None:
    """Feed silent frames until `pred` holds. After an STT failure the back-end drops the audio that came
    during its restart back-off; speech fed only once a fresh STT is in place is heard whole."""
    silence = np.zeros(FRAME_SAMPLES, np.float32)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not pred():
        assert loop.time() < deadline, "condition not reached"
        backend.feed_audio(silence)
        await asyncio.sleep(0.02)


async def test_stt_failure_is_counted_and_the_stt_restarted(tmp_path: Path, executor) -> None:
    # Real faults of our own STT: a VAD mode pocketsphinx refuses (the factory raises), then a decoder
    # pool whose acoustic model is missing (the STT is made, its first decode fails to build a decoder).
    no_model = DecoderPool(hmm=str(tmp_path / "no-such-acoustic-model"))
    good = DecoderPool()
    attempts = 0

    def factory() -> PocketsphinxSTT:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            return PocketsphinxSTT(PocketsphinxConfig(vad_mode=9))
        return PocketsphinxSTT(pool=no_model if attempts == 2 else good)

    rec = Recorder()
    backend = backend_for(rec, executor, stt_factory=factory, llm=None)
    before, dropped = stt_errors(), stt_dropped_frames()
    await backend.start()
    await feed_silence_until(backend, lambda: attempts == 3)  # restarted twice, after each back-off
    assert stt_errors() == before + 2
    assert stt_dropped_frames() > dropped  # the audio of each back-off, thrown away: counted, not silent
    assert [(kind, detail.split(":")[0]) for kind, detail in rec.errors] == [
        ("stt_error", "ValueError"),  # the factory failed
        ("stt_error", "RuntimeError"),  # the first feed failed
    ]
    assert no_model.created == 0
    # The third STT works: the caller is heard.
    await feed_frames(backend, frames_of(speech(tmp_path, "I need to change my password please.")))
    await wait_until(lambda: bool(rec.finals))
    assert "password" in rec.finals[0]
    assert [t for t, is_final in rec.transcripts if not is_final]  # streamed as before the failures
    assert stt_errors() == before + 2
    await backend.aclose()
    assert (good.created, good.idle) == (1, 1)  # closed: its decoder went back to the pool


async def test_a_lagging_stt_drops_the_oldest_caller_frames_and_counts_them(tmp_path: Path) -> None:
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
    frames = frames_of(speech(tmp_path, "What time do you open?"))
    try:
        one_worker.submit(lambda: (busy.set(), release.wait(30)))  # the only worker is taken
        assert busy.wait(5)
        await backend.start()
        before = stt_dropped_frames()
        for f in frames[:10]:  # 10 frames while no worker can take them: only the newest 3 can wait
            backend.feed_audio(f)
        assert stt_dropped_frames() == before + 7
        release.set()
        await wait_until(lambda: not backend._audio)  # the STT drained what was kept
        backend.feed_audio(frames[10])  # caught up: nothing more is dropped
        await wait_until(lambda: not backend._audio)
        assert stt_dropped_frames() == before + 7
    finally:
        release.set()
        await backend.aclose()
        one_worker.shutdown(wait=True)


async def test_frames_of_the_wrong_shape_or_type_never_stop_the_calls_stt(tmp_path: Path, executor) -> None:
    rec = Recorder()
    pool = DecoderPool()
    backend = backend_for(rec, executor, stt_factory=lambda: PocketsphinxSTT(pool=pool), llm=None)
    await backend.start()
    backend.feed_audio(np.zeros((2, FRAME_SAMPLES // 2), np.float64))  # 2-D, float64: flattened, heard
    backend.feed_audio(np.array(["not", "audio"]))  # dropped with a log line
    await feed_frames(backend, frames_of(speech(tmp_path, "I need to change my password please.")))
    await wait_until(lambda: bool(rec.finals))
    assert "password" in rec.finals[0]
    await backend.aclose()


async def test_stt_only_without_llm_and_feeding_from_another_thread(tmp_path: Path, executor) -> None:
    rec = Recorder()
    calls = 0

    def flaky_transcript(text: str, final: bool, at: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("engine bug")  # must not stop the call's STT
        rec.on_transcript(text, final, at)  # asserts that it runs on the event loop, not the feeder

    pool = DecoderPool()
    pool.prewarm(1)  # a decoder built mid-call would hold the GIL, and so the feeder, for ~0.3 s
    backend = CallBackend("t", stt_factory=lambda: PocketsphinxSTT(pool=pool), llm=None, executor=executor,
                          on_transcript=flaky_transcript, on_oracle=rec.on_oracle)  # fmt: skip
    frames = frames_of(speech(tmp_path, "My flight to Boston was cancelled this morning."))

    def feed() -> None:  # as the engine's frame thread does: not the event loop's thread
        for f in frames:
            backend.feed_audio(f)
            time.sleep(0.01)  # 8x real time: the STT keeps up, so partials come before the final

    await backend.start()
    await asyncio.to_thread(feed)
    await wait_until(lambda: bool(rec.finals))
    # The first partial hit the failing callback; every later result still came through.
    assert calls == len(rec.transcripts) + 1
    assert rec.transcripts[-1][1] and [t for t, is_final in rec.transcripts if not is_final]
    (final,) = rec.finals
    assert {"boston", "morning"} <= set(final.split())
    assert backend.conversation.messages()[-1] == {"role": "user", "content": final}
    assert rec.oracles == []
    await backend.aclose()
    assert (pool.created, pool.idle) == (1, 1)  # the STT was closed


async def test_services_wire_config_into_calls(tmp_path: Path, llm_server: FakeLlm) -> None:
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
    await feed_frames(call, frames_of(speech(tmp_path, "What time do you open?")))
    await asyncio.sleep(0.1)
    assert rec.transcripts == [] and call.conversation.bot_text == "Hi"  # --stt none hears nothing
    await call.aclose()
    await services.aclose()
    assert BackendConfig.from_env({}).llm_model == "gpt-4.1"
    stt_only = BackendServices(BackendConfig(stt="none", llm_enabled=False))
    assert stt_only.llm is None
    await stt_only.aclose()


async def test_services_warm_up_prebuilds_pooled_decoders() -> None:
    from knowledge.stt import DECODER_POOL

    services = BackendServices(BackendConfig(stt="pocketsphinx", llm_enabled=False))
    await services.warm_up(2)
    assert DECODER_POOL.idle >= 2
    await services.aclose()


async def test_sse_events_are_parsed_as_the_spec_says() -> None:
    """Data lines join with newlines, comments are skipped, and an error event ends the stream."""
    from knowledge.llm import LlmStreamError, _sse_data

    async def lines(*items: str):  # type: ignore[no-untyped-def]
        for item in items:
            yield item

    got = [d async for d in _sse_data(lines(": keep-alive", "", 'data: {"a":', "data: 1}", "", "data: [DONE]", ""))]
    assert got == ['{"a":\n1}', "[DONE]"]
    with pytest.raises(LlmStreamError, match="overloaded"):
        [d async for d in _sse_data(lines("event: error", "data: overloaded", ""))]


async def test_stream_lines_end_at_crlf_lf_or_cr_even_split_across_chunks() -> None:
    from knowledge.llm import StreamTooLarge, _lines

    async def chunks(*items: bytes):  # type: ignore[no-untyped-def]
        for item in items:
            yield item

    got = [line async for line in _lines(chunks(b"data: a\r", b"\ndata: b\rdata: c\n\r\n", b"data: \xc3", b"\xa9"))]
    assert got == ["data: a", "data: b", "data: c", "", "data: \u00e9"]
    with pytest.raises(StreamTooLarge):
        [line async for line in _lines(chunks(b"x" * 600, b"y" * 600), cap=1000)]
    stream = b"data: a\r\ndata: bb\rdata: ccc\n\r\n" + b"data: " + b"z" * 3000 + b"\r\n\n"
    one_by_one = [line async for line in _lines(chunks(*(stream[i : i + 1] for i in range(len(stream)))))]
    assert one_by_one == ["data: a", "data: bb", "data: ccc", "", "data: " + "z" * 3000, ""]


async def test_a_long_line_in_small_pieces_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk rescanned the whole line buffered so far: a 255 KB line in 256-byte pieces cost 150x its
    size (a third of a core for one slow stream, on the loop every call shares). Now each byte once or twice."""
    from knowledge import llm as llm_module

    scanned = 0
    line_end = llm_module._LINE_END

    class Counting:
        def finditer(self, buffer: bytearray, pos: int = 0):  # type: ignore[no-untyped-def]
            nonlocal scanned
            scanned += len(buffer) - pos
            return line_end.finditer(buffer, pos)

    monkeypatch.setattr(llm_module, "_LINE_END", Counting())
    line = b"data: " + b"x" * 250_000 + b"\n"

    async def pieces():  # type: ignore[no-untyped-def]
        for i in range(0, len(line), 256):
            yield line[i : i + 256]

    got = [x async for x in llm_module._lines(pieces())]
    assert got == [line[:-1].decode()]
    assert scanned < 2 * len(line), scanned


async def test_an_llm_with_neither_endpoint_nor_key_is_said_to_fail_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """serve with no OPENAI_BASE_URL and no key said "fine for local servers only", while no local server was
    named: every request then failed, call after call. Start-up says so, and how to run without one."""
    caplog.set_level(logging.WARNING)
    for config, says in [(LlmConfig(model="m"), "every request will fail"),
                         (LlmConfig(model="m", base_url="http://127.0.0.1:9/v1"), "fine for local servers only")]:
        caplog.clear()
        llm = LlmClient(config)
        await llm.aclose()
        assert says in caplog.text, caplog.text


def test_a_tool_call_made_during_an_utterance_the_stt_retracted_stays_before_the_next_one() -> None:
    """A call made mid-utterance goes after the caller's words once the final comes. If the STT retracted that
    utterance (an empty final), the caller's next words came before the call, though said after it."""
    conv = Conversation()
    conv.caller_partial("where is my")
    conv.tool_exchange(ToolExchange(calls=[{"id": "c1", "type": "function",
                                            "function": {"name": "order_status", "arguments": "{}"}}],
                                    results=[("c1", "shipped Monday")]))  # fmt: skip
    conv.caller_final("")  # retracted
    conv.caller_final("hello are you there")
    assert [m["role"] for m in conv.messages()] == ["system", "assistant", "tool", "user"]


def test_a_tool_call_made_mid_utterance_follows_the_callers_words_though_the_bot_spoke_since() -> None:
    """Full duplex: the bot talks on while the caller does. The caller's final went after the exchange when the
    bot had said anything since it, so the next request read: the call, its result, then the words that asked
    for it (a model calls it again: a booking made twice)."""
    conv = Conversation()
    conv.caller_final("hi")
    conv.bot_piece("▁Hello")
    conv.caller_partial("book a table for")
    conv.tool_exchange(ToolExchange(calls=[{"id": "c1", "type": "function",
                                            "function": {"name": "book", "arguments": "{}"}}],
                                    results=[("c1", "ok: booked")]))  # fmt: skip
    conv.bot_piece("▁Sure")
    conv.caller_final("book a table for two")
    said = [(m["role"], m.get("content")) for m in conv.messages()[1:]]
    assert said == [("user", "hi"), ("assistant", "Hello"), ("user", "book a table for two"), ("assistant", None),
                    ("tool", "ok: booked"), ("assistant", "Sure")]  # fmt: skip
    conv.caller_final("thanks")  # the utterance is over for that call: the next words come after it all
    assert [m.get("content") for m in conv.messages()][-2:] == ["Sure", "thanks"]


def test_a_key_the_server_cut_short_is_still_scrubbed() -> None:
    """A server echoing the request's headers cut to its own length: the key's first part was logged in clear
    (a 22-character key cut to 15, in the review)."""
    for key, echoed in (("gsk_0123456789abcdefgh", "Bearer gsk_0123456789a..."),
                        ("sk-proj-A1b2C3d4E5f6G7h8I9j0", "key=sk-proj-A1b2C3d4 (truncated)")):
        scrubbed = LlmClient(LlmConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key=key))._scrub(echoed)
        assert key[:10] not in scrubbed and "***" in scrubbed, scrubbed


def test_a_short_key_that_is_a_word_does_not_scrub_other_words() -> None:
    """A 12-character key made of a word ("development1") had its head scrubbed from every log line."""
    client = LlmClient(LlmConfig(model="m", base_url="http://127.0.0.1:9/v1", api_key="development1"))
    assert client._scrub("The development server refused development1") == "The development server refused ***"
