"""The application's front door behind Ray Serve's HTTP proxy: every OpenAI request goes to a
replica the router picks (``router.py``), whose lease names its server; the ingress sends the
request there and streams the answer back as that server sends it (``replica.py`` says why
not through the replica actor). ``/metrics`` gathers every replica's series with a
``replica`` label; ``/health`` asks each.

A replica that dies mid-stream ends the stream with an OpenAI-shaped error event and
``data: [DONE]`` (SSE), or a 503 when nothing was sent yet; Ray replaces the replica and new
requests go to the others meanwhile.
"""

# No `from __future__ import annotations`: Ray Serve rebuilds the routes' signatures for the
# class-based view, and string annotations (``request: "Request"``) then go unresolved.
import asyncio
import contextlib
import json

import httpx
import websockets
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from server.ray_serve.prefix_keys import request_prefix_hashes
from server.ray_serve.proxied import REPLICA_HEADER, Lease, ProxiedRequest
from server.ray_serve.registry import registry

app = FastAPI(title="specserve on Ray Serve")
# Replicas tried (0.5 s apart) for a request that no replica has begun to answer. A replica
# whose server died ends its actor, but the routers learn of it only when a call to the actor
# fails; until then the router's pick between two equally short queues is a coin toss, and
# four tries all landed on the dead one about once in sixteen (a CI run's 503 right after a
# kill, session 37). Eight make that about one in 256, inside 3.5 s.
START_ATTEMPTS = 8
# Hop-by-hop headers, and the length the proxy recomputes.
DROPPED_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
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


async def _relay(client: WebSocket, upstream) -> None:
    """Messages both ways until either side closes; the other side is then closed too."""

    async def up() -> None:
        try:
            while True:
                await upstream.send(await client.receive_text())
        except WebSocketDisconnect:
            await upstream.close()

    async def down() -> None:
        async for message in upstream:
            await client.send_text(message if isinstance(message, str) else message.decode())
        await client.close(code=upstream.close_code or 1000)

    tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        for task in done:
            task.result()  # a failure of the replica's side: the caller closes with 1011
    finally:
        for task in tasks:
            task.cancel()


# Decorated here, at import: Ray Serve binds the routes to the class in each process that
# imports this module (applied inside a function, the replica's copy kept unbound routes).
@serve.ingress(app)
class Ingress:
    """The ingress deployment's class (``app.py`` makes it a deployment)."""

    def __init__(self, replicas):
        self.replicas = replicas.options(stream=True)
        self.client = httpx.AsyncClient(timeout=10.0)  # /metrics and /health of the replicas
        # Requests' answers: as long as a stream lasts; many at once.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.streaming = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                           limits=limits)  # fmt: skip

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

    async def _lease(self, proxied: ProxiedRequest):
        """``(lease_stream, Lease)`` from the replica the router picks."""
        stream = self.replicas.remote(proxied)
        lease = await stream.__anext__()
        assert isinstance(lease, Lease)
        return stream, lease

    @app.websocket("/v1/ws")
    async def websocket(self, client: WebSocket) -> None:
        """A connection is relayed, message by message, to the WebSocket of the replica the
        router picks (the shortest queue: a connection has no prompt yet); the connection
        holds that replica's lease while it lasts. The replica's server does the checks
        (origin, key) and the protocol; a replica that dies closes the connection (1011)."""
        offered = client.scope.get("subprotocols") or []
        key = client.headers.get("authorization")
        try:
            lease_stream, lease = await self._lease(ProxiedRequest("GET", "/v1/ws"))
        except Exception:
            await client.close(code=1013)  # try again later
            return
        try:
            async with websockets.connect(
                lease.url.replace("http", "ws", 1) + "/v1/ws",
                subprotocols=offered or None,
                additional_headers={"authorization": key} if key else None,
                origin=client.headers.get("origin"),
            ) as upstream:  # fmt: skip
                await client.accept(subprotocol=upstream.subprotocol)
                await _relay(client, upstream)
        except (OSError, websockets.InvalidHandshake, websockets.ConnectionClosedError):
            with contextlib.suppress(RuntimeError):  # already closed
                await client.close(code=1011)
        finally:
            lease_stream.cancel()

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        hashes = request_prefix_hashes(body) if request.method == "POST" else []
        proxied = ProxiedRequest(request.method, target, hashes)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS]
        # Nothing sent yet: a replica that fails now (its server gone, the actor dying) is
        # skipped and the request goes to another.
        for attempt in range(START_ATTEMPTS):
            lease_stream = None
            try:
                lease_stream, lease = await self._lease(proxied)
                upstream = self.streaming.build_request(
                    request.method, lease.url + target, headers=headers, content=body
                )
                response = await self.streaming.send(upstream, stream=True)
                break
            except StopAsyncIteration:
                return _error(502, "the replica sent no answer")
            except Exception as exc:
                if lease_stream is not None:
                    lease_stream.cancel()
                if attempt == START_ATTEMPTS - 1:
                    return _error(503, f"no replica could answer: {type(exc).__name__}")
                await asyncio.sleep(0.5)
        kept = {k: v for k, v in response.headers.items() if k.lower() not in DROPPED_HEADERS}
        kept[REPLICA_HEADER] = lease.replica_id
        sse = kept.get("content-type", "").startswith("text/event-stream")

        async def chunks():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.HTTPError:
                if sse:  # the replica died mid-stream: end the stream cleanly
                    yield f"data: {json.dumps(STREAM_LOST)}\n\ndata: [DONE]\n\n".encode()
            finally:
                # Done, failed, or the client left (its server sees the disconnect and aborts
                # the request): the replica's lease ends with it.
                await response.aclose()
                lease_stream.cancel()

        return StreamingResponse(chunks(), status_code=response.status_code, headers=kept)
