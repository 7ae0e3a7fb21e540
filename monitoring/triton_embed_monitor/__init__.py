"""GPU monitor for the triton-embed service: NVML samples, the two patterns worth flagging, Prometheus metrics.

Python API (what the load test uses)::

    from triton_embed_monitor import GpuMonitor, find_episodes

    with GpuMonitor(interval_s=0.5, triton_metrics_url="http://127.0.0.1:8002/metrics") as monitor:
        run_load()
    episodes = find_episodes(monitor.samples(), monitor.queue_samples())   # idle-while-queued, saturated

Command line: ``triton-embed-monitor`` / ``python -m triton_embed_monitor`` (:mod:`triton_embed_monitor.cli`),
metrics listed in :mod:`triton_embed_monitor.exporter`. Without a GPU, driver or ``nvidia-ml-py`` the API returns
no samples and the CLI prints one line and exits 0.
"""

from triton_embed_monitor.flags import (
    IDLE_WITH_QUEUE,
    SATURATED,
    Episode,
    FlagThresholds,
    active_flags,
    find_episodes,
    idle_with_queue_episodes,
    saturation_episodes,
)
from triton_embed_monitor.sampling import NOT_REPORTED, GpuMonitor, GpuSample, read_gpus
from triton_embed_monitor.triton_queue import QueueSample, pending_requests

__all__ = [
    "IDLE_WITH_QUEUE",
    "NOT_REPORTED",
    "SATURATED",
    "Episode",
    "FlagThresholds",
    "GpuMonitor",
    "GpuSample",
    "QueueSample",
    "active_flags",
    "find_episodes",
    "idle_with_queue_episodes",
    "pending_requests",
    "read_gpus",
    "saturation_episodes",
]
