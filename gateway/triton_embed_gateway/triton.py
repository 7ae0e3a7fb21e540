"""The gateway's connection to one ensemble of Triton, an embedder's or a reranker's, over gRPC (asyncio tritonclient).

One channel serves every request. A list longer than the ensemble's ``max_batch_size`` is sent as several requests
at once (never refused as overloaded, as the client library sends them) and reassembled in order. Triton's errors
become :class:`~triton_embed_gateway.protocol.ApiError`: bad input -> 400 (a row number is turned into the caller's
index); overloaded, draining, not ready or a backend stub being reloaded -> 503 with ``Retry-After``; a deadline
passed -> 504; anything else -> 502.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import tritonclient.grpc.aio as grpcclient
from triton_embed_protocol import BULK, QUEUED, TOKENS, refusal_reason, step_names
from tritonclient.utils import InferenceServerException

from triton_embed_gateway.protocol import ApiError, Counts, EmbedRequest, RerankRequest, Scores, Vectors, shorten
from triton_embed_gateway.tracing import Tracing

TEXT, PROMPT_NAME, TRUNCATE = "TEXT", "PROMPT_NAME", "TRUNCATE"
EMBEDDING, TOKEN_COUNT = "EMBEDDING", "TOKEN_COUNT"
QUERY, DOCUMENT, SCORE, LOGIT = "QUERY", "DOCUMENT", "SCORE", "LOGIT"  # a reranker's ensemble
TOKENIZER_COUNT = "token_count"  # noqa: S105 - the tokenizer step's output of token counts
RETRY_AFTER_S = 1
_ROW = re.compile(r"input 'TEXT' row (\d+)")
_PROMPT_ROW = re.compile(r"input 'PROMPT_NAME' row \d+")
_PAIR_ROW = re.compile(r"input 'TEXT_PAIR' row (\d+)(?: \(a document\))?")
Rows = npt.NDArray[np.float32]  # a chunk's answer: Vectors or Scores
_ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")  # Triton's, on an error from a step: not the caller's concern


@dataclass(frozen=True)
class ModelInfo:
    """The served ensemble.

    ``max_batch_size``: texts per Triton request; ``dim``: embedding width; ``max_tokens``: the model's
    max_seq_length, from the tokenizer's ``MAX_SEQ_LENGTH`` (None without it); ``precision``: what the encoder
    computes at (``fp32``, ``bf16``, ``fp16``), from the encoder's ``PRECISION`` (None without it); ``kind``:
    ``embedder``, or ``reranker`` for an ensemble that scores (QUERY, DOCUMENT) pairs (``dim`` 1).
    """

    max_batch_size: int
    dim: int
    max_tokens: int | None = None
    precision: str | None = None
    kind: str = "embedder"


def _status(exc: InferenceServerException) -> str:
    return str(exc.status() or "")


def api_error(
    exc: InferenceServerException, offset: int = 0, field: str = "input", prompt_field: str = "input_type"
) -> ApiError:
    """Map a Triton error to the status a caller of the HTTP API expects.

    ``offset``: index of the request's first text in the caller's list, so Triton's ``input 'TEXT' row 3`` of the
    third chunk of 64 becomes ``'input[131]'``; an unknown prompt name is named as ``prompt_field``.
    """
    status, message = _status(exc), _ENSEMBLE_PREFIX.sub("", exc.message() or str(exc))
    if "INVALID_ARGUMENT" in status:
        row = _ROW.search(message)
        param = f"{field}[{int(row.group(1)) + offset}]" if row else field
        message = _ROW.sub(lambda m: f"'{field}[{int(m.group(1)) + offset}]'", message)
        if _PROMPT_ROW.search(message):
            param, message = prompt_field, _PROMPT_ROW.sub(f"'{prompt_field}'", message)
        return ApiError(400, message, param=param, code="invalid_value")
    # a dead backend stub answers INTERNAL "... is not healthy" until the watchdog's reload (a Triton 2.51 workaround,
    # docs/troubleshooting.md): an outage of seconds
    if reason := refusal_reason(message):  # the code the encoder's admission put in front (REFUSAL_REASONS)
        return ApiError(503, message, code=f"overloaded_{reason}", retry_after_s=RETRY_AFTER_S)
    if "UNAVAILABLE" in status or "NOT_FOUND" in status or "is not healthy" in message:
        return ApiError(503, message, code="overloaded_or_not_ready", retry_after_s=RETRY_AFTER_S)
    if "DEADLINE_EXCEEDED" in status:
        return ApiError(504, message, code="timeout")
    return ApiError(502, message, code="triton_error")


def rerank_error(exc: InferenceServerException, offset: int, field: str) -> ApiError:
    """:func:`api_error` for a reranker's request: a document's row becomes ``'<field>[i]'``, the query ``'query'``."""
    status, message = _status(exc), _ENSEMBLE_PREFIX.sub("", exc.message() or str(exc))
    if "INVALID_ARGUMENT" not in status:
        return api_error(exc)
    param = field
    if row := _PAIR_ROW.search(message):
        param = f"{field}[{int(row.group(1)) + offset}]"
        message = _PAIR_ROW.sub(lambda m: f"'{field}[{int(m.group(1)) + offset}]'", message)
    elif _ROW.search(message):
        param, message = "query", _ROW.sub("'query'", message)
    return ApiError(400, message, param=param, code="invalid_value")


def _budget(budget_ms: float | None, bulk: bool) -> dict[str, float] | None:
    """The request parameters of one call: its ``latency_budget_ms`` (None: the server's), 0 for a ``bulk`` chunk.

    One refused chunk would fail the whole call: the chunks of a split list are never refused.
    """
    budget_ms = 0 if bulk else budget_ms
    return None if budget_ms is None else {"latency_budget_ms": budget_ms}


def _bytes_input(name: str, values: list[str]) -> grpcclient.InferInput:
    """A BYTES ``[n, 1]`` input of UTF-8 strings."""
    data = np.array([v.encode("utf-8") for v in values], dtype=np.object_).reshape(-1, 1)
    tensor = grpcclient.InferInput(name, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    return tensor


class TritonEmbedder:
    """Embeds texts with one ensemble (a model ``make model`` exported) of one Triton server, over one gRPC channel.

    Args:
        url: Triton's gRPC ``host:port``.
        model: the ensemble's name.
        timeout_s: deadline of each Triton request, seconds.
        tracing: a client span per Triton request, its context in the request's gRPC metadata when sampled
            (default: off).
    """

    def __init__(self, url: str, model: str = "embed", timeout_s: float = 30.0, tracing: Tracing | None = None) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.tokenizer, self.encoder = step_names(model)  # the encoder's PRECISION parameter is make model's
        self.tracing = tracing or Tracing.off()
        self._channel: grpcclient.InferenceServerClient | None = None
        self._info: ModelInfo | None = None

    @property
    def _client(self) -> grpcclient.InferenceServerClient:
        """The channel, opened on first use: it belongs to the event loop that serves the requests."""
        if self._channel is None:
            self._channel = grpcclient.InferenceServerClient(self.url)
        return self._channel

    async def info(self) -> ModelInfo:
        """The ensemble's batch limit, width and token limit, read once.

        Raises:
            ApiError: 503 while Triton does not answer or the model is not loaded.
        """
        if self._info is None:
            try:
                config = (await self._client.get_model_config(self.model, as_json=True, client_timeout=5))["config"]
                steps = [
                    (await self._client.get_model_config(step, as_json=True, client_timeout=5))["config"]
                    for step in (self.tokenizer, self.encoder)
                ]
            except InferenceServerException as exc:
                raise api_error(exc) from exc
            outputs = {o["name"]: o for o in config["output"]}
            kind = "reranker" if SCORE in outputs else "embedder"
            dims = outputs[SCORE if kind == "reranker" else EMBEDDING]["dims"]
            tokenizer, encoder = steps
            limit = tokenizer.get("parameters", {}).get("MAX_SEQ_LENGTH", {}).get("string_value")
            precision = encoder.get("parameters", {}).get("PRECISION", {}).get("string_value")
            self._info = ModelInfo(
                int(config["max_batch_size"]), int(dims[-1]), int(limit) if limit else None, precision or None, kind
            )
        return self._info

    async def ready(self) -> bool:
        """Whether Triton answers and the ensemble is READY."""
        try:
            return bool(await self._client.is_model_ready(self.model, client_timeout=2))
        except InferenceServerException:
            return False

    async def embed(self, request: EmbedRequest, field: str = "input") -> tuple[Vectors, Counts]:
        """Embed ``request.texts``: float32 ``(n, dim)`` unit rows and int64 ``(n,)`` token counts (after truncation).

        The prompt and the truncation go to Triton as the ensemble's ``PROMPT_NAME`` and ``TRUNCATE`` inputs, so the
        response cache keys on them; ``dimensions`` shortens the rows here, so one cached vector serves every width.

        Raises:
            ApiError: see the module's mapping; a bad text is named by its index in ``texts`` under ``field``, an
                unknown prompt under ``request.prompt_field``, ``dimensions`` over the width under its name.
        """
        vectors, counts = await self._in_chunks(
            request.texts, lambda texts, offset, bulk: self._infer(texts, offset, request, field, bulk)
        )
        return shorten(vectors, request.dimensions, (await self.info()).dim), counts

    async def _in_chunks(
        self, items: list[str], send: Callable[[list[str], int, bool], Awaitable[tuple[Rows, Counts]]]
    ) -> tuple[Rows, Counts]:
        """``send(chunk, offset, bulk)`` for each chunk of ``items`` (at most ``max_batch_size``), all at once.

        Returns the chunks' two arrays, each joined in order. ``bulk`` is true when there are several chunks: one
        refused chunk would fail the whole call, so their requests are never refused.
        """
        step = (await self.info()).max_batch_size
        starts = range(0, len(items), step)
        parts = await asyncio.gather(*(send(items[i : i + step], i, len(starts) > 1) for i in starts))
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    async def _infer(
        self, texts: list[str], offset: int, request: EmbedRequest, field: str, bulk: bool
    ) -> tuple[Vectors, Counts]:
        inputs = [_bytes_input(TEXT, texts), _bytes_input(TRUNCATE, [request.truncate] * len(texts))]
        if request.prompt_name is not None:
            inputs.append(_bytes_input(PROMPT_NAME, [request.prompt_name] * len(texts)))
        errors = functools.partial(api_error, offset=offset, field=field, prompt_field=request.prompt_field)
        result = await self._ensemble(
            inputs, (EMBEDDING, TOKEN_COUNT), len(texts), request.latency_budget_ms, bulk, errors
        )
        counts = result.as_numpy(TOKEN_COUNT)
        if counts is None:  # a cache hit on a response first asked for without it
            counts = await self._token_counts(inputs, errors)
        return result.as_numpy(EMBEDDING), counts.reshape(-1).astype(np.int64)

    async def _ensemble(  # noqa: PLR0913, PLR0917 - one request's pieces
        self,
        inputs: list[grpcclient.InferInput],
        outputs: tuple[str, ...],
        rows: int,
        budget: float | None,
        bulk: bool,
        errors: Callable[[InferenceServerException], ApiError],
    ) -> grpcclient.InferResult:
        """One request to the ensemble, traced; ``budget`` its ``latency_budget_ms`` (0 for a ``bulk`` chunk).

        Raises:
            ApiError: ``errors`` of Triton's error.
        """
        requested = [grpcclient.InferRequestedOutput(name) for name in outputs]
        with self.tracing.triton_call(self.model, rows) as metadata:
            try:
                return await self._client.infer(
                    self.model,
                    inputs,
                    outputs=requested,
                    parameters=_budget(budget, bulk),
                    client_timeout=self.timeout_s,
                    headers=metadata or None,
                )
            except InferenceServerException as exc:
                raise errors(exc) from exc

    async def rerank(self, request: RerankRequest) -> tuple[Scores, Counts]:
        """Score each of ``request.documents`` against ``request.query``.

        Returns float32 ``(n,)`` (the model's activation, or the raw logits with ``request.raw_scores``) and int64
        ``(n,)`` tokens per pair (after truncation). A list longer than the ensemble's ``max_batch_size`` is sent as
        several requests at once, never refused.

        Raises:
            ApiError: see the module's mapping; a bad document is named by its index under
                ``request.documents_field``, a bad query as ``query``.
        """
        return await self._in_chunks(
            request.documents, lambda documents, offset, bulk: self._score(documents, offset, request, bulk)
        )

    async def _score(
        self, documents: list[str], offset: int, request: RerankRequest, bulk: bool
    ) -> tuple[Scores, Counts]:
        n = len(documents)
        inputs = [
            _bytes_input(QUERY, [request.query] * n),
            _bytes_input(DOCUMENT, documents),
            _bytes_input(TRUNCATE, [request.truncate] * n),
        ]
        wanted = LOGIT if request.raw_scores else SCORE
        errors = functools.partial(rerank_error, offset=offset, field=request.documents_field)
        # all three, always: the response cache answers later requests with the outputs the first one asked for
        result = await self._ensemble(inputs, (SCORE, LOGIT, TOKEN_COUNT), n, request.latency_budget_ms, bulk, errors)
        scores, counts = result.as_numpy(wanted), result.as_numpy(TOKEN_COUNT)
        if scores is None or counts is None:  # a cache hit on a direct caller's response that asked for fewer
            try:
                scores, counts = await self._score_by_steps(request, documents, wanted, bulk)
            except InferenceServerException as exc:
                raise rerank_error(exc, offset, request.documents_field) from exc
        return scores.reshape(-1).astype(np.float32), counts.reshape(-1).astype(np.int64)

    async def _score_by_steps(
        self, request: RerankRequest, documents: list[str], wanted: str, bulk: bool
    ) -> tuple[Scores, Counts]:
        """The ensemble's two steps called one after the other, as the ensemble calls them.

        The response cache keys on the inputs only (a Triton 2.51 workaround, as :meth:`_token_counts`), so a hit that
        lacks an output cannot be asked for it again. The tokenizer's hand-off (``queued_ns`` and the lane it chose,
        ``bulk``) goes on to the encoder with the tokens and both calls carry the request's latency budget, so the
        pairs pass the door, the bulk lane and the wait rule as through the ensemble.
        """
        n = len(documents)
        inputs = [
            _bytes_input(TEXT, [request.query] * n),
            _bytes_input("TEXT_PAIR", documents),
            _bytes_input(TRUNCATE, [request.truncate] * n),
        ]
        parameters = _budget(request.latency_budget_ms, bulk)
        tokens = await self._client.infer(
            self.tokenizer,
            inputs,
            client_timeout=self.timeout_s,
            parameters=parameters,
            outputs=[grpcclient.InferRequestedOutput(out) for out in (*TOKENS, QUEUED, BULK, TOKENIZER_COUNT)],
        )
        steps = []
        for name in (*TOKENS, QUEUED, BULK):
            array = tokens.as_numpy(name)
            tensor = grpcclient.InferInput(name, list(array.shape), "BOOL" if name == BULK else "INT64")
            tensor.set_data_from_numpy(array)
            steps.append(tensor)
        output = "logit__0" if wanted == LOGIT else "embedding__0"
        result = await self._client.infer(
            self.encoder,
            steps,
            outputs=[grpcclient.InferRequestedOutput(output)],
            client_timeout=self.timeout_s,
            parameters=parameters,
        )
        return result.as_numpy(output), tokens.as_numpy(TOKENIZER_COUNT)

    async def _token_counts(
        self, inputs: list[grpcclient.InferInput], errors: Callable[[InferenceServerException], ApiError]
    ) -> Counts:
        """Token counts from the ensemble's tokenizer step alone, int64 ``[n, 1]``.

        A Triton 2.51 workaround (docs/troubleshooting.md): the response cache keys on the inputs only and answers
        with the outputs the first request asked for, so a hit may lack ``TOKEN_COUNT``.
        """
        try:
            result = await self._client.infer(
                self.tokenizer,
                inputs,
                outputs=[grpcclient.InferRequestedOutput(TOKENIZER_COUNT)],
                client_timeout=self.timeout_s,
            )
        except InferenceServerException as exc:
            raise errors(exc) from exc
        counts: Counts = result.as_numpy(TOKENIZER_COUNT)
        return counts

    async def request_count(self) -> int | None:
        """Triton's requests to the ensemble since it started (success + failure); None when it does not answer."""
        try:
            stats = await self._client.get_inference_statistics(self.model, as_json=True, client_timeout=2)
        except InferenceServerException:
            return None
        inference = stats["model_stats"][0].get("inference_stats", {})
        return sum(int(inference.get(k, {}).get("count", 0)) for k in ("success", "fail"))

    async def set_trace_rate(self, rate: int, headers: dict[str, str]) -> str | None:
        """Set Triton's ``trace_rate`` (trace 1 request in ``rate``) with the admin ``headers``.

        Returns:
            None when set, else Triton's error (a missing or wrong admin key, tracing off in Triton).
        """
        try:
            await self._client.update_trace_settings(
                settings={"trace_rate": str(rate)}, headers=headers, client_timeout=2
            )
        except InferenceServerException as exc:
            return exc.message() or str(exc)
        return None

    async def close(self) -> None:
        """Close the channel, if one was opened."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
