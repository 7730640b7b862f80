"""How the front-end samples its tokens: the checkpoint's `lm_gen_config`, then the command line's overrides.

The official server builds moshi's `LMGen` with the checkpoint's `lm_gen_config` over LMGen's defaults;
a fine-tuned checkpoint can ship its own temperatures there, so ignoring them changes how the model talks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .checkpoint import CheckpointError

log = logging.getLogger(__name__)

# lm_gen_config keys that are LMGen settings we do not take over: cfg_coef != 1 needs a conditioned model.
_IGNORED_KEYS = ("cfg_coef", "check", "support_out_of_sync", "cfg_is_masked_until", "cfg_is_no_text")


@dataclass(frozen=True)
class SamplingConfig:
    """The values in force (moshi LMGen's defaults here)."""

    use_sampling: bool = True
    temp: float = 0.8
    temp_text: float = 0.7
    top_k: int = 250
    top_k_text: int = 25

    def describe(self) -> str:
        if not self.use_sampling:
            return "greedy (argmax)"
        return (f"temp={self.temp:g} top_k={self.top_k} (audio), "
                f"temp_text={self.temp_text:g} top_k_text={self.top_k_text} (text)")


@dataclass(frozen=True)
class SamplingOverrides:
    """What the command line sets (--greedy, --temp, ...); None leaves the checkpoint's value."""

    greedy: bool = False
    temp: float | None = None
    temp_text: float | None = None
    top_k: int | None = None
    top_k_text: int | None = None

    def resolve(self, lm_gen_config: Mapping[str, Any]) -> SamplingConfig:
        """LMGen's defaults < the checkpoint's `lm_gen_config` < these overrides. Bad checkpoint values are
        refused with the key named."""
        config = checkpoint_sampling(lm_gen_config)
        set_here = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "greedy"}
        config = replace(config, **{k: v for k, v in set_here.items() if v is not None})
        return replace(config, use_sampling=False) if self.greedy else config


def checkpoint_sampling(lm_gen_config: Mapping[str, Any]) -> SamplingConfig:
    defaults = asdict(SamplingConfig())
    values: dict[str, Any] = {}
    for key, value in lm_gen_config.items():
        if key not in defaults:
            if key not in _IGNORED_KEYS:
                log.warning("config.json lm_gen_config.%s is not a sampling setting KAME Phone uses: ignored", key)
            continue
        kind = type(defaults[key])
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
            and (kind is float or (float(value).is_integer() and value >= 1))
        )
        if not ok:
            want = {bool: "true or false", float: "a number >= 0", int: "an integer >= 1"}[kind]
            raise CheckpointError(f"config.json lm_gen_config.{key} must be {want}, not {value!r}")
        values[key] = kind(value)
    if lm_gen_config.get("cfg_coef", 1.0) != 1.0:
        log.warning("config.json lm_gen_config.cfg_coef=%r: classifier-free guidance is not supported; "
                    "running without it", lm_gen_config["cfg_coef"])
    return SamplingConfig(**values)
