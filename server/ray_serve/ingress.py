"""The application's front door behind Ray Serve's HTTP proxy: every OpenAI request goes to a
replica the router picks (``router.py``) and streams back as that replica's server sends it;
``/metrics`` gathers every replica's series with a ``replica`` label; ``/health`` asks each.

A replica that dies mid-stream ends the stream with an OpenAI-shaped error event and
``data: [DONE]`` (SSE), or a 503 when nothing was sent yet; Ray replaces the replica and new
requests go to the others meanwhile.
"""

# No `from __future__ import annotations`: Ray Serve rebuilds the routes' signatures for the
# class-based view, and string annotations (``request: "Request"``) then go unresolved.
import asyncio
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from server.ray_serve.prefix_keys import request_prefix_hashes
from server.ray_serve.proxied import ProxiedRequest, ResponseStart
from server.ray_serve.registry import registry

app = FastAPI(title="specserve on Ray Serve")
START_ATTEMPTS = 4  # replicas tried for a request that no replica has begun to answer
STREAM_LOST = {
    "error": {
        "message": "the replica serving this request stopped; retry the request",
        "type": "server_error",
        "code": 503,
    }
}


def _error(status: int, message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "server_error", "code": status}}
    return JSONResponse(body, status_code=status)


class _Families:
    """A collector that hands prometheus_client the families parsed from the replicas."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge_metrics(texts: dict[str, str]) -> bytes:
    """One Prometheus text of every replica's series, each sample labelled ``replica``."""
    merged: dict[str, object] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            target = merged.setdefault(family.name, family)
            if target is not family:
                target.samples.extend(
                    s._replace(labels={**s.labels, "replica": replica}) for s in family.samples
                )
            else:
                family.samples = [
                    s._replace(labels={**s.labels, "replica": replica}) for s in family.samples
                ]
    registry_ = CollectorRegistry()
    registry_.register(_Families(list(merged.values())))
    return generate_latest(registry_)


# Decorated here, at import: Ray Serve binds the routes to the class in each process that
# imports this module (applied inside a function, the replica's copy kept unbound routes).
@serve.ingress(app)
class Ingress:
    """The ingress deployment's class (``app.py`` makes it a deployment)."""

    def __init__(self, replicas):
        self.replicas = replicas.options(stream=True)
        self.client = httpx.AsyncClient(timeout=10.0)

    async def _replica_urls(self) -> dict[str, str]:
        if getattr(self, "_registry", None) is None:
            self._registry = registry()
        return await self._registry.live.remote()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        urls = await self._replica_urls()

        async def fetch(url: str) -> str:
            try:
                return (await self.client.get(f"{url}/metrics")).text
            except httpx.HTTPError:
                return ""  # a replica going away: its series are missing this once

        texts = await asyncio.gather(*(fetch(u) for u in urls.values()))
        body = merge_metrics(dict(zip(urls, texts, strict=True)))
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health(self) -> Response:
        """200 while at least one replica's server is healthy; the body lists each."""
        urls = await self._replica_urls()

        async def healthy(url: str) -> bool:
            try:
                return (await self.client.get(f"{url}/health")).status_code == 200
            except httpx.HTTPError:
                return False

        states = dict(zip(urls, await asyncio.gather(*(healthy(u) for u in urls.values())),
                          strict=True))  # fmt: skip
        status = 200 if any(states.values()) else 503
        return JSONResponse({"replicas": states}, status_code=status)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        proxied = ProxiedRequest(
            request.method, target, list(request.headers.items()), body,
            request_prefix_hashes(body) if request.method == "POST" else [],
        )  # fmt: skip
        # Nothing sent yet: a replica that fails now (its server gone, the actor dying) is
        # skipped and the request goes to another.
        for attempt in range(START_ATTEMPTS):
            stream = self.replicas.remote(proxied)
            try:
                start = await stream.__anext__()
                break
            except StopAsyncIteration:
                return _error(502, "the replica sent no answer")
            except Exception as exc:
                if attempt == START_ATTEMPTS - 1:
                    return _error(503, f"no replica could answer: {type(exc).__name__}")
                await asyncio.sleep(0.5)
        assert isinstance(start, ResponseStart)
        headers = dict(start.headers)
        sse = headers.get("content-type", "").startswith("text/event-stream")

        async def chunks():
            try:
                async for chunk in stream:
                    yield chunk
            except asyncio.CancelledError:
                stream.cancel()  # the client left: the replica's server aborts the request
                raise
            except Exception:
                if sse:  # the replica died mid-stream: end the stream cleanly
                    yield f"data: {json.dumps(STREAM_LOST)}\n\ndata: [DONE]\n\n".encode()

        return StreamingResponse(chunks(), status_code=start.status, headers=headers)
