"""Loading a KAME checkpoint: a Hugging Face repo id or a local directory in the same layout.

Layout (as moshi's `CheckpointInfo` reads it): `config.json` whose keys are the LM's constructor kwargs,
plus file names under `moshi_name` (LM safetensors), `mimi_name` (Mimi safetensors), `tokenizer_name`
(SentencePiece model) and optionally `mimi_config_name` (a non-default Mimi architecture) and
`lm_gen_config` (sampling defaults). moshi's own LM loader instantiates the stock `LMModel` and rejects
`oracle_emb.*`, so the LM is loaded here; Mimi and the tokenizer go through moshi's helpers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sentencepiece
import torch
from moshi.models import loaders
from moshi.models.compression import MimiModel
from safetensors import SafetensorError
from safetensors.torch import load_file

from .model import KameLM
from .weight_quant import quantize_weights, weights_bytes

log = logging.getLogger(__name__)

DEFAULT_REPO = "SakanaAI/kame"
# Keys of config.json that are not LM constructor kwargs (same list as moshi's CheckpointInfo).
_NON_LM_KEYS = (
    "moshi_name", "mimi_name", "mimi_config_name", "tokenizer_name", "lora_name", "model_type",
    "lm_gen_config", "tts_config", "stt_config", "model_id",
    "random_weights",  # ours: set by make-tiny-checkpoint, so reports can say the answers mean nothing
)


def has_random_weights(source: str) -> bool:
    """`random:SIZE`, or a local checkpoint whose config.json says `"random_weights": true` (the tiny one)."""
    if source.startswith(RANDOM_PREFIX):
        return True
    config = Path(source).expanduser() / "config.json"
    try:
        return bool(json.loads(config.read_text()).get("random_weights")) if config.is_file() else False
    except (OSError, ValueError, AttributeError):
        return False


class CheckpointError(Exception):
    """A checkpoint could not be found or does not match its config. The message says what to do."""


@dataclass
class CheckpointFiles:
    source: str  # the repo id or directory the user named
    config: dict[str, Any]
    lm_weights: Path
    mimi_weights: Path
    tokenizer: Path
    mimi_config: dict[str, Any] | None = None

    @property
    def lm_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.config.items() if k not in _NON_LM_KEYS}

    @property
    def lm_gen_config(self) -> dict[str, Any]:
        gen = self.config.get("lm_gen_config", {})
        if not isinstance(gen, dict):
            raise CheckpointError(f"config.json of {self.source}: lm_gen_config must be a JSON object")
        return dict(gen)


@dataclass
class KameBundle:
    """Everything the engine needs, loaded and in eval mode."""

    lm: KameLM
    mimi: MimiModel
    tokenizer: sentencepiece.SentencePieceProcessor
    lm_gen_config: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def _file_names(config: dict[str, Any]) -> dict[str, str | None]:
    names = {
        "lm": config.get("moshi_name", loaders.MOSHI_NAME),
        "mimi": config.get("mimi_name", loaders.MIMI_NAME),
        "tokenizer": config.get("tokenizer_name", loaders.TEXT_TOKENIZER_NAME),
        "mimi_config": config.get("mimi_config_name"),
    }
    for key, name in names.items():
        if name is None and key == "mimi_config":
            continue
        # A file of the checkpoint itself: not a number (a traceback), nor a path out of it.
        parts = name.replace("\\", "/").split("/") if isinstance(name, str) else []
        if not parts or not parts[0] or ".." in parts:  # (a leading "/" leaves an empty first part)
            raise CheckpointError(f"config.json names its {key} file {name!r}: not a file name inside the checkpoint")
    return names


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def resolve_local(directory: Path) -> CheckpointFiles:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory} has no config.json: not a KAME checkpoint directory")
    config = _read_json(config_path)
    names = _file_names(config)
    paths = {k: directory / v for k, v in names.items() if v is not None}
    missing = [str(p.name) for p in paths.values() if not p.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {directory} is missing {', '.join(missing)} (named in config.json)")
    return CheckpointFiles(
        source=str(directory),
        config=config,
        lm_weights=paths["lm"],
        mimi_weights=paths["mimi"],
        tokenizer=paths["tokenizer"],
        mimi_config=_read_json(paths["mimi_config"]) if "mimi_config" in paths else None,
    )


# Where a fetched copy goes: KAME's own checkpoint (a tiny random one stands in for tests); the Kyutai STT's
# resolves with its own line (knowledge/stt_kyutai.py), or the advice pointed its operator at the wrong flag.
_USE_COPY = "pass --checkpoint DIR (or `kame-phone make-tiny-checkpoint DIR` for a random-weight test model)"


def resolve_hf(repo_id: str, revision: str | None = None, use_copy: str = _USE_COPY) -> CheckpointFiles:
    # Imported here: huggingface_hub reads its environment (HF_HUB_OFFLINE, HF_HOME) at import time.
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    def get(name: str) -> Path:
        try:
            return Path(hf_hub_download(repo_id, name, revision=revision))
        except (LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as e:
            raise CheckpointError(
                f"cannot fetch {name} from the Hugging Face repo {repo_id} (no network?) and no local copy "
                f"is cached. On a machine with internet run `huggingface-cli download {repo_id} "
                f"--local-dir DIR`, copy DIR here and {use_copy}. [{type(e).__name__}]"
            ) from None
        except HfHubHTTPError as e:
            raise CheckpointError(f"Hugging Face refused {repo_id}/{name}: {e}") from None

    config = _read_json(get("config.json"))
    names = _file_names(config)
    return CheckpointFiles(
        source=repo_id,
        config=config,
        lm_weights=get(names["lm"]),  # type: ignore[arg-type]
        mimi_weights=get(names["mimi"]),  # type: ignore[arg-type]
        tokenizer=get(names["tokenizer"]),  # type: ignore[arg-type]
        mimi_config=_read_json(get(names["mimi_config"])) if names["mimi_config"] else None,
    )


def resolve_checkpoint(source: str, revision: str | None = None, use_copy: str = _USE_COPY) -> CheckpointFiles:
    """A local directory if `source` is one, else a Hugging Face repo id (`use_copy`: what to do with a copy
    downloaded elsewhere, said when it cannot be fetched)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return resolve_local(path)
    check_source(source)
    return resolve_hf(source, revision, use_copy)


def check_source(source: str) -> None:
    """CheckpointError, at once, when `source` is neither a local checkpoint directory whose files are there nor
    shaped as a Hugging Face repo id (owner/name): what `resolve_checkpoint` refuses before any download."""
    path = Path(source).expanduser()
    if path.is_dir():
        resolve_local(path)
    elif path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise CheckpointError(f"{source!r} is neither a checkpoint directory nor a Hugging Face repo id")


def clean_lm_kwargs(lm_kwargs: dict[str, Any], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """moshi's config clean-up: drop deprecated keys, rename moved ones; LoRA/conditioning unsupported."""
    kwargs = dict(lm_kwargs) | dict(overrides or {})
    kwargs.pop("depformer_causal", None)
    if "demux_second_stream" in kwargs:
        kwargs["demux_second_text_stream"] = kwargs.pop("demux_second_stream")
    for key in ("lora", "conditioners", "fuser"):
        if kwargs.pop(key, None):
            raise CheckpointError(f"config.json sets {key!r}: not supported by KAME Phone yet")
    kwargs.pop("lora_rank", None)
    kwargs.pop("lora_scaling", None)
    return kwargs


def _upgrade_and_check(model: KameLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Backfill oracle_emb from text_emb (plain Moshi), then check every shape against the config."""
    if not any(k.startswith("oracle_emb.") for k in state):
        text_keys = [k for k in state if k.startswith("text_emb.")]
        if text_keys:
            log.warning("checkpoint %s has no oracle_emb: copying text_emb into it (plain Moshi weights)", source)
            for k in text_keys:
                state["oracle_emb." + k.removeprefix("text_emb.")] = state[k].clone()
    expected = model.state_dict()
    for name, tensor in state.items():
        if name in expected and tuple(expected[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"weights in {source} don't match config.json: {name} has shape {tuple(tensor.shape)} "
                f"in the file but the config makes it {tuple(expected[name].shape)}"
            )


def load_lm(
    files: CheckpointFiles,
    device: torch.device | str,
    dtype: torch.dtype,
    lm_overrides: dict[str, Any] | None = None,
) -> KameLM:
    kwargs = clean_lm_kwargs(files.lm_kwargs, lm_overrides)
    try:
        model = KameLM(device="meta", dtype=dtype, **kwargs)
    except TypeError as e:
        raise CheckpointError(f"config.json of {files.source} has an unknown LM setting: {e}") from None
    except (ValueError, AttributeError, KeyError, AssertionError) as e:  # a setting of the wrong type or range
        raise CheckpointError(f"config.json of {files.source} has an LM setting the model cannot take: "
                              f"{type(e).__name__}: {str(e)[:200]}") from None
    try:
        state = load_file(str(files.lm_weights), device=str(device))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read LM weights {files.lm_weights}: {e}") from None
    for key, value in state.items():
        if value.dtype.is_floating_point:
            keep_fp32 = key.startswith(("condition_provider.", "fuser."))
            state[key] = value.float() if keep_fp32 else value.to(dtype)
    _upgrade_and_check(model, state, files.source)
    # strict=False so the key lists come back after moshi's legacy-name hooks; we enforce strictness.
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"weights in {files.source} don't match config.json: "
            f"missing {sorted(result.missing_keys)[:8]}, unexpected {sorted(result.unexpected_keys)[:8]}"
        )
    return model.eval()


def load_mimi(files: CheckpointFiles, device: torch.device | str) -> MimiModel:
    lm_kwargs = files.lm_kwargs
    num_codebooks = max(lm_kwargs.get("dep_q", 8), lm_kwargs.get("n_q", 16) - lm_kwargs.get("dep_q", 8))
    try:
        return loaders.get_mimi(files.mimi_weights, files.mimi_config, device=device, num_codebooks=num_codebooks)
    except (RuntimeError, SafetensorError, OSError, KeyError, TypeError, ValueError, AttributeError) as e:
        first = str(e).strip().splitlines()[:3]
        raise CheckpointError(f"Mimi weights {files.mimi_weights} don't load: {' '.join(first)}") from None


def load_tokenizer(files: CheckpointFiles, text_card: int) -> sentencepiece.SentencePieceProcessor:
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(files.tokenizer))
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"cannot load the SentencePiece model {files.tokenizer}: {e}") from None
    if sp.vocab_size() > text_card:
        raise CheckpointError(
            f"tokenizer {files.tokenizer.name} has {sp.vocab_size()} pieces but the LM's text_card is {text_card}"
        )
    return sp


RANDOM_PREFIX = "random:"


def load_random(
    size: str, device: torch.device, dtype: torch.dtype, context: int | None = None, weights_dtype: str = "auto"
) -> KameBundle:
    """`random:SIZE`: the named architecture with random weights, no files needed.

    For capacity tests of a GPU node before the real weights are there: speed does not depend on the
    weights' values, but the bot says noise. The tokenizer is the tiny test one (its ids are valid at
    every size), so oracle drafts still cost a real SentencePiece encode.
    """
    # Imported here: presets and the tiny tokenizer are only needed by this path.
    from .presets import SIZES, lm_kwargs_for, mimi_config_for
    from .tiny_checkpoint import train_tiny_tokenizer

    if size not in SIZES:
        raise CheckpointError(f"random:{size}: unknown size; choose one of {', '.join(SIZES)}")
    log.warning("checkpoint random:%s: RANDOM WEIGHTS, for capacity tests only; the bot will speak noise", size)
    kwargs = lm_kwargs_for(size)
    if context:
        kwargs["context"] = context
    torch.manual_seed(0)
    lm = KameLM(device=device, dtype=dtype, **kwargs).eval()
    _quantize(lm, weights_dtype)
    mimi = loaders.get_mimi(None, mimi_config_for(size), device=device, num_codebooks=kwargs["dep_q"])
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=train_tiny_tokenizer())
    return KameBundle(lm=lm, mimi=mimi, tokenizer=tokenizer, source=RANDOM_PREFIX + size)


def _quantize(lm: KameLM, weights_dtype: str) -> None:
    before = weights_bytes(lm)
    layers = quantize_weights(lm, weights_dtype)
    if layers:
        log.info("weights: %s in %d linear layers, %.2f GB (%.2f GB as loaded)", weights_dtype, layers,
                 weights_bytes(lm) / 1e9, before / 1e9)


def load_kame(
    source: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    context: int | None = None,
    revision: str | None = None,
    weights_dtype: str = "auto",
    files: CheckpointFiles | None = None,
) -> KameBundle:
    """Load LM, Mimi and tokenizer from a directory, a Hugging Face repo id or `random:SIZE` (see
    load_random). `context` caps the KV cache in frames (the call-length window); `weights_dtype` int8
    stores the transformers' linear layers in 8 bits (engine/weight_quant.py)."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if source.startswith(RANDOM_PREFIX):
        return load_random(source.removeprefix(RANDOM_PREFIX), device, dtype, context, weights_dtype)
    files = files or resolve_checkpoint(source, revision)  # `files`: resolved (fetched) already
    lm = load_lm(files, device, dtype, {"context": context} if context else None)
    _quantize(lm, weights_dtype)
    return KameBundle(
        lm=lm,
        mimi=load_mimi(files, device),
        tokenizer=load_tokenizer(files, lm.text_card),
        lm_gen_config=files.lm_gen_config,
        source=files.source,
    )
