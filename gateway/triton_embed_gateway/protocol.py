"""The embeddings APIs' request and response shapes: OpenAI's ``POST /v1/embeddings`` and TEI's ``POST /embed``.

Pure functions, no I/O: a JSON body (already parsed) becomes an :class:`EmbedRequest` or an :class:`ApiError`
that names the field, the limit and the value received; an embedding matrix becomes the response body.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from triton_embed import core
from triton_embed_protocol import budget_problem, refusal_reason

Vectors = npt.NDArray[np.float32]
"""Embeddings, float32 ``(n, dim)``, rows of unit length."""
Counts = npt.NDArray[np.int64]
"""Tokens per text, int64 ``(n,)``."""

DEFAULT_MAX_INPUTS = 2048
"""Most texts one request may carry, as OpenAI's embeddings endpoint allows."""

ENCODING_FORMATS = ("float", "base64")


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        """OpenAI's error type: ``invalid_request_error`` for a client's fault (4xx), else ``server_error``."""
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        """The response body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def tei_body(self) -> dict[str, str]:
        """The body in text-embeddings-inference's shape, ``{"error": message, "error_type": ...}``, for ``/embed``.

        ``error_type``: ``validation`` for a client's fault (4xx), ``overloaded`` for a refusal, ``unhealthy`` for
        another 503 (draining, not ready, unreachable), ``backend`` for the rest.
        """
        if self.status < 500:
            kind = "validation"
        elif self.status == 503:
            kind = "overloaded" if refusal_reason(self.message) else "unhealthy"
        else:
            kind = "backend"
        return {"error": self.message, "error_type": kind}


def invalid(param: str, message: str) -> ApiError:
    """A 400 naming ``param``."""
    return ApiError(400, message, param=param, code="invalid_value")


TRUNCATIONS = ("END", "START", "NONE")


@dataclass(frozen=True)
class EmbedRequest:
    """What one API request asks of the service.

    ``texts``: the inputs in order; ``truncate``: ``END`` (a text over the model's token limit loses its end, as
    sentence-transformers cuts it), ``START`` (loses its start) or ``NONE`` (refused); ``prompt_name``: one of the
    model's prompts, None for its default; ``prompt_field``: the API field that named it, for errors;
    ``dimensions``: keep the first ``d`` components, renormalised, None for all; ``encoding_format``: ``float`` or
    ``base64`` (OpenAI route); ``latency_budget_ms``: the request parameter the service refuses a request by once it
    has waited that long in the encoder's queue (0 = never refused), None for the service's own; ``model``: the
    model the request names (OpenAI route), None for none.
    """

    texts: list[str]
    truncate: str = "END"
    prompt_name: str | None = None
    prompt_field: str = "input_type"
    dimensions: int | None = None
    encoding_format: str = "float"
    latency_budget_ms: float | None = None
    model: str | None = None


def _texts(value: Any, field: str, max_inputs: int) -> list[str]:
    """A string or a non-empty list of strings, at most ``max_inputs`` of them."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid(field, f"'{field}' must be a string or a list of strings; got {type(value).__name__}")
    if not value:
        raise invalid(field, f"'{field}' must hold at least 1 text; got an empty list")
    if len(value) > max_inputs:
        raise invalid(field, f"'{field}' holds {len(value)} texts; the limit is {max_inputs}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            token_ids = isinstance(item, int | list) and field in ("input", "inputs")  # what an embeddings API may get
            kind = "token ids" if token_ids else type(item).__name__
            raise invalid(
                f"{field}[{i}]", f"'{field}[{i}]' must be a string; got {kind} (token arrays are not accepted)"
            )
    return value


def _optional_str(body: dict[str, Any], field: str) -> str | None:
    value = body.get(field)
    if value is not None and (not isinstance(value, str) or not value):
        raise invalid(field, f"'{field}' must be a non-empty string; got {value!r}")
    return value


def _dimensions(body: dict[str, Any]) -> int | None:
    """``dimensions``: an integer >= 1 (its upper bound, the model's width, is checked once the width is known)."""
    value = body.get("dimensions")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise invalid("dimensions", f"'dimensions' must be an integer from 1 to the model's width; got {value!r}")
    return value


def _budget(body: dict[str, Any]) -> float | None:
    """``latency_budget_ms``: a number of ms from 0 to an hour, as the service's request parameter; None if absent."""
    value = body.get("latency_budget_ms")
    if value is not None and (problem := budget_problem(value, "'latency_budget_ms'")):
        raise invalid("latency_budget_ms", problem)
    return value


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("body", f"the body must be a JSON object; got {type(body).__name__}")
    return body


def openai_request(body: Any, max_inputs: int = DEFAULT_MAX_INPUTS) -> EmbedRequest:
    """Read an OpenAI embeddings request.

    Fields: ``input`` (str or list of str), ``model`` (a string: the served model it names), ``encoding_format``
    (``float`` | ``base64``), ``dimensions``, ``user`` (ignored), and as NVIDIA's NIM: ``input_type`` (a prompt name
    of the model, e.g. ``query`` or ``passage``) and ``truncate`` (``END``, the default, ``START`` or ``NONE``); and
    ``latency_budget_ms``, the service's request parameter.

    Raises:
        ApiError: 400 naming the field, the limit and the value.
    """
    body = _object(body)
    if "input" not in body:
        raise ApiError(400, "'input' is required", param="input", code="missing_field")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", f"'model' must be a string; got {type(model).__name__}")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise invalid("encoding_format", f"'encoding_format' must be one of {list(ENCODING_FORMATS)}; got {encoding!r}")
    truncate = body.get("truncate") or "END"
    if truncate not in TRUNCATIONS:
        raise invalid("truncate", f"'truncate' must be one of {list(TRUNCATIONS)}; got {truncate!r}")
    return EmbedRequest(
        _texts(body["input"], "input", max_inputs),
        truncate=truncate,
        prompt_name=_optional_str(body, "input_type"),
        prompt_field="input_type",
        dimensions=_dimensions(body),
        encoding_format=encoding,
        latency_budget_ms=_budget(body),
        model=model,
    )


def tei_request(body: Any, max_inputs: int = DEFAULT_MAX_INPUTS) -> EmbedRequest:
    """Read a text-embeddings-inference ``/embed`` request.

    Fields: ``inputs``, ``normalize`` (true only), ``truncate`` (bool, default true), ``truncation_direction``
    (``Right``, the default, or ``Left``), ``prompt_name``, ``dimensions``, ``latency_budget_ms``.

    Raises:
        ApiError: 400 naming the field, the limit and the value.
    """
    body = _object(body)
    if "inputs" not in body:
        raise ApiError(400, "'inputs' is required", param="inputs", code="missing_field")
    if body.get("normalize", True) is not True:
        raise invalid(
            "normalize", f"'normalize' must be true (the model returns unit vectors); got {body['normalize']!r}"
        )
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise invalid("truncate", f"'truncate' must be true or false; got {truncate!r}")
    direction = body.get("truncation_direction") or "Right"
    if direction not in ("Right", "Left"):
        raise invalid("truncation_direction", f"'truncation_direction' must be 'Right' or 'Left'; got {direction!r}")
    return EmbedRequest(
        _texts(body["inputs"], "inputs", max_inputs),
        truncate=("END" if direction == "Right" else "START") if truncate else "NONE",
        prompt_name=_optional_str(body, "prompt_name"),
        prompt_field="prompt_name",
        dimensions=_dimensions(body),
        latency_budget_ms=_budget(body),
    )


def shorten(vectors: Vectors, dimensions: int | None, width: int) -> Vectors:
    """The first ``dimensions`` components of each row, renormalised to unit length (Matryoshka); all for None.

    How well the shortened vectors retrieve depends on the model's training (Matryoshka loss); any model can be cut.

    Raises:
        ApiError: 400 when ``dimensions`` is over the model's ``width``.
    """
    if dimensions is None or dimensions == width:
        return vectors
    if dimensions > width:
        raise invalid("dimensions", f"'dimensions' is {dimensions}; the model's width is {width}")
    return core.shorten(vectors, dimensions)


def openai_response(vectors: Vectors, token_counts: Counts, model: str, encoding_format: str) -> dict[str, Any]:
    """OpenAI's response body for ``vectors`` (float32 ``(n, dim)``) and ``token_counts`` (int ``(n,)``).

    ``base64`` encodes each row's little-endian float32 bytes, as OpenAI and TEI do.
    """
    rows: list[Any]
    if encoding_format == "base64":
        little = vectors.astype("<f4", copy=False)
        rows = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    else:
        rows = list(vectors)  # float32 rows, which orjson writes as they are
    tokens = int(token_counts.sum())
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


@dataclass(frozen=True)
class RerankRequest:
    """What one rerank request asks: ``documents`` scored against ``query``, as (query, document) pairs.

    ``documents_field``: the API field that holds them (``texts`` on TEI's route, ``documents`` on Cohere's), for
    errors; ``truncate``: as :class:`EmbedRequest`'s, per pair; ``top_n``: how many results to answer (None: all);
    ``return_documents``: put each document's text in its result; ``raw_scores``: the logit instead of the model's
    activation of it (TEI's ``raw_scores``); ``model``: the model the request names (Cohere's route), None for none.
    """

    query: str
    documents: list[str]
    documents_field: str = "documents"
    truncate: str = "END"
    top_n: int | None = None
    return_documents: bool = False
    raw_scores: bool = False
    latency_budget_ms: float | None = None
    model: str | None = None


def _flag(body: dict[str, Any], field: str, default: bool) -> bool:
    value = body.get(field, default)
    if not isinstance(value, bool):
        raise invalid(field, f"'{field}' must be true or false; got {value!r}")
    return value


def _query(body: dict[str, Any]) -> str:
    if "query" not in body:
        raise ApiError(400, "'query' is required", param="query", code="missing_field")
    if not isinstance(body["query"], str):
        raise invalid("query", f"'query' must be a string; got {type(body['query']).__name__}")
    return body["query"]


def tei_rerank_request(body: Any, max_inputs: int = DEFAULT_MAX_INPUTS) -> RerankRequest:
    """Read a text-embeddings-inference ``/rerank`` request.

    Fields: ``query``, ``texts`` (a non-empty list of strings), ``raw_scores``, ``return_text``, ``truncate`` (bool,
    default true), ``truncation_direction`` (``Right``, the default, or ``Left``), ``latency_budget_ms``.

    Raises:
        ApiError: 400 naming the field, the limit and the value.
    """
    body = _object(body)
    query = _query(body)
    if "texts" not in body:
        raise ApiError(400, "'texts' is required", param="texts", code="missing_field")
    if isinstance(body["texts"], str):
        raise invalid("texts", "'texts' must be a list of strings; got a string")
    truncate = _flag(body, "truncate", True)
    direction = body.get("truncation_direction") or "Right"
    if direction not in ("Right", "Left"):
        raise invalid("truncation_direction", f"'truncation_direction' must be 'Right' or 'Left'; got {direction!r}")
    return RerankRequest(
        query,
        _texts(body["texts"], "texts", max_inputs),
        documents_field="texts",
        truncate=("END" if direction == "Right" else "START") if truncate else "NONE",
        return_documents=_flag(body, "return_text", False),
        raw_scores=_flag(body, "raw_scores", False),
        latency_budget_ms=_budget(body),
    )


def cohere_rerank_request(body: Any, max_inputs: int = DEFAULT_MAX_INPUTS) -> RerankRequest:
    """Read a Cohere- or Jina-style ``/v1/rerank`` request.

    Fields: ``model``, ``query``, ``documents`` (a non-empty list of strings or of ``{"text": ...}`` objects),
    ``top_n`` (an integer >= 1; more than the documents answers them all), ``return_documents`` (default false, as
    Cohere's), ``truncate`` (``END``, the default, ``START`` or ``NONE``), ``latency_budget_ms``.

    Raises:
        ApiError: 400 naming the field, the limit and the value.
    """
    body = _object(body)
    query = _query(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", f"'model' must be a string; got {type(model).__name__}")
    if "documents" not in body:
        raise ApiError(400, "'documents' is required", param="documents", code="missing_field")
    given = body["documents"]
    if isinstance(given, list):
        given = [
            item["text"] if isinstance(item, dict) and isinstance(item.get("text"), str) else item for item in given
        ]
    documents = _texts(given, "documents", max_inputs) if not isinstance(given, str) else [given]
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise invalid("top_n", f"'top_n' must be an integer >= 1; got {top_n!r}")
    truncate = body.get("truncate") or "END"
    if truncate not in TRUNCATIONS:
        raise invalid("truncate", f"'truncate' must be one of {list(TRUNCATIONS)}; got {truncate!r}")
    return RerankRequest(
        query,
        documents,
        truncate=truncate,
        top_n=top_n,
        return_documents=_flag(body, "return_documents", False),
        latency_budget_ms=_budget(body),
        model=model,
    )


Scores = npt.NDArray[np.float32]
"""One score per document, float32 ``(n,)``."""


def ranked(scores: Scores, top_n: int | None = None) -> list[int]:
    """Indexes of ``scores`` from the highest score down (ties in document order), the first ``top_n`` (None: all)."""
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    return order if top_n is None else order[:top_n]


def tei_rerank_response(request: RerankRequest, scores: Scores) -> list[dict[str, Any]]:
    """TEI's ``/rerank`` answer: ``[{"index", "score"[, "text"]}]``, highest score first."""
    return [
        {"index": i, "score": float(scores[i]), **({"text": request.documents[i]} if request.return_documents else {})}
        for i in ranked(scores)
    ]


def cohere_rerank_response(
    request: RerankRequest, scores: Scores, token_counts: Counts, model: str, request_id: str
) -> dict[str, Any]:
    """The ``/v1/rerank`` answer as Cohere's and Jina's clients read it.

    ``id``, ``model``, ``results`` (``index``, ``relevance_score``[, ``document``: ``{"text"}``]), highest score first,
    ``top_n`` of them, and ``usage``.
    """
    tokens = int(token_counts.sum())
    results = [
        {
            "index": i,
            "relevance_score": float(scores[i]),
            **({"document": {"text": request.documents[i]}} if request.return_documents else {}),
        }
        for i in ranked(scores, request.top_n)
    ]
    return {
        "id": request_id,
        "model": model,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "meta": {"billed_units": {"search_units": 1}},
    }
