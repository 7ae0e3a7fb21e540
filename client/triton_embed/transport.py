"""What the sync and asyncio clients share: settings, request building, decoding, retries, counters."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import warnings
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import serialize_byte_tensor

from triton_embed.errors import EmbeddingError, ServerUnavailableError
from triton_embed.inputs import Embeddings
from triton_embed.shm import Region, ShmPool, output_offset

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
"""This package's folder: warnings point at the first frame outside it."""

DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}
URL_ENV = "TRITON_EMBED_URL"
PROTOCOL_ENV = "TRITON_EMBED_PROTOCOL"
INPUT = "TEXT"
OUTPUT = "EMBEDDING"
MAX_BACKOFF_S = 2.0
DEFAULT_BACKOFF_S = 0.1
"""First wait before a retry, seconds (``backoff_s``); it doubles per attempt up to :data:`MAX_BACKOFF_S`."""


def normalise_url(url: str) -> str:
    """Return ``url`` as the ``host:port`` tritonclient wants.

    Drops a scheme (``http://``, ``grpc://``) and a trailing ``/``; a bare ``:port`` means ``127.0.0.1:port``.

    Raises:
        ValueError: no port, e.g. ``"localhost"``.
    """
    host_port = url.strip().split("://", 1)[-1].rstrip("/")
    if host_port.startswith(":"):
        host_port = "127.0.0.1" + host_port
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"url must be host:port (e.g. 127.0.0.1:8001); got {url!r}")
    return host_port


def url_protocol(url: str) -> str | None:
    """The protocol a url's scheme names: ``"http"`` for ``http://``, ``"grpc"`` for ``grpc://``, None without one.

    Raises:
        ValueError: another scheme (``https://``: TLS is not supported by this client).
    """
    scheme, sep, _ = url.strip().partition("://")
    if not sep:
        return None
    if scheme.lower() not in ("http", "grpc"):
        raise ValueError(f"url scheme must be http:// or grpc:// (or none); got {url!r}")
    return scheme.lower()


MAX_BUDGET_MS = 3_600_000.0
"""The longest ``latency_budget_ms`` the server accepts, ms (python_backends/torchscript/overload.py)."""


@dataclass(frozen=True)
class Settings:
    """Client settings; see :class:`triton_embed.EmbeddingClient` for their meaning."""

    url: str
    protocol: str
    model: str
    timeout_s: float
    retries: int
    backoff_s: float
    binary: bool
    use_shared_memory: bool
    coalesce: bool
    max_concurrency: int
    headers: dict[str, str] | None
    latency_budget_ms: float | None = None
    truncate: bool | None = None

    @classmethod
    def make(cls, *, url: str | None, protocol: str | None, **kwargs: Any) -> Settings:
        """Fill ``url``/``protocol`` from ``TRITON_EMBED_URL``/``TRITON_EMBED_PROTOCOL`` or the defaults.

        Raises:
            ValueError: unknown protocol, a url that is not host:port, or retries/timeout/concurrency/latency budget
                out of range.
        """
        url_given = bool(url)
        url = url or os.environ.get(URL_ENV)
        scheme = url_protocol(url) if url else None
        if protocol and scheme and protocol.lower() != scheme:
            raise ValueError(f"protocol {protocol!r} contradicts the url's scheme: {url!r}")
        from_env = os.environ.get(PROTOCOL_ENV)
        # a url passed in picks its protocol over the environment's; two environment settings must agree
        if not protocol and not url_given and scheme and from_env and from_env.lower() != scheme:
            raise ValueError(f"${PROTOCOL_ENV}={from_env!r} contradicts the url's scheme: {url!r}")
        protocol = (protocol or scheme or from_env or "grpc").lower()
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be 'grpc' or 'http'; got {protocol!r}")
        url = normalise_url(url or DEFAULT_URLS[protocol])
        settings = cls(url=url, protocol=protocol, **kwargs)
        budget = settings.latency_budget_ms
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 <= budget <= MAX_BUDGET_MS
        ):
            raise ValueError(
                f"latency_budget_ms must be a number of ms from 0 to {MAX_BUDGET_MS:.0f} (0 = never refused); "
                f"got {budget!r}"
            )
        if not isinstance(settings.binary, bool):
            raise ValueError(f"binary must be True or False; got {settings.binary!r}")
        headers = settings.headers
        strings = isinstance(headers, dict) and all(isinstance(x, str) for kv in headers.items() for x in kv)
        if headers is not None and not strings:
            raise ValueError(f"headers must be a dict of str to str; got {headers!r}")
        if settings.truncate is not None and not isinstance(settings.truncate, bool):
            raise ValueError(f"truncate must be True, False or None; got {settings.truncate!r}")
        if settings.timeout_s <= 0 or settings.retries < 0 or settings.max_concurrency < 1 or settings.backoff_s < 0:
            raise ValueError(
                f"need timeout_s > 0, retries >= 0, max_concurrency >= 1, backoff_s >= 0; got {settings.timeout_s}, "
                f"{settings.retries}, {settings.max_concurrency}, {settings.backoff_s}"
            )
        return replace(settings, headers=copied(headers))  # the caller's dict stays the caller's


@dataclass
class ClientStats:
    """Client-side counters since the client was made.

    Attributes:
        requests: inference requests answered (a long list is several requests).
        texts: texts embedded by the server (after coalescing).
        retries: attempts repeated after an unavailable/connection error.
        errors: requests that failed after their retries.
        bytes_sent, bytes_received: HTTP body bytes of inference requests/responses (headers excluded; the
            response size is rebuilt from the parsed response, so within a few bytes); 0 on gRPC.
        shared_memory_regions: regions registered with the server now.
    """

    requests: int = 0
    texts: int = 0
    retries: int = 0
    errors: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    shared_memory_regions: int = 0


class Counters:
    """Thread-safe :class:`ClientStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = ClientStats()

    def add(self, **deltas: int) -> None:
        """Add to counters by name."""
        with self._lock:
            for name, value in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def snapshot(self, regions: int) -> ClientStats:
        """A copy, with the current number of shared memory regions."""
        with self._lock:
            return ClientStats(**{**self._stats.__dict__, "shared_memory_regions": regions})


def backoff(attempt: int, base_s: float) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): exponential, capped at 2 s, with 0-25% jitter."""
    return min(MAX_BACKOFF_S, base_s * 2.0**attempt) * (1 + random.random() / 4)  # noqa: S311 - jitter only


def retryable(error: EmbeddingError) -> bool:
    """Only unavailable/overloaded/connection errors are retried; bad input and timeouts never are."""
    return isinstance(error, ServerUnavailableError)


def text_tensor(texts: list[str]) -> npt.NDArray[np.object_]:
    """``[N, 1]`` object array of UTF-8 bytes: the layout of the ensemble's ``TEXT`` input."""
    return np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)


def serialized_bytes(texts: list[str]) -> int:
    """Size of the serialized ``TEXT`` tensor: a 4-byte length before each UTF-8 string (Triton's BYTES layout)."""
    return sum(4 + len(t.encode("utf-8")) for t in texts)


class RequestBuilder:
    """Builds ``infer`` arguments for one protocol, with or without shared memory, and reads the answer."""

    def __init__(self, settings: Settings, module: ModuleType) -> None:
        """``module`` is ``tritonclient.grpc`` or ``tritonclient.http`` (their aio variants share the classes)."""
        self.settings = settings
        self.module = module
        self.http = settings.protocol == "http"

    def infer_kwargs(self, bulk: bool = False) -> dict[str, Any]:
        """Keyword arguments for tritonclient's ``infer``.

        The request parameter ``latency_budget_ms`` (how long this request may wait in the encoder's queue
        before the encoder refuses it, ms): the client's setting when it has one; else ``0`` (never
        refused) for a ``bulk`` request, one chunk of a call split into several; else none (the server's
        ``LATENCY_BUDGET_MS``, 180 ms as shipped); and the request parameter ``truncate`` when set. The chunks of
        one call queue behind each other by the call's own making, so the later ones cannot meet a per-request
        budget even on an idle server: 200 short STS-B sentences are ~450 ms of encoder work on 2 CPU cores.
        """
        kwargs: dict[str, Any] = {}  # the gRPC deadline is every call's: the clients' ``_call`` adds it
        budget = self.settings.latency_budget_ms
        if budget is None and bulk:
            budget = 0
        parameters: dict[str, float | bool] = {} if budget is None else {"latency_budget_ms": budget}
        if self.settings.truncate is not None:
            parameters["truncate"] = self.settings.truncate
        if parameters:
            kwargs["parameters"] = parameters
        return kwargs

    def build(self, texts: list[str], dim: int, region: Region | None = None) -> tuple[list[Any], list[Any], int]:
        """Return ``(inputs, outputs, sent_bytes)``; with ``region`` the tensors travel through shared memory."""
        data = text_tensor(texts)
        tensor = self.module.InferInput(INPUT, list(data.shape), "BYTES")
        output = (
            self.module.InferRequestedOutput(OUTPUT, binary_data=self.settings.binary)
            if self.http
            else self.module.InferRequestedOutput(OUTPUT)
        )
        if region is not None:
            serialized = serialize_byte_tensor(data)
            in_bytes = len(serialized.item())
            shm.set_shared_memory_region(region.handle, [serialized])
            tensor.set_shared_memory(region.name, in_bytes)
            output.set_shared_memory(region.name, len(texts) * dim * 4, offset=output_offset(in_bytes))
        elif self.http:
            tensor.set_data_from_numpy(data, binary_data=self.settings.binary)
        else:
            tensor.set_data_from_numpy(data)
        sent = 0
        if self.http:
            body, _ = self.module.InferenceServerClient.generate_request_body([tensor], outputs=[output])
            sent = len(body)
        return [tensor], [output], sent

    @staticmethod
    def region_bytes(texts: list[str], dim: int) -> int:
        """Bytes a shared memory region needs for these texts and their embeddings."""
        return output_offset(serialized_bytes(texts)) + len(texts) * dim * 4

    def read(self, result: Any, texts: list[str], dim: int, region: Region | None = None) -> tuple[Embeddings, int]:
        """Return ``((len(texts), dim) float32, received_bytes)`` from an ``InferResult``.

        Raises:
            EmbeddingError: the server answered with another row count.
        """
        n = len(texts)
        if region is not None:
            offset = output_offset(serialized_bytes(texts))
            array = np.array(shm.get_contents_as_numpy(region.handle, np.float32, [n, dim], offset=offset))
        else:
            array = result.as_numpy(OUTPUT)
        if array is None or array.shape != (n, dim):
            got = None if array is None else list(array.shape)
            raise EmbeddingError(f"model '{self.settings.model}' returned {got} for {n} texts; expected [{n}, {dim}]")
        received = 0
        if self.http:
            header = len(json.dumps(result.get_response(), separators=(",", ":")))
            received = header + (array.nbytes if self.settings.binary and region is None else 0)
        return array.astype(np.float32, copy=False), received


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


def max_batch_and_dim(config: dict[str, Any]) -> tuple[int, int]:
    """``(max_batch_size, embedding width)`` from a model config in JSON form."""
    output = next(o for o in config["output"] if o["name"] == OUTPUT)
    return int(config.get("max_batch_size", 1)) or 1, int(output["dims"][-1])


__all__ = ["ClientStats", "Settings", "ShmPool"]


def copied(headers: dict[str, str] | None) -> dict[str, str] | None:
    """A fresh copy of ``headers`` for one call.

    tritonclient's HTTP client adds ``Inference-Header-Content-Length`` to the dict it is given, which then
    poisoned the next JSON or shared-memory request made with the same dict.
    """
    return dict(headers) if headers else None
