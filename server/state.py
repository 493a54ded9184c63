"""What the server holds for its one served model, and the checks every request goes through."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.constraints.vocabulary import ConstraintVocabulary
from engine.core_process import AsyncEngineClient
from engine.tokenizer_files import load_api_tokenizer
from server.auth import key_is_valid
from server.cors import CorsSettings
from server.errors import APIError
from server.limits import RequestLimits
from server.metrics import ServerMetrics
from server.shutdown import SHUTDOWN_MESSAGE, Shutdown, ShutdownDeadline
from server.spec_log import log_spec_decode

log = logging.getLogger("specserve")


@dataclass
class ServerSettings:
    config: EngineConfig
    served_model_name: str | None = None  # default: the config's model
    api_keys: list[str] = field(default_factory=list)
    # Requests accepted beyond those the engine can run at once before answering 429.
    max_queued_requests: int = 256
    max_engine_restarts: int = 3
    # An engine that reports nothing this long while requests are in flight is killed and
    # restarted (the watchdog); None: never.
    engine_stall_timeout_s: float | None = 60.0
    # A request still generating this long after it arrived is aborted with a 408 (an error
    # event when streaming); None: no limit.
    request_timeout_s: float | None = None
    # Tokens a streamed choice gathers before a chunk is sent (server/stream_interval.py).
    stream_interval: int = 1
    limits: RequestLimits = field(default_factory=RequestLimits)
    cors: CorsSettings = field(default_factory=CorsSettings)
    # After SIGTERM/SIGINT: how long running requests may go on before they are ended.
    shutdown_timeout_s: float = 30.0

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.config.model


class ServerState:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.shutdown = Shutdown(settings.shutdown_timeout_s, self._end_open_streams)
        self.client = AsyncEngineClient(
            settings.config,
            max_restarts=settings.max_engine_restarts,
            stall_timeout_s=settings.engine_stall_timeout_s,
            on_gave_up=self.shutdown.fail,
        )
        self.metrics = ServerMetrics(settings.model_name, lambda: self.client.totals)
        self.tokenizer = None
        self.constraints: ConstraintVocabulary | None = None
        self.reserved = 0  # sequences of accepted requests that have not ended
        self.created = int(time.time())
        self._starting: asyncio.Task | None = None
        self._spec_log: asyncio.Task | None = None

    def _end_open_streams(self) -> None:
        """The shutdown deadline: whatever still streams from the engine ends now."""
        ended = self.client.end_streams(ShutdownDeadline(SHUTDOWN_MESSAGE))
        log.info("shutdown deadline: %d engine streams still open were ended", ended)

    async def start(self) -> None:
        """Start the engine in the background: /health answers 503 until it is ready."""
        self._starting = asyncio.create_task(self._start())
        self._starting.add_done_callback(self._on_start_done)
        self._spec_log = asyncio.create_task(log_spec_decode(lambda: self.client.totals))

    def _on_start_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            # Nothing retries a failed start (a bad config fails again): exit, saying why.
            self.shutdown.fail(f"engine failed to start: {task.exception()}")

    async def _start(self) -> None:
        info = await self.client.start()
        self.tokenizer = await asyncio.to_thread(load_api_tokenizer, Path(info.model_dir))
        # Checks constraints against the vocabulary (a grammar naming a special token the
        # model lacks) before a response starts; llguidance's tokenizer is built on first use.
        self.constraints = ConstraintVocabulary(
            lambda: self.tokenizer, info.vocab_size, info.eos_token_ids
        )
        log.info("engine ready: %s (context %d tokens)", info.model_dir, info.max_model_len)

    async def stop(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if self._spec_log is not None:
            self._spec_log.cancel()
            await asyncio.gather(self._spec_log, return_exceptions=True)
        await self.client.shutdown()

    @property
    def ready(self) -> bool:
        return self.client.ready and self.tokenizer is not None

    # ---- checks, in the order a request meets them ---------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. Served: {self.settings.model_name}",
                param="model",
                code="model_not_found",
            )

    def check_ready(self) -> None:
        if self.shutdown.stopping:
            raise APIError(503, "the server is shutting down", code="server_shutdown")
        if not self.ready:
            raise APIError(
                503,
                "The engine is not ready (loading or restarting); retry shortly",
                headers={"Retry-After": "1"},
            )

    def reserve(self, sequences: int) -> Reservation:
        """Take room for a request's sequences (prompts x n) or answer 429.

        Counted here, synchronously, when the request is accepted, rather than when its
        stream starts: a burst of requests cannot all slip in before any is counted. A
        request larger than the whole limit is still served when nothing else is.
        """
        limit = self.settings.config.scheduler.max_num_seqs + self.settings.max_queued_requests
        if self.reserved and self.reserved + sequences > limit:
            raise APIError(
                429,
                f"Too many requests: {self.reserved} sequences accepted (limit {limit}); "
                "retry later",
                headers={"Retry-After": "1"},
            )
        self.reserved += sequences
        return Reservation(self, sequences)

    def check_context(
        self, prompt_tokens: int, max_tokens: int | None, prompt_param: str
    ) -> int | None:
        """Returns max_tokens, or raises 400 stating both numbers when they do not fit."""
        context = self.client.info.max_model_len
        if prompt_tokens >= context or (
            max_tokens is not None and prompt_tokens + max_tokens > context
        ):
            requested = prompt_tokens + (max_tokens or 1)
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {requested} tokens ({prompt_tokens} in the prompt, "
                f"{max_tokens if max_tokens is not None else 1} for the completion). Please "
                "reduce the length of the prompt or of max_tokens.",
                param="max_tokens" if prompt_tokens < context else prompt_param,
                code="context_length_exceeded",
            )
        return max_tokens

    def check_api_key(self, token: str | None) -> None:
        """401 unless ``token`` (see server.auth) is a configured key, or none is configured."""
        keys = self.settings.api_keys
        if not keys:
            return
        if not key_is_valid(token, keys):
            raise APIError(
                401,
                "Invalid or missing API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
            )


class Reservation:
    """Room taken by one request; released once, when its run ends (or is dropped)."""

    def __init__(self, state: ServerState, sequences: int):
        self.state = state
        self.sequences = sequences

    def release(self) -> None:
        self.state.reserved -= self.sequences
        self.sequences = 0
