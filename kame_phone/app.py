"""Build the engine (and its back-end) for `kame-phone serve` and `kame-phone demo`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
from urllib.parse import urlsplit

from engine.compiled_step import COMPILE_MODES
from engine.interface import MAX_FORCED_DELAY_MS
from engine.kv_cache import KV_DTYPES
from engine.link_wire import Address, LinkError, LinkFull, LinkRefused, edge_tls
from engine.remote import RemoteEngine
from engine.sampling import SamplingOverrides
from engine.service import EngineConfig, LocalEngine
from engine.weight_quant import WEIGHTS_DTYPES
from knowledge.agents import AgentDirectory
from knowledge.backend import BackendConfig, BackendServices

from .env_flags import env_flag, parse_float, within

log = logging.getLogger(__name__)

# An edge refused for seats (other edges hold them) asks again this often, not on the backoff: in a rollout the
# old edge gives its seats back as it drains, and the new one must take them (and turn ready) within seconds.
SEATS_RETRY_S = 1.0


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, not {text!r}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    env_flag(g, "--checkpoint", "KAME_CHECKPOINT", default="SakanaAI/kame",
             help="Hugging Face repo id, local checkpoint dir, or random:moshi-7b (random weights, load tests)")
    env_flag(g, "--device", "KAME_DEVICE", help="cuda, cuda:1 or cpu (default: cuda if available)")
    env_flag(g, "--max-calls", "KAME_MAX_CALLS", default=8, parse=within(1), help="call slots in the batch")
    env_flag(g, "--context", "KAME_CONTEXT", parse=within(1), help="KV window in 80 ms frames (3000 = 4 min)")
    env_flag(g, "--kv-dtype", "KAME_KV_DTYPE", default="auto", choices=KV_DTYPES,
             help="the main transformer's KV cache: auto (the model's dtype) or 8-bit int8/fp8 (about half the "
                  "memory per call; accuracy cost in docs/benchmarks.md)")
    env_flag(g, "--weights-dtype", "KAME_WEIGHTS_DTYPE", default="auto", choices=WEIGHTS_DTYPES,
             help="the transformers' linear layers: auto (as loaded) or int8 (half their memory, ~7.4 GB less "
                  "for the 7B model; accuracy cost in docs/benchmarks.md)")
    env_flag(g, "--forced-delay-ms", "KAME_FORCED_DELAY_MS", default=0.0,
             parse=within(0, MAX_FORCED_DELAY_MS, parse_float),  # as the agents file and the engine link take it
             help="hold the reply until N ms after a turn")
    env_flag(g, "--compile", "KAME_COMPILE", default="off", choices=COMPILE_MODES,
             help="torch.compile the LM step (GPU: fewer, fused kernels a tick, for batch-1 latency; compiles in "
                  "the warm-up, max-autotune for minutes); off: the official step, token for token")
    # On by default: in the service's process the STT and the phone edge starve the 80 ms loop (6 calls on
    # 2 cores: 0.39-0.56 of real time in process, 0.97-0.98 in its own; docs/benchmarks.md section 4).
    env_flag(g, "--engine-process", "KAME_ENGINE_PROCESS", switch=True, default=True,
             help="run the model and its 80 ms loop in a child process (own GIL and clock; crash-isolated)")
    env_flag(g, "--torch-threads", "KAME_TORCH_THREADS", default=0, parse=within(0),
             help="the model's intra-op CPU threads (0: torch's default)")
    s = parser.add_argument_group("sampling (default: the checkpoint's lm_gen_config, else moshi's 0.8/0.7/250/25)")
    env_flag(s, "--greedy", "KAME_GREEDY", switch=True, help="argmax instead of sampling (deterministic)")
    s.add_argument("--temp", type=_non_negative, default=None, help="audio temperature")
    s.add_argument("--temp-text", type=_non_negative, default=None, help="text temperature")
    s.add_argument("--top-k", type=_positive_int, default=None, help="audio top-k")
    s.add_argument("--top-k-text", type=_positive_int, default=None, help="text top-k")
    b = parser.add_argument_group("back-end")
    env_flag(b, "--stt", "KAME_STT", default="pocketsphinx", choices=("pocketsphinx", "kyutai", "none"),
             help="pocketsphinx: CPU, for development; kyutai: batched on the GPU")
    # On by default: beside the event loop its step took 51 ms p50 at 64 calls on an H200, 22 ms alone
    # (docs/benchmarks.md): the GIL, not the GPU.
    env_flag(b, "--stt-process", "KAME_STT_PROCESS", switch=True, default=True,
             help="--stt kyutai: run its model and 80 ms loop in a child process (own GIL; restarted if it dies)")
    env_flag(b, "--llm", "KAME_LLM", default="openai", choices=("openai", "none"),
             help="'openai': any OpenAI-compatible endpoint (OPENAI_BASE_URL, OPENAI_API_KEY)")
    env_flag(b, "--llm-model", "KAME_LLM_MODEL", help="model name (default: gpt-4.1)")
    env_flag(b, "--llm-idle-timeout", "KAME_LLM_IDLE_TIMEOUT", default=5.0, parse=_positive_seconds,
             help="seconds an LLM reply may go without a token once it has begun, before it counts as a timeout "
             "(raise it for a self-hosted server that pauses under load)")
    env_flag(b, "--agents", "KAME_AGENTS", help="agents file (TOML): instructions, greeting, numbers, busy "
             "policy per agent; SIGHUP reloads it (README, 'Configure your agents')")  # fmt: skip


def _positive_seconds(raw: str) -> float:
    value = parse_float(raw)
    if value <= 0:
        raise ValueError("not a positive number of seconds")
    return value


def agents_from_args(args: argparse.Namespace) -> AgentDirectory:
    """The process's agents, loaded once (the phone edge and the back-end share them); raises AgentsError
    naming the file, the agent and the key when the file cannot be used."""
    directory = getattr(args, "agent_directory", None)
    if directory is None:
        directory = args.agent_directory = AgentDirectory.from_file(args.agents)
    return directory


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        checkpoint=args.checkpoint,
        max_calls=args.max_calls,
        context=args.context,
        kv_dtype=args.kv_dtype,
        weights_dtype=args.weights_dtype,
        compile_mode=args.compile,
        forced_delay_ms=args.forced_delay_ms,
        sampling=SamplingOverrides(
            greedy=args.greedy, temp=args.temp, temp_text=args.temp_text, top_k=args.top_k, top_k_text=args.top_k_text
        ),
        engine_process=args.engine_process,
        torch_threads=args.torch_threads,
    )
    if args.device:
        config.device = args.device
    return config


def device_problem(device: str | None) -> str | None:
    """What is wrong with `--device` on this machine (a CUDA device it does not have), else None. Said at
    start-up in one line: found at the model's load it was a traceback from the engine process."""
    if not device:
        return None
    if device != "cpu" and not re.fullmatch(r"cuda(:[0-9]+)?", device):
        # ("gpu", "CPU", "cuda0": torch's own error came from the engine process, as a traceback and exit 1,
        # which an orchestrator restarts for ever.)
        return f"--device {device}: not a device this engine runs on: cpu, cuda, or cuda:N"
    if not device.startswith("cuda"):
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = device.partition(":")[2]
    if count == 0 and torch.version.cuda is None:  # scripts/setup.sh installs the CPU build unless told
        return (f"--device {device}: torch {torch.__version__} is a CPU-only build: install a CUDA build "
                "(scripts/setup.sh: TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130)")
    if count == 0:
        return f"--device {device}: this machine has no CUDA device (on CPU: --device cpu with a tiny checkpoint)"
    if index and (not index.isdigit() or int(index) >= count):
        return f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


def backend_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the back-end's settings (the Kyutai STT's variables, the LLM's URL), else None: said
    at start-up in one line, not as a traceback at the back-end's first load or as every request failing."""
    if getattr(args, "stt", None) == "kyutai":
        from knowledge.stt_kyutai import settings_from_env

        try:
            settings_from_env(rows=args.max_calls)
        except ValueError as e:
            return str(e)
    base_url = os.environ.get("OPENAI_BASE_URL", "")
    if getattr(args, "llm", "openai") != "none" and base_url:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # (Not echoed: it may carry a key.) Without a scheme every request failed as "Connection error."
            return "OPENAI_BASE_URL must look like https://host[:port]/v1 (with its http:// or https://)"
    return None


def backend_from_args(args: argparse.Namespace, *, start_stt: bool = True) -> BackendServices | None:
    if args.stt == "none" and args.llm == "none":
        return None
    overrides: dict[str, object] = {"stt": args.stt, "llm_enabled": args.llm != "none", "stt_rows": args.max_calls,
                                    "stt_process": args.stt_process}
    if args.llm_model:
        overrides["llm_model"] = args.llm_model
    overrides["llm_idle_timeout_s"] = args.llm_idle_timeout
    return BackendServices(BackendConfig.from_env(**overrides), agents_from_args(args), start_stt=start_stt)


async def load_engine(args: argparse.Namespace) -> LocalEngine:
    # Off the event loop: `--stt kyutai` loads a model, and /healthz must keep answering meanwhile.
    backend = await asyncio.to_thread(backend_from_args, args, start_stt=False)
    engine: LocalEngine | None = None
    try:
        if backend is not None:
            await backend.start()  # the STT's process, where it has one
            # Build STT decoders before the first call instead of during it (~0.4 s each, GIL held).
            await backend.warm_up(min(args.max_calls, 8))
        engine = await LocalEngine.load(engine_config_from_args(args), backend)
        await engine.start()
    except BaseException:
        # A load that failed (a GPU out of memory) or was stopped (SIGTERM) leaves nothing running: the STT's
        # process lived on until the interpreter's exit, whose SIGTERM it then reported as a crash.
        await _give_up_load(engine, backend)
        raise
    return engine


async def _give_up_load(engine: LocalEngine | None, backend: BackendServices | None) -> None:
    stopped = False
    if engine is not None:
        try:
            await engine.stop()  # its frame loop, if it came up, and the back-end it was given
            stopped = True
        except Exception:  # the load's own error is the one to report
            log.exception("stopping what a failed load had started")
    if backend is not None and not stopped:  # not left running because the engine's stop failed half way
        try:
            await backend.aclose()
        except Exception:
            log.exception("closing the back-end of a failed load")


async def connect_engine(args: argparse.Namespace) -> RemoteEngine:
    """`serve --engine`: this edge's seats on a running engine server, retried until it is up (it may still be
    loading its model); a wrong token fails at once."""
    address = Address.parse(args.engine)
    token = os.environ.get("KAME_ENGINE_TOKEN") or None
    # tls://: the engine's certificate is checked against KAME_ENGINE_CA (a PEM file), else the system's CAs.
    tls = edge_tls(os.environ.get("KAME_ENGINE_CA") or None) if address.tls else None
    delay, full = 0.5, 0
    while True:
        try:
            return await RemoteEngine.connect(address, token=token, seats=args.max_calls, tls=tls)
        except LinkRefused:
            raise
        except LinkFull as e:
            full += 1  # said once, then every 30 tries: a drain can last minutes
            log.log(logging.WARNING if full % 30 == 1 else logging.DEBUG, "engine at %s: %s; asking again in %.1fs",
                    address, e, SEATS_RETRY_S)  # fmt: skip
            await asyncio.sleep(SEATS_RETRY_S)
        except (OSError, LinkError) as e:
            log.warning("engine at %s not available yet (%s); retrying in %.1fs", address, e, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 10.0)
