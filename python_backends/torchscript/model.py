"""Triton Python-based backend ``torchscript``: runs a TorchScript sentence encoder on ragged batches.

Loaded by Triton for every model whose config says ``backend: "torchscript"``. The module is the model's
``<version>/model.pt`` written by ``make model``: ``(input_ids int64 [B, T], attention_mask int64 [B, T]) ->
float32 [B, dim]``. Limits (``max_seq_length``, ``vocab_size``, ``dim``) come from ``<version>/export.json``.

The config marks both inputs ``allow_ragged_batch``, so one execute may hold requests of different token lengths.
They are validated one by one (a bad one gets its own INVALID_ARG response), merged into one batch, run ONCE by
:class:`runners.BucketedRunner` (padded up to a length bucket; CUDA graph replay per bucket on a GPU instance),
and the rows are split back per request.

Overload control (``triton_embed_protocol.admission.EncoderAdmission``, docs/overload.md): the tokenizer stamps each
request with ``queued_ns`` as it hands it on (``time.monotonic_ns()``, one clock for every process on the host) and
counts it in flight. At each execution the requests that have waited longer than their latency budget since that
stamp (the request parameter ``latency_budget_ms``, else the config parameter ``LATENCY_BUDGET_MS``; 0 = none, as
shipped on CPU) are answered UNAVAILABLE, ``REFUSAL_HOLD_MS`` after the stamp, instead of being computed late; counted
in ``triton_embed_shed_requests_total``. Every request with a stamp is counted out of flight once answered, its texts
in the lane the tokenizer chose for it (``bulk``, sent with ``queued_ns``).

Buckets come from ``optimization.cuda.graph_spec`` in the model config (see ``buckets.py``). Every bucket runs
during ``initialize``, so the model is READY only when warm. Per-bucket counters are exported on Triton's metrics
endpoint: ``triton_embed_bucket_executions_total{model, bucket, path}``, ``triton_embed_real_tokens_total`` and
``triton_embed_padded_tokens_total`` (padding ratio = real / padded).
"""

from __future__ import annotations

import json
import os
import site
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Triton 2.51 workaround (docs/troubleshooting.md): the stub starts its interpreter without reading PYTHONPATH.
# The embedded server passes its environment's site-packages there (triton_embed_server.layout.server_environment),
# so add them before the third-party imports below. A no-op in images where the packages are installed system-wide.
for _path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)
        site.addsitedir(_path)  # its .pth files too: the editable install of triton_embed_protocol

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from buckets import BucketConfigError, settings_from_model_config
from runners import BucketedRunner, load_module
from triton_embed_protocol import (
    BULK,
    QUEUED,
    TOKENS,
    RequestError,
    config_number,
    config_parameters,
    model_of_step,
    request_parameters,
)
from triton_embed_protocol.admission import EncoderAdmission, HandOff, RefusalCounter, Ticket
from triton_embed_protocol.capacity import (
    CURVE_GAUGE,
    KNOB_GAUGE,
    REF_TOKENS,
    AdmissionConfig,
    Limits,
    ServiceCurve,
    grid,
    timing_alone,
)
from triton_embed_protocol.cpu import usable_cores
from triton_embed_protocol.metric_lifetime import keep

OUTPUT = "embedding__0"
LOGIT = "logit__0"
"""A reranker's second output, its raw logit per pair (``OUTPUT`` holds the score): declared in its config only."""


def read_request(
    request, max_seq_length: int, vocab_size: int, mask_values: tuple[int, ...] = (0, 1)
) -> tuple[np.ndarray, np.ndarray]:
    """Return one request's (input_ids, attention_mask), int64 ``[n, T]``, after checking them.

    ``mask_values``: what the mask may hold; a reranker's also 2 (a pair's second text).

    Raises:
        RequestError: an input is missing, the two shapes differ, a shape is not ``[n >= 1, 1 <= T <= max_seq_length]``,
            a token id is outside ``[0, vocab_size)``, or a mask value is not one of ``mask_values``.
    """
    arrays = []
    for name in TOKENS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise RequestError(f"missing input tensor '{name}'")
        arrays.append(tensor.as_numpy())
    ids, mask = arrays
    if ids.shape != mask.shape:
        raise RequestError(f"'{TOKENS[0]}' has shape {list(ids.shape)} but '{TOKENS[1]}' has {list(mask.shape)}")
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise RequestError(f"'{TOKENS[0]}' must have shape [batch >= 1, tokens >= 1]; got {list(ids.shape)}")
    if ids.shape[1] > max_seq_length:
        raise RequestError(f"'{TOKENS[0]}' has {ids.shape[1]} tokens per row; the limit is {max_seq_length}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise RequestError(f"'{TOKENS[0]}' holds token id {bad}; ids must be in [0, {vocab_size})")
    if not np.isin(mask, mask_values).all():
        raise RequestError(f"'{TOKENS[1]}' must hold only {' and '.join(map(str, mask_values))}")
    return ids, mask


def hand_off(request) -> HandOff | None:
    """The tokenizer's hand-off of ``request``: its ``queued_ns`` (int64 ``[n, 1]``) and ``bulk`` (bool ``[n, 1]``).

    Returns:
        when it was handed on (the first row's stamp), its ``n`` texts and its lane; None for a direct caller that
        sends neither tensor, or no rows.

    Raises:
        RequestError: one of the two tensors without the other (Triton refuses rows that differ before this runs).
    """
    stamp = pb_utils.get_input_tensor_by_name(request, QUEUED)
    lane = pb_utils.get_input_tensor_by_name(request, BULK)
    if stamp is None and lane is None:
        return None
    if stamp is None or lane is None:
        given, missing = (QUEUED, BULK) if lane is None else (BULK, QUEUED)
        raise RequestError(f"input '{given}' came without '{missing}'; the tokenizer hands on the two together")
    stamps, lanes = stamp.as_numpy().reshape(-1), lane.as_numpy().reshape(-1)
    return HandOff(int(stamps[0]), int(stamps.size), bool(lanes[0])) if stamps.size else None


def last_real_column(mask: np.ndarray) -> int:
    """Index of the last column of ``mask`` ``[n, T]`` holding a 1 in any row; 0 when there is none."""
    columns = np.flatnonzero(mask.any(axis=0))
    return int(columns[-1]) if columns.size else 0


def merge_ragged(pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Stack requests of different widths into one batch padded to the longest real sequence.

    Args:
        pieces: per request (input_ids, attention_mask), int64 ``[n_i, T_i]``.

    Returns:
        (input_ids, attention_mask), int64 ``[sum n_i, T]`` where ``T`` is one past the last column whose mask is 1
        in any row (at least 1); padding positions hold id 0 and mask 0, which leaves every row's embedding unchanged.
    """
    width = max(last_real_column(mask) + 1 for _, mask in pieces)
    rows = sum(ids.shape[0] for ids, _ in pieces)
    ids_out = np.zeros((rows, width), dtype=np.int64)
    mask_out = np.zeros((rows, width), dtype=np.int64)
    row = 0
    for ids, mask in pieces:
        n, t = ids.shape
        t = min(t, width)
        ids_out[row : row + n, :t] = ids[:, :t]
        mask_out[row : row + n, :t] = mask[:, :t]
        row += n
    return ids_out, mask_out


class TritonPythonModel:
    """Encoder step of the ``embed`` ensemble."""

    def initialize(self, args: dict) -> None:
        """Load the TorchScript module, time it and export the limits.

        Torch threads: ``TORCH_NUM_THREADS``; 0 (shipped) = the cores it may use (``cpu.usable_cores``).
        """
        self.model_config = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        module_path, manifest_path = version_dir / "model.pt", version_dir / "export.json"
        for path in (module_path, manifest_path):
            if not path.is_file():
                raise pb_utils.TritonModelException(f"{path} not found: run `make model` to export the encoder")
        manifest = json.loads(manifest_path.read_text())
        self.max_seq_length = int(manifest["max_seq_length"])
        self.vocab_size = int(manifest["vocab_size"])

        params = config_parameters(self.model_config)
        try:
            threads = config_number(params, "TORCH_NUM_THREADS", "0", integer=True)
            knobs = AdmissionConfig.read(params)  # every admission knob checked before the warmup
        except ValueError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None
        precision = manifest.get("precision", "fp32")
        configured = params.get("PRECISION", precision)
        if configured != precision:
            raise pb_utils.TritonModelException(
                f"config parameter PRECISION is {configured!r} (fp32, bf16 or fp16) but {module_path} computes at "
                f"{precision!r} ({manifest_path.name}): export again (make model; compose and Kubernetes: the "
                "model-export step), which sets both"
            )
        threads, threads_how = (threads, "TORCH_NUM_THREADS in the config") if threads else usable_cores()
        torch.set_num_threads(threads)

        if args.get("model_instance_kind") == "GPU":
            device = torch.device("cuda", int(args["model_instance_device_id"]))
            torch.cuda.set_device(device)  # this instance's stub process works on its own GPU only
        else:
            device = torch.device("cpu")
        try:
            buckets = settings_from_model_config(self.model_config, max_seq_length=self.max_seq_length)
        except BucketConfigError as exc:
            raise pb_utils.TritonModelException(f"model '{args['model_name']}': {exc}") from None
        module = load_module(module_path, device)
        pb_utils.Logger.log_info(
            f"{args['model_name']} (instance {args['model_instance_name']}): {manifest.get('model_type', '?')} at "
            f"{precision} ({manifest.get('precision_reason', 'fp32')}; min cosine to fp32 sentence-transformers "
            f"{manifest.get('min_cosine', 1.0):.7f}), {manifest.get('attention', '?')} attention, "
            f"dim {manifest['dim']}, max_seq_length {self.max_seq_length}, on {device}"
            + (f", torch threads {threads} ({threads_how})" if device.type == "cpu" else "")
        )
        self._metrics = _BucketMetrics(args["model_name"])
        self.runner = BucketedRunner(
            module,
            device,
            buckets,
            on_execute=self._metrics.record,
            log=lambda line: pb_utils.Logger.log_info(
                f"{args['model_name']} (instance {args['model_instance_name']}): {line}"
            ),
        )
        lock = f"cuda{device.index}" if device.type == "cuda" else "cpu"
        with timing_alone(lock) as waited:  # timed beside another encoder's warmup, executions read 2-3x slow
            self.runner.warmup()
            self._admit(args, knobs, threads if device.type == "cpu" else None, waited)
        out_cfg = pb_utils.get_output_config_by_name(self.model_config, OUTPUT)
        self.output_dtype = pb_utils.triton_string_to_numpy(out_cfg["data_type"])
        self.dim = int(out_cfg["dims"][-1])
        self.logits = pb_utils.get_output_config_by_name(self.model_config, LOGIT) is not None  # a reranker
        self.mask_values = (0, 1, 2) if self.logits else (0, 1)
        if self.dim != int(manifest["dim"]):
            raise pb_utils.TritonModelException(
                f"config says '{OUTPUT}' has dims [{self.dim}] but {module_path} returns {manifest['dim']}; "
                "re-run `make model`, which sets the configs' dims"
            )

    def _admit(self, args: dict, knobs: AdmissionConfig, threads: int | None, waited: float | None) -> None:
        """Time the executions at load; admission derives its knobs from them and tells the tokenizer.

        ``knobs``: the config's admission knobs (read before the warmup). ``threads``: torch threads to share among
        the busy models (None: a GPU instance). ``waited``: seconds this encoder waited for the host's timing lock
        (``capacity.timing_alone``; None: it times without it).
        """
        name = f"{args['model_name']} (instance {args['model_instance_name']})"
        max_batch = int(self.model_config.get("max_batch_size", 0)) or 64
        tokens = min(REF_TOKENS, self.max_seq_length)
        curve = ServiceCurve(self.runner.time_batches(tokens, grid(max_batch)), max_batch)
        self.admission = EncoderAdmission(
            args["model_repository"],
            model_of_step(args["model_name"]),
            knobs,
            curve,
            threads=threads,
            publish=self._metrics.admission,
            count_refused=self._metrics.refused,
        )
        pb_utils.Logger.log_info(
            f"{name}: admission {self.admission.limits.describe()}; service curve at {tokens} tokens a text, "
            + (
                "timed without the timing lock (held too long, or no lock file): "
                if waited is None
                else "timed alone on the host: "
            )
            + ", ".join(f"{rows} in {seconds * 1000:.1f} ms" for rows, seconds in curve.table())
        )

    def finalize(self) -> None:
        """Answer the refusals still held; leave the metrics to Triton (``metric_lifetime.py``).

        The in-flight file stays: Triton finalizes an old instance after its replacement loaded, and the new one has
        written its ``MAX_IN_FLIGHT`` there already.
        """
        self.admission.close()
        self._metrics.close()

    def execute(self, requests: list) -> None:
        """Validate each request, refuse those that waited past their budget, run the rest as one batch, split the rows.

        Every request is answered through its response sender: at once, or a refusal when it falls due
        (``overload.RefusalHold``), so that a held refusal never holds up the next execution. Admission
        (``triton_embed_protocol.admission.EncoderAdmission``) begins and ends each execution: the requests the
        tokenizer counted in flight are counted out, whatever happens.
        """
        started = time.perf_counter()
        threads = self.admission.begin(len(requests))
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self._rows = 0
        try:
            self._execute(requests)
        finally:
            self.admission.end(self._rows, time.perf_counter() - started)

    def _execute(self, requests: list) -> None:
        """Validate -> refuse (the wait rule) -> merge -> run -> split; every request answered once."""
        now_ns = time.monotonic_ns()
        items = [self._validate(request, now_ns) for request in requests]
        tickets = [it.ticket for it in items]
        for k in self.admission.refuse_late(tickets, lambda i, message: _refusal(items[i].request, message)):
            items[k].piece = None
        live = [it for it in items if it.piece is not None]
        embeddings = self._run([it.piece for it in live]) if live else None
        self.admission.served([it.ticket for it in live], time.monotonic_ns())
        row = 0
        for it in items:
            if it.piece is not None:
                n = it.piece[0].shape[0]
                outputs = self._outputs(it.request, embeddings[row : row + n])
                row += n
                _answer(it.request, pb_utils.InferenceResponse(output_tensors=outputs))()
            elif it.ticket.error is not None:
                error = pb_utils.TritonError(it.ticket.error, pb_utils.TritonError.INVALID_ARG)
                _answer(it.request, pb_utils.InferenceResponse(output_tensors=[], error=error))()

    def _validate(self, request, now_ns: int) -> _Request:
        """One request read and checked: its tokens, or its INVALID_ARG message in its admission ticket."""
        try:
            handed = hand_off(request)
        except RequestError as exc:
            return _Request(request, Ticket(None, None, 0, 0, error=str(exc)))
        ticket = self.admission.ticket(request_parameters(request.parameters()), handed, now_ns)
        item = _Request(request, ticket)
        if ticket.error is None:
            try:
                item.piece = read_request(request, self.max_seq_length, self.vocab_size, self.mask_values)
            except RequestError as exc:
                ticket.error = str(exc)
        return item

    def _run(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Merge the requests' tokens into one batch and run it once: ``(rows, dim)`` of the output dtype.

        A reranker's module returns ``(rows, 2)``: its scores, then its logits.
        """
        ids, mask = merge_ragged(pieces)
        self._rows = ids.shape[0]
        embeddings = self.runner(ids, mask).astype(self.output_dtype, copy=False)
        width = self.dim + self.logits
        if embeddings.shape != (ids.shape[0], width):
            raise pb_utils.TritonModelException(
                f"module returned {list(embeddings.shape)} for a batch of {ids.shape[0]}; expected "
                f"[{ids.shape[0]}, {width}]"
            )
        return embeddings

    def _outputs(self, request, rows: np.ndarray) -> list:
        """A request's output tensors from its ``rows`` of the module's output.

        The embedding (a reranker's score), and a reranker's logit when the request asks for it.
        """
        outputs = [pb_utils.Tensor(OUTPUT, np.ascontiguousarray(rows[:, : self.dim]))]
        if self.logits and LOGIT in request.requested_output_names():
            outputs.append(pb_utils.Tensor(LOGIT, np.ascontiguousarray(rows[:, self.dim :])))
        return outputs


@dataclass
class _Request:
    """One request of an execution, as :meth:`TritonPythonModel._validate` read it.

    Attributes:
        request: Triton's request.
        ticket: what admission reads of it (its wait, budget and counts in flight; its INVALID_ARG message).
        piece: its (input_ids, attention_mask), int64 ``[n, T]``; None once refused or when invalid.
    """

    request: object
    ticket: Ticket
    piece: tuple[np.ndarray, np.ndarray] | None = None


def _answer(request, response) -> Callable[[], None]:
    """A call that sends ``response`` as ``request``'s one and final response."""
    sender = request.get_response_sender()
    return lambda: sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _refusal(request, message: str) -> Callable[[], None]:
    """A call that answers ``request`` UNAVAILABLE with ``message`` (a refusal of admission's)."""
    error = pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)
    return _answer(request, pb_utils.InferenceResponse(output_tensors=[], error=error))


class _BucketMetrics:
    """Custom metrics on Triton's ``/metrics`` (Python backend ``MetricFamily``), labelled by model."""

    def __init__(self, model: str) -> None:
        self.model = model
        counter = pb_utils.MetricFamily.COUNTER
        self._executions = pb_utils.MetricFamily(
            name="triton_embed_bucket_executions_total",
            description="Encoder executions per length bucket (BxT or overflow) and path (graph or eager)",
            kind=counter,
        )
        self._real = pb_utils.MetricFamily(
            name="triton_embed_real_tokens_total",
            description="Tokens with attention mask 1 run by the encoder",
            kind=counter,
        )
        self._padded = pb_utils.MetricFamily(
            name="triton_embed_padded_tokens_total",
            description="Tokens the encoder computed including padding (padded batch x padded length)",
            kind=counter,
        )
        gauge = pb_utils.MetricFamily.GAUGE
        self._knobs = pb_utils.MetricFamily(
            name=KNOB_GAUGE,
            description="Admission knobs in force (docs/overload.md): SLA_MS, MAX_IN_FLIGHT, BULK_IN_FLIGHT, "
            "BULK_TEXTS, FLOOD_LATENCY_MS, SERVED_P99_MS; how=pinned, or what it was derived from",
            kind=gauge,
        )
        self._curve = pb_utils.MetricFamily(
            name=CURVE_GAUGE,
            description="The encoder's service curve: predicted seconds of one execution by its rows (measured at "
            "load, then the executions served)",
            kind=gauge,
        )
        self._gauges: dict[tuple, object] = {}
        self.refused = RefusalCounter(pb_utils.MetricFamily, model)
        """counts the requests the wait rule refused (admission's ``count_refused``)"""
        self._real_metric = self._real.Metric(labels={"model": model})
        self._padded_metric = self._padded.Metric(labels={"model": model})
        self._by_bucket: dict[tuple[str, str], object] = {}

    def record(self, bucket: str, path: str, real_tokens: int, padded_tokens: int) -> None:
        """Count one execution."""
        metric = self._by_bucket.get((bucket, path))
        if metric is None:
            metric = self._executions.Metric(labels={"model": self.model, "bucket": bucket, "path": path})
            self._by_bucket[(bucket, path)] = metric
        metric.increment(1)
        self._real_metric.increment(real_tokens)
        self._padded_metric.increment(padded_tokens)

    def admission(self, limits: Limits, curve: ServiceCurve) -> None:
        """Set the admission knobs' gauges (labelled ``knob`` and ``source``: pinned or derived) and the curve's."""
        for knob, value in limits.knobs().items():
            source = "pinned" if limits.how.get(knob, "pinned") == "pinned" else "derived"
            self._gauge(self._knobs, {"knob": knob, "source": source}).set(value)
        for rows, seconds in curve.table():
            self._gauge(self._curve, {"rows": str(rows)}).set(seconds)

    def _gauge(self, family, labels: dict[str, str]):
        key = (id(family), *sorted(labels.items()))
        if key not in self._gauges:
            self._gauges[key] = family.Metric(labels={"model": self.model, **labels})
        return self._gauges[key]

    def close(self) -> None:
        """Keep every metric and family alive for good, then drop this instance's references.

        Releasing them would delete the reloaded instance's metrics (``metric_lifetime.py``).
        """
        keep(*self._by_bucket.values(), *self._gauges.values(), self._real_metric, self._padded_metric)
        keep(self._executions, self._real, self._padded, self._knobs, self._curve)
        self.refused.close()
        self._by_bucket.clear()
        self._gauges.clear()
        self._real_metric = self._padded_metric = None
        self._executions = self._real = self._padded = None
