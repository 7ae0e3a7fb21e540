"""The client core, without I/O: what the sync and the asyncio client both do, written once.

Each operation (read the model config, infer one chunk with retries, register a shared memory region, ask for health
or statistics, unregister regions on close) is a generator that yields the I/O it needs as small steps and receives
each step's result by ``send()``, or its exception by ``throw()``:

- :class:`Call`: one tritonclient method call on one endpoint, headers and gRPC deadline included; the client
  performs it on its connection to that endpoint and maps a tritonclient error to ours with
  :func:`triton_embed.errors.from_triton`. A call whose HTTP connection closed under it before any answer
  (:func:`triton_embed.errors.connection_cut`) is sent once more, on a new connection, when :attr:`Call.resendable`;
  ``retries`` does not count it.
- :class:`Sleep`: wait that long (a backoff, a pause before an unregister is tried again).
- :class:`Blocking`: a function that may block (closing the shared memory pool waits for in-flight requests, DNS
  resolution); the sync client calls it, the asyncio client runs it in a worker thread.

Which endpoint each attempt goes to, and when a failed one is probed again, is decided by
:class:`triton_embed.endpoints.EndpointPool`.

:class:`triton_embed.EmbeddingClient` and :class:`triton_embed.AsyncEmbeddingClient` each drive these generators with
one small loop (``_run``) and keep only what is I/O or concurrency: connections, running chunks at once, waiting for
calls in flight on close.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Concatenate, Generic, ParamSpec, TypeAlias, TypeVar

import numpy as np

from triton_embed import server_stats
from triton_embed.client_stats import ClientStats, Counters
from triton_embed.endpoints import EndpointPool, EndpointState, resolve_all
from triton_embed.errors import EmbeddingError, InvalidInputError, ServerUnavailableError, note_request_row
from triton_embed.inputs import Embeddings, Scores, TextsLike, as_texts
from triton_embed.request_builder import OUTPUT, SCORE, CallOptions, RequestBuilder
from triton_embed.settings import Settings, copied, traced
from triton_embed.shm import Region, ShmPool, close_pool_at_exit, region_in_use, release_pauses

P = ParamSpec("P")
T = TypeVar("T")


# -- steps: the I/O an operation asks its client for -----------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """``method(*args, **kwargs)`` on the client's tritonclient connection to ``endpoint``; the result is sent back.

    ``wait_s``: the longest the asyncio client waits for the whole call (``asyncio.wait_for``), seconds, or None.
    The sync client's connections bound a call themselves (gRPC deadline, HTTP network timeout).
    ``endpoint``: ``host:port`` of the server to call.
    """

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    wait_s: float | None = None
    endpoint: str = ""

    @property
    def resendable(self) -> bool:
        """True if the call may be sent again after its connection closed under it (see ``_perform`` of the clients).

        Sending it twice does what sending it once does: an embedding request has no side effect, nor has a read of
        the config, health or statistics. Registering a shared memory region is the exception: a second registration
        of the same name is refused.
        """
        return self.method != "register_system_shared_memory"


@dataclass(frozen=True)
class Sleep:
    """Wait ``seconds`` (time.sleep or asyncio.sleep)."""

    seconds: float


@dataclass(frozen=True)
class Blocking:
    """``fn(*args)``, which may block: called as it is by the sync client, in a worker thread by the asyncio one."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


Step: TypeAlias = Call | Sleep | Blocking
Steps: TypeAlias = Generator[Step, Any, T]
"""An operation of the core: yields steps, receives their results, returns ``T``."""


@dataclass(frozen=True)
class Done(Generic[T]):
    """An operation's end: its result."""

    value: T


def advance(steps: Steps[T], value: Any = None, error: BaseException | None = None) -> Step | Done[T]:
    """The operation's next step once ``value`` came of the last one (or ``error`` was raised); ``Done`` at its end.

    The clients' one loop: ``step = advance(steps)``, then perform each step and hand back what came of it, until
    ``Done``. An error the operation does not handle is raised here.
    """
    try:
        return steps.send(value) if error is None else steps.throw(error)
    except StopIteration as stop:
        return Done(stop.value)


# -- retry policy ------------------------------------------------------------------------------------------------------
MAX_BACKOFF_S = 2.0
DEFAULT_BACKOFF_S = 0.1
"""First wait before a retry, seconds (``backoff_s``); it doubles per attempt up to :data:`MAX_BACKOFF_S`."""


def backoff(attempt: int, base_s: float) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): exponential, capped at 2 s, with 0-25% jitter."""
    return min(MAX_BACKOFF_S, base_s * 2.0**attempt) * (1 + random.random() / 4)  # noqa: S311 - jitter only


def retryable(error: EmbeddingError) -> bool:
    """Only unavailable/overloaded/connection errors are retried; bad input and timeouts never are."""
    return isinstance(error, ServerUnavailableError)


OVERLOADED = "Exceeds maximum queue size"
"""How Triton says a full queue refused a request (the encoder's own refusals carry a reason code instead)."""


def endpoint_failed(error: EmbeddingError) -> bool:
    """True if ``error`` says its endpoint is unreachable, not ready or draining: no requests go there for a while.

    An overload refusal is retryable (on another endpoint first) but leaves its endpoint up: it serves, and is busy.
    """
    refused = isinstance(error, ServerUnavailableError) and error.reason is not None
    return retryable(error) and not refused and OVERLOADED not in str(error)


RECONNECT_BACKOFF_MS = 1000
"""The longest a gRPC connection waits between attempts to reconnect to a server that went away, ms."""


def grpc_channel_args() -> list[tuple[str, int]]:
    """Channel arguments of this client's gRPC connections: tritonclient's own, and reconnects at most 1 s apart.

    gRPC's default reconnect backoff grows to 120 s while a server is down, and every channel to that address in
    the process shares it: a server back after a minute's outage would get no requests for up to two more. With
    this cap a connection reconnects within about a second of the server listening again.
    """
    import tritonclient.grpc as grpcclient

    keepalive = grpcclient.KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(keepalive.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    ]


PROBE_TIMEOUT_S = 2.0
"""The longest a readiness probe of a down endpoint waits (gRPC deadline, asyncio wait), seconds; at most timeout_s."""


# -- results and pure helpers ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Health:
    """``live``: the server answers; ``ready``: all its models loaded; ``model_ready``: this client's model.

    ``error``: why the server could not be asked ("" when it answered), e.g. the wrong port for the protocol.
    """

    live: bool
    ready: bool
    model_ready: bool
    error: str = ""


def max_batch_and_dim(config: dict[str, Any]) -> tuple[int, int]:
    """``(max_batch_size, embedding width)`` from a model config in JSON form.

    Raises:
        InvalidInputError: the model is a reranker (its ensemble has no ``EMBEDDING`` output).
    """
    output = next((o for o in config["output"] if o["name"] == OUTPUT), None)
    if output is None:
        name = config.get("name", "?")
        raise InvalidInputError(f"model '{name}' is a reranker, not an embedder: call rerank() (CLI: rerank)")
    return int(config.get("max_batch_size", 1)) or 1, int(output["dims"][-1])


@dataclass(frozen=True)
class Ranked:
    """One document of a rerank call.

    Its ``index`` in the call's documents, its ``score`` (the model's activation of its logit: sigmoid, in (0, 1), for
    most cross-encoders) and its text, ``document``.
    """

    index: int
    score: float
    document: str


def ranked(documents: list[str], scores: Scores, top_n: int | None) -> list[Ranked]:
    """``documents`` with their float32 ``(n,)`` ``scores``, highest first (ties in document order); ``top_n``."""
    order = sorted(range(len(documents)), key=lambda i: -float(scores[i]))
    return [Ranked(i, float(scores[i]), documents[i]) for i in order[:top_n]]


def rerank_arguments(
    query: str | bytes, documents: TextsLike, top_n: int | None, truncate: str | None
) -> tuple[str, list[str]]:
    """A rerank call's ``(query, documents)`` as str, after its arguments are checked (before anything is sent).

    Raises:
        ValueError: ``top_n`` is not an integer >= 1, or ``truncate`` not one of END, START, NONE.
        InvalidInputError: the query is not one str or UTF-8 bytes, or a document is not text.
    """
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ValueError(f"top_n must be an integer >= 1; got {top_n!r}")
    CallOptions(None, truncate)  # checks truncate
    if not isinstance(query, str | bytes):
        raise InvalidInputError(f"the query must be one str or UTF-8 bytes; got {type(query).__name__}")
    return as_texts(query)[0], as_texts(documents)


def check_dimensions(dimensions: int | None, width: int) -> None:
    """Check a ``dimensions`` argument against the model's ``width`` (None passes).

    Raises:
        ValueError: ``dimensions`` is not an int from 1 to ``width``.
    """
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= width:
        raise ValueError(f"dimensions must be an int from 1 to the model's width {width}; got {dimensions!r}")


def shorten(vectors: Embeddings, dimensions: int | None) -> Embeddings:
    """The first ``dimensions`` components of each row, renormalised to unit length (Matryoshka); all for None.

    How well shortened vectors retrieve depends on the model's training; any model's vectors can be cut.

    Raises:
        ValueError: ``dimensions`` is not an int from 1 to the rows' width.
    """
    if dimensions is None:
        return vectors
    check_dimensions(dimensions, vectors.shape[1])
    head = vectors[:, :dimensions]
    out: Embeddings = (head / np.maximum(np.linalg.norm(head, axis=1, keepdims=True), 1e-12)).astype(np.float32)
    return out


def chunks(items: list[str], size: int) -> list[list[str]]:
    """``items`` in order, in pieces of at most ``size`` (one request each)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
"""This package's folder: warnings point at the first frame outside it."""


def disable_shared_memory_warning(url: str, error: Exception) -> None:
    """Warn once per failure that shared memory is off for this client.

    The warning points at the caller's line: the first frame outside this package.
    """
    frame, stacklevel = sys._getframe(0), 1  # stacklevel 1 is this function
    while frame.f_back is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(
        f"shared memory registration with {url} failed ({error}); falling back to sending tensors over the "
        "network (registration is an admin API: pass the server's admin key header, see docs/operations.md, threat "
        "model; and client and server must share /dev/shm, e.g. the same host or container IPC namespace)",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


class ClientCore:
    """Settings, state and the I/O-free operations of the sync and the asyncio client; not used directly.

    Methods that return :data:`Steps` are operations: a client runs them with its ``_run``.
    """

    def __init__(
        self,
        *,
        url: str | Sequence[str] | None = None,
        protocol: str | None = None,
        model: str = "embed",
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = DEFAULT_BACKOFF_S,
        binary: bool = True,
        use_shared_memory: bool = False,
        coalesce: bool = False,
        max_concurrency: int = 4,
        headers: dict[str, str] | None = None,
        latency_budget_ms: float | None = None,
        truncate: bool | None = None,
    ) -> None:
        """Connect lazily: nothing is sent until the first call.

        Args:
            url: ``host:port``, or ``http://host:port`` / ``grpc://host:port`` (the scheme picks the protocol);
                ``:8000`` means 127.0.0.1. Several endpoints: a list of them, or one string separated by commas
                (``"10.0.0.5:8001,10.0.0.6:8001"``); a DNS name that resolves to several addresses (a Kubernetes
                headless Service) counts as one endpoint per address. Requests are spread over the endpoints that
                are up and fail over from one that is unreachable or not ready (see :mod:`triton_embed.endpoints`).
                Default: ``$TRITON_EMBED_URL`` (one url or several separated by commas), else ``127.0.0.1:8001``
                (gRPC) / ``127.0.0.1:8000`` (HTTP).
            protocol: ``grpc`` or ``http``. Default: the url's scheme, else ``$TRITON_EMBED_PROTOCOL``, else ``grpc``.
            model: the ensemble's name.
            timeout_s: limit for one request attempt, seconds (gRPC deadline; HTTP connect and network timeout).
            retries: extra attempts after an unavailable/overloaded/connection error (never after bad input or a
                timeout), waiting ``backoff_s * 2**k`` (capped at 2 s, plus up to 25% jitter) before attempt k+1;
                with several endpoints, a retry goes to one this call has not tried when one is up.
            backoff_s: first wait between attempts, seconds.
            binary: HTTP only: binary tensor data (default) instead of JSON, ~4x fewer bytes per embedding.
            use_shared_memory: send texts and receive embeddings through system shared memory (same host only, so
                one url, whose name is not expanded into addresses); falls back to the network with a
                ``RuntimeWarning`` when the server cannot register the regions.
            coalesce: send each distinct text in flight once; concurrent callers asking for it wait for that row.
            max_concurrency: chunks of one long list sent at the same time.
            headers: extra HTTP headers / gRPC metadata on every call (e.g. a restricted-API key); copied, so
                the caller's dict is never changed and may be shared between clients.
            latency_budget_ms: sent as the request parameter ``latency_budget_ms``: how long this request may wait
                in the encoder's queue before the server refuses it as overloaded (ms; 0 = never refused, for bulk
                jobs that prefer slow to rejected; fractions allowed). None = the server's
                ``LATENCY_BUDGET_MS`` (as shipped: none on CPU, 180 ms on GPU).
            truncate: sent as the request parameter ``truncate``: False makes a text over ``max_seq_length`` tokens
                (256 for all-MiniLM-L6-v2) an ``InvalidInputError`` instead of being cut as sentence-transformers
                cuts it; None = the server's ``TRUNCATION`` (truncate as shipped). The response cache keys on the
                texts only: a text already served truncated is answered from the cache whatever this says.

        Raises:
            ValueError: unknown protocol, a url that is not ``host:port``, a url scheme that contradicts
                ``protocol`` (or ``$TRITON_EMBED_PROTOCOL``, when both come from the environment), urls whose
                schemes differ or one url listed twice, ``use_shared_memory`` with more than one url, ``truncate``
                or ``binary`` not a bool, ``headers`` not a dict of str, or a setting out of range
                (``timeout_s``, ``retries``, ``backoff_s``, ``max_concurrency``, ``latency_budget_ms``).
        """
        self.settings = Settings.make(
            url=url,
            protocol=protocol,
            model=model,
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            binary=binary,
            use_shared_memory=use_shared_memory,
            coalesce=coalesce,
            max_concurrency=max_concurrency,
            headers=headers,
            latency_budget_ms=latency_budget_ms,
            truncate=truncate,
        )
        self._pool = EndpointPool(self.settings.urls, expand_names=not self.settings.use_shared_memory)
        self._module = self._protocol_module(self.settings.protocol)
        self._builder = RequestBuilder(self.settings, self._module)
        self._counters = Counters()
        self._config: dict[str, Any] | None = None
        self._closed = False
        self._closing = False  # close() has begun: new calls are refused
        self._shm: ShmPool | None = None
        self._shm_lock = threading.Lock()
        self._shm_fallback: Exception | None = None  # why shared memory was given up, until the caller is warned
        self._setup()

    def _longest_call_s(self) -> float:
        """Longest one embed() call can take, seconds: every attempt's timeout plus the backoffs (capped at 2 s)."""
        s = self.settings
        return (s.retries + 1) * s.timeout_s + s.retries * 2.5

    def _protocol_module(self, protocol: str) -> ModuleType:
        """The tritonclient module for ``protocol`` (sync or aio); set by the subclass."""
        raise NotImplementedError

    def _setup(self) -> None:
        """Subclass state (connections, coalescer, shared memory pool)."""
        raise NotImplementedError

    @property
    def url(self) -> str:
        """``host:port`` this client talks to; with several endpoints, they as given, separated by commas."""
        return self.settings.url

    @property
    def urls(self) -> tuple[str, ...]:
        """The endpoints as given, each ``host:port`` (one for a single url)."""
        return self.settings.urls

    @property
    def endpoints(self) -> list[EndpointState]:
        """The endpoints now (DNS names expanded once resolved): url, whether it is up, requests in flight."""
        return self._pool.states()

    @property
    def protocol(self) -> str:
        """``grpc`` or ``http``."""
        return self.settings.protocol

    @property
    def model(self) -> str:
        """The ensemble's name."""
        return self.settings.model

    def stats(self) -> ClientStats:
        """Client-side counters: requests, texts, retries, errors, HTTP body bytes, shared memory regions."""
        return self._counters.snapshot(len(self._shm.regions) if self._shm else 0)

    def _closed_error(self) -> EmbeddingError:
        return EmbeddingError(f"client for model '{self.model}' at {self.url} is closed")

    def _check_open(self) -> None:
        """Raise ``EmbeddingError`` (the client is closed) once ``close()`` has begun."""
        if self._closing:
            raise self._closed_error()

    # -- calls and retries --------------------------------------------------------------------------------------------
    def _call(
        self, endpoint: str, method: str, /, *args: Any, wait_s: float | None = None, **kwargs: Any
    ) -> Steps[Any]:
        """One tritonclient call to ``endpoint``, ``method(*args, **kwargs)``, with the client's headers; its result.

        Over gRPC every call gets ``timeout_s`` as its deadline: without one, a config fetch or a health check
        against a port that accepts connections but never answers waits ~20 s for gRPC's handshake, whatever
        ``timeout_s`` says; HTTP's connection has the timeout already.
        """
        if self.protocol == "grpc":
            kwargs.setdefault("client_timeout", self.settings.timeout_s)
        headers = traced(copied(self.settings.headers))  # the caller's span's context, when there is one
        return (yield Call(method, args, {"headers": headers, **kwargs}, wait_s, endpoint))

    def _as_json(self) -> dict[str, Any]:
        """Keyword arguments that make a gRPC answer JSON, as HTTP's always is."""
        return {"as_json": True} if self.protocol == "grpc" else {}

    def _retrying(self, fn: Callable[Concatenate[str, P], Steps[T]], *args: P.args, **kwargs: P.kwargs) -> Steps[T]:
        """``fn(endpoint, *args, **kwargs)``, repeated after retryable errors (see ``retries`` and ``backoff_s``).

        Each attempt goes where the endpoint pool says: a retry to an endpoint this call has not tried when one is up.
        """
        tried: list[str] = []
        for attempt in range(self.settings.retries + 1):
            endpoint = yield from self._endpoint(tried)
            tried.append(endpoint)
            try:
                return (yield from self._on_endpoint(endpoint, fn, *args, **kwargs))
            except EmbeddingError as exc:
                if not retryable(exc) or attempt == self.settings.retries:
                    self._counters.add(errors=1)
                    raise
                self._counters.add(retries=1)
                yield Sleep(backoff(attempt, self.settings.backoff_s))
        raise AssertionError("unreachable")

    def _endpoint(self, avoid: Sequence[str] = ()) -> Steps[str]:
        """The endpoint for the next attempt (see :meth:`EndpointPool.pick`), not one of ``avoid`` when another is up.

        DNS names are resolved first when due, and a down endpoint whose cool-down has passed is probed first (its
        model's readiness, within :data:`PROBE_TIMEOUT_S`): one that is ready again takes requests from then on.
        """
        pool = self._pool
        while True:
            yield from self._resolve_if_due()
            choice = pool.pick(avoid)
            if not choice.probe:
                return choice.url
            ready, limit_s = False, min(PROBE_TIMEOUT_S, self.settings.timeout_s)
            grpc = {"client_timeout": limit_s} if self.protocol == "grpc" else {}
            try:
                ready = bool((yield from self._call(choice.url, "is_model_ready", self.model, wait_s=limit_s, **grpc)))
            except EmbeddingError:
                pass
            finally:
                pool.probed(choice.url, ready)

    def _on_endpoint(
        self, endpoint: str, fn: Callable[Concatenate[str, P], Steps[T]], *args: P.args, **kwargs: P.kwargs
    ) -> Steps[T]:
        """``fn(endpoint, *args, **kwargs)``, counted in flight there; its outcome tells the pool whether it is up."""
        self._pool.started(endpoint)
        ok: bool | None = None
        try:
            result = yield from fn(endpoint, *args, **kwargs)
            ok = True
            return result
        except EmbeddingError as exc:
            ok = False if endpoint_failed(exc) else None
            raise
        finally:
            self._pool.finished(endpoint, ok)

    def _get_model_config(self) -> Steps[dict[str, Any]]:
        """The model's config in JSON form: fetched once (with retries), then kept."""
        if self._config is None:
            reply = yield from self._retrying(self._call, "get_model_config", self.model, **self._as_json())
            config: dict[str, Any] = reply["config"] if self.protocol == "grpc" else reply
            self._config = config
        return self._config

    # -- embedding ----------------------------------------------------------------------------------------------------
    def _chunked(self, items: list[str]) -> Steps[tuple[list[list[str]], int]]:
        """``(items in pieces of at most max_batch_size, embedding width)``: one inference request per piece."""
        size, dim = max_batch_and_dim((yield from self._get_model_config()))
        return chunks(items, size), dim

    def _infer(
        self, texts: list[str], dim: int, bulk: bool = False, options: CallOptions | None = None
    ) -> Steps[Embeddings]:
        """Embed one chunk, ``(len(texts), dim)`` float32, retried after retryable errors.

        ``bulk``: the chunk is one of several of one call (see :meth:`RequestBuilder.infer_kwargs`).
        """
        return (yield from self._retrying(self._infer_once, texts, dim, bulk, options))

    def _infer_once(
        self, endpoint: str, texts: list[str], dim: int, bulk: bool = False, options: CallOptions | None = None
    ) -> Steps[Embeddings]:
        if self._closed:  # a call that outlived close() fails here, before it takes a region
            raise self._closed_error()
        pool, region = yield from self._acquire_region(endpoint, texts, dim)
        try:
            inputs, outputs, sent = self._builder.build(texts, dim, region, options)
            try:
                result = yield from self._call(
                    endpoint,
                    "infer",
                    self.model,
                    inputs,
                    outputs=outputs,
                    wait_s=self.settings.timeout_s + 1,  # a backstop: the connection's own timeout answers first
                    **self._builder.infer_kwargs(bulk),
                )
            except InvalidInputError as exc:
                note_request_row(exc, texts)
                raise
            array, received = self._builder.read(result, texts, dim, region)
            array = array.copy() if region is not None else array
        finally:
            if pool is not None and region is not None:
                pool.release(region)
        self._counters.add(requests=1, texts=len(texts), bytes_sent=sent, bytes_received=received)
        return array

    # -- reranking ----------------------------------------------------------------------------------------------------
    def _pair_chunks(self, documents: list[str]) -> Steps[list[list[str]]]:
        """``documents`` in pieces of at most the ensemble's ``max_batch_size``: one inference request per piece."""
        config = yield from self._get_model_config()
        if not any(o["name"] == SCORE for o in config["output"]):
            raise InvalidInputError(
                f"model '{self.model}' is an embedder, not a reranker: call embed(), or name a reranker (model=)"
            )
        return chunks(documents, int(config.get("max_batch_size", 1)) or 1)

    def _score(self, query: str, documents: list[str], bulk: bool, truncate: str | None) -> Steps[Scores]:
        """Score one chunk of (``query``, document) pairs, float32 ``(len(documents),)``, retried as :meth:`_infer`."""
        return (yield from self._retrying(self._score_once, query, documents, bulk, truncate))

    def _score_once(
        self, endpoint: str, query: str, documents: list[str], bulk: bool, truncate: str | None
    ) -> Steps[Scores]:
        if self._closed:
            raise self._closed_error()
        inputs, outputs, sent = self._builder.build_pairs(query, documents, truncate)
        result = yield from self._call(
            endpoint,
            "infer",
            self.model,
            inputs,
            outputs=outputs,
            wait_s=self.settings.timeout_s + 1,
            **self._builder.infer_kwargs(bulk),
        )
        scores, received = self._builder.read_scores(result, len(documents))
        self._counters.add(requests=1, texts=len(documents), bytes_sent=sent, bytes_received=received)
        return scores

    # -- shared memory ------------------------------------------------------------------------------------------------
    def _open_shared_memory(self) -> ShmPool | None:
        """A new region pool when ``use_shared_memory`` is on, else None.

        A client never closed still unregisters and frees its regions at interpreter exit.
        """
        if not self.settings.use_shared_memory:
            return None
        pool, s = ShmPool(), self.settings
        self._finalizer = weakref.finalize(self, close_pool_at_exit, pool, s.protocol, s.url, s.headers)
        return pool

    def _acquire_region(self, endpoint: str, texts: list[str], dim: int) -> Steps[tuple[ShmPool | None, Region | None]]:
        """``(pool, region registered with endpoint)`` for this request, or ``(None, None)`` (shm off or given up).

        Shared memory comes with one endpoint only (:class:`Settings`).
        """
        pool, region = self._take_region(texts, dim)
        if pool is None or region is None or region.registered:
            return pool, region
        try:
            yield from self._call(endpoint, "register_system_shared_memory", region.name, region.key, region.byte_size)
        except EmbeddingError as exc:  # any refusal means: use the network instead
            self._give_up_shared_memory(pool, region, exc)
            yield Blocking(pool.close, (lambda name: None, 5.0))
            return None, None
        region.registered = True
        return pool, region

    def _take_region(self, texts: list[str], dim: int) -> tuple[ShmPool | None, Region | None]:
        """``(pool, region)`` big enough for this request (maybe not registered yet), or ``(None, None)``."""
        pool = self._shm
        if pool is None:
            return None, None
        try:
            return pool, pool.acquire(RequestBuilder.region_bytes(texts, dim))
        except RuntimeError:  # another caller gave shared memory up a moment ago
            return None, None

    def _give_up_shared_memory(self, pool: ShmPool, region: Region, error: Exception) -> None:
        """Registration failed: free the region and send tensors over the network from now on (warned once).

        The caller then closes ``pool``.
        """
        pool.discard(region)
        with self._shm_lock:
            if self._shm is pool:
                self._shm = None
                self._shm_fallback = error  # warned by the embed() call, in its caller's thread or task

    def _warn_of_fallback(self) -> None:
        """Issue the shared-memory fallback warning if one is due.

        Called at the end of ``embed``: its chunks run in worker threads or tasks, where no frame of the caller's is
        on the stack to point the warning at.
        """
        with self._shm_lock:
            error, self._shm_fallback = self._shm_fallback, None
        if error is not None:
            disable_shared_memory_warning(self.url, error)

    def _unregister_region(self, name: str) -> Steps[None]:
        """Unregister region ``name``, tried again while the server still holds it (see ``shm.region_in_use``).

        A Triton 2.51 workaround (docs/troubleshooting.md).

        Raises:
            EmbeddingError: any other refusal, or the server still held the region after ``shm.RELEASE_WAIT_S``.
        """
        for pause in (*release_pauses(), None):
            try:
                yield from self._call(self.urls[0], "unregister_system_shared_memory", name)
                return
            except EmbeddingError as exc:
                if pause is None or not region_in_use(exc):
                    raise
            yield Sleep(pause)

    def _close_shared_memory(self) -> Steps[None]:
        """Wait for in-flight requests to give their regions back, destroy the regions, unregister them."""
        pool = self._shm
        if pool is None:
            return
        names: list[str] = []
        yield Blocking(pool.close, (names.append,))  # collects the names of the regions the server knows
        for name in names:
            with contextlib.suppress(EmbeddingError):  # the server may be gone; local regions are freed anyway
                yield from self._unregister_region(name)
        self._finalizer.detach()

    # -- health and statistics ----------------------------------------------------------------------------------------
    def _resolve_if_due(self) -> Steps[None]:
        """Resolve the pool's DNS names when due (see :meth:`EndpointPool.names_due`)."""
        if due := self._pool.names_due():
            found: dict[str, list[str] | None] = {}
            try:
                found = yield Blocking(resolve_all, (due,))
            finally:
                self._pool.resolved(found)

    def _health(self) -> Steps[Health]:
        """See the clients' ``health``: each endpoint asked in turn; what each says marks it up or down."""
        self._check_open()
        yield from self._resolve_if_due()
        answers = []
        for url in self._pool.urls:
            health = yield from self._endpoint_health(url)
            self._pool.mark(url, health.model_ready)
            answers.append((url, health))
        return combined_health(answers)

    def _endpoint_health(self, url: str) -> Steps[Health]:
        try:
            # Triton's metrics port answers 200 to any path, with an empty body: the metadata tells them apart
            yield from self._call(url, "get_server_metadata")
            live = yield from self._call(url, "is_server_live")
            ready = yield from self._call(url, "is_server_ready")
            model_ready = yield from self._call(url, "is_model_ready", self.model)
        except EmbeddingError as exc:
            return Health(False, False, False, error=str(exc))
        return Health(live=bool(live), ready=bool(ready), model_ready=bool(model_ready))

    def _server_stats(self, models: tuple[str, ...]) -> Steps[list[server_stats.StepStats]]:
        """See the clients' ``server_stats``: with several endpoints, their counters added up."""
        self._check_open()
        yield from self._resolve_if_due()
        rows = []
        for name in models:
            entries = []
            for url in self._pool.urls:
                raw = yield from self._call(url, "get_inference_statistics", name, **self._as_json())
                entries.append(raw["model_stats"][0])
            rows.append(server_stats.parse(server_stats.merge(entries)))
        return rows


def combined_health(answers: Sequence[tuple[str, Health]]) -> Health:
    """One :class:`Health` for the endpoints' answers ``(url, health)``; one endpoint's as it is.

    With several: each flag is True if it is for any endpoint (the client can serve while one model is ready), and
    ``error`` names each endpoint whose model is not ready, with its error when it could not be asked.
    """
    if len(answers) == 1:
        return answers[0][1]
    return Health(
        live=any(h.live for _, h in answers),
        ready=any(h.ready for _, h in answers),
        model_ready=any(h.model_ready for _, h in answers),
        error="; ".join(f"{url}: {h.error or 'model not ready'}" for url, h in answers if not h.model_ready),
    )
