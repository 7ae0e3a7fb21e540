"""The GPU monitor check of ``bench/gpu_check.py``: ``triton_embed_monitor`` must see this GPU get busy.

Sampling every 0.2 s, the monitor must report this GPU (its NVML UUID or name) and see its utilisation rise while a
load runs, over an idle baseline (mean during the load >= idle mean + 20 points). Needs ``nvidia-ml-py`` (carried as
a wheel to the GPU machine); without it, or without a GPU, the check reports itself as not checked.
tritonclient is not needed: the monitor is imported without the client package.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_monitor():
    """The ``triton_embed_monitor`` package, from this checkout (the GPU machine does not install the project).

    Returns:
        The ``triton_embed_monitor`` module.
    """
    if str(ROOT / "monitoring") not in sys.path:
        sys.path.insert(0, str(ROOT / "monitoring"))
    import triton_embed_monitor

    return triton_embed_monitor


def check_monitor(run_load, device: torch.device, *, idle_s: float = 3.0, interval_s: float = 0.2) -> dict:
    """Sample the GPUs while idle, then while ``run_load()`` runs; the monitor must see this GPU get busy.

    Args:
        run_load: blocks while it keeps ``device`` busy (seconds of work).
        device: the CUDA device the load runs on; matched to an NVML GPU by UUID, else by name.
        idle_s: seconds of idle baseline before the load.
        interval_s: the monitor's sampling interval, seconds.

    Returns:
        ``{"checked": False, "reason": ...}`` when NVML cannot be used here, else the GPU the monitor named, the
        utilisation (percent) idle and under load, the flagged episodes, and ``ok``.
    """
    monitor_module = load_monitor()
    monitor = monitor_module.GpuMonitor(interval_s)
    if not monitor.available:
        return {"checked": False, "ok": False, "reason": monitor.unavailable_reason}
    with monitor:
        time.sleep(idle_s)
        load_start = time.time()
        run_load()
        load_end = time.time()
    samples = monitor.samples()
    torch_uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "")).lower()
    torch_name = torch.cuda.get_device_name(device)
    mine = [s for s in samples if torch_uuid and s.uuid.lower().endswith(torch_uuid)]
    matched_by = "uuid"
    if not mine:
        mine = [s for s in samples if s.name == torch_name]
        matched_by = "name"
    indices = sorted({s.index for s in mine})
    mine = [s for s in mine if indices and s.index == indices[0]]
    # NVML's utilisation covers its last sample period (up to 1 s): skip the first second of the load
    idle = [s.gpu_util_pct for s in mine if s.timestamp < load_start]
    busy = [s.gpu_util_pct for s in mine if load_start + 1.0 <= s.timestamp <= load_end]
    idle_mean = float(np.mean(idle)) if idle else float("nan")
    busy_mean = float(np.mean(busy)) if busy else float("nan")
    episodes = monitor_module.find_episodes(samples, [], monitor_module.FlagThresholds(saturation_window_s=2.0))
    result = {
        "checked": True,
        "gpu": {"index": indices[0], "name": mine[0].name, "uuid": mine[0].uuid, "matched_by": matched_by}
        if mine
        else None,
        "gpus_seen": sorted({(s.index, s.name) for s in samples}),
        "samples": len(samples),
        "idle_util_pct_mean": idle_mean,
        "load_util_pct_mean": busy_mean,
        "load_util_pct_max": max(busy, default=float("nan")),
        "load_mem_used_bytes_max": max((s.mem_used_bytes for s in mine), default=0),
        "load_power_w_max": max((s.power_w for s in mine), default=float("nan")),
        "episodes": [vars(e) | {"duration_s": e.duration_s} for e in episodes],
        "processes_seen": sorted({pid for s in mine for pid, _ in s.processes}),
    }
    result["ok"] = bool(mine and idle and busy and busy_mean >= idle_mean + 20.0)
    try:
        from triton_embed_monitor.exporter import MonitorExporter
    except ImportError as exc:  # prometheus-client not installed here
        result["exporter"] = f"not checked: {exc}"
    else:
        from prometheus_client import generate_latest

        exporter = MonitorExporter()
        exporter.observe([s for s in samples if s.timestamp == samples[-1].timestamp], None)
        text = generate_latest(exporter.registry).decode()
        result["exporter"] = [line for line in text.splitlines() if line.startswith("triton_embed_gpu_utilization")]
    return result
