"""Length buckets for the ``torchscript`` backend: one list of (batch size, length) shapes, one derived lookup.

A batch of ``B`` rows whose longest sequence is ``T`` tokens runs padded up to the smallest bucket that holds it
(fewest padded tokens ``b * l``; ties go to the shorter length). A batch larger than every bucket, or longer,
has no bucket and runs eagerly at its exact shape; the runner counts those.

The list comes from the model config's standard CUDA-graph fields, as TensorRT's backend reads them::

    optimization { cuda {
      graphs: true
      graph_spec [ { batch_size: 8  input { key: "input_ids" value: { dim: [ 32 ] } } }, ... ]
    } }

and defaults to :func:`default_grid` when no ``graph_spec`` is given: ``DEFAULT_BATCH_SIZES x`` powers of two from
16 up to the model's ``max_seq_length``, each bucket past batch 1 at most ``DEFAULT_MAX_TOKENS`` tokens. Buckets
longer than ``max_seq_length`` are dropped: no request reaches them. ``make model`` writes the CPU config's list with
:func:`bucket_lengths`, so a long-context model's buckets reach its limit. This module is pure Python + NumPy (no
torch, no Triton) so it is unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_LENGTHS = (16, 32, 64, 128, 256)
"""The default grid's lengths for a model of ``max_seq_length`` 256 (``default_grid``)."""
DEFAULT_MAX_TOKENS = 64 * 256
"""Largest bucket of the default grid, tokens: past 256 tokens its batch sizes shrink, so a CUDA graph of a long
bucket holds no more activations than the 64 x 256 one."""


def bucket_lengths(max_seq_length: int, *, smallest: int = 8, half_steps: bool = True) -> list[int]:
    """Bucket lengths from ``smallest`` up to ``max_seq_length``, which is always the last.

    The lengths are ``smallest`` times powers of two and, with ``half_steps``, 1.5 times each power past the first:
    8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, ... A batch padded to its bucket wastes at most a third
    of its tokens past 16 (half without ``half_steps``).

    Raises:
        ValueError: ``max_seq_length`` or ``smallest`` is below 1.
    """
    if max_seq_length < 1 or smallest < 1:
        raise ValueError(f"max_seq_length and smallest must be >= 1; got {max_seq_length}, {smallest}")
    lengths, power = [], smallest
    while power < max_seq_length:
        lengths.append(power)
        if half_steps and power > smallest and power * 3 // 2 < max_seq_length:
            lengths.append(power * 3 // 2)
        power *= 2
    return [*lengths, max_seq_length]


def default_grid(max_seq_length: int = DEFAULT_LENGTHS[-1]) -> BucketTable:
    """The buckets without a ``graph_spec``, for a model of ``max_seq_length`` tokens.

    ``DEFAULT_BATCH_SIZES`` x :func:`bucket_lengths` (powers of two from 16), keeping the buckets of at most
    ``DEFAULT_MAX_TOKENS`` tokens (and batch 1 at every length).
    """
    lengths = bucket_lengths(max_seq_length, smallest=DEFAULT_LENGTHS[0], half_steps=False)
    return BucketTable(
        (b, length) for b in DEFAULT_BATCH_SIZES for length in lengths if b == 1 or b * length <= DEFAULT_MAX_TOKENS
    )


class BucketConfigError(ValueError):
    """The model config's bucket list is malformed; the message names the field and the value."""


@dataclass(frozen=True, order=True)
class Bucket:
    """One padded shape: ``batch_size`` rows x ``length`` tokens."""

    batch_size: int
    length: int

    @property
    def tokens(self) -> int:
        """Padded tokens in one execution of this bucket (``batch_size * length``)."""
        return self.batch_size * self.length

    def __str__(self) -> str:
        return f"{self.batch_size}x{self.length}"


class BucketTable:
    """The bucket list and its lookup table.

    Attributes:
        buckets: the buckets, largest first (the order CUDA graphs are captured in, so smaller graphs reuse the
            memory pool of the larger ones).
        max_batch_size, max_length: the largest batch size / length any bucket holds.
    """

    def __init__(self, buckets: Iterable[tuple[int, int] | Bucket]) -> None:
        """Build from ``(batch_size, length)`` pairs (duplicates dropped).

        Raises:
            BucketConfigError: the list is empty or a size is not a positive integer.
        """
        unique = {Bucket(int(b), int(length)) for b, length in (_pair(x) for x in buckets)}
        if not unique:
            raise BucketConfigError("no buckets given")
        for bucket in unique:
            if bucket.batch_size < 1 or bucket.length < 1:
                raise BucketConfigError(f"bucket {bucket} must have batch_size >= 1 and length >= 1")
        self.buckets = tuple(sorted(unique, key=lambda k: (-k.tokens, -k.length)))
        self.max_batch_size = max(k.batch_size for k in unique)
        self.max_length = max(k.length for k in unique)
        # _index[b, t] = position in self.buckets of the bucket for a batch of b rows and t tokens, -1 if none.
        best = np.full((self.max_batch_size + 1, self.max_length + 1), -1, dtype=np.int32)
        cost = np.full(best.shape, np.iinfo(np.int64).max, dtype=np.int64)
        for i, k in enumerate(self.buckets):
            better = cost[: k.batch_size + 1, : k.length + 1] >= k.tokens  # later (smaller/shorter) wins ties
            best[: k.batch_size + 1, : k.length + 1][better] = i
            cost[: k.batch_size + 1, : k.length + 1][better] = k.tokens
        self._index = best

    @classmethod
    def grid(cls, batch_sizes: Iterable[int], lengths: Iterable[int]) -> BucketTable:
        """Every combination of ``batch_sizes`` and ``lengths``."""
        return cls((b, length) for b in batch_sizes for length in lengths)

    def lookup(self, batch_size: int, length: int) -> Bucket | None:
        """The smallest bucket holding ``batch_size`` rows of ``length`` tokens, or None above the largest."""
        if batch_size < 1 or length < 1:
            raise ValueError(f"batch_size and length must be >= 1; got {batch_size}, {length}")
        if batch_size > self.max_batch_size or length > self.max_length:
            return None
        i = int(self._index[batch_size, length])
        return self.buckets[i] if i >= 0 else None

    def __len__(self) -> int:
        return len(self.buckets)

    def __repr__(self) -> str:
        return f"BucketTable([{', '.join(map(str, sorted(self.buckets)))}])"


def _pair(item: tuple[int, int] | Bucket) -> tuple[int, int]:
    return (item.batch_size, item.length) if isinstance(item, Bucket) else item


@dataclass(frozen=True)
class GraphSettings:
    """What ``optimization.cuda`` in the model config asks for.

    Attributes:
        graphs: ``optimization.cuda.graphs``: capture CUDA graphs (only on a GPU instance).
        table: the buckets, from ``graph_spec`` or the default grid.
        from_config: True when ``graph_spec`` gave the buckets, False for the default grid.
    """

    graphs: bool
    table: BucketTable
    from_config: bool


def settings_from_model_config(
    config: dict, *, input_name: str = "input_ids", max_seq_length: int = DEFAULT_LENGTHS[-1]
) -> GraphSettings:
    """Read buckets and the graphs flag from a model config as Triton passes it (``json.loads(args["model_config"])``).

    ``graph_spec`` entries need ``batch_size`` in ``[1, max_batch_size]`` and ``input[input_name].dim`` holding one
    positive length (protobuf's JSON form gives int64 as strings; both are accepted). Entries longer than
    ``max_seq_length`` (the model's limit, tokens) are left out; without entries the buckets are
    :func:`default_grid` of ``max_seq_length``.

    Raises:
        BucketConfigError: a malformed entry; the message names the field path and the value received.
    """
    cuda = (config.get("optimization") or {}).get("cuda") or {}
    graphs = bool(cuda.get("graphs", False))
    specs = cuda.get("graph_spec") or []
    if not specs:
        return GraphSettings(graphs, default_grid(max_seq_length), from_config=False)
    max_batch = int(config.get("max_batch_size", 0) or 0)
    pairs = []
    for i, spec in enumerate(specs):
        field = f"optimization.cuda.graph_spec[{i}]"
        batch = _positive_int(spec.get("batch_size"), f"{field}.batch_size")
        if max_batch and batch > max_batch:
            raise BucketConfigError(f"{field}.batch_size is {batch}; the model's max_batch_size is {max_batch}")
        shape = (spec.get("input") or {}).get(input_name)
        if shape is None:
            raise BucketConfigError(
                f"{field}.input has no '{input_name}' entry; got keys {sorted(spec.get('input', {}))}"
            )
        dims = shape.get("dim") or []
        if len(dims) != 1:
            raise BucketConfigError(f"{field}.input['{input_name}'].dim must hold one length; got {list(dims)}")
        pairs.append((batch, _positive_int(dims[0], f"{field}.input['{input_name}'].dim[0]")))
    kept = [(batch, length) for batch, length in pairs if length <= max_seq_length]
    if not kept:
        raise BucketConfigError(
            f"optimization.cuda.graph_spec: every entry is longer than the model's max_seq_length {max_seq_length}; "
            f"got lengths {sorted({length for _, length in pairs})}"
        )
    return GraphSettings(graphs, BucketTable(kept), from_config=True)


def _positive_int(value: object, field: str) -> int:
    try:
        number = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise BucketConfigError(f"{field} must be a positive integer; got {value!r}") from None
    if number < 1:
        raise BucketConfigError(f"{field} must be a positive integer; got {number}")
    return number


def plan_chunks(lengths: list[int], cost, overhead: float) -> list[tuple[int, int]]:
    """Split rows, sorted by length, into consecutive chunks that minimise total cost (dynamic programming).

    A batch of random sentences padded as one block wastes most of its tokens on the few long rows; running
    the short rows and the long rows as separate executions costs one extra launch but far fewer padded tokens.
    sentence-transformers gets the same effect in process by sorting its input by length before batching.

    Args:
        lengths: real token counts, ascending (``lengths[i] <= lengths[i + 1]``).
        cost: ``cost(rows, length) -> float``, padded tokens one execution of ``rows`` rows of up to ``length``
            tokens costs (e.g. its bucket's padded tokens).
        overhead: fixed cost of one more execution, in the same unit (tokens).

    Returns:
        ``[(start, end), ...]`` half-open row ranges covering ``0..len(lengths)`` in order.
    """
    n = len(lengths)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest plan for rows [0, j)
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            total = best[start] + overhead + cost(end - start, lengths[end - 1])
            if total < best[end]:
                best[end], cut[end] = total, start
    chunks, end = [], n
    while end > 0:
        chunks.append((cut[end], end))
        end = cut[end]
    return chunks[::-1]
