"""`kame-phone demo`: the whole phone path offline, on a fresh machine, in about a minute.

Makes (or reuses) the tiny random-weight checkpoint, starts the service on loopback with signature checks
on, speaks a question with flite, dials it with the simulated Twilio caller, writes the reply WAV and
prints the latency figures. The tiny model's reply is noise: this shows the pipeline, not the answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import subprocess
from pathlib import Path

from engine.sampling import SamplingOverrides
from engine.service import EngineConfig, LocalEngine
from engine.tiny_checkpoint import make_tiny_checkpoint
from knowledge.backend import BackendConfig, BackendServices
from telephony.call_store import CallRecord, MemoryCallStore
from telephony.config import ServiceConfig
from telephony.server import MEDIA_PATH, ServerContext, ServiceHandle
from telephony.sim_caller import CallReport, format_summary, simulate_call


def speak(text: str, out: Path) -> Path:
    flite = shutil.which("flite")
    if flite is None:
        raise SystemExit("kame-phone demo needs Debian's flite for the caller's voice: apt-get install flite")
    subprocess.run([flite, "-voice", "rms", "-t", text, "-o", str(out)], check=True)
    return out


def tiny_checkpoint(workdir: Path) -> Path:
    ckpt = workdir / "tiny-kame"
    if not (ckpt / "config.json").is_file():
        print(f"making the tiny random-weight checkpoint in {ckpt} ...")
        make_tiny_checkpoint(ckpt)
    return ckpt


def run_demo(args: argparse.Namespace) -> int:
    workdir: Path = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = tiny_checkpoint(workdir)
    question = speak(args.question, workdir / "question.wav")
    reply = workdir / "reply.wav"
    report, record = asyncio.run(_call_the_demo_service(ckpt, question, reply, args.stt))
    print(format_summary(report))
    (workdir / "report.json").write_text(report.to_json() + "\n")
    if record is not None:
        heard = [t.text for t in record.turns if t.role == "caller"]
        print(f"caller's words as the STT heard them: {json.dumps(heard)}")
    print(f"reply audio: {reply}   report: {workdir / 'report.json'}")
    print("note: the tiny model has random weights, so its reply is noise. The demo shows the phone")
    print("pipeline and its latency; load real KAME weights with `kame-phone serve --checkpoint` for answers.")
    return 0 if report.outcome == "completed" else 1


async def _call_the_demo_service(
    ckpt: Path, question: Path, reply: Path, stt: str
) -> tuple[CallReport, CallRecord | None]:
    token = secrets.token_hex(16)  # signatures are checked, as in production
    backend = None
    if stt != "none":
        backend = BackendServices(BackendConfig(stt=stt, llm_enabled=False))
        await backend.warm_up(2)  # decoders are built before the call, not during it
    engine = await LocalEngine.load(
        EngineConfig(checkpoint=str(ckpt), device="cpu", max_calls=2, sampling=SamplingOverrides()), backend
    )
    await engine.start()
    store = MemoryCallStore()
    config = ServiceConfig(host="127.0.0.1", port=0, twilio_auth_token=token)
    handle = await ServiceHandle(ServerContext(config, store, engine)).start()
    try:
        base = handle.http_url
        ws_url = base.replace("http://", "ws://") + MEDIA_PATH
        print(f"service on {base}; calling it with {question} ...")
        report = await simulate_call(ws_url, question, auth_token=token, public_url=base, out_wav=reply, hold_after=3.0)
        async with asyncio.timeout(10):
            await handle.ctx.no_streams.wait()
        await store.flush()
        return report, await store.get(report.call_sid)
    finally:
        await handle.aclose()
        await engine.stop()
