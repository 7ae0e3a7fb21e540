"""What the sync and asyncio clients have in common: constructor, settings, properties, counters."""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from triton_embed.errors import EmbeddingError
from triton_embed.shm import Region, ShmPool
from triton_embed.transport import (
    DEFAULT_BACKOFF_S,
    ClientStats,
    Counters,
    RequestBuilder,
    Settings,
    disable_shared_memory_warning,
)


class ClientBase:
    """Settings and state shared by the sync and the asyncio client; not used directly."""

    def __init__(
        self,
        *,
        url: str | None = None,
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
                ``:8000`` means 127.0.0.1. Default: ``$TRITON_EMBED_URL``, else ``127.0.0.1:8001`` (gRPC) /
                ``127.0.0.1:8000`` (HTTP).
            protocol: ``grpc`` or ``http``. Default: the url's scheme, else ``$TRITON_EMBED_PROTOCOL``, else ``grpc``.
            model: the ensemble's name.
            timeout_s: limit for one request attempt, seconds (gRPC deadline; HTTP connect and network timeout).
            retries: extra attempts after an unavailable/overloaded/connection error (never after bad input or a
                timeout), waiting ``backoff_s * 2**k`` (capped at 2 s, plus up to 25% jitter) before attempt k+1.
            backoff_s: first wait between attempts, seconds.
            binary: HTTP only: binary tensor data (default) instead of JSON, ~4x fewer bytes per embedding.
            use_shared_memory: send texts and receive embeddings through system shared memory (same host only);
                falls back to the network with a ``RuntimeWarning`` when the server cannot register the regions.
            coalesce: send each distinct text in flight once; concurrent callers asking for it wait for that row.
            max_concurrency: chunks of one long list sent at the same time.
            headers: extra HTTP headers / gRPC metadata on every call (e.g. a restricted-API key); copied, so
                the caller's dict is never changed and may be shared between clients.
            latency_budget_ms: sent as the request parameter ``latency_budget_ms``: how long this request may wait
                in the encoder's queue before the server refuses it as overloaded (ms; 0 = never refused, for bulk
                jobs that prefer slow to rejected; fractions allowed). None = the server's
                ``LATENCY_BUDGET_MS`` (180 ms as shipped).
            truncate: sent as the request parameter ``truncate``: False makes a text over ``max_seq_length`` tokens
                (256 for all-MiniLM-L6-v2) an ``InvalidInputError`` instead of being cut as sentence-transformers
                cuts it; None = the server's ``TRUNCATION`` (truncate as shipped). The response cache keys on the
                texts only: a text already served truncated is answered from the cache whatever this says.

        Raises:
            ValueError: unknown protocol, a url that is not ``host:port``, a url scheme that contradicts
                ``protocol`` (or ``$TRITON_EMBED_PROTOCOL``, when both come from the environment), ``truncate``
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
        """``host:port`` this client talks to."""
        return self.settings.url

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

        The caller then closes ``pool`` (blocking for the sync client, in a thread for the asyncio one).
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

    def _closed_error(self) -> EmbeddingError:
        return EmbeddingError(f"client for model '{self.model}' at {self.url} is closed")

    def _check_open(self) -> None:
        """Raise ``EmbeddingError`` (the client is closed) once ``close()`` has begun."""
        if self._closing:
            raise self._closed_error()
