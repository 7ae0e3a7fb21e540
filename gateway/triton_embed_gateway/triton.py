"""The gateway's one connection to Triton: the ``embed`` ensemble over gRPC (tritonclient's asyncio client).

One channel serves every request. A list longer than the ensemble's ``max_batch_size`` is sent as several requests
at once (never refused as overloaded, as the client library sends them) and reassembled in order. Triton's errors
become :class:`~triton_embed_gateway.protocol.ApiError`: bad input -> 400 (a row number is turned into the caller's
index), overloaded, draining or not ready -> 503 with ``Retry-After``, a deadline passed -> 504, anything else -> 502.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from triton_embed_gateway.protocol import ApiError, Counts, Vectors

TEXT, EMBEDDING, TOKEN_COUNT = "TEXT", "EMBEDDING", "TOKEN_COUNT"
TOKENIZER, TOKENIZER_COUNT = "tokenizer", "token_count"  # the ensemble's first step and its output
RETRY_AFTER_S = 1
_ROW = re.compile(r"input 'TEXT' row (\d+)")


@dataclass(frozen=True)
class ModelInfo:
    """The served ensemble: ``max_batch_size`` (texts per Triton request) and ``dim`` (embedding width)."""

    max_batch_size: int
    dim: int


def _status(exc: InferenceServerException) -> str:
    return str(exc.status() or "")


def api_error(exc: InferenceServerException, offset: int = 0, field: str = "input") -> ApiError:
    """Map a Triton error to the status a caller of the HTTP API expects.

    ``offset``: index of the request's first text in the caller's list, so Triton's ``input 'TEXT' row 3`` of the
    third chunk of 64 becomes ``'input[131]'``.
    """
    status, message = _status(exc), exc.message() or str(exc)
    if "INVALID_ARGUMENT" in status:
        row = _ROW.search(message)
        param = f"{field}[{int(row.group(1)) + offset}]" if row else field
        message = _ROW.sub(lambda m: f"'{field}[{int(m.group(1)) + offset}]'", message)
        return ApiError(400, message, param=param, code="invalid_value")
    if "UNAVAILABLE" in status or "NOT_FOUND" in status:
        return ApiError(503, message, code="overloaded_or_not_ready", retry_after_s=RETRY_AFTER_S)
    if "DEADLINE_EXCEEDED" in status:
        return ApiError(504, message, code="timeout")
    return ApiError(502, message, code="triton_error")


class TritonEmbedder:
    """Embeds texts with the ``embed`` ensemble of one Triton server, over one gRPC channel.

    Args:
        url: Triton's gRPC ``host:port``.
        model: the ensemble's name.
        timeout_s: deadline of each Triton request, seconds.
    """

    def __init__(self, url: str, model: str = "embed", timeout_s: float = 30.0) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self._channel: grpcclient.InferenceServerClient | None = None
        self._info: ModelInfo | None = None

    @property
    def _client(self) -> grpcclient.InferenceServerClient:
        """The channel, opened on first use: it belongs to the event loop that serves the requests."""
        if self._channel is None:
            self._channel = grpcclient.InferenceServerClient(self.url)
        return self._channel

    async def info(self) -> ModelInfo:
        """The ensemble's batch limit and width, read once.

        Raises:
            ApiError: 503 while Triton does not answer or the model is not loaded.
        """
        if self._info is None:
            try:
                config = (await self._client.get_model_config(self.model, as_json=True, client_timeout=5))["config"]
            except InferenceServerException as exc:
                raise api_error(exc) from exc
            dims = next(o["dims"] for o in config["output"] if o["name"] == EMBEDDING)
            self._info = ModelInfo(int(config["max_batch_size"]), int(dims[-1]))
        return self._info

    async def ready(self) -> bool:
        """Whether Triton answers and the ensemble is READY."""
        try:
            return bool(await self._client.is_model_ready(self.model, client_timeout=2))
        except InferenceServerException:
            return False

    async def embed(self, texts: list[str], truncate: bool = True, field: str = "input") -> tuple[Vectors, Counts]:
        """Embed ``texts``: float32 ``(n, dim)`` unit rows and int64 ``(n,)`` token counts (after truncation).

        Raises:
            ApiError: see the module's mapping; a bad text is named by its index in ``texts`` under ``field``.
        """
        step = (await self.info()).max_batch_size
        starts = range(0, len(texts), step)
        bulk = len(starts) > 1
        parts = await asyncio.gather(*(self._infer(texts[i : i + step], i, truncate, field, bulk) for i in starts))
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    async def _infer(
        self, texts: list[str], offset: int, truncate: bool, field: str, bulk: bool
    ) -> tuple[Vectors, Counts]:
        data = np.array([t.encode("utf-8") for t in texts], dtype=np.object_).reshape(-1, 1)
        request = grpcclient.InferInput(TEXT, list(data.shape), "BYTES")
        request.set_data_from_numpy(data)
        outputs = [grpcclient.InferRequestedOutput(EMBEDDING), grpcclient.InferRequestedOutput(TOKEN_COUNT)]
        parameters: dict[str, Any] = {} if truncate else {"truncate": False}
        if bulk:  # one refused chunk would fail the whole call: the chunks of a split list are never refused
            parameters["latency_budget_ms"] = 0
        try:
            result = await self._client.infer(
                self.model, [request], outputs=outputs, parameters=parameters or None, client_timeout=self.timeout_s
            )
        except InferenceServerException as exc:
            raise api_error(exc, offset, field) from exc
        counts = result.as_numpy(TOKEN_COUNT)
        if counts is None:  # a cache hit on a response first asked for without it
            counts = await self._token_counts(request, parameters, offset, field)
        return result.as_numpy(EMBEDDING), counts.reshape(-1).astype(np.int64)

    async def _token_counts(
        self, request: grpcclient.InferInput, parameters: dict[str, Any], offset: int, field: str
    ) -> Counts:
        """Token counts from the ensemble's tokenizer step alone, int64 ``[n, 1]``.

        A Triton 2.51 workaround (docs/troubleshooting.md): the response cache keys on the inputs only and answers
        with the outputs the first request asked for, so a hit may lack ``TOKEN_COUNT``.
        """
        try:
            result = await self._client.infer(
                TOKENIZER, [request], outputs=[grpcclient.InferRequestedOutput(TOKENIZER_COUNT)],
                parameters=parameters or None, client_timeout=self.timeout_s,
            )  # fmt: skip
        except InferenceServerException as exc:
            raise api_error(exc, offset, field) from exc
        counts: Counts = result.as_numpy(TOKENIZER_COUNT)
        return counts

    async def close(self) -> None:
        """Close the channel, if one was opened."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
