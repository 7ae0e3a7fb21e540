"""asyncio embedding client on tritonclient's ``grpc.aio`` / ``http.aio``: the I/O of :mod:`triton_embed.core`."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections import Counter
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from triton_embed import server_stats
from triton_embed.coalesce import AsyncCoalescer
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
from triton_embed.inputs import Embeddings, Scores, TextsLike, as_texts
from triton_embed.request_builder import CallOptions

T = TypeVar("T")


def _closed_by_server() -> tuple[type[BaseException], ...]:
    """The error aiohttp (tritonclient's HTTP library) raises for a connection closed before any answer."""
    from aiohttp import ServerDisconnectedError  # noqa: PLC0415 - loaded only when HTTP is used

    return (ServerDisconnectedError,)


class AsyncEmbeddingClient(ClientCore):
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
        self._shm = self._open_shared_memory()
        self._clients: dict[str, Any] = {}  # tritonclient's aio InferenceServerClient per endpoint, made on first use
        self._in_flight: Counter[str] = Counter()  # calls in flight per endpoint
        self._version = self._pool.version  # of the endpoint list the connections were last checked against
        self._calls = 0  # embed() calls in progress, which close() waits for
        self._idle = asyncio.Event()  # set while no embed() call is in progress
        self._idle.set()

    # -- I/O ----------------------------------------------------------------------------------------------------------
    def _conn(self, endpoint: str) -> Any:
        if self._closed:
            raise self._closed_error()
        client = self._clients.get(endpoint)
        if client is None:
            if self.settings.protocol == "grpc":
                client = self._module.InferenceServerClient(endpoint, channel_args=grpc_channel_args())
            else:
                client = self._module.InferenceServerClient(endpoint, conn_timeout=self.settings.timeout_s)
            self._clients[endpoint] = client
        return client

    async def _close_departed(self) -> None:
        """Close the connections to endpoints that left the endpoint list (DNS) and have no call in flight."""
        if self._version == self._pool.version:
            return
        self._version, current = self._pool.version, set(self._pool.urls)
        departed = [self._clients.pop(u) for u in list(self._clients) if u not in current and not self._in_flight[u]]
        for client in departed:  # out of the dict first: no other task takes one of them while these awaits run
            await client.close()

    async def _run(self, steps: Steps[T]) -> T:
        """Run an operation of the core in this task: perform each step it yields, hand back what came of it."""
        step = advance(steps)
        while not isinstance(step, Done):
            value, error = None, None
            try:
                if isinstance(step, Call):
                    value = await self._perform(step)
                elif isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                else:
                    value = await asyncio.to_thread(step.fn, *step.args)
            except BaseException as exc:  # the operation decides (a cancellation runs its cleanup and goes on up)
                error = exc
            step = advance(steps, value, error)
        return step.value

    async def _perform(self, call: Call) -> Any:
        """Await the tritonclient method on the call's endpoint, within ``call.wait_s`` if any; map errors to ours.

        A resendable call whose kept-alive HTTP connection closed under it is sent once more: aiohttp takes another
        connection (it resends only GET, HEAD and the like itself).
        """
        endpoint = call.endpoint or self.urls[0]
        await self._close_departed()
        self._in_flight[endpoint] += 1
        try:
            for resend in (call.resendable and self.settings.protocol == "http", False):
                try:
                    pending = getattr(self._conn(endpoint), call.method)(*call.args, **call.kwargs)
                    return await (pending if call.wait_s is None else asyncio.wait_for(pending, call.wait_s))
                except EmbeddingError:
                    raise
                except Exception as exc:  # asyncio's TimeoutError from wait_for included
                    if not (resend and connection_cut(exc, _closed_by_server())):
                        raise from_triton(exc, model=self.model, url=endpoint) from exc
            raise AssertionError("unreachable")
        finally:
            self._in_flight[endpoint] -= 1

    # -- embedding ----------------------------------------------------------------------------------------------------
    async def embed(
        self,
        texts: TextsLike,
        *,
        input_type: str | None = None,
        truncate: str | None = None,
        dimensions: int | None = None,
    ) -> Embeddings:
        """Embed texts; row ``i`` belongs to text ``i``. Same inputs, options, result and errors as the sync client.

        Returns:
            float32 ``(n, dim)``, rows L2-normalised; ``(0, dim)`` for no texts, without an inference request.
        """
        options = CallOptions(input_type, truncate)
        items = as_texts(texts)
        if dimensions is not None or not items:
            width = max_batch_and_dim(await self._run(self._get_model_config()))[1]
            check_dimensions(dimensions, width)
            if not items:
                return np.zeros((0, dimensions or width), dtype=np.float32)
        if self._closing:
            raise self._closed_error()
        self._calls += 1
        self._idle.clear()
        try:
            if self._coalescer is not None and options == CallOptions():  # the coalescer keys on the texts alone
                return shorten(await self._coalescer.run(items, self._embed_chunks), dimensions)
            return shorten(await self._embed_chunks(items, options), dimensions)
        except InvalidInputError as exc:  # the server's row counts within one request: name the caller's index
            raise at_call_index(exc, items) from exc.__cause__
        finally:
            self._warn_of_fallback()
            self._calls -= 1
            if not self._calls:
                self._idle.set()

    async def similarity(self, a: str | bytes, b: str | bytes) -> float:
        """Cosine similarity of two texts, in [-1, 1]."""
        vectors = await self.embed([a, b])
        return float(np.dot(vectors[0], vectors[1]))

    async def _embed_chunks(self, items: list[str], options: CallOptions | None = None) -> Embeddings:
        chunks, dim = await self._run(self._chunked(items))
        if len(chunks) == 1:
            return await self._run(self._infer(chunks[0], dim, False, options))
        limit = asyncio.Semaphore(self.settings.max_concurrency)  # this list's chunks only

        async def chunk(texts: list[str]) -> Embeddings:
            async with limit:
                return await self._run(self._infer(texts, dim, True, options))

        return np.concatenate(await asyncio.gather(*(chunk(c) for c in chunks)))

    # -- reranking ----------------------------------------------------------------------------------------------------
    async def rerank(
        self,
        query: str | bytes,
        documents: TextsLike,
        *,
        top_n: int | None = None,
        truncate: str | None = None,
    ) -> list[Ranked]:
        """Score ``documents`` against ``query`` with a reranker, highest score first.

        Same inputs, options, result and errors as the sync client's :meth:`~triton_embed.EmbeddingClient.rerank`.
        """
        text, items = rerank_arguments(query, documents, top_n, truncate)
        if not items:
            return []
        self._check_open()
        pieces = await self._run(self._pair_chunks(items))
        if len(pieces) == 1:
            return ranked(items, await self._run(self._score(text, pieces[0], False, truncate)), top_n)
        limit = asyncio.Semaphore(self.settings.max_concurrency)

        async def piece(documents: list[str]) -> Scores:
            async with limit:
                return await self._run(self._score(text, documents, True, truncate))

        return ranked(items, np.concatenate(await asyncio.gather(*(piece(p) for p in pieces))), top_n)

    # -- health and statistics ----------------------------------------------------------------------------------------
    async def health(self) -> Health:
        """Server liveness/readiness and this model's readiness; an unreachable server gives all False.

        So does a server that is not Triton's HTTP or gRPC endpoint (e.g. its metrics port, which answers 200 to
        ``/v2/health/ready``): ``error`` says why. Several endpoints: as :meth:`EmbeddingClient.health`.

        Raises:
            EmbeddingError: the client is closed (a closed client cannot tell; it is not the server's state).
        """
        return await self._run(self._health())

    async def server_stats(self, models: tuple[str, ...] | None = None) -> list[server_stats.StepStats]:
        """Per-step counters and mean queue/compute times from Triton's statistics API; several endpoints added up.

        ``models``: the Triton models to ask (default: the client's model's ensemble and steps, ``server_stats.steps``).

        Raises:
            EmbeddingError: an endpoint could not be asked (the message names it), or the client is closed.
        """
        return await self._run(self._server_stats(models or server_stats.steps(self.model)))

    # -- lifecycle ----------------------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Wait for in-flight calls, unregister shared memory, close the connection. Idempotent.

        Calls in other tasks finish first (at most each attempt's ``timeout_s`` and its retries).
        """
        if self._closed:
            return
        self._closing = True
        with contextlib.suppress(TimeoutError):  # a call still running then is left to its own timeout
            await asyncio.wait_for(self._idle.wait(), self._longest_call_s())
        await self._run(self._close_shared_memory())
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()

    async def _unregister_when_released(self, name: str) -> None:
        """Unregister region ``name``, tried again while the server still holds it (see ``shm.region_in_use``).

        Raises:
            EmbeddingError: any other refusal, or the server still held the region after ``shm.RELEASE_WAIT_S``.
        """
        await self._run(self._unregister_region(name))

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
