"""Inference requests for the ensemble: the ``TEXT`` input and ``EMBEDDING`` output, by network or shared memory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import serialize_byte_tensor

from triton_embed.errors import EmbeddingError
from triton_embed.inputs import Embeddings, Scores
from triton_embed.settings import Settings
from triton_embed.shm import Region, output_offset

INPUT = "TEXT"
OUTPUT = "EMBEDDING"
QUERY, DOCUMENT, SCORE = "QUERY", "DOCUMENT", "SCORE"  # a reranker's ensemble
PROMPT_NAME, TRUNCATE = "PROMPT_NAME", "TRUNCATE"
TRUNCATIONS = ("END", "START", "NONE")


@dataclass(frozen=True)
class CallOptions:
    """Per-call choices sent as the ensemble's optional inputs (part of the response cache's key).

    ``prompt_name``: one of the model's sentence-transformers prompts (``""`` for none; None: the model's default);
    ``truncate``: ``END``, ``START`` or ``NONE`` (None: the server's ``TRUNCATION`` and the client's ``truncate``).
    """

    prompt_name: str | None = None
    truncate: str | None = None

    def __post_init__(self) -> None:
        """Check the values.

        Raises:
            ValueError: ``prompt_name`` not a str, or ``truncate`` not one of ``TRUNCATIONS``.
        """
        if self.prompt_name is not None and not isinstance(self.prompt_name, str):
            raise ValueError(f"input_type must be a prompt name (str); got {self.prompt_name!r}")
        if self.truncate is not None and self.truncate not in TRUNCATIONS:
            raise ValueError(f"truncate must be one of {list(TRUNCATIONS)}; got {self.truncate!r}")


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
        ``LATENCY_BUDGET_MS``, none on CPU as shipped); and the request parameter ``truncate`` when set. The chunks of
        one call queue behind each other by the call's own making, so the later ones cannot meet a per-request
        budget even on an idle server: 200 short STS-B sentences are ~450 ms of encoder work on 2 CPU cores.
        """
        kwargs: dict[str, Any] = {}  # the gRPC deadline is every call's: ``ClientCore._request`` adds it
        budget = self.settings.latency_budget_ms
        if budget is None and bulk:
            budget = 0
        parameters: dict[str, float | bool] = {} if budget is None else {"latency_budget_ms": budget}
        if self.settings.truncate is not None:
            parameters["truncate"] = self.settings.truncate
        if parameters:
            kwargs["parameters"] = parameters
        return kwargs

    def build(
        self, texts: list[str], dim: int, region: Region | None = None, options: CallOptions | None = None
    ) -> tuple[list[Any], list[Any], int]:
        """Return ``(inputs, outputs, sent_bytes)``.

        With ``region``, ``TEXT`` and ``EMBEDDING`` travel through shared memory; ``options`` add the
        ``PROMPT_NAME`` / ``TRUNCATE`` inputs, over the network.
        """
        data = text_tensor(texts)
        output = self._requested(OUTPUT)
        if region is not None:
            tensor = self.module.InferInput(INPUT, list(data.shape), "BYTES")
            serialized = serialize_byte_tensor(data)
            in_bytes = len(serialized.item())
            shm.set_shared_memory_region(region.handle, [serialized])
            tensor.set_shared_memory(region.name, in_bytes)
            output.set_shared_memory(region.name, len(texts) * dim * 4, offset=output_offset(in_bytes))
        else:
            tensor = self._tensor(INPUT, data)
        inputs = [tensor]
        chosen = options or CallOptions()
        for name, value in ((PROMPT_NAME, chosen.prompt_name), (TRUNCATE, chosen.truncate)):
            if value is not None:
                inputs.append(self._tensor(name, text_tensor([value] * len(texts))))
        return inputs, [output], self._sent(inputs, [output])

    def _tensor(self, name: str, data: npt.NDArray[np.object_]) -> Any:
        """The BYTES input ``name`` holding ``data`` (:func:`text_tensor`), over the network."""
        tensor = self.module.InferInput(name, list(data.shape), "BYTES")
        if self.http:
            tensor.set_data_from_numpy(data, binary_data=self.settings.binary)
        else:
            tensor.set_data_from_numpy(data)
        return tensor

    def _requested(self, name: str) -> Any:
        """The requested output ``name`` (binary over HTTP as the settings say)."""
        if self.http:
            return self.module.InferRequestedOutput(name, binary_data=self.settings.binary)
        return self.module.InferRequestedOutput(name)

    def _sent(self, inputs: list[Any], outputs: list[Any]) -> int:
        """Bytes of the request body over HTTP; 0 over gRPC."""
        if not self.http:
            return 0
        body, _ = self.module.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
        return len(body)

    def _received(self, result: Any, binary_bytes: int) -> int:
        """Bytes of the response over HTTP: its JSON header and ``binary_bytes`` of binary outputs; 0 over gRPC."""
        if not self.http:
            return 0
        return len(json.dumps(result.get_response(), separators=(",", ":"))) + binary_bytes

    def build_pairs(self, query: str, documents: list[str], truncate: str | None) -> tuple[list[Any], list[Any], int]:
        """Return ``(inputs, outputs, sent_bytes)`` for a reranker.

        ``QUERY`` (repeated) and ``DOCUMENT`` per pair, ``TRUNCATE`` when given; the output ``SCORE``. Always over the
        network.
        """
        n = len(documents)
        inputs = [self._tensor(QUERY, text_tensor([query] * n)), self._tensor(DOCUMENT, text_tensor(documents))]
        if truncate is not None:
            inputs.append(self._tensor(TRUNCATE, text_tensor([truncate] * n)))
        outputs = [self._requested(SCORE)]
        return inputs, outputs, self._sent(inputs, outputs)

    def read_scores(self, result: Any, n: int) -> tuple[Scores, int]:
        """Return ``((n,) float32 scores, received_bytes)`` from a reranker's ``InferResult``.

        Raises:
            EmbeddingError: the server answered with another row count.
        """
        array = result.as_numpy(SCORE)
        if array is None or array.shape != (n, 1):
            got = None if array is None else list(array.shape)
            raise EmbeddingError(f"model '{self.settings.model}' returned {got} for {n} pairs; expected [{n}, 1]")
        received = self._received(result, array.nbytes if self.settings.binary else 0)
        return array[:, 0].astype(np.float32), received

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
        received = self._received(result, array.nbytes if self.settings.binary and region is None else 0)
        return array.astype(np.float32, copy=False), received
