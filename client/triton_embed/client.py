"""Synchronous embedding client over Triton's gRPC or HTTP protocol."""

from __future__ import annotations

import importlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ParamSpec, TypeVar

import numpy as np

from triton_embed import server_stats
from triton_embed.base import ClientBase
from triton_embed.coalesce import Coalescer
from triton_embed.errors import EmbeddingError, InvalidInputError, at_call_index, from_triton, note_request_row
from triton_embed.inputs import Embeddings, TextsLike, as_texts
from triton_embed.shm import Region, ShmPool
from triton_embed.transport import (
    backoff,
    copied,
    max_batch_and_dim,
    normalise_url,
    retryable,
)

__all__ = ["EmbeddingClient", "Health", "normalise_url"]

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Health:
    """``live``: the server answers; ``ready``: all its models loaded; ``model_ready``: this client's model.

    ``error``: why the server could not be asked ("" when it answered), e.g. the wrong port for the protocol.
    """

    live: bool
    ready: bool
    model_ready: bool
    error: str = ""


def _protocol_module(protocol: str) -> ModuleType:
    """``tritonclient.grpc`` or ``tritonclient.http``, imported on first use."""
    return importlib.import_module(f"tritonclient.{protocol}")


def close_pool_at_exit(pool: ShmPool, protocol: str, url: str, headers: dict[str, str] | None) -> None:
    """Interpreter-exit cleanup of a client (sync or asyncio) that was never closed.

    Unregisters its regions with the client's headers (the shared-memory API is behind the admin header) and
    destroys them.
    """
    if pool.closed:
        return
    client = _protocol_module(protocol).InferenceServerClient(url)
    try:
        pool.close(lambda name: client.unregister_system_shared_memory(name, headers=copied(headers)), timeout_s=5.0)
    finally:
        client.close()


class EmbeddingClient(ClientBase):
    """Embed texts with the triton-embed ``embed`` ensemble, from one thread or many.

    Example::

        with EmbeddingClient(url="127.0.0.1:8001") as client:
            vectors = client.embed(["A man plays a guitar.", "Someone plays music."])  # (2, 384) float32

    Thread safety: one client may be shared by any number of threads. gRPC uses one channel; HTTP one
    connection per thread (tritonclient's HTTP client is not thread-safe). After ``os.fork()`` the child's first
    call opens its own connections (and shared memory regions); the parent's are left to the parent.
    """

    def _protocol_module(self, protocol: str) -> ModuleType:
        return _protocol_module(protocol)

    def _setup(self) -> None:
        self._coalescer = Coalescer() if self.settings.coalesce else None
        self._lock = threading.Lock()
        self._reset_for_process()

    def _reset_for_process(self) -> None:
        """Per-process state: connections, worker pool, shared memory (fresh in a forked child)."""
        self._pid = os.getpid()
        self._local = threading.local()
        self._connections: list[Any] = []  # tritonclient's InferenceServerClient, one per thread
        self._executor: ThreadPoolExecutor | None = None
        self._calls = 0  # embed() calls in progress, which close() waits for
        self._closing = False
        self._idle = threading.Condition()
        self._shm: ShmPool | None = None
        if self.settings.use_shared_memory:
            self._shm = ShmPool()
            self._finalizer = weakref.finalize(
                self, close_pool_at_exit, self._shm, self.settings.protocol, self.url, self.settings.headers
            )

    # -- public properties --------------------------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        """Most texts one request may carry (the model's ``max_batch_size``, read once from the server)."""
        return max_batch_and_dim(self._model_config())[0]

    @property
    def dim(self) -> int:
        """Embedding width (the model's ``EMBEDDING`` dims, read once from the server), e.g. 384."""
        return max_batch_and_dim(self._model_config())[1]

    # -- connections ------------------------------------------------------------------------------------------
    def _conn(self) -> Any:
        if self._closed:
            raise self._closed_error()
        if os.getpid() != self._pid:
            if self.protocol == "http":
                import gevent  # tritonclient.http runs on geventhttpclient: its event loop must be rebuilt

                gevent.reinit()
            self._reset_for_process()
        client = getattr(self._local, "client", None)
        if client is None:
            if self.protocol == "grpc":
                client = self._module.InferenceServerClient(self.url)
            else:
                t = self.settings.timeout_s
                client = self._module.InferenceServerClient(self.url, connection_timeout=t, network_timeout=t)
            self._local.client = client
            with self._lock:
                self._connections.append(client)
        return client

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a tritonclient method; map its errors to ours.

        Over gRPC every call gets ``timeout_s`` as its deadline: without one, a config fetch or a health check
        against a port that accepts connections but never answers waited ~20 s for gRPC's handshake, whatever
        ``timeout_s`` said; HTTP's connection has the timeout already.
        """
        if self.protocol == "grpc":
            kwargs.setdefault("client_timeout", self.settings.timeout_s)
        try:
            return getattr(self._conn(), method)(*args, headers=copied(self.settings.headers), **kwargs)
        except EmbeddingError:
            raise
        except Exception as exc:
            raise from_triton(exc, model=self.model, url=self.url) from exc

    def _model_config(self) -> dict[str, Any]:
        if self._config is None:
            if self.protocol == "grpc":
                config: dict[str, Any] = self._retrying(self._call, "get_model_config", self.model, as_json=True)[
                    "config"
                ]
            else:
                config = self._retrying(self._call, "get_model_config", self.model)
            self._config = config
        return self._config

    # -- embedding --------------------------------------------------------------------------------------------
    def embed(self, texts: TextsLike) -> Embeddings:
        """Embed texts; row ``i`` belongs to text ``i``.

        Args:
            texts: a str, bytes, a list/tuple/generator of str or UTF-8 bytes, or a NumPy array of ``<U``, ``|S``
                or object dtype, shape ``(n,)`` or ``(n, 1)``. Lists longer than :attr:`max_batch_size` are sent
                as several requests, up to ``max_concurrency`` at once, and reassembled in order.

        Returns:
            float32 array ``(n, dim)`` (dim 384 for all-MiniLM-L6-v2), rows L2-normalised. An empty input gives
            ``(0, dim)`` without an inference request.

        Raises:
            InvalidInputError: a text is not str/UTF-8 (raised before anything is sent), or the server rejected
                the input (the message names the limit and the value).
            ServerUnavailableError: unreachable, not ready or overloaded after the retries.
            EmbeddingTimeoutError: an attempt took longer than ``timeout_s``.
            ServerError: the server failed on a valid request.
        """
        items = as_texts(texts)
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._idle:
            if self._closing:
                raise self._closed_error()
            self._calls += 1
        try:
            if self._coalescer is not None:
                return self._coalescer.run(items, self._embed_chunks)
            return self._embed_chunks(items)
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

    def _embed_chunks(self, items: list[str]) -> Embeddings:
        step, dim = max_batch_and_dim(self._model_config())
        chunks = [items[i : i + step] for i in range(0, len(items), step)]
        if len(chunks) == 1:
            return self._infer_with_retries(chunks[0], dim)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.settings.max_concurrency, thread_name_prefix="triton-embed")
            executor = self._executor
        return np.concatenate(list(executor.map(lambda c: self._infer_with_retries(c, dim, True), chunks)))

    def _infer_with_retries(self, texts: list[str], dim: int, bulk: bool = False) -> Embeddings:
        return self._retrying(self._infer_once, texts, dim, bulk)

    def _retrying(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)``, repeated after retryable errors (see ``retries`` and ``backoff_s``)."""
        for attempt in range(self.settings.retries + 1):
            try:
                return fn(*args, **kwargs)
            except EmbeddingError as exc:
                if not retryable(exc) or attempt == self.settings.retries:
                    self._counters.add(errors=1)
                    raise
                self._counters.add(retries=1)
                time.sleep(backoff(attempt, self.settings.backoff_s))
        raise AssertionError("unreachable")

    def _infer_once(self, texts: list[str], dim: int, bulk: bool = False) -> Embeddings:
        client = self._conn()
        pool, region = self._acquire_region(client, texts, dim)
        try:
            inputs, outputs, sent = self._builder.build(texts, dim, region)
            try:
                result = self._call("infer", self.model, inputs, outputs=outputs, **self._builder.infer_kwargs(bulk))
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

    def _acquire_region(self, client: Any, texts: list[str], dim: int) -> tuple[ShmPool | None, Region | None]:
        """``(pool, registered region)`` for this request, or ``(None, None)`` (shared memory off or given up)."""
        pool, region = self._take_region(texts, dim)
        if pool is None or region is None or region.registered:
            return pool, region
        try:
            client.register_system_shared_memory(
                region.name, region.key, region.byte_size, headers=copied(self.settings.headers)
            )
        except Exception as exc:  # noqa: BLE001 - any failure means: use the network instead
            self._give_up_shared_memory(pool, region, exc)
            pool.close(lambda name: None, timeout_s=5.0)
            return None, None
        region.registered = True
        return pool, region

    # -- health and statistics --------------------------------------------------------------------------------
    def health(self) -> Health:
        """Server liveness/readiness and this model's readiness; an unreachable server gives all False.

        So does a server that is not Triton's HTTP or gRPC endpoint (e.g. its metrics port, which answers 200 to
        ``/v2/health/ready``): ``error`` says why.

        Raises:
            EmbeddingError: the client is closed (a closed client cannot tell; it is not the server's state).
        """
        self._check_open()
        try:
            # Triton's metrics port answers 200 to any path, with an empty body: the metadata tells them apart
            self._call("get_server_metadata")
            return Health(
                live=bool(self._call("is_server_live")),
                ready=bool(self._call("is_server_ready")),
                model_ready=bool(self._call("is_model_ready", self.model)),
            )
        except EmbeddingError as exc:
            return Health(False, False, False, error=str(exc))

    def server_stats(self, models: tuple[str, ...] = server_stats.STEPS) -> list[server_stats.StepStats]:
        """Per-step counters and mean queue/compute times from Triton's statistics API (since server start)."""
        self._check_open()
        rows = []
        for name in models:
            if self.protocol == "grpc":
                raw = self._call("get_inference_statistics", name, as_json=True)
            else:
                raw = self._call("get_inference_statistics", name)
            rows.append(server_stats.parse(raw["model_stats"][0]))
        return rows

    # -- lifecycle --------------------------------------------------------------------------------------------
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
        if self._shm is not None and os.getpid() == self._pid:
            self._shm.close(
                lambda name: self._conn().unregister_system_shared_memory(name, headers=copied(self.settings.headers))
            )
            self._finalizer.detach()
        self._closed = True
        for client in self._connections:
            client.close()
        self._connections.clear()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
