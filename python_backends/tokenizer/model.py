"""Triton Python-based backend ``tokenizer``: TEXT -> input_ids / attention_mask.

Loaded by Triton for every model whose config says ``backend: "tokenizer"``. The tokenizer file is the model's
``<version>/tokenizer.json`` written by ``make model``: a Hugging Face fast tokenizer whose truncation is set to
the encoder's ``max_seq_length``, so ids equal what sentence-transformers feeds the transformer.

Per execute: all requests' texts are decoded, tokenised in ONE ``encode_batch`` call (texts over 4,096 characters
from their head when that gives the same ids: ``common/long_texts.py``), and split back per request.
Each response holds ``input_ids`` and ``attention_mask``, int64 ``[n_texts, T]`` where ``T`` is the longest text of
that request in tokens; shorter rows are padded with the tokenizer's pad id and mask 0. ``arrival_ns``, int64
``[n_texts, 1]``, is ``time.monotonic_ns()`` when this execute began plus the request's index in it (one clock for
every process on the host; unique per request, so it also orders them): the encoder sheds requests that can no
longer finish in time (``LATENCY_BUDGET_MS``, encoder config). ``tokenize_ns``, int64 ``[n_texts, 1]``, is the
request's own share of this execute's work (:func:`own_work_ns`), which the encoder does not count as waiting.

Admission control (``common/admission.py``): before answering, each request's finish is predicted from the load the
encoder named by ``ADMISSION_MODEL`` publishes (``common/loadboard.py``) plus the requests admitted here that it has
not taken yet; a request that would miss the encoder's latency budget (or the share of it that the encoder's
lateness feedback allows, ``common/target.py``) is refused at once (UNAVAILABLE, counted in
``triton_embed_shed_requests_total{model="tokenizer"}``) instead of queueing ~200 ms to be shed there. A
request (missing input, wrong shape, no texts, a text over ``MAX_TEXT_BYTES``, non-UTF-8 bytes, a NUL byte, or a
text over max_seq_length tokens when truncation is off) gets its own INVALID_ARG error; the others still succeed.

Config parameters: ``MAX_TEXT_BYTES`` (default 65536) and ``TRUNCATION`` (``truncate``, the default, cuts long
texts at max_seq_length as sentence-transformers does; ``error`` rejects them), ``ADMISSION_MODEL`` (the encoder
model whose load is read; empty = no admission control). Request parameters: ``truncate`` (true/false) overrides
``TRUNCATION``; ``latency_budget_ms`` overrides the encoder's budget (0 = never refuse); ``sent_ns`` (the client's
send, ``time.time_ns()``) makes the budget count the time the request took to get here too, beyond the
``SEND_ALLOWANCE_MS`` it leaves for that.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# The 2.51 Python backend stub starts its interpreter without reading PYTHONPATH; the embedded server passes its
# environment's site-packages there (triton_embed_server.layout.server_environment), so put them on sys.path
# before the third-party imports below. A no-op in images where the packages are installed system-wide.
for _path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)
# Code shared with the encoder backend (cost model, shedding, load board): python_backends/common, beside this
# backend's folder (resolved, because the embedded server's backend directory links to python_backends/tokenizer).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
# Batches here are a few short texts: the Rust thread pool of encode_batch only fights the encoder's torch
# threads for the cores (measured: tokenizer execution 4.1 ms -> 1.4 ms at 16 clients on 2 cores).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import triton_python_backend_utils as pb_utils
from admission import Backlog, cost_of
from loadboard import LoadReader
from long_texts import encode_heads, margin_chars
from metric_lifetime import keep
from shedding import (
    SHED_METRIC,
    SHED_METRIC_HELP,
    BudgetError,
    budget_from_parameters,
    late_arrival_ms,
    request_parameters,
    sent_age_ms,
)
from target import share_of
from tokenizers import Tokenizer

INPUT = "TEXT"
OUTPUTS = ("input_ids", "attention_mask")
ARRIVAL = "arrival_ns"
OWN_WORK = "tokenize_ns"
ENSEMBLE_HOP_MS = 1.0
"""Time for the ensemble to hand a tokenizer response to the encoder's queue, ms (rough; with this execute's
duration it is the transit that decides whether a new request can still join the encoder's next batch)."""
TRANSIT_ALPHA = 0.1


class RequestError(ValueError):
    """A problem with one request; becomes that request's INVALID_ARG response."""


def decode_texts(tensor, max_bytes: int) -> list[str]:
    """Decode a TEXT tensor (``[n, 1]`` of UTF-8 bytes) into ``n`` strings.

    Raises:
        RequestError: the tensor is missing, not ``[n, 1]``, has no rows, or a row is longer than ``max_bytes``,
            is not valid UTF-8, or holds a NUL byte.
    """
    if tensor is None:
        raise RequestError(f"missing input tensor '{INPUT}'")
    array = tensor.as_numpy()
    if array.ndim != 2 or array.shape[1] != 1:
        raise RequestError(f"input '{INPUT}' must have shape [batch, 1]; got {list(array.shape)}")
    if array.shape[0] == 0:
        raise RequestError(f"input '{INPUT}' has 0 texts; at least 1 is required")
    texts = []
    for row, item in enumerate(array[:, 0]):
        raw = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        if len(raw) > max_bytes:
            raise RequestError(f"input '{INPUT}' row {row} has {len(raw)} bytes; the limit is {max_bytes} bytes")
        if b"\0" in raw:
            raise RequestError(
                f"input '{INPUT}' row {row} holds a NUL byte at offset {raw.index(0)}; a text may not hold one"
            )
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise RequestError(
                f"input '{INPUT}' row {row} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                f"({exc.reason})"
            ) from None
    return texts


def own_work_ns(chars_per_request: list[int], work_ns: int) -> list[int]:
    """Each request's share of ``work_ns`` (this execute's decoding and tokenization, ns) by characters tokenized.

    ``chars_per_request``: the characters tokenized for each request (``long_texts.encode_heads``: a long text read
    from its head counts its head), 0 for a request that failed decoding.

    The encoder does not count a request's share as waiting (``tokenize_ns``): 32 texts of 65,000 characters without
    a space take ~0.5 s to tokenize into one token each, so an idle server shed them at every try as "waited 522 ms"
    (a new user's trial). Tokenization time grows about linearly with the characters tokenized; the rest of the
    execute (the other requests' texts) still counts as waiting.
    """
    total = sum(chars_per_request)
    return [work_ns * n // total if total else 0 for n in chars_per_request]


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
        admission_model = params.get("ADMISSION_MODEL", "")
        # The stub's parent is the tritonserver process; the encoder's stubs publish under the same pid.
        self.loads = LoadReader(os.getppid(), admission_model) if admission_model else None
        instances = sum(int(group.get("count", 1)) for group in self.model_config.get("instance_group", [])) or 1
        self.backlog = Backlog(share=instances)
        self._transit_ms = 1.0  # moving average: this execute's duration + ENSEMBLE_HOP_MS (see _admit)
        self._refused_ns = 0  # when this instance last refused a request (monotonic ns)
        self._shed_family = pb_utils.MetricFamily(
            name=SHED_METRIC, description=SHED_METRIC_HELP, kind=pb_utils.MetricFamily.COUNTER
        )
        self._shed_metric = self._shed_family.Metric(labels={"model": args["model_name"]})

    def finalize(self) -> None:
        """Leave the metric and its family to Triton (``common/metric_lifetime.py``), so a reload keeps its own."""
        keep(self._shed_metric, self._shed_family)
        self._shed_metric = None
        self._shed_family = None

    def _truncates(self, parameters: dict) -> bool:
        """Truncate this request's long texts? Request parameter ``truncate`` (bool) wins over ``TRUNCATION``.

        Args:
            parameters: the request's parameters (``shedding.request_parameters``).

        Raises:
            RequestError: ``truncate`` is present but not a bool.
        """
        value = parameters.get("truncate")
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"request parameter 'truncate' must be true or false; got {value!r}")
        return self.truncate == "truncate" if value is None else value

    def execute(self, requests: list) -> list:
        """Tokenise all requests' texts in one call; one response per request, in order."""
        arrival_ns = time.monotonic_ns()  # + request index: one unique, ordered stamp per request
        wall_ns = time.time_ns()  # the clock of the request parameter sent_ns
        parameters = [request_parameters(request.parameters()) for request in requests]  # parsed once per request
        texts_per_request: list[list[str] | None] = []
        errors: dict[int, str] = {}
        for i, request in enumerate(requests):
            try:
                texts_per_request.append(
                    decode_texts(pb_utils.get_input_tensor_by_name(request, INPUT), self.max_text_bytes)
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
        own_ns = own_work_ns([sum(c) if c else 0 for c in chars_of], time.monotonic_ns() - arrival_ns)

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
                        f"input '{INPUT}' row {long} has {'' if whole else 'at least '}"
                        f"{token_count(encs[long], self._special_tokens)} tokens; the limit is {self.max_tokens} "
                        "(the model's max_seq_length) and truncation is off for this request"
                    )
        refusals = self._admit(requests, per_request, errors, arrival_ns, wall_ns, parameters=parameters)
        responses = []
        for i, encs in enumerate(per_request):
            if i in errors:
                error = pb_utils.TritonError(errors[i], pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            if i in refusals:
                error = pb_utils.TritonError(refusals[i], pb_utils.TritonError.UNAVAILABLE)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            ids, mask = pad_rows([e.ids for e in encs], self.pad_id)
            arrival = np.full((len(encs), 1), arrival_ns + i, dtype=np.int64)
            tensors = [pb_utils.Tensor(OUTPUTS[0], ids), pb_utils.Tensor(OUTPUTS[1], mask)]
            tensors.append(pb_utils.Tensor(ARRIVAL, arrival))
            tensors.append(pb_utils.Tensor(OWN_WORK, np.full((len(encs), 1), own_ns[i], dtype=np.int64)))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        took_ms = (time.monotonic_ns() - arrival_ns) / 1e6
        self._transit_ms += TRANSIT_ALPHA * (took_ms + ENSEMBLE_HOP_MS - self._transit_ms)
        return responses

    def _admit(
        self,
        requests: list,
        per_request: list,
        errors: dict[int, str],
        arrival_ns: int,
        wall_ns: int,
        *,
        parameters: list[dict],
    ) -> dict[int, str]:
        """Admission control: ``{request index: UNAVAILABLE message}`` for requests refused (see the module doc).

        Requests already in ``errors`` are skipped, and so are those that do not ask for ``arrival_ns`` (direct callers
        of this model; the ensemble asks for it); a bad ``latency_budget_ms`` or ``sent_ns`` parameter is added to
        ``errors`` (INVALID_ARG). A request with ``sent_ns`` (the client's send; ``wall_ns`` is now on the same clock)
        has its budget cut by how late it arrived (``shedding.late_arrival_ms``). Without a published encoder load
        nothing is refused.
        """
        if self.loads is None:
            return {}
        loads = self.loads.read(arrival_ns)
        if not loads:
            return {}
        latest = max(loads, key=lambda load: load.updated_ns)
        share = share_of(loads, arrival_ns)
        cost = cost_of(loads, arrival_ns, refused_ns=self._refused_ns)
        plan = self.backlog.plan(loads, cost, arrival_ns, transit_ms=self._transit_ms)
        refusals: dict[int, str] = {}
        for i, encs in enumerate(per_request):
            if encs is None or i in errors or ARRIVAL not in requests[i].requested_output_names():
                continue  # a direct caller of this model, not the ensemble: nothing goes on to the encoder
            try:
                budget = budget_from_parameters(parameters[i], latest.budget_ms)
                waited = late_arrival_ms(sent_age_ms(parameters[i], wall_ns))
            except BudgetError as exc:
                errors[i] = str(exc)
                continue
            rows, width = len(encs), max(len(e.ids) for e in encs)
            refusal = plan.judge(rows, width, budget, share, waited_ms=waited)
            if refusal is None:
                self.backlog.admit(plan, arrival_ns + i, rows, width, budget)
                continue
            refusals[i] = refusal.message()
            # Only a refusal the queue causes makes admission cautious for everyone (admission.cost_of); one that
            # the client's late arrival alone causes (a clock behind ours, its own stalls) must not.
            if not waited or plan.judge(rows, width, budget, share) is not None:
                self._refused_ns = arrival_ns
        if refusals:
            self._shed_metric.increment(len(refusals))
        return refusals
