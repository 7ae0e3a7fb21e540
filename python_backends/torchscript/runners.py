"""Runs the TorchScript encoder on padded batches: length buckets everywhere, CUDA graph replay on a GPU.

No Triton imports here, so the runner is tested directly on CPU against the exported module.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from buckets import Bucket, GraphSettings, plan_chunks

CHUNK_OVERHEAD_TOKENS = 32
"""Cost of one more execution, in padded tokens: a launch costs what ~16-32 tokens do on 2 CPU cores
(docs/benchmarks.md, "Queue delay, chunks and threads")."""

OVERFLOW = "overflow"
"""Stats label of batches above the largest bucket (run eagerly at their exact shape)."""


def load_module(path: str | Path, device: torch.device) -> torch.jit.ScriptModule:
    """Load the exported TorchScript encoder onto ``device``, in eval mode.

    The file is read onto the CPU and its parameters and buffers are then moved: its traced constants stay CPU
    scalars. ``map_location=device`` would move them too, and the trace's ``int()`` of a sequence length plus such a
    constant would then wait on the GPU, which CUDA graph capture forbids.

    Raises:
        RuntimeError: the file is not a TorchScript module, or ``device`` is not available.
    """
    return torch.jit.load(str(path), map_location="cpu").to(device).eval()


def eager_label(length: int) -> str:
    """Stats label of an eager run padded to a bucket's ``length``: ``"*x32"``, since its rows stay exact."""
    return f"*x{length}"


@dataclass
class RunnerStats:
    """Counters since load, per label and path (``graph`` / ``eager``).

    Labels: a graph replay's bucket (``"8x32"``: 8 rows x 32 tokens), an eager run's padded length with its exact
    rows (``"*x32"``), or ``OVERFLOW``.

    Attributes:
        executions: ``Counter[(label, path)]``, module runs.
        real_tokens: tokens whose mask is 1, summed over executions.
        padded_tokens: tokens the module actually processed (padded batch size x padded length).
    """

    executions: Counter = field(default_factory=Counter)
    real_tokens: int = 0
    padded_tokens: int = 0

    @property
    def padding_ratio(self) -> float:
        """Real / padded tokens, 1.0 = no padding waste (1.0 before the first execution)."""
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    output: torch.Tensor


class BucketedRunner:
    """Pads each batch up to its bucket and runs the module once per batch.

    * Graph path (a CUDA device and ``settings.graphs``): one ``torch.cuda.CUDAGraph`` per bucket, captured at
      :meth:`warmup`; a batch is padded in both batch size and length, copied into the bucket's static buffers,
      replayed, and its real rows sliced out.
    * Eager path (CPU, graphs off, or no bucket): the batch is padded to its bucket's *length* only; padding rows
      would cost compute linearly and buys nothing without a graph. Above the largest bucket the batch runs at its
      exact shape and is counted under ``OVERFLOW``. The module runs with TorchScript's graph optimizer off
      (``torch.jit.optimized_execution(False)``): with it, the first call at each new shape is a p99 spike, for ~2%
      faster later calls (docs/benchmarks.md, "TorchScript graph optimizer").

    Padding positions hold id 0 and mask 0, which leaves every real row's embedding unchanged.
    """

    def __init__(
        self,
        module: torch.jit.ScriptModule,
        device: torch.device,
        settings: GraphSettings,
        *,
        on_execute: Callable[[str, str, int, int], None] | None = None,
        log: Callable[[str], None] = print,
        chunk_overhead_tokens: int = CHUNK_OVERHEAD_TOKENS,
    ) -> None:
        """Keep the module (already on ``device``); nothing runs until :meth:`warmup`.

        Args:
            module: ``(input_ids int64 [B, T], attention_mask int64 [B, T]) -> float32 [B, dim]``.
            device: where the module lives.
            settings: buckets and the graphs flag (``buckets.settings_from_model_config``).
            on_execute: called after each run with (bucket label, path, real tokens, padded tokens), for metrics.
            log: where load-time lines go.
            chunk_overhead_tokens: what splitting a batch into one more execution must save, in padded tokens.
        """
        self.module = module
        self.device = device
        self.table = settings.table
        self.use_graphs = settings.graphs and device.type == "cuda"
        self.on_execute = on_execute
        self.log = log
        self.chunk_overhead_tokens = chunk_overhead_tokens
        self.stats = RunnerStats()
        self._graphs: dict[Bucket, _Graph] = {}

    def _on_device(self) -> contextlib.AbstractContextManager:
        """Make ``self.device`` the current CUDA device, so streams, pools and graphs are made on it."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # -- load time --------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Run every bucket once (and capture its graph on GPU), so no request pays first-run costs.

        On the eager path each bucket length runs once at batch 1 and once at batch 2, not at the bucket's batch
        size: batch rows are not padded there, so the first call of each length is what warming saves.
        """
        start = time.perf_counter()
        if self.use_graphs:
            with self._on_device():
                self._capture_all()
        else:
            with torch.no_grad(), torch.jit.optimized_execution(False):
                for length in sorted({k.length for k in self.table.buckets}, reverse=True):
                    for batch in (1, 2):
                        ids, mask = self._dummy(batch, length)
                        self.module(ids, mask)
        took = time.perf_counter() - start
        if self.use_graphs:
            shapes = f"{len(self.table)} buckets, CUDA graphs on {self.device}; buckets {self.table!r}"
        else:
            lengths = sorted({k.length for k in self.table.buckets})
            shapes = f"{len(lengths)} bucket lengths, eager on {self.device} (rows exact); lengths {lengths}"
        self.log(f"warmup done in {took:.1f} s: {shapes}")

    def time_batches(self, length: int, batch_sizes: list[int], repeats: int = 3) -> dict[int, float]:
        """Seconds of one execution of ``batch`` texts of ``length`` tokens, per batch size, on this runner's path.

        Each size runs ``repeats`` times through the serving path (padding, graph replay or eager run, the copy to
        the host) and its fastest run is kept: other work on the cores (another server loading, a test, a build)
        only adds time, and a door sized from a slowed run refuses what the machine can serve. The runs are not
        counted in :attr:`stats` or the metrics. Call after :meth:`warmup`.

        Returns:
            ``{batch: seconds}``.
        """
        on_execute, self.on_execute = self.on_execute, None
        stats, self.stats = self.stats, RunnerStats()
        try:
            out = {}
            for batch in batch_sizes:
                ids = np.full((batch, length), 100, dtype=np.int64)
                mask = np.ones_like(ids)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    self(ids, mask)
                    times.append(time.perf_counter() - start)
                out[batch] = min(times)
            return out
        finally:
            self.on_execute, self.stats = on_execute, stats

    def _dummy(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((batch, length), 100, dtype=torch.int64, device=self.device)
        return ids, torch.ones_like(ids)

    def _capture_all(self, warmup_iters: int = 3) -> None:
        """Capture one graph per bucket, largest first, all in one memory pool (``self.device`` is current)."""
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        with torch.no_grad(), torch.jit.optimized_execution(False):
            for bucket in self.table.buckets:  # largest first: smaller graphs reuse the larger ones' pool
                ids, mask = self._dummy(bucket.batch_size, bucket.length)
                side = torch.cuda.Stream(device=self.device)
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    for _ in range(warmup_iters):
                        self.module(ids, mask)
                current.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = self.module(ids, mask)
                self._graphs[bucket] = _Graph(graph, ids, mask, output)
        torch.cuda.synchronize(self.device)
        used = (torch.cuda.memory_reserved(self.device) - reserved_before) / 2**20
        self.log(f"captured {len(self._graphs)} CUDA graphs in {time.perf_counter() - start:.1f} s, {used:.0f} MiB")

    # -- serving ----------------------------------------------------------------------------------------------
    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Embed int64 ``[B, T]`` inputs (right-padded, mask 0 on padding); returns float32 ``[B, dim]`` on the host.

        Rows are sorted by real length and split into the chunks :func:`buckets.plan_chunks` finds cheapest
        (``CHUNK_OVERHEAD_TOKENS`` per extra execution); each chunk runs padded to its own bucket.
        """
        lengths = _real_lengths(attention_mask)
        order = np.argsort(lengths, kind="stable")
        sorted_lengths = [int(x) for x in lengths[order]]
        out = None
        for start, end in plan_chunks(sorted_lengths, self._chunk_cost, self.chunk_overhead_tokens):
            rows = order[start:end]
            width = max(1, sorted_lengths[end - 1])
            part = self._run(input_ids[rows, :width], attention_mask[rows, :width])
            if out is None:
                out = np.empty((input_ids.shape[0], part.shape[1]), dtype=part.dtype)
            out[rows] = part
        return out

    def _chunk_cost(self, rows: int, length: int) -> int:
        """Padded tokens one execution of ``rows`` x ``length`` costs on this runner's path."""
        bucket = self.table.lookup(rows, max(1, length))
        if bucket is None:
            return rows * length
        return bucket.tokens if bucket in self._graphs else rows * bucket.length

    def _run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """One execution: graph replay of the batch's bucket, or eager padded to its bucket length (exact above)."""
        batch, length = input_ids.shape
        bucket = self.table.lookup(batch, length)
        real = int(np.count_nonzero(attention_mask))  # a reranker's mask holds 2 on a pair's second text
        if bucket is not None and bucket in self._graphs:
            with self._on_device():
                out = self._replay(self._graphs[bucket], input_ids, attention_mask)
            self._count(str(bucket), "graph", real, bucket.tokens)
            return out
        padded_length = bucket.length if bucket is not None else length
        ids, mask = _pad(input_ids, attention_mask, batch, padded_length)
        with torch.no_grad(), torch.jit.optimized_execution(False):
            out = self.module(torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device))
        self._count(eager_label(bucket.length) if bucket else OVERFLOW, "eager", real, batch * padded_length)
        return out.float().cpu().numpy()

    def _replay(self, g: _Graph, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        batch = input_ids.shape[0]
        ids, mask = _pad(input_ids, attention_mask, g.input_ids.shape[0], g.input_ids.shape[1])
        g.input_ids.copy_(torch.from_numpy(ids))
        g.attention_mask.copy_(torch.from_numpy(mask))
        g.graph.replay()
        return g.output[:batch].float().cpu().numpy()  # .cpu() waits for the replay; a copy, not the static buffer

    def _count(self, label: str, path: str, real: int, padded: int) -> None:
        self.stats.executions[(label, path)] += 1
        self.stats.real_tokens += real
        self.stats.padded_tokens += padded
        if self.on_execute is not None:
            self.on_execute(label, path, real, padded)


def _real_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """Per row, one past the last position whose mask is 1 (0 for an all-padding row)."""
    has = attention_mask.astype(bool)
    last = attention_mask.shape[1] - np.argmax(has[:, ::-1], axis=1)
    return np.where(has.any(axis=1), last, 0)


def _pad(input_ids: np.ndarray, attention_mask: np.ndarray, rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Zero-pad ``[B, T]`` inputs to ``[rows, length]`` (rows >= B, length >= T); no copy when already that shape."""
    if input_ids.shape == (rows, length):
        return input_ids, attention_mask
    ids = np.zeros((rows, length), dtype=np.int64)
    mask = np.zeros((rows, length), dtype=np.int64)
    b, t = input_ids.shape
    ids[:b, :t] = input_ids
    mask[:b, :t] = attention_mask
    return ids, mask
