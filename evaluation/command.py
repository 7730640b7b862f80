"""`kame-phone eval` and `kame-phone eval compare A B`: arguments, checks, and the run."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from .line_caller import Listening
from .questions import SUITES, QuestionError, load_file, load_suite, narrow


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what it dials (one of)")
    what.add_argument("--checkpoint", help="start a service on this checkpoint (a directory, a Hugging Face repo id, "
                                           "random:SIZE, or 'tiny': the tiny random-weight one, made if missing)")
    what.add_argument("--url", help="dial a running service at https://host[/prefix], signing with "
                                    "$TWILIO_AUTH_TOKEN as Twilio would for $PUBLIC_URL (default: --url)")
    serve = p.add_argument_group("the started service (--checkpoint)")
    serve.add_argument("--agents", help="its agents file")
    serve.add_argument("--stt", choices=("pocketsphinx", "kyutai", "none"), help="its speech-to-text")
    serve.add_argument("--llm-model", help="its back-end LLM (OPENAI_BASE_URL/OPENAI_API_KEY as serve reads them)")
    serve.add_argument("--forced-delay-ms", default="0",
                       help="comma-separated: one run per value, e.g. 0,500,1000,2000 (--checkpoint only)")
    serve.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                       help="another serve flag, repeat (e.g. --serve-arg=--device=cuda)")
    qs = p.add_argument_group("questions (one of)")
    qs.add_argument("--questions", type=Path, help="JSONL in MT-Bench's format (question_id, category, turns, "
                                                   "optional reference); first turns are asked")
    qs.add_argument("--suite", choices=sorted(SUITES), help="the paper's subset: reasoning, STEM, humanities "
                                                           "(needs the [eval] questions package, see README)")
    qs.add_argument("--limit", type=int, help="ask only the first N questions")
    qs.add_argument("--categories", help="comma-separated categories to keep")
    speech = p.add_argument_group("speech")
    speech.add_argument("--tts", choices=("flite", "openai"), default="flite", help="the caller's voice")
    speech.add_argument("--tts-model", default="gpt-4o-mini-tts")
    speech.add_argument("--tts-voice", default="alloy")
    speech.add_argument("--tts-base-url", help="default $OPENAI_BASE_URL")
    speech.add_argument("--asr", choices=("pocketsphinx", "openai"), default="pocketsphinx",
                        help="transcribes the bot's reply")
    speech.add_argument("--asr-model", default="whisper-1")
    speech.add_argument("--asr-base-url", help="default $OPENAI_BASE_URL")
    judge = p.add_argument_group("judge")
    judge.add_argument("--judge-model", default=os.environ.get("KAME_JUDGE_MODEL", "gpt-4.1"),
                       help="any OpenAI-compatible chat model (default $KAME_JUDGE_MODEL or gpt-4.1)")
    judge.add_argument("--judge-base-url", help="default $OPENAI_BASE_URL")
    judge.add_argument("--judge-api-key", help="default $OPENAI_API_KEY (also read for --tts/--asr openai)")
    judge.add_argument("--judge-retries", type=int, default=3, help="tries per answer before the score is missing")
    run = p.add_argument_group("the run")
    run.add_argument("--concurrency", type=int, default=1, help="calls at once")
    run.add_argument("--probes", type=int, default=3,
                     help="the first N questions also get an interaction call: a pause mid-sentence, then a "
                          "barge-in (0: none)")
    run.add_argument("--pause-s", type=float, default=1.5, help="the probe's mid-sentence pause")
    run.add_argument("--busy-redials", type=int, default=5,
                     help="dial a call again this many times at most when the line answers busy, after a "
                          "growing pause (0: a busy call stays busy in the report)")
    run.add_argument("--lead-in-s", type=float, default=1.0, help="silence before each question")
    run.add_argument("--quiet-s", type=float, default=2.0, help="hang up once the bot was quiet this long")
    run.add_argument("--no-answer-s", type=float, default=10.0, help="hang up if no reply this long")
    run.add_argument("--max-reply-s", type=float, default=60.0, help="cut replies here")
    run.add_argument("--from", dest="from_number", default="+15005550006", help="the caller's number")
    run.add_argument("--to", dest="to_number", default="+15005550001", help="the number dialed (picks the agent)")
    run.add_argument("--out", type=Path, help="report directory (default var/eval/<time>)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, help="a run's directory or report.json (before)")
    p.add_argument("b", type=Path, help="another (after)")


class UsageError(ValueError):
    pass


def _delays(text: str, own_service: bool) -> list[float | None]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--forced-delay-ms takes comma-separated milliseconds, got {text!r}") from None
    if any(not 0 <= v <= 10000 for v in values) or not values:
        raise UsageError("--forced-delay-ms values must be 0-10000 ms")
    if not own_service:
        if values != [0.0]:
            raise UsageError("--forced-delay-ms sweeps need --checkpoint: a running service keeps its own delay")
        return [None]
    return list(dict.fromkeys(values))


def _agents_file(serve_args: list[str]) -> str | None:
    """The agents file the throwaway service is given (the last one, as argparse takes it), if any."""
    found = None
    for i, arg in enumerate(serve_args):
        if arg == "--agents" and i + 1 < len(serve_args):
            found = serve_args[i + 1]
        elif arg.startswith("--agents="):
            found = arg.split("=", 1)[1]
    return found


def _no_agent_delay(path: str | None, to_number: str) -> None:
    """The agent answering the eval's calls must not set its own forced delay: it wins over the service's
    --forced-delay-ms, so every call of the sweep would run at the agent's, reported under the sweep's."""
    if path is None:
        return
    from knowledge.agents import Agents, AgentsError

    try:
        agent = Agents.load(path).for_call(to_number)
    except AgentsError as exc:
        raise UsageError(str(exc)) from None
    if agent.forced_delay_ms is not None:
        raise UsageError(f"agent {agent.name!r} (answering {to_number}) sets forced_delay_ms = "
                         f"{agent.forced_delay_ms:g} in {path}: it would override every delay of the sweep "
                         "(--forced-delay-ms); remove it there, or --to a number another agent answers")  # fmt: skip


def _checkpoint(value: str) -> str:
    if value != "tiny":
        from engine.checkpoint import RANDOM_PREFIX, CheckpointError, check_source

        if not value.startswith(RANDOM_PREFIX):
            try:  # now: it was found out after every question was spoken and a service started (~25 s)
                check_source(value)
            except CheckpointError as exc:
                raise UsageError(f"--checkpoint: {exc}") from None
        return value
    from engine.tiny_checkpoint import make_tiny_checkpoint

    ckpt = Path("var/tiny-kame")
    if not (ckpt / "config.json").is_file():
        print(f"making the tiny random-weight checkpoint in {ckpt} ...", file=sys.stderr)
        make_tiny_checkpoint(ckpt)
    return str(ckpt)


def build_plan(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from engine.checkpoint import has_random_weights

    from .judge import Judge
    from .runner import EvalPlan, Target, check_url
    from .transcribe import OpenAITranscriber, PocketsphinxTranscriber
    from .voices import FliteVoice, OpenAIVoice

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("the eval's plots need matplotlib: pip install -e '.[eval]'")
    if bool(args.checkpoint) == bool(args.url):
        raise UsageError("give one of --checkpoint (start a service) or --url (dial a running one)")
    if args.url:
        try:
            check_url(args.url)  # now, not after every question was spoken
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if bool(args.questions) == bool(args.suite):
        raise UsageError("give one of --questions FILE or --suite mt-bench-speech")
    if args.concurrency < 1 or args.probes < 0 or args.busy_redials < 0 or (args.limit is not None and args.limit < 1):
        raise UsageError("--concurrency and --limit must be at least 1, --probes and --busy-redials at least 0")
    questions = load_file(args.questions) if args.questions else load_suite(args.suite)
    questions = narrow(questions, args.categories.split(",") if args.categories else None, args.limit)
    out = args.out or Path("var/eval") / time.strftime("%Y%m%d-%H%M%S")
    env_base, env_key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY")
    key = args.judge_api_key or env_key
    voice = (FliteVoice() if args.tts == "flite" else
             OpenAIVoice(args.tts_base_url or env_base, key, args.tts_model, args.tts_voice))
    # A worker per call at once, up to the cores: replies are transcribed as their calls end.
    asr = (PocketsphinxTranscriber(min(args.concurrency, os.cpu_count() or 1)) if args.asr == "pocketsphinx" else
           OpenAITranscriber(args.asr_base_url or env_base, key, args.asr_model))
    if args.checkpoint:
        ckpt = _checkpoint(args.checkpoint)
        serve_args = list(args.serve_arg)
        for flag, value in (("--agents", args.agents), ("--stt", args.stt), ("--llm-model", args.llm_model)):
            if value:
                serve_args += [flag, value]
        _no_agent_delay(_agents_file(serve_args), args.to_number)
        if any(a == "--forced-delay-ms" or a.startswith("--forced-delay-ms=") for a in args.serve_arg):
            # It would come after the sweep's own flag and win: every run at it, each reported under its own.
            raise UsageError("--serve-arg=--forced-delay-ms would override every delay of the sweep: give the "
                             "delays as --forced-delay-ms")  # fmt: skip
        target = Target(checkpoint=ckpt, serve_args=serve_args, random_weights=has_random_weights(ckpt))
    else:
        if args.agents or args.stt or args.llm_model or args.serve_arg:
            raise UsageError("--agents, --stt, --llm-model and --serve-arg set up a started service: use --checkpoint")
        token = os.environ.get("TWILIO_AUTH_TOKEN") or None
        if token is None:
            print("kame-phone eval: TWILIO_AUTH_TOKEN is not set: calls go unsigned (a production service "
                  "refuses them)", file=sys.stderr)
        target = Target(url=args.url, auth_token=token, public_url=os.environ.get("PUBLIC_URL") or None)
    judge = Judge(args.judge_model, args.judge_base_url or env_base, key, attempts=max(1, args.judge_retries))
    listening = Listening(args.lead_in_s, args.quiet_s, args.no_answer_s, args.max_reply_s)
    try:  # now: a file there, or a directory it may not write, was a traceback after every question was spoken
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-check").touch()
        (out / ".write-check").unlink()
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    return EvalPlan(
        questions=questions, source=str(args.questions or f"suite {args.suite}"), out=out, voice=voice,
        transcriber=asr, judge=judge, target=target, delays=_delays(args.forced_delay_ms, bool(args.checkpoint)),
        concurrency=args.concurrency, probes=min(args.probes, len(questions)), pause_s=args.pause_s,
        listening=listening, from_number=args.from_number, to_number=args.to_number, busy_redials=args.busy_redials,
    )


def run_from_args(args: argparse.Namespace) -> int:
    from .report import delay_label
    from .runner import run_eval
    from .voices import VoiceError

    if getattr(args, "eval_command", None) == "compare":
        from .compare import compare

        try:
            print(compare(args.a, args.b))
        except ValueError as exc:
            print(f"kame-phone eval compare: {exc}", file=sys.stderr)
            return 2
        return 0
    logging.basicConfig(level=logging.INFO, format="kame-phone eval: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the openai client logs every request at INFO
    try:
        plan = build_plan(args)
    except (UsageError, QuestionError) as exc:
        print(f"kame-phone eval: {exc}", file=sys.stderr)
        return 2
    print(f"kame-phone eval: {len(plan.questions)} questions from {plan.source}, "
          f"{len(plan.delays)} run(s), out {plan.out}", file=sys.stderr)
    try:
        report = asyncio.run(run_eval(plan, progress=not args.no_progress))
    except (VoiceError, RuntimeError, ValueError) as exc:
        print(f"kame-phone eval: {exc}", file=sys.stderr)
        return 1
    for block in report["summary"]["by_delay"]:
        a = block["all"]
        delay = delay_label(block["forced_delay_ms"])
        score = "–" if a["mean_score"] is None else f"{a['mean_score']:.2f}"
        lat = "–" if a["median_latency_s"] is None else f"{a['median_latency_s']:.2f} s"
        print(f"forced delay {delay}: mean score {score} ({a['scored']}/{a['questions']} scored), "
              f"median latency {lat}")
    for note in report["notes"]:
        print(f"note: {note}")
    print(f"report: {plan.out / 'report.md'}  ({plan.out / 'report.json'})")
    return exit_code(report)


def exit_code(report: dict[str, Any]) -> int:
    """1, each said on stderr, when a question call or a barge-in probe call did not complete: a run whose calls
    partly failed is no pass, its figures being of the calls that did (failed probes exited 0; review, session
    29); else 0."""
    failed = sum(r["outcome"] != "completed" for r in report["results"])
    failed_probes = sum(p["outcome"] != "completed" for p in report["probes"])
    if failed:
        print(f"kame-phone eval: {failed} of {len(report['results'])} calls did not complete", file=sys.stderr)
    if failed_probes:
        print(f"kame-phone eval: {failed_probes} of {len(report['probes'])} barge-in probe calls did not complete",
              file=sys.stderr)  # fmt: skip
    return 1 if failed or failed_probes else 0
