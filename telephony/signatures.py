"""X-Twilio-Signature checks for HTTP webhooks and the Media Streams WebSocket upgrade.

Thin wrappers over `twilio.request_validator.RequestValidator`. The one thing that goes wrong in practice
is the URL: Twilio signs the *public* URL it called, so behind a TLS-terminating proxy the URL must be
rebuilt from PUBLIC_URL, never from the Host/scheme the server sees. Nothing here logs (the token is a
secret, and so is a valid signature).
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

from twilio.request_validator import RequestValidator

SIGNATURE_HEADER = "X-Twilio-Signature"

_WS_SCHEME = {"https": "wss", "http": "ws"}


def _split_base(public_base_url: str) -> tuple[str, str, str]:
    parts = urlsplit(public_base_url)
    if parts.scheme not in _WS_SCHEME or not parts.netloc or parts.query or parts.fragment:
        raise ValueError("public base URL must be http(s)://host[:port][/prefix] without query or fragment")
    return parts.scheme, parts.netloc, parts.path.rstrip("/")


def public_url_for(request_path_qs: str, public_base_url: str) -> str:
    """The URL Twilio called for an HTTP webhook: PUBLIC_URL + the raw path and query as received.

    Pass the *raw* (still percent-encoded) path and query, e.g. aiohttp's `request.raw_path`: Twilio
    signs the URL byte for byte, and a decoded path would not match. A path prefix in PUBLIC_URL is kept
    (for proxies that strip it before forwarding).
    """
    if not request_path_qs.startswith("/"):
        raise ValueError("request path must start with '/'")
    scheme, netloc, prefix = _split_base(public_base_url)
    return f"{scheme}://{netloc}{prefix}{request_path_qs}"


def websocket_signature_url(public_base_url: str, path: str) -> str:
    """The URL Twilio signs for the Media Streams upgrade: wss://<public host>/path (ws:// for http)."""
    if not path.startswith("/"):
        raise ValueError("path must start with '/'")
    scheme, netloc, prefix = _split_base(public_base_url)
    return f"{_WS_SCHEME[scheme]}://{netloc}{prefix}{path}"


def _validate(token: str, url: str, params: Mapping[str, str], signature: str | None) -> bool:
    if not token or not signature:
        return False
    try:
        return bool(RequestValidator(token).validate(url, params, signature))
    except ValueError:  # a URL urllib can't parse (e.g. a bad port) is simply not a match
        return False


def validate_webhook(token: str, url: str, form_params: Mapping[str, str], signature: str | None) -> bool:
    """True if `signature` is Twilio's for this public URL and form body (a missing signature is False).

    `form_params` may be a multidict (aiohttp's `await request.post()`); repeated keys are all signed.
    """
    return _validate(token, url, form_params, signature)


def validate_websocket(
    token: str, ws_url: str, signature: str | None, query_params: Mapping[str, str] | None = None
) -> bool:
    """True if `signature` (from the upgrade request) is Twilio's for `ws_url`, e.g. wss://host/twilio/media.

    Query parameters, if any, are signed as params (as in Twilio's own agent-connect server); the
    <Stream> url itself doesn't support query strings, so normally there are none.
    """
    params = query_params or {}
    if _validate(token, ws_url, params, signature):
        return True
    # RequestValidator also tries the URL with a port, but adds :80 for every scheme but https. Whether
    # Twilio ever signs wss://host:443/... is undocumented; accepting it costs nothing (still our URL).
    parts = urlsplit(ws_url)
    try:
        has_port = parts.port is not None
    except ValueError:
        return False
    if parts.scheme != "wss" or has_port:
        return False
    return _validate(token, urlunsplit(parts._replace(netloc=f"{parts.netloc}:443")), params, signature)
