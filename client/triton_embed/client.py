"""Synchronous embedding client over Triton's gRPC or HTTP (binary tensors) protocol."""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from triton_embed.errors import EmbeddingError, InvalidInputError, from_triton

DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}
URL_ENV = "TRITON_EMBED_URL"
PROTOCOL_ENV = "TRITON_EMBED_PROTOCOL"
INPUT = "TEXT"
OUTPUT = "EMBEDDING"


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


def _as_texts(texts: str | Iterable[str]) -> list[str]:
    """Turn a str or an iterable of str into a list; anything else raises InvalidInputError."""
    items = [texts] if isinstance(texts, str) else list(texts)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidInputError(f"texts[{i}] is {type(item).__name__}; every text must be str")
    return items


class EmbeddingClient:
    """Embed texts with the ``embed`` ensemble.

    Example::

        with EmbeddingClient(url="127.0.0.1:8001", protocol="grpc") as client:
            vectors = client.embed(["A man plays a guitar.", "Someone plays music."])  # (2, 384) float32

    ``url`` and ``protocol`` default to the environment variables ``TRITON_EMBED_URL`` and
    ``TRITON_EMBED_PROTOCOL`` (read when the client is made), then to ``127.0.0.1:8001`` over gRPC
    (``127.0.0.1:8000`` for HTTP). HTTP requests and responses use binary tensor data, not JSON.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        protocol: str | None = None,
        model: str = "embed",
        timeout_s: float = 30.0,
    ) -> None:
        """Connect lazily; nothing is sent until the first call.

        ``url`` may carry a scheme (``http://127.0.0.1:8000``) or be a bare ``:port`` (on 127.0.0.1).

        Raises:
            ValueError: ``protocol`` is not ``grpc`` or ``http``, or ``url`` is not ``host:port``.
        """
        self.protocol = (protocol or os.environ.get(PROTOCOL_ENV) or "grpc").lower()
        if self.protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be 'grpc' or 'http'; got {self.protocol!r}")
        self.url = normalise_url(url or os.environ.get(URL_ENV) or DEFAULT_URLS[self.protocol])
        self.model = model
        self.timeout_s = timeout_s
        if self.protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        self._module = module
        kwargs = {} if self.protocol == "grpc" else {"connection_timeout": timeout_s, "network_timeout": timeout_s}
        self._client = module.InferenceServerClient(self.url, **kwargs)
        self._config: dict | None = None

    def _model_config(self) -> dict:
        """The model's config as a dict (fetched once): ``max_batch_size``, ``output[0].dims``, ..."""
        if self._config is None:
            try:
                if self.protocol == "grpc":
                    self._config = self._client.get_model_config(self.model, as_json=True)["config"]
                else:
                    self._config = self._client.get_model_config(self.model)
            except Exception as exc:
                raise from_triton(exc, model=self.model, url=self.url) from exc
        return self._config

    @property
    def max_batch_size(self) -> int:
        """Most texts one request may carry (the model's ``max_batch_size``, read once from the server)."""
        return int(self._model_config().get("max_batch_size", 1)) or 1

    @property
    def dim(self) -> int:
        """Embedding width (the model's ``EMBEDDING`` dims, read once from the server), e.g. 384."""
        output = next(o for o in self._model_config()["output"] if o["name"] == OUTPUT)
        return int(output["dims"][-1])

    def embed(self, texts: str | Iterable[str]) -> np.ndarray:
        """Embed texts; row ``i`` belongs to ``texts[i]``.

        Args:
            texts: a str (one row) or an iterable of str. Lists longer than :attr:`max_batch_size` are sent as
                several requests and reassembled in order.

        Returns:
            float32 array ``(len(texts), dim)`` (dim 384 for all-MiniLM-L6-v2), rows L2-normalised.
            An empty input gives ``(0, dim)`` without an inference request.

        Raises:
            InvalidInputError: a text is not str, or the server rejected the input.
            ServerUnavailableError, EmbeddingTimeoutError, ServerError: see :mod:`triton_embed.errors`.
        """
        items = _as_texts(texts)
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        step = self.max_batch_size
        parts = [self._infer(items[i : i + step]) for i in range(0, len(items), step)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def similarity(self, a: str, b: str) -> float:
        """Cosine similarity of two texts, in [-1, 1] (dot product of their unit-norm embeddings)."""
        vectors = self.embed([a, b])
        return float(np.dot(vectors[0], vectors[1]))

    def _infer(self, texts: list[str]) -> np.ndarray:
        data = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)
        infer_input = self._module.InferInput(INPUT, list(data.shape), "BYTES")
        if self.protocol == "http":
            infer_input.set_data_from_numpy(data, binary_data=True)
            outputs = [self._module.InferRequestedOutput(OUTPUT, binary_data=True)]
            kwargs = {}  # the HTTP client's network_timeout bounds the call
        else:
            infer_input.set_data_from_numpy(data)
            outputs = [self._module.InferRequestedOutput(OUTPUT)]
            kwargs = {"client_timeout": self.timeout_s}
        try:
            result = self._client.infer(self.model, [infer_input], outputs=outputs, **kwargs)
        except Exception as exc:
            raise from_triton(exc, model=self.model, url=self.url) from exc
        array = result.as_numpy(OUTPUT)
        if array is None or array.shape[0] != len(texts):
            got = None if array is None else list(array.shape)
            raise EmbeddingError(f"model '{self.model}' returned {got} for {len(texts)} texts")
        return array.astype(np.float32, copy=False)

    def close(self) -> None:
        """Close the connection."""
        self._client.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
