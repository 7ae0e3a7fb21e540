"""Triton Python-based backend ``tokenizer``: TEXT -> input_ids / attention_mask.

Loaded by Triton for every model whose config says ``backend: "tokenizer"``. The tokenizer file is the model's
``<version>/tokenizer.json`` written by ``make model``: a Hugging Face fast tokenizer whose truncation is set to
the encoder's ``max_seq_length``, so ids equal what sentence-transformers feeds the transformer. ``prompts.json``
beside it holds the model's sentence-transformers ``prompts`` and ``default_prompt_name``.

Per execute: all requests' texts are decoded, each gets its prompt in front (optional input ``PROMPT_NAME``, else
the default prompt), and they are tokenised in one ``encode_batch`` call (texts over 4,096 characters from their head
when that gives the same ids: ``long_texts.py``), plus one for the texts whose ``TRUNCATE`` is ``START``, then split
back per request. Each response holds ``input_ids`` and ``attention_mask``, int64 ``[n_texts, T]`` where ``T`` is the
longest text of that request in tokens (shorter rows padded with the pad id and mask 0); ``queued_ns``, int64
``[n_texts, 1]``: ``time.monotonic_ns()`` as this execute hands its requests on to the encoder's queue, from which
the encoder's overload control counts each request's wait (python_backends/triton_embed_protocol/overload.py);
``bulk``, bool ``[n_texts, 1]``: the lane admission chose for the request (true: the bulk lane), in which the encoder
counts its texts out of flight; and ``token_count``, int64 ``[n_texts, 1]``: each text's tokens after truncation,
prompt and special tokens included.

A request with the optional input ``TEXT_PAIR`` (a reranker's ensemble sends its documents there, its queries in
``TEXT``) is tokenised as pairs, as the model's tokenizer joins them and CrossEncoder truncates them (longest first);
its ``attention_mask`` then holds each token's type id + 1 (1 the first text, 2 the second), which the reranker's
scorer reads as the mask and the token types.

A bad request (missing input, wrong shape, no texts, a text over ``MAX_TEXT_BYTES``, non-UTF-8 bytes, a NUL byte, an
unknown prompt name or truncation, a text over max_seq_length tokens with truncation ``NONE``) gets its own
INVALID_ARG error; the others still succeed.

Config parameters: ``MAX_TEXT_BYTES`` (default 65536) and ``TRUNCATION`` (``truncate``, the default: END; ``error``:
NONE). The request parameter ``truncate`` (true/false) overrides ``TRUNCATION``; the input ``TRUNCATE`` overrides
both, and unlike them is part of the response cache's key.
"""

from __future__ import annotations

import json
import os
import site
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Triton 2.51 workaround (docs/troubleshooting.md): the stub starts its interpreter without reading PYTHONPATH.
# The embedded server passes its environment's site-packages there (triton_embed_server.layout.server_environment),
# so add them before the third-party imports below. A no-op in images where the packages are installed system-wide.
for _path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)
        site.addsitedir(_path)  # its .pth files too: the editable install of triton_embed_protocol
# Batches here are a few short texts: the Rust thread pool of encode_batch only fights the encoder's torch
# threads for the cores (docs/benchmarks.md, "Queue delay, chunks and threads").
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import triton_python_backend_utils as pb_utils
from long_texts import encode_heads, margin_chars
from tokenizers import Tokenizer
from triton_embed_protocol import (
    BULK,
    PROMPT_NAME,
    QUEUED,
    TEXT,
    TEXT_PAIR,
    TOKEN_COUNT,
    TOKENS,
    TRUNCATE,
    RequestError,
    config_number,
    config_parameters,
    model_of_step,
    request_parameters,
)
from triton_embed_protocol.admission import RefusalCounter, Sorted, TokenizerAdmission

END, START, NONE = MODES = ("END", "START", "NONE")


def text_array(request) -> np.ndarray | None:
    """The request's ``TEXT`` input as numpy (object ``[n, 1]``), read once per execution; None when it has none."""
    tensor = pb_utils.get_input_tensor_by_name(request, TEXT)
    return None if tensor is None else tensor.as_numpy()


def decode_texts(array: np.ndarray | None, max_bytes: int, name: str = TEXT) -> list[str]:
    """Decode a TEXT input (:func:`text_array`: ``[n, 1]`` of UTF-8 bytes; ``name``: its name) into ``n`` strings.

    Raises:
        RequestError: the input is missing, not ``[n, 1]``, has no rows, or a row is longer than ``max_bytes``,
            is not valid UTF-8, or holds a NUL byte.
    """
    if array is None:
        raise RequestError(f"missing input tensor '{name}'")
    if array.ndim != 2 or array.shape[1] != 1:
        raise RequestError(f"input '{name}' must have shape [batch, 1]; got {list(array.shape)}")
    if array.shape[0] == 0:
        raise RequestError(f"input '{name}' has 0 texts; at least 1 is required")
    texts = []
    for row, item in enumerate(array[:, 0]):
        raw = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        if len(raw) > max_bytes:
            raise RequestError(f"input '{name}' row {row} has {len(raw)} bytes; the limit is {max_bytes} bytes")
        if b"\0" in raw:
            raise RequestError(
                f"input '{name}' row {row} holds a NUL byte at offset {raw.index(0)}; a text may not hold one"
            )
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise RequestError(
                f"input '{name}' row {row} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                f"({exc.reason})"
            ) from None
    return texts


def per_text(tensor, name: str, n: int) -> list[str] | None:
    """An optional per-text input (BYTES ``[n, 1]``) as ``n`` strings; None when the request has none.

    Raises:
        RequestError: its shape is not ``[n, 1]`` (the same rows as ``TEXT``), or a row is not UTF-8.
    """
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.shape != (n, 1):
        raise RequestError(f"input '{name}' must have shape [{n}, 1], one row per text; got {list(array.shape)}")
    try:
        return [(v.encode() if isinstance(v, str) else bytes(v)).decode("utf-8") for v in array[:, 0]]
    except UnicodeDecodeError:
        raise RequestError(f"input '{name}' is not valid UTF-8") from None


def token_count(encoding, special_tokens: int) -> int:
    """Tokens of a truncated text, special tokens included once, as the model would see it whole.

    ``encoding``: a ``tokenizers.Encoding`` truncated with stride 0; its ``overflowing`` windows hold the rest,
    each with the ``special_tokens`` ([CLS] and [SEP] for BERT: 2) added again.
    """
    return sum(len(window.ids) - special_tokens for window in (encoding, *encoding.overflowing)) + special_tokens


def pad_rows(rows: list[list[int]], pad_id: int, types: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pad token id lists to the longest one.

    ``types``: a pair's type ids per row; the mask then holds type id + 1 on each token (1 the first text, 2 the
    second: ``encoder_module.PairScorer``), not 1.

    Returns:
        (input_ids, attention_mask), both int64 ``[len(rows), max(len)]``.
    """
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1 if types is None else np.asarray(types[i]) + 1
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
        self.tail_tokenizer = Tokenizer.from_file(str(path))  # TRUNCATE START: keeps the last max_seq_length tokens
        self.tail_tokenizer.no_padding()
        self.tail_tokenizer.enable_truncation(self.max_tokens, direction="left")
        self.whole_tokenizer = Tokenizer.from_file(str(path))  # a pair's length for its error: no truncation
        self.whole_tokenizer.no_padding()
        self.whole_tokenizer.no_truncation()
        prompts_file = path.parent / "prompts.json"
        prompts = json.loads(prompts_file.read_text()) if prompts_file.is_file() else {}
        self.prompts: dict[str, str] = prompts.get("prompts", {})
        self.default_prompt: str | None = prompts.get("default_prompt_name")
        params = config_parameters(self.model_config)
        try:
            self.max_text_bytes = config_number(params, "MAX_TEXT_BYTES", "65536", minimum=1, integer=True)
            configured = config_number(params, "MAX_SEQ_LENGTH", str(self.max_tokens), minimum=1, integer=True)
        except ValueError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None
        if configured != self.max_tokens:
            raise pb_utils.TritonModelException(
                f"config parameter MAX_SEQ_LENGTH is {configured} but {path} truncates at {self.max_tokens}: "
                "run `make model` (it sets both)"
            )
        self._refused = RefusalCounter(pb_utils.MetricFamily, args["model_name"])
        self.admission = TokenizerAdmission(args["model_repository"], model_of_step(args["model_name"]), self._refused)
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

    def _modes(self, request, n: int, parameters: dict) -> list[str]:
        """Each text's truncation: the ``TRUNCATE`` input, else ``END`` or ``NONE`` from ``truncate``/``TRUNCATION``.

        Raises:
            RequestError: a row of ``TRUNCATE`` is not END, START or NONE, or ``truncate`` is not a bool.
        """
        given = per_text(pb_utils.get_input_tensor_by_name(request, TRUNCATE), TRUNCATE, n)
        if given is None:
            return [END if self._truncates(parameters) else NONE] * n
        for row, mode in enumerate(given):
            if mode not in MODES:
                raise RequestError(f"input '{TRUNCATE}' row {row} is {mode!r}; it must be one of {list(MODES)}")
        return given

    def _prompted(self, request, texts: list[str]) -> list[str]:
        """``texts`` with each one's prompt in front (``PROMPT_NAME``, else the model's default prompt).

        Raises:
            RequestError: a row of ``PROMPT_NAME`` names no prompt of this model ("" means none).
        """
        names = per_text(pb_utils.get_input_tensor_by_name(request, PROMPT_NAME), PROMPT_NAME, len(texts))
        if names is None:
            names = [self.default_prompt or ""] * len(texts)
        out = []
        for row, (name, text) in enumerate(zip(names, texts, strict=True)):
            if name and name not in self.prompts:
                known = f"this model's prompts are {sorted(self.prompts)}" if self.prompts else "this model has none"
                raise RequestError(f"input '{PROMPT_NAME}' row {row} is {name!r}, not a prompt name; {known}")
            out.append(self.prompts.get(name, "") + text)
        return out

    def finalize(self) -> None:
        """Hand on the bulk requests waiting, answer the refusals still held; keep the refusal counter alive for good.

        (``metric_lifetime.py``.)

        The in-flight file stays: it carries the encoder's ``MAX_IN_FLIGHT``, which a reloaded tokenizer (Triton
        finalizes the old instance after the new one loaded) must still read.
        """
        self.admission.close()
        self._refused.close()

    def execute(self, requests: list) -> None:
        """Refuse at the door past ``MAX_IN_FLIGHT``; tokenise the rest's texts in two calls at most (END/NONE, START).

        Admission (``triton_embed_protocol.admission.TokenizerAdmission``) sorts the requests into the door and the
        bulk lane. Every request is answered through its response sender: at once; a bulk request when the bulk lane
        hands it on; a refusal ``REFUSAL_HOLD_MS`` after this execution began.
        """
        arrived_ns = time.monotonic_ns()
        parameters = [request_parameters(request.parameters()) for request in requests]  # parsed once per request
        texts_per_request: list[list[str] | None] = []
        seconds_per_request: list[list[str] | None] = []  # a pair's second texts (TEXT_PAIR), None for single texts
        modes_per_request: list[list[str]] = []
        arrays = [text_array(request) for request in requests]  # read once: the door counts rows, decoding reads them
        door = self.admission.sort(
            parameters, [_text_rows(array) for array in arrays], arrived_ns, lambda i, m: _refusal(requests[i], m)
        )
        errors, refused = door.errors, door.refused
        for i, request in enumerate(requests):
            texts: list[str] | None = None
            seconds: list[str] | None = None
            modes: list[str] = []
            if i not in errors and i not in refused:
                try:
                    decoded = decode_texts(arrays[i], self.max_text_bytes)
                    second = pb_utils.get_input_tensor_by_name(request, TEXT_PAIR)
                    if second is not None:
                        seconds = decode_texts(second.as_numpy(), self.max_text_bytes, TEXT_PAIR)
                        if len(seconds) != len(decoded):
                            raise RequestError(
                                f"input '{TEXT_PAIR}' has {len(seconds)} rows and '{TEXT}' {len(decoded)}; a pair "
                                "is one row of each"
                            )
                    modes = self._modes(request, len(decoded), parameters[i])
                    texts = self._prompted(request, decoded)
                except RequestError as exc:
                    errors[i] = str(exc)
            texts_per_request.append(texts)
            seconds_per_request.append(seconds if texts is not None else None)
            modes_per_request.append(modes)

        rows = [
            (i, row, text, mode)
            for i, texts in enumerate(texts_per_request)
            if texts is not None and seconds_per_request[i] is None
            for row, (text, mode) in enumerate(zip(texts, modes_per_request[i], strict=True))
        ]
        heads = [r for r in rows if r[3] != START]
        tails = [r for r in rows if r[3] == START]
        head_texts = [r[2] for r in heads]
        # long texts: their head
        encodings, chars = encode_heads(self.tokenizer, head_texts, self._head_margin) if heads else ([], [])
        tail_encodings = self.tail_tokenizer.encode_batch([r[2] for r in tails]) if tails else []
        if len(encodings) != len(heads) or len(tail_encodings) != len(tails):
            raise pb_utils.TritonModelException(
                f"tokenizer returned {len(encodings) + len(tail_encodings)} encodings for {len(rows)} texts"
            )
        encoded: dict[tuple[int, int], object] = {}
        for (i, row, text, mode), enc, read in zip(heads, encodings, chars, strict=True):
            encoded[i, row] = enc
            if mode == NONE and enc.overflowing and i not in errors:
                whole = read >= len(text)  # else read from its head
                errors[i] = (
                    f"input '{TEXT}' row {row} has {'' if whole else 'at least '}"
                    f"{token_count(enc, self._special_tokens)} tokens; the limit is {self.max_tokens} "
                    "(the model's max_seq_length) and truncation is off for this request"
                )
        for (i, row, _, _), enc in zip(tails, tail_encodings, strict=True):
            encoded[i, row] = enc
        self._encode_pairs(texts_per_request, seconds_per_request, modes_per_request, encoded, errors)

        pairs = {i for i, seconds in enumerate(seconds_per_request) if seconds is not None}
        self._hand_on(requests, texts_per_request, encoded, door, pairs)

    def _encode_pairs(
        self,
        texts_per_request: list,
        seconds_per_request: list,
        modes_per_request: list,
        encoded: dict,
        errors: dict[int, str],
    ) -> None:
        """Tokenise the pairs (TEXT, TEXT_PAIR) of the requests that have them into ``encoded``.

        As the model's tokenizer joins a pair (its specials, its type ids), truncated longest-first (START: from the
        left); a pair over the limit with ``NONE`` gets its request's error.
        """
        for tokenizer, direction in ((self.tokenizer, END), (self.tail_tokenizer, START)):
            rows = [
                (i, row, (text, seconds[row]), mode)
                for i, (texts, seconds) in enumerate(zip(texts_per_request, seconds_per_request, strict=True))
                if texts is not None and seconds is not None
                for row, (text, mode) in enumerate(zip(texts, modes_per_request[i], strict=True))
                if (mode == START) == (direction == START)
            ]
            encodings = tokenizer.encode_batch([pair for _, _, pair, _ in rows]) if rows else []
            for (i, row, pair, mode), enc in zip(rows, encodings, strict=True):
                encoded[i, row] = enc
                if mode == NONE and enc.overflowing and i not in errors:
                    whole = len(self.whole_tokenizer.encode(*pair).ids)
                    errors[i] = (
                        f"input '{TEXT_PAIR}' row {row} (a document) with its query has {whole} tokens; the limit "
                        f"is {self.max_tokens} (the model's max_seq_length) and truncation is off for this request"
                    )

    def _hand_on(self, requests: list, texts_per_request: list, encoded: dict, door: Sorted, pairs: set[int]) -> None:
        """Answer each request not refused: its error, its tokens now, or (a bulk request) its tokens in its turn."""
        queued_ns = time.monotonic_ns()
        responses = {}
        handed_on = 0
        bulk = {}
        for i, texts in enumerate(texts_per_request):
            if i in door.refused:
                continue
            if i in door.errors or texts is None:
                error = pb_utils.TritonError(door.errors[i], pb_utils.TritonError.INVALID_ARG)
                responses[i] = pb_utils.InferenceResponse(output_tensors=[], error=error)
                continue
            encodings = [encoded[i, row] for row in range(len(texts))]
            types = [e.type_ids for e in encodings] if i in pairs else None
            ids, mask = pad_rows([e.ids for e in encodings], self.pad_id, types)
            wanted = request_outputs(requests[i])
            counted = QUEUED in wanted  # the ensemble feeds it to the encoder
            if i in door.bulk and counted:
                bulk[i] = (len(texts), _later(requests[i], ids, mask, wanted))
                continue
            responses[i] = _response(ids, mask, queued_ns, False, wanted)
            handed_on += len(texts) if counted else 0
        # before the answers: the encoder's count-down must not come first
        self.admission.hand_on(handed_on, bulk, door, lambda i, m: _refusal(requests[i], m))
        for i, response in responses.items():
            _answer(requests[i], response)()


def _text_rows(array: np.ndarray | None) -> int:
    """The texts of a request: the rows of its ``TEXT`` input (1 when it has none; decoding refuses it then)."""
    shape = array.shape if array is not None else ()
    return max(1, int(shape[0])) if shape else 1


def _response(ids: np.ndarray, mask: np.ndarray, queued_ns: int, bulk: bool, wanted: set[str]):
    """The tokenizer's response: tokens (int64 ``[n, T]``), ``queued_ns``, ``bulk`` and token counts (``[n, 1]``).

    ``bulk`` (bool) is the lane admission chose (true: the bulk lane); the others are int64.

    It holds only the outputs in ``wanted`` (:func:`request_outputs`), a Triton 2.51 workaround
    (docs/troubleshooting.md, "The stub frees unrequested outputs without the GIL"): the stub drops the others after
    it released the GIL, and the Python 3.12 stub dies of SIGSEGV doing so.
    """
    arrays = {
        TOKENS[0]: ids,
        TOKENS[1]: mask,
        QUEUED: np.full((ids.shape[0], 1), queued_ns, dtype=np.int64),
        BULK: np.full((ids.shape[0], 1), bulk, dtype=np.bool_),
        TOKEN_COUNT: np.count_nonzero(mask, axis=1)[:, None].astype(np.int64),
    }
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, array) for name, array in arrays.items() if name in wanted]
    )


def _later(request, ids: np.ndarray, mask: np.ndarray, wanted: set[str]) -> Callable[[], None]:
    """A call that answers bulk ``request`` with the outputs in ``wanted``, ``queued_ns`` stamped as it is called."""
    sender = request.get_response_sender()
    return lambda: sender.send(
        _response(ids, mask, time.monotonic_ns(), True, wanted), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    )


def request_outputs(request) -> set[str]:
    """The outputs ``request`` asks for.

    The ensemble asks for every output it maps, ``queued_ns`` among them; a direct caller that names only the tokens
    is not counted in flight, since no encoder step follows.
    """
    return set(request.requested_output_names())


def _answer(request, response) -> Callable[[], None]:
    """A call that sends ``response`` as ``request``'s one and final response."""
    sender = request.get_response_sender()
    return lambda: sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _refusal(request, message: str) -> Callable[[], None]:
    """A call that answers ``request`` UNAVAILABLE with ``message`` (a refusal of admission's)."""
    error = pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)
    return _answer(request, pb_utils.InferenceResponse(output_tensors=[], error=error))
