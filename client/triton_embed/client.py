"""Synchronous embedding client over Triton's gRPC or HTTP protocol: the I/O of :mod:`triton_embed.core`, blocking."""

from __future__ import annotations

import importlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from triton_embed import server_stats
from triton_embed.coalesce import Coalescer
from triton_embed.core import (
    Call,
    ClientCore,
    Done,
    Health,
    Ranked,
    Sleep,
    Steps,
    advance,
    check_dimensions,
    grpc_channel_args,
    max_batch_and_dim,
    ranked,
    rerank_arguments,
    shorten,
)
from triton_embed.errors import EmbeddingError, InvalidInputError, at_call_index, connection_cut, from_triton
from triton_embed.inputs import Embeddings, TextsLike, as_texts
from triton_embed.request_builder import CallOptions
from triton_embed.settings import normalise_url

__all__ = ["EmbeddingClient", "Health", "normalise_url"]

T = TypeVar("T")


def _closed_by_server() -> tuple[type[BaseException], ...]:
    """The error geventhttpclient (tritonclient's HTTP library) raises for a connection closed before any answer."""
    from geventhttpclient.response import HTTPConnectionClosed  # noqa: PLC0415 - loaded only when HTTP is used

    return (HTTPConnectionClosed,)


class EmbeddingClient(ClientCore):
    """Embed texts with the triton-embed ``embed`` ensemble, from one thread or many.

    Example::

        with EmbeddingClient(url="127.0.0.1:8001") as client:
            vectors = client.embed(["A man plays a guitar.", "Someone plays music."])  # (2, 384) float32

    Several servers: ``EmbeddingClient(url=["10.0.0.5:8001", "10.0.0.6:8001"])`` (or ``"host-a:8001,host-b:8001"``,
    or one DNS name with several addresses) spreads requests over them and fails over from one that is down.

    Thread safety: one client may be shared by any number of threads. Each thread has its own connection to each
    endpoint (tritonclient's HTTP client is not thread-safe; gRPC channels to one endpoint share its connection).
    After ``os.fork()`` the child's first call opens its own connections (and shared memory regions); the parent's
    are left to the parent.
    """

    def _protocol_module(self, protocol: str) -> ModuleType:
        return importlib.import_module(f"tritonclient.{protocol}")

    def _setup(self) -> None:
        self._coalescer = Coalescer() if self.settings.coalesce else None
        self._lock = threading.Lock()
        self._reset_for_process()

    def _reset_for_process(self) -> None:
        """Per-process state: connections, worker pool, shared memory (fresh in a forked child)."""
        self._pid = os.getpid()
        self._local = threading.local()
        self._connections: list[Any] = []  # tritonclient's InferenceServerClient, one per thread and endpoint
        self._executor: ThreadPoolExecutor | None = None
        self._calls = 0  # embed() calls in progress, which close() waits for
        self._closing = False
        self._idle = threading.Condition()  # notified when an embed() call ends
        self._shm = self._open_shared_memory()

    def _own_process(self) -> None:
        """After ``os.fork()``, start the child's own per-process state (the parent's stays the parent's)."""
        if os.getpid() != self._pid:
            if self.protocol == "http":
                import gevent  # tritonclient.http runs on geventhttpclient: its event loop must be rebuilt

                gevent.reinit()
            self._reset_for_process()

    # -- public properties --------------------------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        """Most texts one request may carry (the model's ``max_batch_size``, read once from the server)."""
        return max_batch_and_dim(self._model_config())[0]

    @property
    def dim(self) -> int:
        """Embedding width (the model's ``EMBEDDING`` dims, read once from the server), e.g. 384."""
        return max_batch_and_dim(self._model_config())[1]

    # -- I/O ----------------------------------------------------------------------------------------------------------
    def _conn(self, endpoint: str) -> Any:
        """This thread's connection to ``endpoint`` (made on first use).

        When the endpoint list has changed (DNS), this thread first closes its connections to endpoints that left
        it: none of them has a call in flight, since a thread makes one call at a time.
        """
        if self._closed:
            raise self._closed_error()
        self._own_process()
        local = self._local
        if not hasattr(local, "clients"):
            local.clients, local.version = {}, self._pool.version
        clients: dict[str, Any] = local.clients
        if local.version != self._pool.version:
            local.version, current = self._pool.version, set(self._pool.urls)
            for url in [u for u in clients if u not in current and u != endpoint]:
                self._drop(clients.pop(url))
        client = clients.get(endpoint)
        if client is None:
            if self.protocol == "grpc":
                client = self._module.InferenceServerClient(endpoint, channel_args=grpc_channel_args())
            else:
                t = self.settings.timeout_s
                client = self._module.InferenceServerClient(endpoint, connection_timeout=t, network_timeout=t)
            clients[endpoint] = client
            with self._lock:
                self._connections.append(client)
        return client

    def _drop(self, client: Any) -> None:
        """Close one of this thread's connections (to an endpoint that left the list)."""
        with self._lock:
            self._connections.remove(client)
        client.close()

    def _run(self, steps: Steps[T]) -> T:
        """Run an operation of the core in this thread: perform each step it yields, hand back what came of it."""
        self._own_process()  # before the operation touches per-process state (e.g. takes a shared memory region)
        step = advance(steps)
        while not isinstance(step, Done):
            value, error = None, None
            try:
                if isinstance(step, Call):
                    value = self._perform(step)
                elif isinstance(step, Sleep):
                    time.sleep(step.seconds)
                else:
                    value = step.fn(*step.args)
            except BaseException as exc:  # the operation decides: retry, give up shared memory, or raise it
                error = exc
            step = advance(steps, value, error)
        return step.value

    def _perform(self, call: Call) -> Any:
        """Call the tritonclient method on this thread's connection to the call's endpoint; map its errors to ours.

        A resendable call whose kept-alive HTTP connection closed under it is sent once more: geventhttpclient then
        opens a new connection (it resends only GET, HEAD and the like itself).
        """
        endpoint = call.endpoint or self.urls[0]
        for resend in (call.resendable and self.protocol == "http", False):
            try:
                return getattr(self._conn(endpoint), call.method)(*call.args, **call.kwargs)
            except EmbeddingError:
                raise
            except Exception as exc:
                if not (resend and connection_cut(exc, _closed_by_server())):
                    raise from_triton(exc, model=self.model, url=endpoint) from exc
        raise AssertionError("unreachable")

    def _model_config(self) -> dict[str, Any]:
        return self._run(self._get_model_config())

    # -- embedding ----------------------------------------------------------------------------------------------------
    def embed(
        self,
        texts: TextsLike,
        *,
        input_type: str | None = None,
        truncate: str | None = None,
        dimensions: int | None = None,
    ) -> Embeddings:
        """Embed texts; row ``i`` belongs to text ``i``.

        Args:
            texts: a str, bytes, a list/tuple/generator of str or UTF-8 bytes, or a NumPy array of ``<U``, ``|S``
                or object dtype, shape ``(n,)`` or ``(n, 1)``. Lists longer than :attr:`max_batch_size` are sent
                as several requests, up to ``max_concurrency`` at once, and reassembled in order.
            input_type: the name of one of the model's sentence-transformers prompts (``"query"``, ``"passage"``,
                ...), put in front of each text as sentence-transformers does; ``""``: none; None: the model's
                default prompt, if it has one.
            truncate: ``"END"`` (a text over ``max_seq_length`` tokens loses its end, as sentence-transformers cuts
                it), ``"START"`` (loses its start) or ``"NONE"`` (``InvalidInputError``); None: the client's
                ``truncate`` setting, else the server's ``TRUNCATION``. Unlike that setting, part of the cache key.
            dimensions: keep the first ``dimensions`` components, renormalised (Matryoshka); how well they
                retrieve depends on the model's training. None: all.

        Returns:
            float32 array ``(n, dim)`` (dim 384 for all-MiniLM-L6-v2, or ``dimensions``), rows L2-normalised. An
            empty input gives ``(0, dim)`` without an inference request.

        Raises:
            ValueError: ``input_type``, ``truncate`` or ``dimensions`` out of range (before anything is sent).
            InvalidInputError: a text is not str/UTF-8 (raised before anything is sent), or the server rejected
                the input (the message names the limit and the value, e.g. an unknown prompt name).
            ServerUnavailableError: unreachable, not ready or overloaded after the retries.
            EmbeddingTimeoutError: an attempt took longer than ``timeout_s``.
            ServerError: the server failed on a valid request.
        """
        options = CallOptions(input_type, truncate)
        items = as_texts(texts)
        if dimensions is not None or not items:
            check_dimensions(dimensions, self.dim)
        if not items:
            return np.zeros((0, dimensions or self.dim), dtype=np.float32)
        self._own_process()  # a forked child counts this call on its own state, not on the parent's copy
        with self._idle:
            if self._closing:
                raise self._closed_error()
            self._calls += 1
        try:
            if self._coalescer is not None and options == CallOptions():  # the coalescer keys on the texts alone
                return shorten(self._coalescer.run(items, self._embed_chunks), dimensions)
            return shorten(self._embed_chunks(items, options), dimensions)
        except InvalidInputError as exc:  # the server's row counts within one request: name the caller's index
            raise at_call_index(exc, items) from exc.__cause__
        finally:
            self._warn_of_fallback()
            with self._idle:
                self._calls -= 1
                self._idle.notify_all()

    def similarity(self, a: str | bytes, b: str | bytes) -> float:
        """Cosine similarity of two texts, in [-1, 1] (dot product of their unit-norm embeddings)."""
        vectors = self.embed([a, b])
        return float(np.dot(vectors[0], vectors[1]))

    def _embed_chunks(self, items: list[str], options: CallOptions | None = None) -> Embeddings:
        chunks, dim = self._run(self._chunked(items))
        if len(chunks) == 1:
            return self._run(self._infer(chunks[0], dim, False, options))
        return np.concatenate(
            list(self._threads().map(lambda c: self._run(self._infer(c, dim, True, options)), chunks))
        )

    # -- reranking ----------------------------------------------------------------------------------------------------
    def rerank(
        self,
        query: str | bytes,
        documents: TextsLike,
        *,
        top_n: int | None = None,
        truncate: str | None = None,
    ) -> list[Ranked]:
        """Score ``documents`` against ``query`` with a reranker, highest score first.

        The reranker: a cross-encoder ``make model`` exported, whose ensemble the client's ``model`` names.

        Args:
            query: the query, str or UTF-8 bytes.
            documents: as :meth:`embed`'s ``texts``; lists longer than :attr:`max_batch_size` pairs are sent as
                several requests, up to ``max_concurrency`` at once.
            top_n: answer the best ``top_n`` only; None: all.
            truncate: ``"END"`` (a pair over the model's ``max_seq_length`` tokens loses tokens from the end of its
                longer text, as ``CrossEncoder`` truncates), ``"START"`` or ``"NONE"`` (``InvalidInputError``); None:
                the server's ``TRUNCATION``.

        Returns:
            :class:`Ranked` (``index``, ``score`` as ``CrossEncoder.predict`` computes it, ``document``) per
            document, highest score first; empty for no documents, without a request.

        Raises:
            ValueError: ``top_n`` or ``truncate`` out of range (before anything is sent).
            InvalidInputError: a text is not str/UTF-8, the model is not a reranker, or the server rejected a pair.
            ServerUnavailableError, EmbeddingTimeoutError, ServerError: as :meth:`embed`.
        """
        text, items = rerank_arguments(query, documents, top_n, truncate)
        if not items:
            return []
        self._own_process()
        self._check_open()
        pieces = self._run(self._pair_chunks(items))
        if len(pieces) == 1:
            scores = self._run(self._score(text, pieces[0], False, truncate))
        else:
            parts = self._threads().map(lambda piece: self._run(self._score(text, piece, True, truncate)), pieces)
            scores = np.concatenate(list(parts))
        return ranked(items, scores, top_n)

    def _threads(self) -> ThreadPoolExecutor:
        """The pool the chunks of one call run on, ``max_concurrency`` threads, made at first use."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.settings.max_concurrency, thread_name_prefix="triton-embed")
            return self._executor

    # -- health and statistics ----------------------------------------------------------------------------------------
    def health(self) -> Health:
        """Server liveness/readiness and this model's readiness; an unreachable server gives all False.

        So does a server that is not Triton's HTTP or gRPC endpoint (e.g. its metrics port, which answers 200 to
        ``/v2/health/ready``): ``error`` says why. With several endpoints, each is asked in turn: a flag is True if
        it is for any of them, ``error`` names each one whose model is not ready (and why), and what each says
        marks it up or down for the requests that follow.

        Raises:
            EmbeddingError: the client is closed (a closed client cannot tell; it is not the server's state).
        """
        return self._run(self._health())

    def server_stats(self, models: tuple[str, ...] | None = None) -> list[server_stats.StepStats]:
        """Per-step counters and mean queue/compute times from Triton's statistics API (since server start).

        ``models``: the Triton models to ask (default: the client's model's ensemble and steps, ``server_stats.steps``).

        With several endpoints, their counters added up.

        Raises:
            EmbeddingError: an endpoint could not be asked (the message names it), or the client is closed.
        """
        return self._run(self._server_stats(models or server_stats.steps(self.model)))

    # -- lifecycle ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight requests, unregister shared memory, close connections. Idempotent.

        Calls in other threads finish first (at most each attempt's ``timeout_s`` and its retries); later calls
        raise ``EmbeddingError`` (the client is closed).
        """
        if self._closed:
            return
        with self._idle:
            self._closing = True
            self._idle.wait_for(lambda: self._calls == 0, timeout=self._longest_call_s())
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if os.getpid() == self._pid:  # a forked child leaves the parent's regions to the parent
            self._run(self._close_shared_memory())
        self._closed = True
        for client in self._connections:
            client.close()
        self._connections.clear()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
