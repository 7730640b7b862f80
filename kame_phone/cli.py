"""`kame-phone`: serve phone calls, dial the service, run the offline demo, benchmark, make test models."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from telephony.config import DEFAULT_METRICS_PORT
from telephony.logs import setup_logging

from .env_flags import EnvDefault, EnvError, env_flag, parse_float, parse_int, resolve_env_defaults, within


def _serve(args: argparse.Namespace) -> int:
    from knowledge.agents import AgentsError
    from telephony.audiosocket_config import parse_listeners, parse_networks
    from telephony.call_store import open_call_store
    from telephony.config import ConfigError, ServiceConfig
    from telephony.server import run_service

    from .app import agents_from_args, backend_problem, connect_engine, device_problem, load_engine

    setup_logging(json_lines=args.log_json)
    try:
        agents = agents_from_args(args)
    except AgentsError as e:
        print(f"kame-phone serve: {e}", file=sys.stderr)
        return 2
    try:
        audiosocket = parse_listeners(args.audiosocket)
    except ValueError as e:
        print(f"kame-phone serve: --audiosocket: {e}", file=sys.stderr)
        return 2
    try:
        audiosocket_allow = parse_networks(args.audiosocket_allow)
    except ValueError as e:
        print(f"kame-phone serve: --audiosocket-allow: {e}", file=sys.stderr)
        return 2
    if unknown := [str(a) for a in audiosocket if a.agent and a.agent not in agents.agents.by_name]:
        print(f"kame-phone serve: --audiosocket names an agent the agents file does not have: {', '.join(unknown)}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        config = ServiceConfig.from_env(
            audiosocket=audiosocket,
            audiosocket_allow=audiosocket_allow,
            host=args.host,
            port=args.port,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            public_url=args.public_url,
            insecure_dev=args.insecure_dev,
            store_transcripts=not args.no_transcripts,
            retention_s=args.retention_hours * 3600,
            max_unstarted_streams=args.max_unstarted_streams,
            start_timeout_s=args.start_timeout,
            max_idle_connections=args.max_idle_connections,
            drain_timeout_s=args.drain_timeout,
            max_call_s=args.max_call_minutes * 60,
        )
    except ConfigError as e:
        print(f"kame-phone serve: {e}", file=sys.stderr)
        return 2
    if args.engine:
        from engine.link_wire import Address

        try:
            address = Address.parse(args.engine)
        except ValueError as e:
            print(f"kame-phone serve: --engine: {e}", file=sys.stderr)
            return 2
        if address.tls and (ca := os.environ.get("KAME_ENGINE_CA")):
            from engine.link_wire import edge_tls

            try:
                edge_tls(ca)  # now: an unmounted CA volume was a traceback at the first connect
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                print(f"kame-phone serve: KAME_ENGINE_CA {ca}: cannot load it as PEM certificates ({e})",
                      file=sys.stderr)  # fmt: skip
                return 2
    elif (problem := device_problem(args.device) or backend_problem(args)) is not None:
        print(f"kame-phone serve: {problem}", file=sys.stderr)
        return 2

    async def main() -> int:
        store = open_call_store(
            config.redis_url,
            key_prefix=config.redis_prefix,
            ttl_s=config.retention_s,
            store_transcripts=config.store_transcripts,
        )
        return await run_service(config, store, lambda: connect_engine(args) if args.engine else load_engine(args),
                                 agents=agents, remote_engine=bool(args.engine))  # fmt: skip

    return asyncio.run(main())


def _engine_serve(args: argparse.Namespace) -> int:
    from .engine_serve import run_engine_server

    setup_logging(json_lines=args.log_json)
    return asyncio.run(run_engine_server(args))


def _call(args: argparse.Namespace) -> int:
    from telephony.sim_caller import run_call_from_args

    setup_logging(level="WARNING")
    return asyncio.run(run_call_from_args(args))


def _audiosocket_call(args: argparse.Namespace) -> int:
    from telephony.sim_audiosocket import run_audiosocket_call_from_args

    setup_logging(level="WARNING")
    return asyncio.run(run_audiosocket_call_from_args(args))


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    setup_logging(level="WARNING" if not args.verbose else "INFO")
    return run_demo(args)


def _bench(args: argparse.Namespace) -> int:
    if args.what == "engine":
        from engine.bench import run_engine_bench
        from engine.kv_cache import KV_DTYPES
        from engine.weight_quant import WEIGHTS_DTYPES

        if (args.kv_dtype or "auto") not in KV_DTYPES or (args.weights_dtype or "auto") not in WEIGHTS_DTYPES:
            print(f"kame-phone bench engine: --kv-dtype takes one of {', '.join(KV_DTYPES)} and --weights-dtype one "
                  f"of {', '.join(WEIGHTS_DTYPES)}, got {args.kv_dtype!r} and {args.weights_dtype!r}", file=sys.stderr)
            return 2

        report = run_engine_bench(
            args.size,
            [int(b) for b in args.batch.split(",")],
            args.device or ("cuda" if _cuda() else "cpu"),
            ticks=args.ticks,
            warmup=args.warmup,
            context=args.context,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype or "auto",
            weights_dtype=args.weights_dtype or "auto",
            int8_matmul=args.int8_matmul,
            compile_mode=args.compile,
            phases=args.phases,
            profile_dir=args.profile,
            paced=args.paced,
            # After each batch, so a run its timeout cuts short keeps every finished batch's figures.
            on_batch=(lambda r: _write_atomically(Path(args.json), r.to_json() + "\n")) if args.json else None,
        )
        if args.json:
            _write_atomically(Path(args.json), report.to_json() + "\n")
        return 0
    if args.what == "kv":
        from engine.kv_cache import KV_DTYPES
        from engine.quant_accuracy import run_quant_accuracy
        from engine.weight_quant import WEIGHTS_DTYPES

        kinds = [k for k in (args.kv_dtype or "int8,fp8").split(",") if k != "auto"]
        weights = [w for w in (args.weights_dtype or "int8").split(",") if w != "auto"]
        if any(k not in KV_DTYPES for k in kinds) or any(w not in WEIGHTS_DTYPES for w in weights):
            print(f"kame-phone bench kv: --kv-dtype takes {', '.join(KV_DTYPES[1:])} and --weights-dtype "
                  f"{', '.join(WEIGHTS_DTYPES[1:])} (or auto: none), got {args.kv_dtype!r} and {args.weights_dtype!r}",
                  file=sys.stderr)
            return 2
        if not kinds and not weights:
            print("kame-phone bench kv: nothing to compare (--kv-dtype auto and --weights-dtype auto)", file=sys.stderr)
            return 2

        def write(results: list) -> None:  # type: ignore[type-arg]
            _write_atomically(Path(args.json), json.dumps([r.to_dict() for r in results], indent=1) + "\n")

        # Written after each variant: a run cut short (a GPU call's time limit) keeps what it measured.
        run_quant_accuracy(args.size, args.device or ("cuda" if _cuda() else "cpu"), kinds, weights,
                           steps=args.steps, context=args.context, dtype=args.dtype, checkpoint=args.checkpoint,
                           on_result=write if args.json else None)
        return 0
    if args.what == "stt":
        from knowledge.stt_bench import run_stt_bench

        # --batch: the STT's rows (calls at once). Written after each, as the engine bench does.
        run_stt_bench(args.checkpoint or "random:tiny", [int(b) for b in args.batch.split(",")],
                      args.device or ("cuda" if _cuda() else "cpu"), ticks=args.ticks, warmup=args.warmup,
                      on_row=(lambda r: _write_atomically(Path(args.json), r.to_json() + "\n")) if args.json else None)
        return 0
    if args.what == "oracle":
        from .oracle_bench import run_oracle_bench

        result = asyncio.run(
            run_oracle_bench(
                calls=args.calls, seconds=args.seconds, ttft_ms=args.llm_ttft_ms,
                engine_process=args.engine_process, torch_threads=args.torch_threads,
                size=args.size, ttft_jitter_ms=args.llm_ttft_jitter_ms,
                device=args.device or ("cuda" if args.size != "tiny" and _cuda() else "cpu"), context=args.context,
            )
        )
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.what == "node":
        from .node_bench import run_node_bench

        result = asyncio.run(run_node_bench(calls=args.calls, serve_args=args.serve_arg, checkpoint=args.checkpoint,
                                            ttft_ms=args.llm_ttft_ms, hold_s=max(0.0, args.hold),
                                            voices=Path(args.voices) if args.voices else None,
                                            serve_log=Path(args.json).with_suffix(".serve.log") if args.json else None))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        if result["not_served"]:  # the figures are not at --calls calls: no fleet is sized with them
            ended = ", ".join(f"{o} {n}" for o, n in sorted(result["outcome_counts"].items()) if o != "completed")
            print(f"kame-phone bench node: {result['not_served']} of {result['calls']} calls not served ({ended}); "
                  f"the figures are not at {result['calls']} calls", file=sys.stderr)
            return 3
        return 0
    from .media_bench import run_media_bench

    result = asyncio.run(
        run_media_bench(calls=args.calls, seconds=args.seconds, engine_link=args.engine_link, edges=args.edges)
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _write_atomically(path: Path, text: str) -> None:
    """The whole file or the one before it, never half of one: written beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _twilio(args: argparse.Namespace) -> int:
    from . import twilio_cli

    setup_logging(level="WARNING")
    return twilio_cli.run(twilio_cli.twilio_setup, args)


def _dial(args: argparse.Namespace) -> int:
    from . import twilio_cli

    setup_logging(level="WARNING")
    return twilio_cli.run(twilio_cli.dial, args)


def _eval(args: argparse.Namespace) -> int:
    from evaluation.command import run_from_args

    return run_from_args(args)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _make_tiny(args: argparse.Namespace) -> int:
    from engine.tiny_checkpoint import make_tiny_checkpoint

    out = make_tiny_checkpoint(args.dir, seed=args.seed)
    print(f"tiny random-weight KAME checkpoint written to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.compiled_step import COMPILE_MODES
    from engine.weight_quant import INT8_MATMULS
    from evaluation.command import add_compare_arguments, add_eval_arguments
    from telephony.sim_audiosocket import add_audiosocket_call_arguments
    from telephony.sim_caller import add_call_arguments

    from .app import add_engine_arguments

    parser = argparse.ArgumentParser(prog="kame-phone", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="answer Twilio calls with KAME")
    env_flag(serve, "--host", "KAME_HOST", default="127.0.0.1", help="the public listener's address")
    env_flag(serve, "--port", "KAME_PORT", default=8080, parse=within(0, 65535), help="the public listener's port")
    env_flag(serve, "--metrics-host", "KAME_METRICS_HOST", default="127.0.0.1",
             help="GET /metrics listens here, never on the public port (0.0.0.0 in a container or pod)")
    env_flag(serve, "--metrics-port", "KAME_METRICS_PORT", default=DEFAULT_METRICS_PORT, parse=within(0, 65535),
             help=f"the metrics listener's port (default {DEFAULT_METRICS_PORT}; 0: any free one)")
    serve.add_argument("--public-url", default=None, help="how Twilio reaches this service (default: $PUBLIC_URL)")
    serve.add_argument("--insecure-dev", action="store_true",
                       help="no TWILIO_AUTH_TOKEN: skip signature checks, loopback only")
    env_flag(serve, "--no-transcripts", "KAME_NO_TRANSCRIPTS", switch=True,
             help="keep timings, not words, in call records")
    env_flag(serve, "--retention-hours", "KAME_RETENTION_HOURS", default=24.0, parse=parse_float,
             help="how long call records live after their last write (1 minute to 10 years; default 24)")
    env_flag(serve, "--log-json", "KAME_LOG_JSON", switch=True, help="JSON log lines")
    env_flag(serve, "--max-unstarted-streams", "KAME_MAX_UNSTARTED_STREAMS", default=16, parse=parse_int,
             help="media sockets upgraded but not started, at most (beyond, a newer upgrade closes the oldest one "
                  "over a second old, else gets 503)")  # fmt: skip
    env_flag(serve, "--start-timeout", "KAME_START_TIMEOUT", default=5.0, parse=parse_float,
             help="seconds a media socket may wait for its stream's start")  # fmt: skip
    env_flag(serve, "--max-idle-connections", "KAME_MAX_IDLE_CONNECTIONS", default=256, parse=parse_int,
             help="public-port connections without a started call, at most (beyond: refused at once)")  # fmt: skip
    env_flag(serve, "--drain-timeout", "KAME_DRAIN_TIMEOUT", default=600.0, parse=parse_float,
             help="on SIGTERM, wait this long (s) for the calls in progress to end; those still up then are "
                  "ended (keep the orchestrator's grace period above it)")  # fmt: skip
    env_flag(serve, "--max-call-minutes", "KAME_MAX_CALL_MINUTES", default=240.0, parse=parse_float,
             help="end a call this long (a stuck line must not hold a seat for good): hung up through Twilio's "
                  "REST API when its credentials are set, else the agent's fallback; 0: no limit")  # fmt: skip
    env_flag(serve, "--audiosocket", "KAME_AUDIOSOCKET", default="",
             help="answer Asterisk's AudioSocket() too: HOST:PORT[=AGENT], comma-separated, one agent a port "
                  "(none: the agents file's default); no Twilio needed")  # fmt: skip
    env_flag(serve, "--audiosocket-allow", "KAME_AUDIOSOCKET_ALLOW", default="",
             help="who may connect to the AudioSocket ports (it has no credentials): CIDRs, comma-separated, "
                  "'private' (loopback, RFC 1918, CGNAT, link-local, ULA) or 'any'; unset: loopback only, and "
                  "required for a listener on another address")  # fmt: skip
    serve.add_argument("--engine", default=EnvDefault("KAME_ENGINE_ADDRESS", None), metavar="ADDRESS",
                       help="use the engine of a `kame-phone engine-serve` at unix:/path, tcp://host:port or "
                            "tls://host:port (token in $KAME_ENGINE_TOKEN; for tls://, the CA in $KAME_ENGINE_CA) "
                            "instead of loading one; --max-calls is the seats to ask for (env KAME_ENGINE_ADDRESS)")
    add_engine_arguments(serve)
    serve.set_defaults(func=_serve)

    engine_serve = sub.add_parser("engine-serve", help="run the engine alone, for `serve --engine` edges to share")
    env_flag(engine_serve, "--listen", "KAME_ENGINE_LISTEN",
             help="unix:/path/engine.sock, tcp://host:port or tls://host:port (off loopback: needs "
                  "$KAME_ENGINE_TOKEN); required")  # fmt: skip
    env_flag(engine_serve, "--tls-cert", "KAME_ENGINE_TLS_CERT", help="certificate chain for a tls:// address")
    env_flag(engine_serve, "--tls-key", "KAME_ENGINE_TLS_KEY", help="its private key")
    env_flag(engine_serve, "--http-port", "KAME_ENGINE_HTTP_PORT", default=9091, parse=within(0, 65535),
             help="/healthz, /readyz and /metrics")  # fmt: skip
    env_flag(engine_serve, "--http-host", "KAME_ENGINE_HTTP_HOST", default="127.0.0.1",
             help="the health and metrics listener's address")  # fmt: skip
    env_flag(engine_serve, "--drain-timeout", "KAME_ENGINE_DRAIN_TIMEOUT", default=600.0,
             parse=within(0, parse=parse_float),
             help="on SIGTERM, wait this long (s) for seated calls to end")  # fmt: skip
    env_flag(engine_serve, "--log-json", "KAME_LOG_JSON", switch=True, help="JSON log lines")
    add_engine_arguments(engine_serve)
    engine_serve.set_defaults(func=_engine_serve)

    call = sub.add_parser("call", help="dial the service like Twilio would, from a WAV file")
    add_call_arguments(call)
    call.set_defaults(func=_call)

    pbx = sub.add_parser("audiosocket-call",
                         help="call a `serve --audiosocket` port like Asterisk's AudioSocket() does")  # fmt: skip
    add_audiosocket_call_arguments(pbx)
    pbx.set_defaults(func=_audiosocket_call)

    demo = sub.add_parser("demo", help="offline end-to-end demo on a tiny random-weight model")
    demo.add_argument("--workdir", type=Path, default=Path("var/demo"))
    demo.add_argument("--question", default="Hello, can you tell me what time the store opens on Monday?")
    demo.add_argument("--stt", choices=["pocketsphinx", "none"], default="pocketsphinx")
    demo.add_argument("--verbose", action="store_true")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks (results go in docs/benchmarks.md)")
    # kv: the accuracy cost of 8-bit KV caches and weights (engine/quant_accuracy.py)
    bench.add_argument("what", choices=["engine", "media", "oracle", "node", "kv", "stt"])
    bench.add_argument("--size", choices=["tiny", "moshi-7b"], default="tiny")
    bench.add_argument("--batch", default="1,8,16,32,48,64", help="comma-separated batch sizes")
    bench.add_argument("--ticks", type=int, default=100)
    bench.add_argument("--warmup", type=int, default=10)
    bench.add_argument("--device", default=None)
    bench.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    bench.add_argument("--context", type=int, default=None, help="KV window in frames (moshi-7b: 3000)")
    bench.add_argument("--kv-dtype", default=None,
                       help="engine bench: auto (default), int8 or fp8; kv bench: the 8-bit formats to compare with "
                            "the model's own cache (comma-separated, default int8,fp8; auto: none)")
    bench.add_argument("--weights-dtype", default=None,
                       help="engine bench: auto (default) or int8; kv bench: the 8-bit weights to compare with the "
                            "model's own, alone and with each --kv-dtype (default int8; auto: none)")
    bench.add_argument("--int8-matmul", choices=INT8_MATMULS, default="auto",
                       help="engine bench with --weights-dtype int8: torch's int8 kernel (aten), dequantize in the "
                            "matmul (dequant), or auto: aten on CPU, dequant on a GPU (engine/weight_quant.py)")
    bench.add_argument("--compile", choices=COMPILE_MODES, default="off",
                       help="engine bench: torch.compile the LM step (engine/compiled_step.py)")
    bench.add_argument("--phases", action="store_true",
                       help="engine bench: then time each phase of a tick (device synchronised between them)")
    bench.add_argument("--paced", action="store_true",
                       help="engine bench: then time more ticks each started on an 80 ms clock, as served (the "
                            "device idle between them), and read the GPU's SM clock as it goes")
    bench.add_argument("--profile", default=None, metavar="DIR",
                       help="engine bench: then profile 60 more ticks per batch: the device's busy and idle time in "
                            "the slow ticks against the rest, the kernels that grew, and a Chrome trace in DIR")
    bench.add_argument("--steps", type=int, default=500, help="kv bench: greedy steps per run")
    bench.add_argument("--calls", type=int, default=200, help="media/oracle bench: concurrent calls")
    bench.add_argument("--seconds", type=float, default=20.0, help="media/oracle bench: how long")
    bench.add_argument("--llm-ttft-ms", type=float, default=300.0, help="oracle bench: the LLM's fixed TTFT")
    bench.add_argument("--llm-ttft-jitter-ms", type=float, default=0.0,
                       help="oracle bench: vary each request's TTFT uniformly by up to this much")
    bench.add_argument("--engine-process", action="store_true", help="oracle bench: the engine in its own process")
    bench.add_argument("--engine-link", action="store_true",
                       help="media bench: the loopback engine in its own process, reached over the engine link")
    bench.add_argument("--edges", type=int, default=1,
                       help="media bench: this many edge processes on one engine process (implies --engine-link)")
    bench.add_argument("--torch-threads", type=int, default=0, help="oracle bench: the model's intra-op threads")
    bench.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                       help="node bench: a flag for the service under test (repeat; e.g. --serve-arg=--engine-process)")
    bench.add_argument("--checkpoint", default=None,
                       help="node bench: the service's checkpoint (default: tiny); kv bench: measure this "
                            "checkpoint's weights instead of --size's random ones; stt bench: the Kyutai STT "
                            "checkpoint (default random:tiny; random:stt-2.6b-en is the real layout)")
    bench.add_argument("--hold", type=float, default=5.0, metavar="SECONDS",
                       help="node bench: each caller stays on this long after its question (the figures' steady "
                            "part: the first seconds hold every call's start)")
    bench.add_argument("--voices", default=None, metavar="DIR",
                       help="node bench: the callers' WAVs (q0.wav ...), used if there, else spoken with flite and "
                            "kept there (make them where flite is, carry them to a GPU box)")
    bench.add_argument("--json", default=None, help="also write the figures here (node bench: and the service's "
                                                     "log beside them, .serve.log; written even when it exits 3 "
                                                     "because a call was not served)")
    bench.set_defaults(func=_bench)

    twilio = sub.add_parser("twilio", help="set up a Twilio number to call this service")
    twilio_sub = twilio.add_subparsers(dest="twilio_command", required=True)
    setup = twilio_sub.add_parser("setup", help="point one of the account's numbers (or SIP Domains) at "
                                                "PUBLIC_URL/twilio/voice")
    target = setup.add_mutually_exclusive_group(required=True)
    target.add_argument("--number", help="the Twilio number, E.164 (+15551234567)")
    target.add_argument("--sip-domain", help="a Twilio SIP Domain (acme.sip.twilio.com) a PBX's SIP trunk sends "
                                             "calls to")
    setup.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
    setup.add_argument("--replace-status-callback", action="store_true",
                       help="take over a status callback that points at another URL (else setup refuses)")
    env_flag(setup, "--public-url", "PUBLIC_URL", help="the https:// URL Twilio reaches this service at")
    setup.set_defaults(func=_twilio)

    dial = sub.add_parser("dial", help="call a phone from one of your Twilio numbers, answered by this service")
    dial.add_argument("to", help="the number to call, E.164, or a sip: URI (sip:1001@pbx.example.com)")
    dial.add_argument("--from", dest="from_number", required=True, help="one of your Twilio numbers, E.164")
    dial.add_argument("--agent", help="the agent that speaks (else the one claiming --from, else default)")
    env_flag(dial, "--agents", "KAME_AGENTS", help="the service's agents file, to check --agent against")
    env_flag(dial, "--public-url", "PUBLIC_URL", help="the https:// URL Twilio reaches this service at")
    dial.add_argument("--wait", action="store_true", help="follow the call to its end, then print its figures")
    # Checked before dialling: nan or a negative placed a real, billed call, then failed at once (review, session 29).
    dial.add_argument("--wait-timeout", type=within(1, parse=parse_float), default=900.0,
                      help="seconds --wait waits at most")
    env_flag(dial, "--admin-token", "ADMIN_TOKEN", help="the service's admin token (--wait reads /calls/SID)")
    dial.set_defaults(func=_dial)

    evaluate = sub.add_parser(
        "eval", help="the paper's score-vs-latency measurement, dialed over the phone path (see README)",
        description="Dial each question as a call, transcribe and judge the spoken replies, report score and "
                    "latency per forced delay. `kame-phone eval compare A B` diffs two runs.")
    add_eval_arguments(evaluate)
    eval_sub = evaluate.add_subparsers(dest="eval_command", required=False)
    add_compare_arguments(eval_sub.add_parser("compare", help="what changed between two eval runs"))
    evaluate.set_defaults(func=_eval)

    tiny = sub.add_parser("make-tiny-checkpoint", help="write a tiny random-weight checkpoint (real layout)")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=1234)
    tiny.set_defaults(func=_make_tiny)
    return parser


def load_dotenv_file() -> None:
    """`.env` in the working directory (KEY=VALUE lines), read by every command; the environment wins.
    KAME_ENV_FILE names another file, which must then exist (EnvError); set empty, none is read (the tests do,
    so a developer's own .env never reaches the commands they run)."""
    from dotenv import dotenv_values

    name = os.environ.get("KAME_ENV_FILE", ".env")
    path = Path(name) if name else None
    if path is None or not path.is_file():
        if path is not None and "KAME_ENV_FILE" in os.environ:
            # Named and not there (a typo, a volume not mounted): going on would run without its settings.
            raise EnvError(f"KAME_ENV_FILE names {name}, which is not a file (set it empty to read none)")
        return
    try:
        values = dotenv_values(path)
    except (UnicodeDecodeError, OSError) as e:  # PowerShell's `echo K=V > .env` writes UTF-16; a directory
        raise EnvError(f"{path}: cannot read it as UTF-8 KEY=VALUE lines ({type(e).__name__})") from None
    for key, value in values.items():
        if value is not None:
            os.environ.setdefault(key, value)


_LONG_RUNNING = ("serve", "engine-serve")
_CANNOT_LISTEN = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


def _exit_at_once(signum: int, _frame: object) -> None:
    os._exit(128 + signum)  # 143: nothing to drain yet; what the default action would do, as PID 1 too


def main(argv: list[str] | None = None) -> int:
    # First thing: as PID 1 (a pod without an init) a signal with no handler is ignored, so a SIGTERM during
    # the seconds of imports and start-up was lost and the pod waited out its grace period for the SIGKILL.
    # The service's own drain handler replaces this one once it can drain.
    command = (sys.argv[1:] if argv is None else argv)[:1]
    if command and command[0] in _LONG_RUNNING and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_at_once)
    try:
        load_dotenv_file()
    except EnvError as e:
        print(f"kame-phone: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        resolve_env_defaults(args)
    except EnvError as e:
        print(f"kame-phone {args.command}: {e}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one clear line for expected failures (bad checkpoint, missing tool)
        from engine.checkpoint import CheckpointError
        from engine.link_wire import LinkRefused
        from engine.memory_check import NotEnoughMemory
        from telephony.cluster import NodeIdInUse

        # A bad checkpoint, a wrong token or protocol version, a node sized past its GPU, a node id another
        # live node has: a retry won't help.
        if isinstance(e, (CheckpointError, LinkRefused, NotEnoughMemory, NodeIdInUse)):
            print(f"kame-phone: {e}", file=sys.stderr)
            return 2
        # Another process holds the port, an address not on this host, a port below 1024, a host name that does
        # not resolve: asyncio's message names the address.
        if isinstance(e, OSError) and (e.errno in _CANNOT_LISTEN or isinstance(e, socket.gaierror)):
            print(f"kame-phone {args.command}: cannot listen: {e.strerror or e}", file=sys.stderr)
            return 2
        logging.getLogger("kame-phone").exception("failed")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
