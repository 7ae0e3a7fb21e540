"""The two patterns the GPU monitor exists to flag, as pure functions over recorded samples.

* **GPU idle while requests wait** (:func:`idle_with_queue_episodes`): utilisation below ``idle_below_pct``
  while Triton reports pending requests, sustained. The GPU could work but is not given any: batching, queue
  delay, CUDA graphs or the CPU steps in front of it are misconfigured or too slow.
* **Saturation** (:func:`saturation_episodes`): utilisation above ``saturation_above_pct``, sustained. More
  load only adds queueing: add a GPU or shed load.

"Sustained" means: the condition holds at every sample of that GPU from an episode's first sample to its last,
and the last is at least ``window_s`` seconds after the first. A sample whose value is ``nan`` (not reported)
breaks an episode. Samples of several GPUs may come interleaved, in any order.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from triton_embed_monitor.sampling import GpuSample
from triton_embed_monitor.triton_queue import QueueSample

IDLE_WITH_QUEUE = "idle_with_queue"
SATURATED = "saturated"


@dataclass(frozen=True)
class FlagThresholds:
    """When a pattern is flagged.

    Attributes:
        idle_below_pct: GPU utilisation (percent) under which the GPU counts as idle.
        idle_window_s: seconds "idle while requests wait" must last.
        saturation_above_pct: GPU utilisation (percent) over which the GPU counts as saturated.
        saturation_window_s: seconds saturation must last.
        max_queue_age_s: a queue reading older than this (seconds before the GPU sample) counts as unknown, so
            the idle flag needs a fresh reading of Triton's queue.
    """

    idle_below_pct: float = 10.0
    idle_window_s: float = 10.0
    saturation_above_pct: float = 95.0
    saturation_window_s: float = 30.0
    max_queue_age_s: float = 5.0

    def __post_init__(self) -> None:
        """Check the ranges.

        Raises:
            ValueError: a percentage outside 0..100, or a negative window or age.
        """
        for name in ("idle_below_pct", "saturation_above_pct"):
            if not 0.0 <= getattr(self, name) <= 100.0:
                raise ValueError(f"{name} must be within 0..100 percent, got {getattr(self, name)}")
        for name in ("idle_window_s", "saturation_window_s", "max_queue_age_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")


@dataclass(frozen=True)
class Episode:
    """A stretch of time in which one GPU showed a flagged pattern.

    Attributes:
        kind: ``idle_with_queue`` or ``saturated``.
        gpu: NVML index of the GPU.
        start: timestamp of the first sample in the stretch, seconds since the epoch.
        end: timestamp of the last sample in the stretch, seconds since the epoch.
        samples: how many samples of that GPU the stretch holds.
    """

    kind: str
    gpu: int
    start: float
    end: float
    samples: int

    @property
    def duration_s(self) -> float:
        """``end - start``, seconds."""
        return self.end - self.start


def _by_gpu(samples: Iterable[GpuSample]) -> dict[int, list[GpuSample]]:
    groups: dict[int, list[GpuSample]] = {}
    for s in samples:
        groups.setdefault(s.index, []).append(s)
    for group in groups.values():
        group.sort(key=lambda s: s.timestamp)
    return dict(sorted(groups.items()))


def _episodes(
    kind: str, samples: Iterable[GpuSample], condition: Callable[[GpuSample], bool], window_s: float
) -> list[Episode]:
    """Runs of consecutive samples (per GPU) where ``condition`` holds, kept when they last ``window_s`` or more."""
    found = []
    for gpu, series in _by_gpu(samples).items():
        run: list[GpuSample] = []
        for sample in [*series, None]:  # None closes the last run
            if sample is not None and condition(sample):
                run.append(sample)
                continue
            if run and run[-1].timestamp - run[0].timestamp >= window_s:
                found.append(Episode(kind, gpu, run[0].timestamp, run[-1].timestamp, len(run)))
            run = []
    return found


def saturation_episodes(
    samples: Iterable[GpuSample], *, above_pct: float = 95.0, window_s: float = 30.0
) -> list[Episode]:
    """Stretches where a GPU's utilisation stayed above ``above_pct`` for ``window_s`` seconds or more.

    Args:
        samples: GPU samples of one or more GPUs, any order.
        above_pct: utilisation threshold, percent (strictly above counts).
        window_s: shortest stretch reported, seconds (first to last sample).

    Returns:
        Episodes of kind ``saturated``, by GPU index, then time.
    """
    return _episodes(SATURATED, samples, lambda s: s.gpu_util_pct > above_pct, window_s)


def queue_at(queue: Sequence[QueueSample], timestamp: float, max_age_s: float) -> int | None:
    """Pending requests known at ``timestamp``: the latest reading at or before it, if not older than ``max_age_s``.

    Args:
        queue: readings sorted by timestamp.
        timestamp: the instant asked about, seconds since the epoch.
        max_age_s: oldest usable reading, seconds before ``timestamp``.

    Returns:
        The reading's pending count, or None when no reading is recent enough.
    """
    i = bisect.bisect_right([q.timestamp for q in queue], timestamp) - 1
    if i < 0 or timestamp - queue[i].timestamp > max_age_s:
        return None
    return queue[i].pending


def idle_with_queue_episodes(
    samples: Iterable[GpuSample],
    queue: Iterable[QueueSample],
    *,
    below_pct: float = 10.0,
    window_s: float = 10.0,
    max_queue_age_s: float = 5.0,
) -> list[Episode]:
    """Stretches where a GPU stayed under ``below_pct`` utilisation while Triton had requests pending.

    Args:
        samples: GPU samples of one or more GPUs, any order.
        queue: readings of Triton's pending requests, any order (see :class:`QueueSample`).
        below_pct: utilisation under which the GPU counts as idle, percent (strictly below counts).
        window_s: shortest stretch reported, seconds (first to last sample).
        max_queue_age_s: a GPU sample with no queue reading within this many seconds before it breaks a
            stretch (queue unknown).

    Returns:
        Episodes of kind ``idle_with_queue``, by GPU index, then time.
    """
    readings = sorted(queue, key=lambda q: q.timestamp)

    def idle_with_work(s: GpuSample) -> bool:
        pending = queue_at(readings, s.timestamp, max_queue_age_s)
        return not math.isnan(s.gpu_util_pct) and s.gpu_util_pct < below_pct and bool(pending)

    return _episodes(IDLE_WITH_QUEUE, samples, idle_with_work, window_s)


def find_episodes(
    samples: Iterable[GpuSample], queue: Iterable[QueueSample], thresholds: FlagThresholds | None = None
) -> list[Episode]:
    """Both patterns over one recording, with the thresholds given (defaults: :class:`FlagThresholds`).

    Returns:
        Idle-with-queue episodes first, then saturation episodes.
    """
    t = thresholds or FlagThresholds()
    samples = list(samples)
    return idle_with_queue_episodes(
        samples, queue, below_pct=t.idle_below_pct, window_s=t.idle_window_s, max_queue_age_s=t.max_queue_age_s
    ) + saturation_episodes(samples, above_pct=t.saturation_above_pct, window_s=t.saturation_window_s)


def active_flags(
    samples: Iterable[GpuSample], queue: Iterable[QueueSample], thresholds: FlagThresholds | None = None
) -> dict[int, dict[str, bool]]:
    """Which patterns hold right now: an episode that ends at a GPU's latest sample.

    Returns:
        ``{gpu index: {"idle_with_queue": bool, "saturated": bool}}`` for every GPU in ``samples``.
    """
    samples = list(samples)
    latest = {gpu: series[-1].timestamp for gpu, series in _by_gpu(samples).items()}
    flags = {gpu: {IDLE_WITH_QUEUE: False, SATURATED: False} for gpu in latest}
    for episode in find_episodes(samples, queue, thresholds):
        if episode.end == latest[episode.gpu]:
            flags[episode.gpu][episode.kind] = True
    return flags
