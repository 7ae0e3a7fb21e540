"""asyncio embedding client on tritonclient's ``grpc.aio`` / ``http.aio``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import weakref
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any, ParamSpec, TypeVar

import numpy as np

from triton_embed import server_stats
from triton_embed.base import ClientBase
from triton_embed.client import Health, close_pool_at_exit
from triton_embed.coalesce import AsyncCoalescer
from triton_embed.errors import EmbeddingError, InvalidInputError, at_call_index, from_triton, note_request_row
from triton_embed.inputs import Embeddings, TextsLike, as_texts
from triton_embed.shm import Region, ShmPool, region_in_use, release_pauses
from triton_embed.transport import (
    backoff,
    copied,
    max_batch_and_dim,
    retryable,
)

P = ParamSpec("P")
T = TypeVar("T")


class AsyncEmbeddingClient(ClientBase):
    """The asyncio twin of :class:`triton_embed.EmbeddingClient`; same arguments, awaitable methods.

    Example::

        async with AsyncEmbeddingClient(url="127.0.0.1:8001") as client:
            vectors = await client.embed(["A man plays a guitar."])  # (1, 384) float32

    One client may be shared by any number of tasks of ONE event loop (its connection belongs to the loop that
    made the first call); their requests are not limited here, as with the sync client's threads. Chunks of one
    long list are sent concurrently, ``max_concurrency`` at a time.
    """

    def _protocol_module(self, protocol: str) -> ModuleType:
        return importlib.import_module(f"tritonclient.{protocol}.aio")

    def _setup(self) -> None:
        self._coalescer = AsyncCoalescer() if self.settings.coalesce else None
        self._shm = ShmPool() if self.settings.use_shared_memory else None
        self._client: Any = None  # tritonclient's aio InferenceServerClient, made on the first call
        self._calls = 0  # embed() calls in progress, which close() waits for
        self._closing = False
        if self._shm is not None:  # a client never closed still unregisters and frees its regions at exit
            self._finalizer = weakref.finalize(
                self, close_pool_at_exit, self._shm, self.settings.protocol, self.url, self.settings.headers
            )

    def _conn(self) -> Any:
        if self._closed:
            raise self._closed_error()
        if self._client is None:
            if self.settings.protocol == "grpc":
                self._client = self._module.InferenceServerClient(self.url)
            else:
                t = self.settings.timeout_s
                self._client = self._module.InferenceServerClient(self.url, conn_timeout=t)
        return self._client

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Await a tritonclient method; map its errors to ours (over gRPC with ``timeout_s`` as the deadline)."""
        if self.settings.protocol == "grpc":
            kwargs.setdefault("client_timeout", self.settings.timeout_s)
        try:
            return await getattr(self._conn(), method)(*args, headers=copied(self.settings.headers), **kwargs)
        except EmbeddingError:
            raise
        except Exception as exc:
            raise from_triton(exc, model=self.model, url=self.url) from exc

    async def _model_config(self) -> dict[str, Any]:
        if self._config is None:
            if self.settings.protocol == "grpc":
                config: dict[str, Any] = (
                    await self._retrying(self._call, "get_model_config", self.model, as_json=True)
                )["config"]
            else:
                config = await self._retrying(self._call, "get_model_config", self.model)
            self._config = config
        return self._config

    async def embed(self, texts: TextsLike) -> Embeddings:
        """Embed texts; row ``i`` belongs to text ``i``. Same inputs, result and errors as the sync client.

        Returns:
            float32 ``(n, dim)``, rows L2-normalised; ``(0, dim)`` for no texts, without an inference request.
        """
        items = as_texts(texts)
        if not items:
            return np.zeros((0, max_batch_and_dim(await self._model_config())[1]), dtype=np.float32)
        if self._closing:
            raise self._closed_error()
        self._calls += 1
        try:
            if self._coalescer is not None:
                return await self._coalescer.run(items, self._embed_chunks)
            return await self._embed_chunks(items)
        except InvalidInputError as exc:  # the server's row counts within one request: name the caller's index
            raise at_call_index(exc, items) from exc.__cause__
        finally:
            self._warn_of_fallback()
            self._calls -= 1

    async def similarity(self, a: str | bytes, b: str | bytes) -> float:
        """Cosine similarity of two texts, in [-1, 1]."""
        vectors = await self.embed([a, b])
        return float(np.dot(vectors[0], vectors[1]))

    async def _embed_chunks(self, items: list[str]) -> Embeddings:
        step, dim = max_batch_and_dim(await self._model_config())
        chunks = [items[i : i + step] for i in range(0, len(items), step)]
        if len(chunks) == 1:
            return await self._retrying(self._infer_once, chunks[0], dim)
        limit = asyncio.Semaphore(self.settings.max_concurrency)  # this list's chunks only

        async def chunk(texts: list[str]) -> Embeddings:
            async with limit:
                return await self._retrying(self._infer_once, texts, dim, True)

        return np.concatenate(await asyncio.gather(*(chunk(c) for c in chunks)))

    async def _retrying(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """``await fn(*args, **kwargs)``, repeated after retryable errors (see ``retries`` and ``backoff_s``)."""
        for attempt in range(self.settings.retries + 1):
            try:
                return await fn(*args, **kwargs)
            except EmbeddingError as exc:
                if not retryable(exc) or attempt == self.settings.retries:
                    self._counters.add(errors=1)
                    raise
                self._counters.add(retries=1)
                await asyncio.sleep(backoff(attempt, self.settings.backoff_s))
        raise AssertionError("unreachable")

    async def _infer_once(self, texts: list[str], dim: int, bulk: bool = False) -> Embeddings:
        pool, region = await self._acquire_region(texts, dim)
        try:
            inputs, outputs, sent = self._builder.build(texts, dim, region)
            call = self._call("infer", self.model, inputs, outputs=outputs, **self._builder.infer_kwargs(bulk))
            try:
                result = await asyncio.wait_for(call, timeout=self.settings.timeout_s + 1)
            except InvalidInputError as exc:
                note_request_row(exc, texts)
                raise
            array, received = self._builder.read(result, texts, dim, region)
            array = array.copy() if region is not None else array
        except TimeoutError as exc:
            raise from_triton(exc, model=self.model, url=self.url) from exc
        finally:
            if pool is not None and region is not None:
                pool.release(region)
        self._counters.add(requests=1, texts=len(texts), bytes_sent=sent, bytes_received=received)
        return array

    async def _acquire_region(self, texts: list[str], dim: int) -> tuple[ShmPool | None, Region | None]:
        """``(pool, registered region)`` for this request, or ``(None, None)`` (shared memory off or given up)."""
        pool, region = self._take_region(texts, dim)
        if pool is None or region is None or region.registered:
            return pool, region
        try:
            await self._call("register_system_shared_memory", region.name, region.key, region.byte_size)
        except EmbeddingError as exc:
            self._give_up_shared_memory(pool, region, exc)
            await asyncio.to_thread(pool.close, lambda name: None, 5.0)
            return None, None
        region.registered = True
        return pool, region

    async def health(self) -> Health:
        """Server liveness/readiness and this model's readiness; an unreachable server gives all False.

        So does a server that is not Triton's HTTP or gRPC endpoint (e.g. its metrics port, which answers 200 to
        ``/v2/health/ready``): ``error`` says why.

        Raises:
            EmbeddingError: the client is closed (a closed client cannot tell; it is not the server's state).
        """
        self._check_open()
        try:
            # Triton's metrics port answers 200 to any path, with an empty body: the metadata tells them apart
            await self._call("get_server_metadata")
            return Health(
                live=bool(await self._call("is_server_live")),
                ready=bool(await self._call("is_server_ready")),
                model_ready=bool(await self._call("is_model_ready", self.model)),
            )
        except EmbeddingError as exc:
            return Health(False, False, False, error=str(exc))

    async def server_stats(self, models: tuple[str, ...] = server_stats.STEPS) -> list[server_stats.StepStats]:
        """Per-step counters and mean queue/compute times from Triton's statistics API."""
        self._check_open()
        rows = []
        for name in models:
            if self.settings.protocol == "grpc":
                raw = await self._call("get_inference_statistics", name, as_json=True)
            else:
                raw = await self._call("get_inference_statistics", name)
            rows.append(server_stats.parse(raw["model_stats"][0]))
        return rows

    async def close(self) -> None:
        """Wait for in-flight calls, unregister shared memory, close the connection. Idempotent.

        Calls in other tasks finish first (at most each attempt's ``timeout_s`` and its retries).
        """
        if self._closed:
            return
        self._closing = True
        deadline = asyncio.get_running_loop().time() + self._longest_call_s()
        while self._calls and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self._shm is not None:
            names: list[str] = []
            await asyncio.to_thread(self._shm.close, names.append)
            for name in names:
                with contextlib.suppress(EmbeddingError):  # the server may be gone; local regions are freed anyway
                    await self._unregister_when_released(name)
        self._closed = True
        if self._client is not None:
            await self._client.close()

    async def _unregister_when_released(self, name: str) -> None:
        """Unregister region ``name``, tried again while the server still holds it (see ``shm.region_in_use``).

        Raises:
            EmbeddingError: any other refusal, or the server still held the region after ``shm.RELEASE_WAIT_S``.
        """
        for pause in (*release_pauses(), None):
            try:
                await self._call("unregister_system_shared_memory", name)
                return
            except EmbeddingError as exc:
                if pause is None or not region_in_use(exc):
                    raise
            await asyncio.sleep(pause)

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
