"""The phone edge's settings: read once, from CLI flags and the environment, in this one place."""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from .audiosocket_config import AudioSocketListen, Network


class ConfigError(ValueError):
    """A setting is missing or unsafe; the message says which and what to do."""


LOOPBACK = ("127.0.0.1", "::1", "localhost")
# `kame-phone serve`'s metrics port: 9090 is Prometheus' own and 9091 engine-serve's (both may share a host).
DEFAULT_METRICS_PORT = 9092


MIN_ADMIN_TOKEN_CHARS = 16
MIN_START_TIMEOUT_S, MAX_START_TIMEOUT_S = 0.5, 30.0  # --start-timeout's bounds (ServiceConfig.check)


def is_loopback(host: str | None) -> bool:
    """`localhost` or a loopback IP address (127.0.0.0/8, ::1); an empty host binds every interface."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# Secrets ops/.env.example ships as placeholders. Left unfilled, ADMIN_TOKEN's is a published password (the
# admin API open to anyone who read the example), and the others fail every webhook or request at run time.
SECRET_VARIABLES = ("TWILIO_AUTH_TOKEN", "TWILIO_ACCOUNT_SID", "TWILIO_API_KEY", "TWILIO_API_SECRET", "ADMIN_TOKEN",
                    "OPENAI_API_KEY", "KAME_ENGINE_TOKEN", "HF_TOKEN")
_PLACEHOLDER = "replace-with-"


def unfilled_placeholders(env: Mapping[str, str]) -> list[str]:
    """The variables that still hold ops/.env.example's placeholder: the secrets, and PUBLIC_URL (left at an
    example host, `twilio setup` pointed a live number at it and `dial` placed billed calls that failed)."""
    return [name for name in (*SECRET_VARIABLES, "PUBLIC_URL") if _PLACEHOLDER in env.get(name, "")]


def unfilled_message(names: list[str]) -> str:
    return (f"{', '.join(names)} still hold{'s' if len(names) == 1 else ''} the placeholder from ops/.env.example "
            "(replace-with-...): fill in the real value, or unset it")


MIN_RETENTION_S = 60.0  # a call's record must outlive the call's last writes and its status callback
MAX_RETENTION_S = 10 * 366 * 24 * 3600.0  # ten years


def hide_password(url: str | None) -> str | None:
    """`url` as it may be printed or logged: a password it carries (https://user:pass@host, as webhooks with basic
    auth are often set on a Twilio number) is ***; anything else comes back as it was."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # "https://[::1": shown in the error that refuses it, whatever is after the last '@'
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else url
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))


def check_public_url(name: str, url: str) -> None:
    """A base URL the webhooks and stream URLs are built on (PUBLIC_URL, KAME_NODE_URL): https://host[:port]
    [/path], http:// only for a loopback host. Else ConfigError, in one line."""
    shown = hide_password(url)  # a basic-auth webhook URL's password is not repeated
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        # urlsplit drops tabs and newlines: it passed, and every webhook, stream URL and signature was built on it.
        raise ConfigError(f"{name} holds a blank or a control character (a newline at its end?), got {shown!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing it is the check (99999, "abc": every signature would fail)
    except ValueError:
        raise ConfigError(f"{name} must look like https://host[:port], got {shown!r}") from None
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        # (A query or fragment: the webhook URLs are built on it, and every webhook failed with a 500.)
        raise ConfigError(f"{name} must look like https://host[:port][/path], got {shown!r}")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        # Twilio only calls https:// and only opens wss:// streams; http:// is for local tests.
        raise ConfigError(f"{name} must be https:// (http:// only for a loopback host), got {shown!r}")


def _stripped_or_blank(value: str | None) -> str | None:
    """A secret without its surrounding whitespace; one of whitespace alone is kept so that it is refused."""
    if not value:
        return None
    return value.strip() or value


@dataclass(frozen=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # GET /metrics listens here, apart from the public port. None: nowhere (the service embedded in tests and
    # benches); `kame-phone serve` defaults to 127.0.0.1:DEFAULT_METRICS_PORT; port 0: any free one.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    public_url: str = ""  # how Twilio reaches us, e.g. https://voice.example.com (signatures use it)
    twilio_auth_token: str | None = field(default=None, repr=False)  # never printed
    admin_token: str | None = field(default=None, repr=False)
    insecure_dev: bool = False
    redis_url: str | None = field(default=None, repr=False)  # may hold a password
    node_id: str = field(default_factory=socket.gethostname)  # unique per node (KAME_NODE_ID)
    # This node's own public base URL, when Twilio reaches the webhooks through a shared load balancer
    # (PUBLIC_URL) but must open each media stream on the node that reserved the call's slot.
    node_url: str = ""
    redis_prefix: str = "kame:"  # cluster keys (KAME_REDIS_PREFIX)
    heartbeat_s: float = 1.0  # how often a node publishes its free slots to Redis
    node_ttl_s: float = 3.0  # a node silent for this long gets no more calls
    store_transcripts: bool = True
    retention_s: float = 24 * 3600.0
    # A webhook's slot reservation that never got its stream. Twilio opens the stream within a second or
    # two; replayed or abandoned webhooks must not hold a node's seats for long.
    reservation_ttl_s: float = 8.0
    silent_socket_s: float = 10.0  # no message from Twilio for this long: the stream is dead
    # Upgraded media sockets without a `start` yet: at most this many per node (beyond, a newer upgrade closes
    # the oldest one over a second old, else gets 503), each closed after start_timeout_s. Twilio sends
    # `start` right after the upgrade.
    max_unstarted_streams: int = 16
    start_timeout_s: float = 5.0
    # Connections on the public port that carry no started call (webhooks in flight, idle keep-alives,
    # unstarted sockets): beyond this many, new ones are refused at once.
    max_idle_connections: int = 256
    # An idle keep-alive connection (or one that never sends a request) is closed after this. Above a load
    # balancer's own idle timeout (nginx's and AWS ALB's 60 s), so it never reuses one we just closed; far
    # below aiohttp's 3630 s, so silent connections cannot hold the cap above for an hour.
    keepalive_timeout_s: float = 75.0
    max_message_bytes: int = 64 * 1024
    flood_burst_packets: int = 50  # inbound packets allowed ahead of real time (1 s)
    mark_every_frames: int = 6  # one playout mark per 480 ms of bot audio
    # Bot audio a peer has not read yet, beyond which its frames are dropped rather than queued: one
    # fan-out task sends every call's audio, so it must never wait on a single slow socket (~2.6 s).
    outbound_backlog_bytes: int = 32 * 1024
    # The kernel's send buffer per media socket (Linux doubles it). Left to autotuning it grows to MBs,
    # minutes of audio at 11 KB/s, so a peer that stopped reading would go unnoticed that long. 0: kernel's.
    media_send_buffer_bytes: int = 64 * 1024
    drain_timeout_s: float = 600.0  # serve --drain-timeout (KAME_DRAIN_TIMEOUT)
    # serve --max-call-minutes (KAME_MAX_CALL_MINUTES); 0: no limit. A stuck call (a robocaller looping, a line
    # left open) would hold a GPU seat for good; 4 h is Twilio's own default limit for a dialled call.
    max_call_s: float = 4 * 3600.0
    # serve --audiosocket (KAME_AUDIOSOCKET): Asterisk AudioSocket listeners, each with its agent; none by default.
    audiosocket: tuple[AudioSocketListen, ...] = ()
    # serve --audiosocket-allow (KAME_AUDIOSOCKET_ALLOW): who may connect to them (AudioSocket has no credentials);
    # empty: loopback only, and a listener on any other address is refused at start-up until it is set.
    audiosocket_allow: tuple[Network, ...] = ()

    @classmethod
    def from_env(cls, **overrides: object) -> ServiceConfig:
        env = os.environ
        if placeholders := unfilled_placeholders(env):
            raise ConfigError(unfilled_message(placeholders))
        values: dict[str, object] = {
            # Stripped as the secrets are: a URL from a ConfigMap or `echo` into a file ends in a newline.
            "public_url": env.get("PUBLIC_URL", "").strip(),
            # Secrets made with `echo` into a file or a Secret end in a newline: every signature (every bearer
            # token) would be refused with no word of why.
            "twilio_auth_token": (env.get("TWILIO_AUTH_TOKEN") or "").strip() or None,
            "admin_token": _stripped_or_blank(env.get("ADMIN_TOKEN")),
            "redis_url": env.get("REDIS_URL") or None,
        }
        if env.get("KAME_NODE_ID"):
            values["node_id"] = env["KAME_NODE_ID"]
        if env.get("KAME_NODE_URL", "").strip():
            values["node_url"] = env["KAME_NODE_URL"].strip()
        if env.get("KAME_REDIS_PREFIX"):
            values["redis_prefix"] = env["KAME_REDIS_PREFIX"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)  # type: ignore[arg-type]
        config.check()
        return config

    def check(self) -> None:
        if not self.twilio_auth_token and not self.insecure_dev and not self.audiosocket:
            raise ConfigError(
                "TWILIO_AUTH_TOKEN is not set: refusing to serve unauthenticated phone traffic. "
                "Set it, pass --insecure-dev for a loopback-only development server, or answer only Asterisk's "
                "AudioSocket (--audiosocket)."
            )
        if self.insecure_dev and self.host not in LOOPBACK:
            raise ConfigError(f"--insecure-dev binds to loopback only, not {self.host!r}")
        if self.twilio_auth_token and not self.public_url and not is_loopback(self.host):
            # The derived http://<host>:<port> is not the URL Twilio calls: every signature would fail (403).
            raise ConfigError(
                f"PUBLIC_URL is not set: bound to {self.host!r} with TWILIO_AUTH_TOKEN, Twilio's signatures can only "
                "be checked against the https:// URL it calls. Set PUBLIC_URL=https://<your public host> "
                "(or --public-url)."
            )
        for name, url in (("PUBLIC_URL", self.public_url), ("KAME_NODE_URL", self.node_url)):
            if url:
                check_public_url(name, url)
        if self.admin_token is not None and not self.admin_token.strip():
            raise ConfigError("ADMIN_TOKEN is set but blank: unset it (no admin API) or give it a real token")
        public = bool(self.public_url) and not is_loopback(urlsplit(self.public_url).hostname)
        reachable = not is_loopback(self.host) or public
        if self.admin_token and len(self.admin_token) < MIN_ADMIN_TOKEN_CHARS and reachable:
            # The admin API reads every call's transcript; a short bearer token on a public port is guessable, and
            # so it is on loopback behind a tunnel or proxy (PUBLIC_URL names a public host).
            raise ConfigError(f"ADMIN_TOKEN must be at least {MIN_ADMIN_TOKEN_CHARS} characters on a port that is not "
                              "loopback-only (e.g. `openssl rand -hex 32`)")  # fmt: skip
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"KAME_PORT must be 0-65535 (0: any free port), got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"KAME_METRICS_PORT must be 0-65535 (0: any free port), got {self.metrics_port}")
        if not 0 < self.heartbeat_s < self.node_ttl_s:
            raise ConfigError(f"need 0 < heartbeat_s < node_ttl_s, got {self.heartbeat_s} and {self.node_ttl_s}")
        if not self.node_id.strip() or self.node_id != self.node_id.strip() or not self.node_id.isprintable():
            # (" " was taken: a node named by a blank in every log line, Redis key and dashboard.)
            raise ConfigError(f"KAME_NODE_ID must be a name without blanks at its ends or control characters, "
                              f"got {self.node_id!r}")
        # Each of these at 0 (or below) refuses every call, or closes every stream before its start.
        positive = {"--start-timeout (KAME_START_TIMEOUT)": self.start_timeout_s,
                    "--retention-hours (KAME_RETENTION_HOURS)": self.retention_s / 3600,
                    "--max-unstarted-streams (KAME_MAX_UNSTARTED_STREAMS)": self.max_unstarted_streams,
                    "--max-idle-connections (KAME_MAX_IDLE_CONNECTIONS)": self.max_idle_connections,
                    "keepalive_timeout_s": self.keepalive_timeout_s}  # fmt: skip
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be above 0, got {value:g}")
        # Twilio's `start` (and Asterisk's UUID) comes within a second: a long wait only lets a peer bank caller
        # audio (the real-time bank is sized from it), a tiny one busy-wakes each call's watchdog.
        if not MIN_START_TIMEOUT_S <= self.start_timeout_s <= MAX_START_TIMEOUT_S:
            raise ConfigError(f"--start-timeout (KAME_START_TIMEOUT) must be {MIN_START_TIMEOUT_S:g} to "
                              f"{MAX_START_TIMEOUT_S:g} seconds, got {self.start_timeout_s:g}")  # fmt: skip
        # Redis keeps records for whole milliseconds, as a 64-bit count: 1e300 hours was refused on every write
        # (each call's record lost, silently), and a fraction of a millisecond failed the store's start.
        if not MIN_RETENTION_S <= self.retention_s <= MAX_RETENTION_S:
            raise ConfigError(f"--retention-hours (KAME_RETENTION_HOURS) must be {MIN_RETENTION_S / 3600:g} to "
                              f"{MAX_RETENTION_S / 3600:g} hours, got {self.retention_s / 3600:g}")  # fmt: skip
        if not (math.isfinite(self.max_call_s) and self.max_call_s >= 0):  # 0: no limit
            raise ConfigError(f"--max-call-minutes (KAME_MAX_CALL_MINUTES) must be 0 (no limit) or more, "
                              f"got {self.max_call_s / 60:g}")  # fmt: skip
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):  # 0: end the calls at once
            raise ConfigError(f"--drain-timeout (KAME_DRAIN_TIMEOUT) must be 0 or more seconds, "
                              f"got {self.drain_timeout_s:g}")  # fmt: skip
        taken = {"--port": self.port, "--metrics-port": self.metrics_port}
        for listen in self.audiosocket:
            clash = next((flag for flag, port in taken.items() if port and port == listen.port), None)
            if clash is not None:
                raise ConfigError(f"--audiosocket {listen}: port {listen.port} is {clash}'s too")
            if listen.port:
                taken[f"--audiosocket {listen}"] = listen.port
            if not self.audiosocket_allow and not is_loopback(listen.host):
                # No credentials on this protocol: who may connect must be said (behind a load balancer's SNAT
                # or a proxy, "private" means anyone).
                raise ConfigError(f"--audiosocket {listen} listens beyond loopback: set --audiosocket-allow "
                                  "(KAME_AUDIOSOCKET_ALLOW) to your PBX's addresses")  # fmt: skip
        if self.redis_url:
            self._check_redis_url(self.redis_url)

    @staticmethod
    def _check_redis_url(url: str) -> None:
        """Refused here in one line that never repeats the URL (it may hold a password): else redis-py fails at
        the first connection with a traceback quoting part of it."""
        try:
            parts = urlsplit(url)  # a '[' or ']' in a password: "Invalid IPv6 URL"
            parts.port  # noqa: B018 - parsing it is the check: a '/', '#' or '?' in a password breaks it
        except ValueError:
            raise ConfigError("REDIS_URL does not parse (a '/', '#', '?', '@', '[' or ']' in the password must be "
                              "percent-encoded, e.g. '/' as %2F)") from None
        if parts.scheme not in ("redis", "rediss", "unix") or not (parts.hostname or parts.path):
            raise ConfigError(f"REDIS_URL must look like redis://[:password@]host:port/db "
                              f"(or rediss://, unix://), got scheme {parts.scheme!r}")
        from redis.connection import parse_url

        try:
            parse_url(url)  # its options (?socket_timeout=xyz): else a traceback at the first connection
        except ValueError as e:
            why = str(e).replace(parts.password, "***") if parts.password else str(e)
            raise ConfigError(f"REDIS_URL: {why}") from None

    def twilio_summary(self) -> str:
        """What serve says once at start: the URL a Twilio number must call, and whether signatures can work
        (a newcomer whose PUBLIC_URL is wrong otherwise sees only 403s)."""
        webhook = f"POST {hide_password(self.base_url)}/twilio/voice"
        if self.insecure_dev:
            return (f"Twilio voice webhook: {webhook}; --insecure-dev: signatures NOT checked, loopback only "
                    "(a real Twilio number cannot reach it)")  # fmt: skip
        if not self.public_url:
            return (f"Twilio voice webhook: {webhook}; PUBLIC_URL is not set, so only local callers can sign for "
                    "this URL: for a real number, start a tunnel and set PUBLIC_URL=https://<its host>")  # fmt: skip
        scheme = urlsplit(self.public_url).scheme
        if scheme != "https":
            return f"Twilio voice webhook: {webhook}; PUBLIC_URL is http://: Twilio calls https:// only"
        return (f"Twilio voice webhook: {webhook} (`kame-phone twilio setup --number +1...` sets it); "
                "signatures are checked with TWILIO_AUTH_TOKEN against PUBLIC_URL: consistent")  # fmt: skip

    @property
    def base_url(self) -> str:
        """The public http(s) base URL, without a trailing slash."""
        if self.public_url:
            return self.public_url.rstrip("/")
        return f"http://{self.host}:{self.port}"

    @property
    def node_base_url(self) -> str:
        """This node's own public http(s) base: KAME_NODE_URL, else the public base URL."""
        return self.node_url.rstrip("/") if self.node_url else self.base_url

    @property
    def ws_base_url(self) -> str:
        """Where Twilio opens this node's media streams (ws(s):// form of `node_base_url`)."""
        base = self.node_base_url
        return "wss://" + base[len("https://"):] if base.startswith("https://") else "ws://" + base[len("http://"):]
