"""A hung-up call frees its engine seat at once, even while its STT still works through a backlog."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from engine.sampling import SamplingOverrides
from engine.service import EngineConfig, LocalEngine
from knowledge.backend import BackendConfig, BackendServices

from .test_backend import frames_of, speech, wait_until


async def test_a_hung_up_call_frees_its_seat_while_its_stt_is_busy(tiny_checkpoint: Path, tmp_path: Path) -> None:
    backend = BackendServices(BackendConfig(stt="pocketsphinx", llm_enabled=False))
    await backend.warm_up(1)
    engine = await LocalEngine.load(
        EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", max_calls=1, warmup_ticks=1,
                     sampling=SamplingOverrides(greedy=True)),
        backend,
    )
    await engine.start()
    try:
        call = await engine.open_call("CA-busy-stt")
        assert engine.free_slots == 0
        # 12 s of speech at once: one long pocketsphinx job (real pocketsphinx, real speech).
        words = "I would like to check the status of my order and change the delivery address please"
        for frame in frames_of(np.tile(speech(tmp_path, words), 3), tail_s=0.0):
            call.push_audio(frame)
        # The transcription job itself: the first job can be the STT's creation, short enough to be over
        # before the hang-up below on a loaded box.
        backend_ = call.backend
        assert backend_ is not None
        await wait_until(lambda: backend_._stt is not None and backend_._stt_job is not None
                         and not backend_._stt_job.done(), limit_s=10)  # fmt: skip
        stt_job = backend_._stt_job
        assert stt_job is not None
        started = time.monotonic()
        await call.close()
        closed_in = time.monotonic() - started
        assert not stt_job.done(), "the STT was meant to be busy when the caller hung up"
        assert engine.free_slots == 1 and closed_in < 0.5
        nxt = await engine.open_call("CA-next")  # the next caller gets the seat now, not in seconds
        await nxt.close()
    finally:
        await engine.stop()  # waits for the background close
    assert stt_job.done() and not engine._backend_closes
