"""The environment of a throwaway `serve` that a bench or the eval starts on loopback.

It inherits the operator's environment (their LLM, STT and model settings are what the figures are
about), less every variable that would tie it to a real deployment: run on a production box (where
`.env` was loaded), it would otherwise join the production cluster through REDIS_URL and advertise the
node's public URL (real webhooks routed to a bench), write its calls into the production call records,
take seats on the shared engine (KAME_ENGINE_ADDRESS), carry out call actions through the real Twilio
account (TWILIO_ACCOUNT_SID and API keys), or answer the PBX's calls on its AudioSocket port (KAME_AUDIOSOCKET).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEPLOYMENT_VARIABLES = (
    "REDIS_URL", "KAME_REDIS_PREFIX", "KAME_NODE_ID", "KAME_NODE_URL", "PUBLIC_URL",
    "KAME_ENGINE_ADDRESS", "KAME_ENGINE_TOKEN", "KAME_ENGINE_CA",
    "TWILIO_ACCOUNT_SID", "TWILIO_AUTH_TOKEN", "TWILIO_API_KEY", "TWILIO_API_SECRET", "TWILIO_API_BASE_URL",
    "ADMIN_TOKEN", "KAME_AGENTS", "KAME_AUDIOSOCKET", "KAME_AUDIOSOCKET_ALLOW",
)  # fmt: skip


def throwaway_env(base: Mapping[str, str] | None = None, **overrides: str) -> dict[str, str]:
    """`base` (default: this process's environment) without DEPLOYMENT_VARIABLES, with `overrides`; and
    KAME_ENV_FILE empty, so the child reads no `.env` of its own."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in DEPLOYMENT_VARIABLES}
    env["KAME_ENV_FILE"] = ""
    env.update(overrides)
    return env
