"""Triton Python-based backend ``tokenizer``: TEXT -> input_ids / attention_mask.

Loaded by Triton for every model whose config says ``backend: "tokenizer"``. The tokenizer file is the model's
``<version>/tokenizer.json`` written by ``make model``: a Hugging Face fast tokenizer whose truncation is set to
the encoder's ``max_seq_length``, so ids equal what sentence-transformers feeds the transformer.

Per execute: all requests' texts are decoded, tokenised in ONE ``encode_batch`` call (texts over 4,096 characters
from their head when that gives the same ids: ``long_texts.py``), and split back per request.
Each response holds ``input_ids`` and ``attention_mask``, int64 ``[n_texts, T]`` where ``T`` is the longest text of
that request in tokens; shorter rows are padded with the tokenizer's pad id and mask 0, and ``queued_ns``, int64
``[n_texts, 1]``: ``time.monotonic_ns()`` as this execute hands its requests on to the encoder's queue (one clock for
every process on the host), from which the encoder's overload control counts each request's wait
(python_backends/torchscript/overload.py), and ``token_count``, int64 ``[n_texts, 1]``: each text's tokens after
truncation (the ensemble's ``TOKEN_COUNT``, for usage accounting). A bad request (missing input, wrong shape, no texts, a text over
``MAX_TEXT_BYTES``, non-UTF-8 bytes, a NUL byte, or a text over max_seq_length tokens when truncation is off) gets its
own INVALID_ARG error; the others still succeed.

Config parameters: ``MAX_TEXT_BYTES`` (default 65536) and ``TRUNCATION`` (``truncate``, the default, cuts long
texts at max_seq_length as sentence-transformers does; ``error`` rejects them). Request parameter: ``truncate``
(true/false) overrides ``TRUNCATION``.
"""

from __future__ import annotations

import json
import os
import site
import sys
import time
from pathlib import Path

# Triton 2.51 workaround (docs/troubleshooting.md): the stub starts its interpreter without reading PYTHONPATH.
# The embedded server passes its environment's site-packages there (triton_embed_server.layout.server_environment),
# so add them before the third-party imports below. A no-op in images where the packages are installed system-wide.
for _path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)
        site.addsitedir(_path)  # its .pth files too: the editable install of triton_embed_protocol
# Batches here are a few short texts: the Rust thread pool of encode_batch only fights the encoder's torch
# threads for the cores (measured: tokenizer execution 4.1 ms -> 1.4 ms at 16 clients on 2 cores).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import triton_python_backend_utils as pb_utils
from long_texts import encode_heads, margin_chars
from tokenizers import Tokenizer
from triton_embed_protocol import QUEUED, TEXT, TOKEN_COUNT, TOKENS, RequestError, request_parameters


def decode_texts(tensor, max_bytes: int) -> list[str]:
    """Decode a TEXT tensor (``[n, 1]`` of UTF-8 bytes) into ``n`` strings.

    Raises:
        RequestError: the tensor is missing, not ``[n, 1]``, has no rows, or a row is longer than ``max_bytes``,
            is not valid UTF-8, or holds a NUL byte.
    """
    if tensor is None:
        raise RequestError(f"missing input tensor '{TEXT}'")
    array = tensor.as_numpy()
    if array.ndim != 2 or array.shape[1] != 1:
        raise RequestError(f"input '{TEXT}' must have shape [batch, 1]; got {list(array.shape)}")
    if array.shape[0] == 0:
        raise RequestError(f"input '{TEXT}' has 0 texts; at least 1 is required")
    texts = []
    for row, item in enumerate(array[:, 0]):
        raw = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        if len(raw) > max_bytes:
            raise RequestError(f"input '{TEXT}' row {row} has {len(raw)} bytes; the limit is {max_bytes} bytes")
        if b"\0" in raw:
            raise RequestError(
                f"input '{TEXT}' row {row} holds a NUL byte at offset {raw.index(0)}; a text may not hold one"
            )
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise RequestError(
                f"input '{TEXT}' row {row} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                f"({exc.reason})"
            ) from None
    return texts


def token_count(encoding, special_tokens: int) -> int:
    """Tokens of a truncated text, special tokens included once, as the model would see it whole.

    ``encoding``: a ``tokenizers.Encoding`` truncated with stride 0; its ``overflowing`` windows hold the rest,
    each with the ``special_tokens`` ([CLS] and [SEP] for BERT: 2) added again.
    """
    return sum(len(window.ids) - special_tokens for window in (encoding, *encoding.overflowing)) + special_tokens


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad token id lists to the longest one.

    Returns:
        (input_ids, attention_mask), both int64 ``[len(rows), max(len)]``.
    """
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


class TritonPythonModel:
    """Tokenizer step of the ``embed`` ensemble."""

    def initialize(self, args: dict) -> None:
        """Load ``<model_repository>/<version>/tokenizer.json``; fail the load if it has no truncation set."""
        self.model_config = json.loads(args["model_config"])
        path = Path(args["model_repository"]) / args["model_version"] / "tokenizer.json"
        if not path.is_file():
            raise pb_utils.TritonModelException(f"{path} not found: run `make model` to export the tokenizer")
        self.tokenizer = Tokenizer.from_file(str(path))
        if self.tokenizer.truncation is None:
            raise pb_utils.TritonModelException(f"{path} has no truncation; re-export it with `make model`")
        self.max_tokens = self.tokenizer.truncation["max_length"]
        padding = self.tokenizer.padding
        self.pad_id = padding["pad_id"] if padding else 0
        self.tokenizer.no_padding()  # we pad per request, not to the longest text of the whole execution
        self._special_tokens = len(self.tokenizer.encode("", add_special_tokens=True).ids)  # [CLS] [SEP]: 2
        self._head_margin = margin_chars(self.tokenizer)  # None: not WordPiece, every text is tokenized whole
        params = {k: v["string_value"] for k, v in self.model_config.get("parameters", {}).items()}
        self.max_text_bytes = int(params.get("MAX_TEXT_BYTES", "65536"))
        self.truncate = params.get("TRUNCATION", "truncate")
        if self.truncate not in ("truncate", "error"):
            raise pb_utils.TritonModelException(
                f"parameter TRUNCATION must be 'truncate' or 'error'; got {self.truncate!r}"
            )

    def _truncates(self, parameters: dict) -> bool:
        """Truncate this request's long texts? Request parameter ``truncate`` (bool) wins over ``TRUNCATION``.

        Args:
            parameters: the request's parameters (:func:`request_parameters`).

        Raises:
            RequestError: ``truncate`` is present but not a bool.
        """
        value = parameters.get("truncate")
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"request parameter 'truncate' must be true or false; got {value!r}")
        return self.truncate == "truncate" if value is None else value

    def execute(self, requests: list) -> list:
        """Tokenise all requests' texts in one call; one response per request, in order."""
        parameters = [request_parameters(request.parameters()) for request in requests]  # parsed once per request
        texts_per_request: list[list[str] | None] = []
        errors: dict[int, str] = {}
        for i, request in enumerate(requests):
            try:
                texts_per_request.append(
                    decode_texts(pb_utils.get_input_tensor_by_name(request, TEXT), self.max_text_bytes)
                )
            except RequestError as exc:
                errors[i] = str(exc)
                texts_per_request.append(None)

        flat = [t for texts in texts_per_request if texts for t in texts]
        # long texts: their head
        encodings, chars = encode_heads(self.tokenizer, flat, self._head_margin) if flat else ([], [])
        if len(encodings) != len(flat):
            raise pb_utils.TritonModelException(f"tokenizer returned {len(encodings)} encodings for {len(flat)} texts")
        rows, tokenized = iter(encodings), iter(chars)
        per_request = [None if texts is None else [next(rows) for _ in texts] for texts in texts_per_request]
        chars_of = [None if texts is None else [next(tokenized) for _ in texts] for texts in texts_per_request]

        for i, encs in enumerate(per_request):
            if encs is None:
                continue
            try:
                truncates = self._truncates(parameters[i])
            except RequestError as exc:
                errors[i] = str(exc)
                continue
            if not truncates:
                long = next((row for row, e in enumerate(encs) if e.overflowing), None)
                if long is not None:
                    whole = chars_of[i][long] >= len(texts_per_request[i][long])  # else read from its head
                    errors[i] = (
                        f"input '{TEXT}' row {long} has {'' if whole else 'at least '}"
                        f"{token_count(encs[long], self._special_tokens)} tokens; the limit is {self.max_tokens} "
                        "(the model's max_seq_length) and truncation is off for this request"
                    )
        queued_ns = time.monotonic_ns()
        responses = []
        for i, encs in enumerate(per_request):
            if i in errors:
                error = pb_utils.TritonError(errors[i], pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            ids, mask = pad_rows([e.ids for e in encs], self.pad_id)
            queued = pb_utils.Tensor(QUEUED, np.full((len(encs), 1), queued_ns, dtype=np.int64))
            counts = pb_utils.Tensor(TOKEN_COUNT, mask.sum(axis=1, keepdims=True))
            tensors = [pb_utils.Tensor(TOKENS[0], ids), pb_utils.Tensor(TOKENS[1], mask), queued, counts]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
