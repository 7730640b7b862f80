"""`kame-phone engine-serve`: the engine alone (model, frame loop, STT + LLM back-end), serving edges.

SIGTERM drains: edges are told (they get no more seats: new calls go busy or to a node with room), seated calls go
on until they end or `--drain-timeout` passes, then the process exits.

Edges (`kame-phone serve --engine ADDRESS`) connect over `engine/remote.py`'s link. A small HTTP side
answers /healthz (503 once the engine has died: restart the pod), /readyz (200 once the model is loaded)
and /metrics (the engine's own: ticks, oracle lag, LLM, STT, link).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
import sys

from aiohttp import web

from engine.heap import freeze_startup_heap
from engine.link_server import EngineServer
from engine.link_wire import Address, server_tls
from knowledge.agents import AgentsError
from telephony.config import MIN_ADMIN_TOKEN_CHARS, unfilled_message, unfilled_placeholders
from telephony.metrics_http import METRICS_PATH, handle_metrics, internal_runner
from telephony.server import LOADING_STOP_TIMEOUT_S

from .app import agents_from_args, backend_problem, device_problem, load_engine

log = logging.getLogger(__name__)

_ENGINE_WATCH_S = 1.0


def _http_app(state: dict[str, object]) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        engine = state.get("engine")
        failed = engine is not None and engine.failed  # type: ignore[attr-defined]
        return web.Response(status=503 if failed else 200, text="engine failed\n" if failed else "ok\n")

    async def readyz(_: web.Request) -> web.Response:
        engine, server = state.get("engine"), state.get("server")
        if server is not None and server.draining:  # type: ignore[attr-defined]
            return web.Response(status=503, text="draining\n")  # no new edges: they would be refused
        ready = engine is not None and engine.ready  # type: ignore[attr-defined]
        return web.Response(status=200 if ready else 503, text="ready\n" if ready else "not ready\n")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    # The same exposition as `serve`'s metrics listener; this whole port stays off the public network.
    app.router.add_get(METRICS_PATH, handle_metrics)
    return app


def _folder_exists(path: str) -> bool:
    return os.path.isdir(os.path.dirname(os.path.abspath(path)))


async def run_engine_server(args: argparse.Namespace) -> int:
    if not args.listen:
        print("kame-phone engine-serve: --listen (or KAME_ENGINE_LISTEN) is required", file=sys.stderr)
        return 2
    try:
        address = Address.parse(args.listen)
    except ValueError as e:
        print(f"kame-phone engine-serve: {e}", file=sys.stderr)
        return 2
    if address.unix_path is not None and not _folder_exists(address.unix_path):
        # Found out at the bind, after the model had loaded (minutes at full size), with a traceback.
        print(f"kame-phone engine-serve: --listen {args.listen}: its folder does not exist", file=sys.stderr)
        return 2
    try:
        agents = agents_from_args(args)  # the back-end's prompts and greetings
    except AgentsError as e:
        print(f"kame-phone engine-serve: {e}", file=sys.stderr)
        return 2
    if (problem := device_problem(args.device) or backend_problem(args)) is not None:
        print(f"kame-phone engine-serve: {problem}", file=sys.stderr)
        return 2
    if placeholders := unfilled_placeholders(os.environ):
        print(f"kame-phone engine-serve: {unfilled_message(placeholders)}", file=sys.stderr)
        return 2
    token = os.environ.get("KAME_ENGINE_TOKEN") or None
    if token is None and not address.local_only:
        print("kame-phone engine-serve: listening beyond this machine needs KAME_ENGINE_TOKEN "
              "(edges send the same value)", file=sys.stderr)  # fmt: skip
        return 2
    if token is not None and not address.local_only and len(token) < MIN_ADMIN_TOKEN_CHARS:
        # Each connection may guess once, and connections are not limited in number: a guessed token takes every
        # free seat (edges' seats are a hard partition), and hears callers.
        print(f"kame-phone engine-serve: KAME_ENGINE_TOKEN must be at least {MIN_ADMIN_TOKEN_CHARS} characters on "
              "an address beyond this machine (e.g. `openssl rand -hex 32`)", file=sys.stderr)  # fmt: skip
        return 2
    tls = None
    if address.tls:
        if not (args.tls_cert and args.tls_key):
            print(f"kame-phone engine-serve: {address} needs --tls-cert and --tls-key "
                  "(or KAME_ENGINE_TLS_CERT / KAME_ENGINE_TLS_KEY)", file=sys.stderr)  # fmt: skip
            return 2
        try:
            tls = server_tls(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as e:
            print(f"kame-phone engine-serve: cannot use the TLS certificate/key: {e}", file=sys.stderr)
            return 2
    elif not address.local_only:
        log.warning("the engine link on %s is not encrypted: callers' audio crosses the network in clear "
                    "(listen on tls://host:port with --tls-cert/--tls-key)", address)  # fmt: skip
    state: dict[str, object] = {}
    runner = await internal_runner(_http_app(state), "engine-serve HTTP listener")
    await web.TCPSite(runner, args.http_host, args.http_port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, agents.reload)  # new calls get the new agents, live ones keep theirs
    engine = server = None
    code = 0
    try:
        loading = asyncio.create_task(load_engine(args))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({loading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            loading.cancel()  # the engine gives up its load (engine/service.py: start)
            await asyncio.wait({loading}, timeout=LOADING_STOP_TIMEOUT_S)
            return 0
        engine = state["engine"] = loading.result()
        server = state["server"] = EngineServer(engine, token=token, tls=tls)
        bound = await server.listen(address)
        freeze_startup_heap()
        print(f"engine serving {engine.max_calls} seats on {bound}", flush=True)  # the line tests wait for
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), _ENGINE_WATCH_S)
            if engine.failed:  # its calls are gone: exit so the orchestrator restarts us (edges see the link drop)
                log.error("the engine died; exiting")
                code = 1
                break
        if server is not None and not engine.failed:
            remaining = await server.drain(args.drain_timeout)
            log.info("drained: %d calls still up are cut", remaining) if remaining else log.info("drained")
    finally:
        if server is not None:
            await server.aclose()
        if engine is not None:
            await engine.stop()
        await runner.cleanup()
        if server is not None:
            server.remove_socket()
    return code
