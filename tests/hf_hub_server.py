"""A local stand-in for the Hugging Face Hub's file endpoint (the external service a first start downloads
the checkpoint from): HEAD and GET `/{repo}/resolve/{revision}/{file}` for the files of a local checkpoint
directory, with the headers `huggingface_hub` reads. `trickle_s` sends each weights file's bytes over that
many seconds, in small pieces (a slow link, never a stalled one: the hub client gives up after 10 s of
silence)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from .loopback_http import serve_on_loopback

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubStandIn:
    root: Path
    repo_id: str
    trickle_s: float = 0.0
    downloads: list[str] = field(default_factory=list)  # file names, one per GET

    def _file(self, request: web.Request) -> Path | None:
        if f"{request.match_info['org']}/{request.match_info['name']}" != self.repo_id:
            return None
        path = (self.root / request.match_info["file"]).resolve()
        return path if path.is_file() and path.is_relative_to(self.root.resolve()) else None

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        path = self._file(request)
        if path is None:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
        data = path.read_bytes()
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Length": str(len(data))}  # fmt: skip
        if request.method == "HEAD":
            return web.Response(headers=headers)
        self.downloads.append(path.name)
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        slow = self.trickle_s > 0 and path.suffix == ".safetensors"
        pieces = 40 if slow else 1
        step = -(-len(data) // pieces)
        for start in range(0, len(data), step):
            await response.write(data[start:start + step])
            if slow:
                await asyncio.sleep(self.trickle_s / pieces)
        await response.write_eof()
        return response


@contextlib.asynccontextmanager
async def serve_hub(root: Path, repo_id: str, trickle_s: float = 0.0) -> AsyncIterator[tuple[HubStandIn, str]]:
    """(the stand-in, its endpoint for HF_ENDPOINT)."""
    hub = HubStandIn(root, repo_id, trickle_s)
    app = web.Application()
    app.router.add_route("*", "/{org}/{name}/resolve/{revision}/{file:.+}", hub.resolve)
    async with serve_on_loopback(app) as base_url:
        yield hub, base_url
