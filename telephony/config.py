"""The phone edge's settings: read once, from CLI flags and the environment, in this one place."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """A setting is missing or unsafe; the message says which and what to do."""


LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    public_url: str = ""  # how Twilio reaches us, e.g. https://voice.example.com (signatures use it)
    twilio_auth_token: str | None = field(default=None, repr=False)  # never printed
    admin_token: str | None = field(default=None, repr=False)
    insecure_dev: bool = False
    redis_url: str | None = field(default=None, repr=False)  # may hold a password
    node_id: str = field(default_factory=socket.gethostname)
    store_transcripts: bool = True
    retention_s: float = 24 * 3600.0
    reservation_ttl_s: float = 30.0  # a webhook's slot reservation that never got its stream
    silent_socket_s: float = 10.0  # no message from Twilio for this long: the stream is dead
    max_message_bytes: int = 64 * 1024
    flood_burst_packets: int = 50  # inbound packets allowed ahead of real time (1 s)
    mark_every_frames: int = 6  # one playout mark per 480 ms of bot audio
    drain_timeout_s: float = 600.0

    @classmethod
    def from_env(cls, **overrides: object) -> ServiceConfig:
        env = os.environ
        values: dict[str, object] = {
            "public_url": env.get("PUBLIC_URL", ""),
            "twilio_auth_token": env.get("TWILIO_AUTH_TOKEN") or None,
            "admin_token": env.get("ADMIN_TOKEN") or None,
            "redis_url": env.get("REDIS_URL") or None,
        }
        if env.get("KAME_NODE_ID"):
            values["node_id"] = env["KAME_NODE_ID"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)  # type: ignore[arg-type]
        config.check()
        return config

    def check(self) -> None:
        if not self.twilio_auth_token and not self.insecure_dev:
            raise ConfigError(
                "TWILIO_AUTH_TOKEN is not set: refusing to serve unauthenticated phone traffic. "
                "Set it, or pass --insecure-dev for a loopback-only development server."
            )
        if self.insecure_dev and self.host not in LOOPBACK:
            raise ConfigError(f"--insecure-dev binds to loopback only, not {self.host!r}")
        if self.public_url:
            parts = urlsplit(self.public_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"PUBLIC_URL must look like https://host[:port], got {self.public_url!r}")

    @property
    def base_url(self) -> str:
        """The public http(s) base URL, without a trailing slash."""
        if self.public_url:
            return self.public_url.rstrip("/")
        return f"http://{self.host}:{self.port}"

    @property
    def ws_base_url(self) -> str:
        base = self.base_url
        return "wss://" + base[len("https://"):] if base.startswith("https://") else "ws://" + base[len("http://"):]
