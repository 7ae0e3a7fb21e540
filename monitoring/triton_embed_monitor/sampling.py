"""NVML sampling: one :class:`GpuSample` per GPU per tick, recorded by :class:`GpuMonitor` on a background thread.

Numbers come from NVML (the driver's management library, through ``nvidia-ml-py``'s ``pynvml`` module), the
same source as ``nvidia-smi``. Without ``nvidia-ml-py``, the driver library or a GPU, :attr:`GpuMonitor.available`
is False, :meth:`GpuMonitor.start` does nothing and :meth:`GpuMonitor.samples` stays empty: nothing raises.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from triton_embed_monitor.triton_queue import QueueSample, pending_requests

NOT_REPORTED = -1
"""Process memory value when NVML cannot tell (``usedGpuMemory`` unavailable, e.g. without permission or MIG)."""


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant, as NVML reports it.

    Attributes:
        timestamp: ``time.time()`` when the GPU was read, seconds since the epoch.
        index: NVML device index (0-based; the order of ``nvidia-smi``, not necessarily ``CUDA_VISIBLE_DEVICES``).
        name: product name, e.g. ``NVIDIA H200``.
        uuid: ``GPU-...`` identifier, stable across reboots and index changes.
        gpu_util_pct: percent of the last sample period (1/6 s to 1 s, by product) in which one or more kernels ran
            (``nvmlDeviceGetUtilizationRates().gpu``); 100 does not mean every SM was busy.
        mem_util_pct: percent of that period in which device memory was read or written (``.memory``).
        mem_used_bytes: device memory in use, all processes (``nvmlDeviceGetMemoryInfo().used``), bytes.
        mem_total_bytes: device memory installed (``.total``), bytes.
        sm_clock_mhz: current SM clock (``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``), MHz.
        power_w: board power draw (``nvmlDeviceGetPowerUsage`` milliwatts / 1000), watts.
        temperature_c: GPU die temperature (``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)``), degrees Celsius.
        processes: ``(pid, used GPU memory bytes)`` per compute process on this GPU, sorted by pid; the pid is in
            the host's PID namespace (in a container it may not match ``ps``); memory is ``NOT_REPORTED`` (-1)
            when NVML cannot tell.

    A value this GPU does not support (power on some boards, clocks under MIG) is ``nan``.
    """

    timestamp: float
    index: int
    name: str
    uuid: str
    gpu_util_pct: float
    mem_util_pct: float
    mem_used_bytes: int
    mem_total_bytes: int
    sm_clock_mhz: float
    power_w: float
    temperature_c: float
    processes: tuple[tuple[int, int], ...]


def load_nvml() -> tuple[ModuleType | None, str | None]:
    """Import ``pynvml`` and initialise NVML.

    Returns:
        ``(pynvml module, None)`` when NVML is up and sees at least one GPU, else ``(None, reason)`` where
        ``reason`` is one line (package missing, driver library missing, no GPU, or NVML's own message).
    """
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install 'triton-embed[monitor]')"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and OSError from loading the library; never a traceback
        return None, f"NVML could not start: {exc}"
    try:
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        return None, f"NVML could not count GPUs: {exc}"
    if count == 0:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        return None, "NVML sees no GPU"
    return pynvml, None


def _or_nan(nvml: ModuleType, read: Callable[..., float], *args: object) -> float:
    """``read(*args)`` as float, or nan when NVML says the GPU does not support it."""
    try:
        return float(read(*args))
    except nvml.NVMLError:
        return math.nan


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def read_gpus(nvml: ModuleType, now: Callable[[], float] = time.time) -> list[GpuSample]:
    """Read every GPU NVML sees, once.

    Args:
        nvml: an initialised ``pynvml`` module (see :func:`load_nvml`) or an object with the same functions.
        now: clock for :attr:`GpuSample.timestamp`, seconds.

    Returns:
        One sample per GPU, in NVML index order.

    Raises:
        nvml.NVMLError: the device count, a handle, name, UUID or memory info could not be read (the GPU fell
            off the bus, the driver was unloaded); fields a GPU merely does not support become ``nan`` instead.
    """
    samples = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            gpu_util, mem_util = float(util.gpu), float(util.memory)
        except nvml.NVMLError:
            gpu_util = mem_util = math.nan
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError:
            procs = []
        processes = tuple(
            sorted((int(p.pid), NOT_REPORTED if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs)
        )
        samples.append(
            GpuSample(
                timestamp=now(),
                index=index,
                name=_text(nvml.nvmlDeviceGetName(handle)),
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                gpu_util_pct=gpu_util,
                mem_util_pct=mem_util,
                mem_used_bytes=int(memory.used),
                mem_total_bytes=int(memory.total),
                sm_clock_mhz=_or_nan(nvml, nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
                power_w=_or_nan(nvml, nvml.nvmlDeviceGetPowerUsage, handle) / 1000.0,
                temperature_c=_or_nan(nvml, nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
                processes=processes,
            )
        )
    return samples


class GpuMonitor:
    """Samples every GPU every ``interval_s`` seconds on a background thread (and, optionally, Triton's queue).

    Usage::

        with GpuMonitor(interval_s=0.5, triton_metrics_url="http://127.0.0.1:8002/metrics") as monitor:
            run_load()
        samples = monitor.samples()          # [] on a machine without a GPU
        queue = monitor.queue_samples()      # pending requests of queue_model over time

    Never raises for a missing GPU, driver or package: :attr:`available` is then False and
    :attr:`unavailable_reason` says why, in one line.
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        *,
        triton_metrics_url: str | None = None,
        queue_model: str | None = "encoder",
        max_samples: int = 100_000,
        nvml: ModuleType | None = None,
        on_tick: Callable[[list[GpuSample], QueueSample | None], None] | None = None,
    ) -> None:
        """Set up the monitor; nothing is read until :attr:`available` or :meth:`start`.

        Args:
            interval_s: seconds between two reads of all GPUs (> 0). NVML's own utilisation window is 1/6 s to
                1 s, so intervals below ~0.2 s repeat values.
            triton_metrics_url: Triton's Prometheus endpoint (``http://host:8002/metrics``); when given, every
                tick also reads ``nv_inference_pending_request_count`` for the flag "GPU idle while requests wait".
            queue_model: model whose pending requests count (default ``encoder``, the step on the GPU); None sums
                every model.
            max_samples: most GPU samples kept (oldest dropped first); at 1 s and 8 GPUs, 100,000 is ~3.5 hours.
            nvml: an initialised ``pynvml``-like module to read instead of loading NVML (tests, replays).
            on_tick: called on the sampling thread after each tick with that tick's samples and queue reading
                (the exporter uses it); exceptions it raises are counted in :attr:`errors`, not propagated.

        Raises:
            ValueError: ``interval_s`` is not positive or ``max_samples`` is below 1.
        """
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.interval_s = float(interval_s)
        self.triton_metrics_url = triton_metrics_url
        self.queue_model = queue_model
        self.on_tick = on_tick
        self.errors: dict[str, int] = {"nvml": 0, "triton": 0, "callback": 0}
        self._nvml = nvml
        self._owns_nvml = nvml is None
        self._reason: str | None = None
        self._loaded = nvml is not None
        self._samples: deque[GpuSample] = deque(maxlen=max_samples)
        self._queue: deque[QueueSample] = deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- availability -------------------------------------------------------------------------------------------
    def _load(self) -> None:
        if not self._loaded:
            self._nvml, self._reason = load_nvml()
            self._loaded = True

    @property
    def available(self) -> bool:
        """True when NVML is up and sees a GPU (loads NVML on first use; never raises)."""
        self._load()
        return self._nvml is not None

    @property
    def unavailable_reason(self) -> str | None:
        """One line saying why :attr:`available` is False; None when it is True."""
        self._load()
        return self._reason

    # -- sampling -----------------------------------------------------------------------------------------------
    def sample_once(self) -> list[GpuSample]:
        """Read every GPU now and record the samples (and Triton's queue when configured).

        Returns:
            This tick's samples, one per GPU; empty without a GPU or when NVML failed this time (counted in
            ``errors["nvml"]``).
        """
        if not self.available or self._nvml is None:
            return []
        try:
            samples = read_gpus(self._nvml)
        except Exception:  # a GPU fell off the bus or the driver went away: skip this tick, keep going
            self.errors["nvml"] += 1
            samples = []
        queue = self.read_queue()
        with self._lock:
            self._samples.extend(samples)
            if queue is not None:
                self._queue.append(queue)
        if self.on_tick is not None:
            try:
                self.on_tick(samples, queue)
            except Exception:
                self.errors["callback"] += 1
        return samples

    def read_queue(self) -> QueueSample | None:
        """Read Triton's pending requests now (not recorded; works without a GPU).

        Returns:
            The reading, or None without ``triton_metrics_url``, when Triton cannot be reached, or when its scrape
            has no ``nv_inference_pending_request_count`` for ``queue_model`` (both counted in ``errors["triton"]``).
        """
        if not self.triton_metrics_url:
            return None
        try:
            timeout = max(0.5, min(self.interval_s, 5.0))
            with urllib.request.urlopen(self.triton_metrics_url, timeout=timeout) as response:  # noqa: S310 - URL given by the operator
                text = response.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError):
            self.errors["triton"] += 1
            return None
        pending = pending_requests(text, self.queue_model)
        if pending is None:
            self.errors["triton"] += 1
            return None
        return QueueSample(timestamp=time.time(), pending=pending)

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            next_tick += self.interval_s
            delay = next_tick - time.monotonic()
            if delay < 0:  # a slow tick: do not try to catch up with a burst
                next_tick = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def start(self) -> GpuMonitor:
        """Start the sampling thread (a daemon); a no-op without a GPU or when already running.

        Returns:
            self, so ``monitor = GpuMonitor().start()`` works.
        """
        if self._thread is not None or not self.available:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="triton-embed-gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the sampling thread and wait for it (at most one tick); shut NVML down if this monitor started it.

        Samples stay readable after stop. Safe to call more than once, or without :meth:`start`.
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=self.interval_s + 10)
        if self._owns_nvml and self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml, self._loaded = None, False

    @property
    def running(self) -> bool:
        """True while the sampling thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def samples(self) -> list[GpuSample]:
        """Every GPU sample recorded so far (oldest first; at most ``max_samples``); a copy."""
        with self._lock:
            return list(self._samples)

    def queue_samples(self) -> list[QueueSample]:
        """Every reading of Triton's pending requests so far (oldest first); empty without a metrics URL."""
        with self._lock:
            return list(self._queue)

    def __enter__(self) -> GpuMonitor:
        """Start sampling."""
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        """Stop sampling."""
        self.stop()
