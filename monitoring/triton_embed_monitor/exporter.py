"""The monitor's Prometheus metrics (prometheus-client), updated on every sampling tick.

Metric names (label ``gpu`` is the NVML index as a string):

=============================================================  ===============================================
``triton_embed_gpu_info{gpu,name,uuid}``                        1 per GPU; carries the product name and UUID
``triton_embed_gpu_utilization_percent{gpu}``                   :attr:`GpuSample.gpu_util_pct`
``triton_embed_gpu_memory_utilization_percent{gpu}``            :attr:`GpuSample.mem_util_pct`
``triton_embed_gpu_memory_used_bytes{gpu}``                     :attr:`GpuSample.mem_used_bytes`
``triton_embed_gpu_memory_total_bytes{gpu}``                    :attr:`GpuSample.mem_total_bytes`
``triton_embed_gpu_sm_clock_hertz{gpu}``                        :attr:`GpuSample.sm_clock_mhz` x 1e6
``triton_embed_gpu_power_watts{gpu}``                           :attr:`GpuSample.power_w`
``triton_embed_gpu_temperature_celsius{gpu}``                   :attr:`GpuSample.temperature_c`
``triton_embed_gpu_processes{gpu}``                             compute processes on the GPU
``triton_embed_gpu_process_memory_used_bytes{gpu,pid}``         per process (omitted when NVML cannot tell)
``triton_embed_gpu_idle_with_queue{gpu}``                       1 while "idle while requests wait" holds
``triton_embed_gpu_saturated{gpu}``                             1 while saturation holds
``triton_embed_monitor_triton_pending_requests{model}``         the queue reading the idle flag used
``triton_embed_monitor_samples_total``                          GPU samples taken
``triton_embed_monitor_errors_total{source}``                   failed reads (``nvml``, ``triton``, ``callback``)
``triton_embed_monitor_last_sample_timestamp_seconds``          when the GPUs were last read
=============================================================  ===============================================
"""

from __future__ import annotations

import threading
from collections import deque
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from triton_embed_monitor.flags import IDLE_WITH_QUEUE, SATURATED, FlagThresholds, active_flags
from triton_embed_monitor.sampling import NOT_REPORTED, GpuMonitor, GpuSample
from triton_embed_monitor.triton_queue import QueueSample

PREFIX = "triton_embed_"


class MonitorExporter:
    """Holds the monitor's metrics in their own registry and recomputes the flags on every tick.

    Usage::

        exporter = MonitorExporter(FlagThresholds(), queue_model="encoder")
        monitor = GpuMonitor(1.0, triton_metrics_url=url, on_tick=exporter.observe)
        exporter.serve("127.0.0.1", 9455)      # http://127.0.0.1:9455/metrics
        monitor.start()
    """

    def __init__(
        self,
        thresholds: FlagThresholds | None = None,
        *,
        queue_model: str | None = "encoder",
        registry: CollectorRegistry | None = None,
        monitor: GpuMonitor | None = None,
    ) -> None:
        """Create the metrics.

        Args:
            thresholds: when the flag gauges turn 1 (see :class:`FlagThresholds`).
            queue_model: value of the ``model`` label on the pending-requests gauge ("all" when None).
            registry: where the metrics live; a new one by default (no process or platform collectors).
            monitor: the monitor whose ``errors`` counts are exported; may be set later as ``exporter.monitor``.
        """
        self.thresholds = thresholds or FlagThresholds()
        self.queue_model = queue_model or "all"
        self.registry = registry or CollectorRegistry()
        self.monitor = monitor
        t = self.thresholds
        # the flags look back over their windows plus the queue reading's allowed age, with slack for jitter
        self.history_s = max(t.idle_window_s + t.max_queue_age_s, t.saturation_window_s) + 10.0
        self._recent: deque[GpuSample] = deque()
        self._queue: deque[QueueSample] = deque()
        self._errors_seen: dict[str, int] = {}
        self.flags: dict[int, dict[str, bool]] = {}
        """The flags after the last tick: ``{gpu index: {"idle_with_queue": bool, "saturated": bool}}``."""

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ("gpu",)) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        self.info = gauge(
            "gpu_info", "GPU seen by NVML (value 1); labels carry its product name and UUID", ("gpu", "name", "uuid")
        )
        self.util = gauge("gpu_utilization_percent", "Percent of the last NVML sample period with a kernel running")
        self.mem_util = gauge(
            "gpu_memory_utilization_percent", "Percent of the last NVML sample period with memory traffic"
        )
        self.mem_used = gauge("gpu_memory_used_bytes", "Device memory in use by all processes, bytes")
        self.mem_total = gauge("gpu_memory_total_bytes", "Device memory installed, bytes")
        self.clock = gauge("gpu_sm_clock_hertz", "Current SM clock, hertz")
        self.power = gauge("gpu_power_watts", "Board power draw, watts")
        self.temperature = gauge("gpu_temperature_celsius", "GPU die temperature, degrees Celsius")
        self.processes = gauge("gpu_processes", "Compute processes on the GPU")
        self.process_memory = gauge(
            "gpu_process_memory_used_bytes", "Device memory used per compute process (host PID), bytes", ("gpu", "pid")
        )
        self.idle_flag = gauge(
            "gpu_idle_with_queue",
            f"1 while utilisation stayed under {t.idle_below_pct:g}% for {t.idle_window_s:g} s with requests pending",
        )
        self.saturated_flag = gauge(
            "gpu_saturated",
            f"1 while utilisation stayed over {t.saturation_above_pct:g}% for {t.saturation_window_s:g} s",
        )
        self.pending = Gauge(
            PREFIX + "monitor_triton_pending_requests",
            "Triton's nv_inference_pending_request_count as the monitor last read it (the idle flag's input)",
            ("model",),
            registry=self.registry,
        )
        self.samples_total = Counter(
            PREFIX + "monitor_samples", "GPU samples taken (one per GPU per tick)", registry=self.registry
        )
        self.errors_total = Counter(
            PREFIX + "monitor_errors",
            "Failed reads by source (nvml, triton, callback)",
            ("source",),
            registry=self.registry,
        )
        self.last_sample = Gauge(
            PREFIX + "monitor_last_sample_timestamp_seconds",
            "When the GPUs were last read, seconds since the epoch",
            registry=self.registry,
        )
        for source in ("nvml", "triton", "callback"):
            self.errors_total.labels(source)  # present at 0 from the start

    def observe(self, samples: list[GpuSample], queue: QueueSample | None) -> None:
        """Take one tick (the :class:`GpuMonitor` ``on_tick`` callback): set the gauges, recompute the flags."""
        for s in samples:
            gpu = str(s.index)
            self.info.labels(gpu, s.name, s.uuid).set(1)
            self.util.labels(gpu).set(s.gpu_util_pct)
            self.mem_util.labels(gpu).set(s.mem_util_pct)
            self.mem_used.labels(gpu).set(s.mem_used_bytes)
            self.mem_total.labels(gpu).set(s.mem_total_bytes)
            self.clock.labels(gpu).set(s.sm_clock_mhz * 1e6)
            self.power.labels(gpu).set(s.power_w)
            self.temperature.labels(gpu).set(s.temperature_c)
            self.processes.labels(gpu).set(len(s.processes))
            self.samples_total.inc()
            self.last_sample.set(s.timestamp)
            self._recent.append(s)
        if samples:
            self.process_memory.clear()  # processes come and go: only the current ones stay
            for s in samples:
                for pid, used in s.processes:
                    if used != NOT_REPORTED:
                        self.process_memory.labels(str(s.index), str(pid)).set(used)
        if queue is not None:
            self.pending.labels(self.queue_model).set(queue.pending)
            self._queue.append(queue)
        newest = max((s.timestamp for s in self._recent), default=0.0)
        while self._recent and self._recent[0].timestamp < newest - self.history_s:
            self._recent.popleft()
        while self._queue and self._queue[0].timestamp < newest - self.history_s:
            self._queue.popleft()
        self.flags = active_flags(self._recent, self._queue, self.thresholds)
        for index, flags in self.flags.items():
            self.idle_flag.labels(str(index)).set(int(flags[IDLE_WITH_QUEUE]))
            self.saturated_flag.labels(str(index)).set(int(flags[SATURATED]))
        if self.monitor is not None:
            for source, count in self.monitor.errors.items():
                grew = count - self._errors_seen.get(source, 0)
                if grew > 0:
                    self.errors_total.labels(source).inc(grew)
                self._errors_seen[source] = count

    def serve(self, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread.

        Returns:
            ``(server, thread)`` from ``prometheus_client.start_http_server``; ``server.server_port`` is the bound
            port (useful with ``port=0``); ``server.shutdown()`` stops it.

        Raises:
            OSError: the address is in use or cannot be bound.
        """
        return start_http_server(port, addr=host, registry=self.registry)


def metric_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name a registry exposes (counters with ``_total`` and ``_created``), for checking dashboards."""
    return {sample.name for family in registry.collect() for sample in family.samples}
