"""The HTTP routes: OpenAI's and TEI's embeddings APIs, models, health, readiness and metrics, on Starlette.

``POST /v1/embeddings`` and ``POST /embed`` need the API key when one is set (``Authorization: Bearer <key>``);
``/health``, ``/ready``, ``/metrics`` and ``/v1/models`` do not, so probes and scrapers need no secret. Every
response carries ``X-Request-Id`` (the caller's, else a new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from triton_embed_gateway.protocol import (
    DEFAULT_MAX_INPUTS,
    ApiError,
    Counts,
    EmbedRequest,
    RerankRequest,
    Scores,
    Vectors,
    cohere_rerank_request,
    cohere_rerank_response,
    invalid,
    openai_request,
    openai_response,
    tei_request,
    tei_rerank_request,
    tei_rerank_response,
)
from triton_embed_gateway.sampling import SamplingController, SamplingPolicy
from triton_embed_gateway.tracing import Tracing, annotate, record_status
from triton_embed_gateway.triton import TritonEmbedder

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from triton_embed_gateway.ratio_sampler import AdaptiveRatio

log = logging.getLogger("triton_embed_gateway")
ADMIN_HEADER = "triton-embed-admin-key"  # Triton's admin lock, as triton_embed_server.supervisor names it
DEFAULT_PAYLOAD_LIMIT = 2_000_000
"""Largest request body, bytes (TEI's default): 2,048 texts of ~1 KB."""


@dataclass(frozen=True)
class GatewaySettings:
    """How the gateway answers.

    ``served_names``: ensemble -> the id answered for it in ``model`` and ``/v1/models`` (an ensemble without one
    answers under its own name); ``api_key``: None = no key needed;
    ``payload_limit``: bytes; ``max_inputs``: texts per API request; ``sampling``: how the share of requests traced
    follows load, when it does; ``admin_header`` and ``admin_key``: Triton's admin lock, with which the sampling sets
    Triton's ``trace_rate`` (None: Triton's rate is left alone).
    """

    served_names: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    payload_limit: int = DEFAULT_PAYLOAD_LIMIT
    max_inputs: int = DEFAULT_MAX_INPUTS
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)
    admin_header: str = ADMIN_HEADER
    admin_key: str | None = None


class Metrics:
    """The gateway's own Prometheus metrics, named and counted as Triton's are (counters, microseconds)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["route", "code"]
        self.requests = Counter(
            "triton_embed_gateway_request",
            "API requests answered, by route and HTTP status",
            labels,
            registry=self.registry,
        )
        self.duration_us = Counter(
            "triton_embed_gateway_request_duration_us",
            "Time to answer API requests, microseconds",
            labels,
            registry=self.registry,
        )
        self.latency = Histogram(
            "triton_embed_gateway_request_seconds",
            "Time to answer one API request, seconds",
            ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.texts = Counter("triton_embed_gateway_texts", "Texts embedded", registry=self.registry)
        self.tokens = Counter(
            "triton_embed_gateway_tokens", "Tokens embedded (after truncation)", registry=self.registry
        )
        self.sampling_ratio = Gauge(
            "triton_embed_gateway_trace_sampling_ratio",
            "Share of new API requests traced, 0..1 (1 when tracing is off: nothing to sample)",
            registry=self.registry,
        )
        self.sampling_ratio.set(1.0)
        self.sampling_changes = Counter(
            "triton_embed_gateway_trace_sampling_changes",
            "Changes of the share traced, by the load that made them",
            ["state"],
            registry=self.registry,
        )
        self.triton_trace_rate = Gauge(
            "triton_embed_gateway_triton_trace_rate",
            "Triton's trace_rate as the gateway last set it (1 in N; 0: not set)",
            registry=self.registry,
        )


def _sampling(
    embedders: list[TritonEmbedder], settings: GatewaySettings, sampler: AdaptiveRatio, metrics: Metrics
) -> SamplingController:
    """The controller of ``sampler`` and of Triton's ``trace_rate`` (with the admin key, if given)."""
    key = settings.admin_key
    headers = {f"triton-grpc-protocol-{settings.admin_header}": key} if key else {}  # Triton's gRPC form of it

    def changed(share: float, triton_rate: int | None) -> None:
        metrics.sampling_ratio.set(share)
        metrics.triton_trace_rate.set(triton_rate or 0)
        state = "slow" if controller.slow else "quiet" if share == 1.0 else "load"
        metrics.sampling_changes.labels(state=state).inc()

    async def request_count() -> int | None:
        counts = await asyncio.gather(*(e.request_count() for e in embedders))
        return None if None in counts else sum(c for c in counts if c is not None)

    controller = SamplingController(
        settings.sampling,
        sampler,
        request_count,
        (lambda rate: embedders[0].set_trace_rate(rate, headers)) if key else None,
        changed,
    )
    if not key:
        log.warning(
            "TRITON_EMBED_ADMIN_KEY is not set: Triton's trace_rate stays as Triton started; the gateway's "
            "own sampling follows load"
        )
    return controller


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``body`` as JSON (orjson; NumPy arrays as lists)."""
    content = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(content, status_code=status, media_type="application/json", headers=headers)


def error_response(error: ApiError, *, tei: bool = False) -> Response:
    """``error`` in OpenAI's shape (``tei``: text-embeddings-inference's), with ``Retry-After`` on a 503."""
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return json_response(error.tei_body() if tei else error.body(), error.status, headers)


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body.

    Raises:
        ApiError: 413 for a body over ``limit`` bytes (read no further), 400 for one that is not UTF-8 or not JSON.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body has {declared} bytes; the limit is {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(
                413, f"the body has over {limit} bytes; the limit is {limit} bytes", code="request_too_large"
            )
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:
            bytes(body).decode("utf-8")
        except UnicodeDecodeError as bad:  # orjson's own message names surrogates and position 0
            raise invalid(
                "body",
                f"the body is not valid UTF-8: byte 0x{body[bad.start]:02x} at offset {bad.start} ({bad.reason}); "
                "JSON text is UTF-8",
            ) from None
        raise invalid("body", f"the body is not valid JSON: {exc}") from exc


def build_app(  # noqa: PLR0915 - the routes are closures over one application's state
    embedders: TritonEmbedder | list[TritonEmbedder], settings: GatewaySettings, tracing: Tracing | None = None
) -> Starlette:
    """The ASGI application answering for the ensembles of ``embedders`` (one Triton server).

    ``/v1/embeddings`` and ``/v1/rerank`` route by the request's ``model`` (an id of ``settings.served_names`` or an
    ensemble's name) among the embedders and the rerankers: with one model of that kind any name that names no
    other model, none means the first; the TEI routes ``/embed`` and ``/rerank`` use the first of their kind.
    ``tracing``: a server span per request of the embedding and rerank routes (default: the first embedder's, off
    unless set up). The channels are closed and the spans still queued are exported when the application shuts down.
    """
    embedders = [embedders] if isinstance(embedders, TritonEmbedder) else list(embedders)
    served = {settings.served_names.get(e.model, e.model): e for e in embedders}
    metrics = Metrics()
    tracing = tracing or embedders[0].tracing
    sampling = _sampling(embedders, settings, tracing.sampler, metrics) if tracing.sampler is not None else None

    async def kind_of(embedder: TritonEmbedder) -> str | None:
        """The model's kind, None while Triton cannot say (a model not loaded must not fail the others' requests)."""
        try:
            return (await embedder.info()).kind
        except ApiError:
            return None

    async def chosen(model: str | None, kind: str = "embedder") -> tuple[str, TritonEmbedder]:
        """The served id and the ensemble a request's ``model`` names among those of ``kind``.

        Raises:
            ApiError: 404 for a name nothing serves, or no model of ``kind``; 400 for a model of the other kind;
                503 (:meth:`TritonEmbedder.info`'s) when Triton cannot say what the model is.
        """
        named = next(((name, e) for name, e in served.items() if model in (name, e.model)), None)
        if named is not None:
            other = (await named[1].info()).kind  # its own error (503: not loaded) when Triton cannot say
            if other != kind:
                route = "/v1/rerank" if other == "reranker" else "/v1/embeddings"
                raise ApiError(
                    400,
                    f"model '{model}' is a{'n' if other == 'embedder' else ''} {other}; send it to {route}",
                    code="wrong_model_kind",
                    param="model",
                )
            return named
        kinds = {name: await kind_of(e) for name, e in served.items()}
        of_kind = {name: e for name, e in served.items() if kinds[name] == kind}
        if of_kind and (model is None or len(of_kind) == 1):
            return next(iter(of_kind.items()))
        if not of_kind and None in kinds.values():  # Triton cannot say what is served: its error (503), not a 404
            await next(e for name, e in served.items() if kinds[name] is None).info()
        listed = ", ".join(of_kind) or "none"
        raise ApiError(
            404,
            f"model '{model}' is not served here; the served {kind}s are {listed}",
            code="model_not_found",
            param="model",
        )

    def authorised(request: Request) -> bool:
        if settings.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), settings.api_key.encode())

    def route(
        name: str, handler: Callable[[Request], Awaitable[Response]], *, needs_key: bool = False, tei: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        traced = needs_key  # the embedding routes; not probes and scrapes

        async def endpoint(request: Request) -> Response:
            started = time.perf_counter()
            if traced and sampling is not None:
                sampling.begin()
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            span = tracing.request(name, request.method, request.headers) if traced else contextlib.nullcontext()
            with span:
                try:
                    if needs_key and not authorised(request):
                        raise ApiError(
                            401,
                            "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                            code="invalid_api_key",
                        )
                    response = await handler(request)
                    record_status(response.status_code)
                except ApiError as error:
                    response = error_response(error, tei=tei)
                    record_status(error.status, error.message)
            response.headers["X-Request-Id"] = request_id
            took = time.perf_counter() - started
            labels = {"route": name, "code": str(response.status_code)}
            metrics.requests.labels(**labels).inc()
            metrics.duration_us.labels(**labels).inc(took * 1e6)
            metrics.latency.labels(route=name).observe(took)
            if traced and sampling is not None:
                sampling.observe(took)
            return response

        return endpoint

    def counted(texts: int, tokens: Counts) -> None:
        metrics.texts.inc(texts)
        metrics.tokens.inc(int(tokens.sum()))
        annotate(tokens=int(tokens.sum()))

    async def embed(request: EmbedRequest, field: str, model: str | None = None) -> tuple[str, Vectors, Counts]:
        name, embedder = await chosen(model)
        annotate(texts=len(request.texts), model=name)
        vectors, tokens = await embedder.embed(request, field)
        counted(len(request.texts), tokens)
        return name, vectors, tokens

    async def openai_embeddings(request: Request) -> Response:
        parsed = openai_request(await read_json(request, settings.payload_limit), settings.max_inputs)
        name, vectors, tokens = await embed(parsed, "input", parsed.model)
        return json_response(openai_response(vectors, tokens, name, parsed.encoding_format))

    async def tei_embed(request: Request) -> Response:
        parsed = tei_request(await read_json(request, settings.payload_limit), settings.max_inputs)
        _, vectors, _ = await embed(parsed, "inputs")
        return json_response(vectors)

    async def rerank(request: RerankRequest) -> tuple[str, Scores, Counts]:
        name, reranker = await chosen(request.model, "reranker")
        annotate(texts=len(request.documents), model=name)
        scores, tokens = await reranker.rerank(request)
        counted(len(request.documents), tokens)
        return name, scores, tokens

    async def tei_rerank(request: Request) -> Response:
        parsed = tei_rerank_request(await read_json(request, settings.payload_limit), settings.max_inputs)
        _, scores, _ = await rerank(parsed)
        return json_response(tei_rerank_response(parsed, scores))

    async def cohere_rerank(request: Request) -> Response:
        parsed = cohere_rerank_request(await read_json(request, settings.payload_limit), settings.max_inputs)
        name, scores, tokens = await rerank(parsed)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        return json_response(cohere_rerank_response(parsed, scores, tokens, name, request_id))

    async def models(request: Request) -> Response:
        data = []
        for name, embedder in served.items():
            info = await embedder.info()
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "triton-embed",
                    "type": info.kind,
                    "dimension": info.dim,
                    "max_tokens": info.max_tokens,
                    "max_batch_size": info.max_batch_size,
                    "precision": info.precision,
                }
            )
        return json_response({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        return json_response({"status": "ok"})

    async def ready(request: Request) -> Response:
        for embedder in embedders:
            if not await embedder.ready():
                raise ApiError(
                    503, f"model '{embedder.model}' is not ready at {embedder.url}", code="not_ready", retry_after_s=1
                )
        return json_response({"status": "ready"})

    async def metrics_page(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/embeddings", route("/v1/embeddings", openai_embeddings, needs_key=True), methods=["POST"]),
        Route("/embed", route("/embed", tei_embed, needs_key=True, tei=True), methods=["POST"]),
        Route("/v1/rerank", route("/v1/rerank", cohere_rerank, needs_key=True), methods=["POST"]),
        Route("/v2/rerank", route("/v2/rerank", cohere_rerank, needs_key=True), methods=["POST"]),  # Cohere's v2 SDK
        Route("/rerank", route("/rerank", tei_rerank, needs_key=True, tei=True), methods=["POST"]),
        Route("/v1/models", route("/v1/models", models), methods=["GET"]),
        Route("/health", route("/health", health), methods=["GET"]),
        Route("/ready", route("/ready", ready), methods=["GET"]),
        Route("/metrics", route("/metrics", metrics_page), methods=["GET"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        path = f"{request.method} {request.url.path}"
        response = error_response(ApiError(status, f"{path}: {getattr(exc, 'detail', exc)}", code="not_found"))
        response.headers["X-Request-Id"] = request.headers.get("x-request-id") or uuid.uuid4().hex
        return response

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        controller = asyncio.create_task(sampling.run()) if sampling is not None else None
        yield
        if controller is not None:
            controller.cancel()
        for embedder in embedders:
            await embedder.close()
        tracing.shutdown()

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
