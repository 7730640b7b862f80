"""The knowledge path end to end: simulated phone calls -> pocketsphinx -> a real local OpenAI-compatible
server -> each call's own oracle, fed into that call's row of the batch."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import numpy as np
import pytest

from knowledge.backend import BackendConfig, BackendServices
from telephony.sim_caller import simulate_call

from .llm_server import FakeLlm
from .phone_fixtures import flite_wav, metric, running_phone

QUESTIONS = {
    "store": "What time does the store open on Monday?",
    "card": "Please block my credit card now.",
}


@pytest.fixture(scope="module")
def question_wavs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("speech")
    return {key: flite_wav(text, d / f"{key}.wav") for key, text in QUESTIONS.items()}


def _segments(tokens: list[int], start: int, pad: int) -> list[list[int]]:
    """Split one row's fed oracle tokens into candidates (each starts with the boundary token)."""
    out: list[list[int]] = []
    for t in tokens:
        if t == start:
            out.append([])
        elif t != pad and out:
            out[-1].append(t)
    return out


async def test_two_calls_each_get_their_own_llm_answer_as_oracle(
    tiny_checkpoint: Path, question_wavs: dict[str, Path], llm_server: FakeLlm
) -> None:
    backend = BackendServices(
        BackendConfig(stt="pocketsphinx", llm_base_url=llm_server.base_url, llm_api_key="sk-test", llm_model="m")
    )
    await backend.warm_up(2)
    lag_before = metric("kame_oracle_lag_seconds_count")
    async with running_phone(tiny_checkpoint, max_calls=2, backend=backend) as phone:
        lm, sp = phone.engine.bundle.lm, phone.engine.bundle.tokenizer
        fed: list[np.ndarray] = []  # per tick: the oracle token each row fed (frame-loop thread)
        hook = lm.oracle_emb.register_forward_hook(lambda _m, a, _o: fed.append(a[0][:, 0].numpy().copy()))
        sids = {key: "CA" + secrets.token_hex(16) for key in QUESTIONS}
        rows: dict[str, int] = {}

        async def watch_rows() -> None:  # which row each call sits in
            while len(rows) < len(sids):
                for key, sid in sids.items():
                    session = phone.engine._sessions.get(sid)
                    if session is not None:
                        rows[key] = session.row
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_rows())
        reports = await asyncio.gather(*[
            simulate_call(phone.ws_url, question_wavs[key], auth_token=phone.token, public_url=phone.base,
                          custom_sid=sids[key], hold_after=4.0)
            for key in QUESTIONS
        ])
        await watcher
        hook.remove()
        await phone.settled()
        records = {key: await phone.store.get(sid) for key, sid in sids.items()}
    assert [r.outcome for r in reports] == ["completed", "completed"]
    # The LLM was asked with each caller's words.
    asked = [" ".join(m["content"] for m in req["messages"] if m["role"] == "user") for req in llm_server.requests]
    assert any("store" in a for a in asked) and any("card" in a for a in asked)
    assert not any("store" in a and "card" in a for a in asked)  # one call's words never in the other's request
    # Each call's row was fed that LLM's answer for that call, and only that.
    tokens = np.stack(fed)
    start, pad = lm.oracle_start_token_id, lm.text_padding_token_id
    for key, other in (("store", "card"), ("card", "store")):
        candidates = _segments(tokens[:, rows[key]].tolist(), start, pad)
        assert candidates, f"no oracle reached the {key} call"
        last = sp.decode(candidates[-1])
        assert last.startswith("Sure, about") and key in last and other not in last, last
        assert records[key] is not None
        notes = [n.text or "" for n in records[key].oracle]
        assert notes and notes[-1].startswith("Sure, about") and key in notes[-1]
        # One entry per candidate with its whole text, not one per streamed chunk.
        assert not any(b.startswith(a) and a != b for a, b in zip(notes, notes[1:], strict=False)), notes
        caller_words = " ".join(t.text or "" for t in records[key].turns if t.role == "caller")
        assert key in caller_words
    assert metric("kame_oracle_lag_seconds_count") > lag_before  # oracle lag was measured

