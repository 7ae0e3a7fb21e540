"""GPU monitor logic on recorded sample sequences: flags, NVML reading, sampling thread, exporter (no GPU needed)."""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
import urllib.request
from dataclasses import replace
from types import SimpleNamespace

import pytest
from triton_embed_monitor import (
    IDLE_WITH_QUEUE,
    NOT_REPORTED,
    SATURATED,
    FlagThresholds,
    GpuMonitor,
    GpuSample,
    QueueSample,
    active_flags,
    find_episodes,
    idle_with_queue_episodes,
    read_gpus,
    saturation_episodes,
)
from triton_embed_monitor.exporter import MonitorExporter, metric_names
from triton_embed_monitor.flags import queue_at

T0 = 1_700_000_000.0


def sample(t: float, util: float, gpu: int = 0) -> GpuSample:
    return GpuSample(
        timestamp=T0 + t,
        index=gpu,
        name="NVIDIA H200",
        uuid=f"GPU-{gpu}",
        gpu_util_pct=util,
        mem_util_pct=util / 2,
        mem_used_bytes=2 * 1024**3,
        mem_total_bytes=141 * 1024**3,
        sm_clock_mhz=1980.0,
        power_w=320.5,
        temperature_c=41.0,
        processes=((4242, 1024**3),),
    )


def series(utils: list[float], gpu: int = 0, step_s: float = 1.0) -> list[GpuSample]:
    """One GPU sampled every ``step_s`` seconds with the given utilisations."""
    return [sample(i * step_s, u, gpu) for i, u in enumerate(utils)]


def queue(pending: list[int], step_s: float = 1.0, offset_s: float = -0.2) -> list[QueueSample]:
    """Triton queue readings taken just before each GPU sample."""
    return [QueueSample(T0 + i * step_s + offset_s, p) for i, p in enumerate(pending)]


# -- saturation -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("seconds_high", "expected"), [(29, 0), (30, 1), (45, 1)])
def test_saturation_needs_the_whole_window(seconds_high, expected):
    # seconds_high + 1 samples one second apart span seconds_high seconds
    samples = series([50.0] * 3 + [99.0] * (seconds_high + 1) + [40.0] * 3)
    episodes = saturation_episodes(samples, above_pct=95.0, window_s=30.0)
    assert len(episodes) == expected
    if expected:
        (e,) = episodes
        assert (e.kind, e.gpu, e.start, e.duration_s, e.samples) == (
            SATURATED,
            0,
            T0 + 3,
            seconds_high,
            seconds_high + 1,
        )


@pytest.mark.parametrize("dip", [80.0, 95.0, math.nan])
def test_a_dip_or_a_missing_value_breaks_saturation(dip):
    samples = series([99.0] * 20 + [dip] + [99.0] * 20)
    assert saturation_episodes(samples, window_s=30.0) == []
    assert len(saturation_episodes(samples, window_s=19.0)) == 2


def test_saturation_is_per_gpu_with_interleaved_unordered_samples():
    samples = series([99.0] * 40, gpu=0) + series([60.0] * 40, gpu=1) + series([100.0] * 12, gpu=2, step_s=3.0)
    samples.reverse()
    episodes = saturation_episodes(samples, window_s=30.0)
    assert [(e.gpu, e.duration_s) for e in episodes] == [(0, 39.0), (2, 33.0)]


# -- idle while requests wait -----------------------------------------------------------------------------------
def test_idle_with_pending_requests_is_flagged():
    samples = series([70.0] * 5 + [3.0] * 15 + [70.0] * 5)
    waiting = queue([0] * 5 + [12] * 15 + [0] * 5)
    (e,) = idle_with_queue_episodes(samples, waiting, below_pct=10.0, window_s=10.0)
    assert (e.kind, e.gpu, e.start, e.end, e.samples) == (IDLE_WITH_QUEUE, 0, T0 + 5, T0 + 19, 15)


@pytest.mark.parametrize(
    ("utils", "pending", "why"),
    [
        ([3.0] * 20, [0] * 20, "idle with an empty queue is just a quiet service"),
        ([60.0] * 20, [30] * 20, "busy with a queue is load, not misconfiguration"),
        ([3.0] * 20, [5] * 10 + [0] + [5] * 9, "one empty reading breaks the stretch"),
        ([3.0] * 9 + [50.0] + [3.0] * 10, [5] * 20, "one busy sample breaks the stretch"),
    ],
)
def test_idle_with_queue_not_flagged(utils, pending, why):
    assert idle_with_queue_episodes(series(utils), queue(pending), window_s=10.0) == [], why


def test_stale_or_missing_queue_readings_count_as_unknown():
    samples = series([2.0] * 30)
    # the last reading is at 8.8 s: with a max age of 5 s it covers the samples up to 13 s, then the queue is unknown
    (e,) = idle_with_queue_episodes(samples, queue([7] * 10), window_s=10.0, max_queue_age_s=5.0)
    assert (e.start, e.end) == (T0, T0 + 13)
    assert idle_with_queue_episodes(samples, [], window_s=0.0) == []


def test_queue_at_takes_the_latest_reading_not_after_the_instant():
    readings = [QueueSample(T0, 1), QueueSample(T0 + 2, 0), QueueSample(T0 + 4, 9)]
    assert queue_at(readings, T0 - 0.1, 5.0) is None
    assert queue_at(readings, T0 + 1.9, 5.0) == 1
    assert queue_at(readings, T0 + 2.0, 5.0) == 0
    assert queue_at(readings, T0 + 9.0, 5.0) == 9
    assert queue_at(readings, T0 + 9.1, 5.0) is None


# -- both, and what holds now -----------------------------------------------------------------------------------
def test_find_episodes_and_active_flags():
    thresholds = FlagThresholds(idle_window_s=5.0, saturation_window_s=5.0)
    gpu0 = series([2.0] * 10 + [99.0] * 10)  # idle-with-queue first, then saturated until the end
    gpu1 = series([99.0] * 10 + [50.0] * 10, gpu=1)  # saturated, but over by the end
    waiting = queue([4] * 20)
    kinds = [(e.kind, e.gpu) for e in find_episodes(gpu0 + gpu1, waiting, thresholds)]
    assert kinds == [(IDLE_WITH_QUEUE, 0), (SATURATED, 0), (SATURATED, 1)]
    assert active_flags(gpu0 + gpu1, waiting, thresholds) == {
        0: {IDLE_WITH_QUEUE: False, SATURATED: True},
        1: {IDLE_WITH_QUEUE: False, SATURATED: False},
    }
    assert active_flags([], [], thresholds) == {}


@pytest.mark.parametrize(
    "kwargs", [{"idle_below_pct": -1}, {"saturation_above_pct": 101}, {"idle_window_s": -1}, {"max_queue_age_s": -1}]
)
def test_thresholds_are_checked(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        FlagThresholds(**kwargs)


# -- reading NVML ---------------------------------------------------------------------------------------------
class FakeNvml:
    """Replays recorded NVML answers with pynvml's function names (no driver here)."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, utils: list[float], *, power_supported: bool = True, fail_after: int | None = None) -> None:
        self.utils = list(utils)
        self.power_supported = power_supported
        self.fail_after = fail_after
        self.reads = 0
        self.shutdowns = 0

    def nvmlDeviceGetCount(self):
        self.reads += 1
        if self.fail_after is not None and self.reads > self.fail_after:
            raise self.NVMLError("GPU is lost")
        return len(self.utils)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H200" if handle == 0 else "NVIDIA H200"  # old pynvml returned bytes

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-0000-{handle}"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self.utils[handle], memory=self.utils[handle] / 4)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=3 * 1024**3, total=150_754_820_096, free=0)

    def nvmlDeviceGetClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetPowerUsage(self, handle):
        if not self.power_supported:
            raise self.NVMLError("Not Supported")
        return 123456  # milliwatts

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 38

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=900, usedGpuMemory=None), SimpleNamespace(pid=77, usedGpuMemory=512 * 1024**2)]

    def nvmlShutdown(self):
        self.shutdowns += 1


def test_read_gpus_converts_units_and_marks_what_is_not_reported():
    nvml = FakeNvml([42.0, 7.0], power_supported=False)
    first, second = read_gpus(nvml, now=lambda: T0)
    assert math.isnan(first.power_w)  # power not supported on this board
    assert replace(first, power_w=0.0) == GpuSample(
        timestamp=T0,
        index=0,
        name="NVIDIA H200",
        uuid="GPU-0000-0",
        gpu_util_pct=42.0,
        mem_util_pct=10.5,
        mem_used_bytes=3 * 1024**3,
        mem_total_bytes=150_754_820_096,
        sm_clock_mhz=1980.0,
        power_w=0.0,
        temperature_c=38.0,
        processes=((77, 512 * 1024**2), (900, NOT_REPORTED)),
    )
    assert (second.index, second.name, second.gpu_util_pct) == (1, "NVIDIA H200", 7.0)
    assert read_gpus(FakeNvml([1.0]))[0].power_w == pytest.approx(123.456)


def test_monitor_samples_on_a_thread_and_survives_a_lost_gpu():
    nvml = FakeNvml([55.0], fail_after=3)
    ticks = []
    monitor = GpuMonitor(0.02, nvml=nvml, on_tick=lambda s, q: ticks.append(len(s)))
    assert monitor.available and monitor.unavailable_reason is None
    with monitor:
        deadline = time.monotonic() + 5
        while len(ticks) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not monitor.running
    assert len(monitor.samples()) == 3  # the reads after the GPU was lost are skipped, not raised
    assert ticks[:4] == [1, 1, 1, 0] and monitor.errors["nvml"] >= 3
    assert monitor.queue_samples() == []  # no Triton URL given
    assert nvml.shutdowns == 0  # an injected NVML belongs to the caller


def test_monitor_keeps_at_most_max_samples():
    monitor = GpuMonitor(1.0, nvml=FakeNvml([1.0, 2.0]), max_samples=5)
    for _ in range(4):
        monitor.sample_once()
    assert len(monitor.samples()) == 5 and monitor.samples()[-1].index == 1


@pytest.mark.parametrize("kwargs", [{"interval_s": 0}, {"interval_s": -1.0}, {"max_samples": 0}])
def test_monitor_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        GpuMonitor(**kwargs)


def test_without_a_gpu_the_api_is_empty_and_never_raises():
    # this machine has no NVIDIA driver: the real NVML load fails and says why
    monitor = GpuMonitor(0.01, triton_metrics_url="http://127.0.0.1:9/metrics")
    assert monitor.available is False
    assert "NVML" in monitor.unavailable_reason and "\n" not in monitor.unavailable_reason
    with monitor as m:
        assert m.sample_once() == [] and not m.running
    assert monitor.samples() == [] and monitor.queue_samples() == []


# -- exporter ---------------------------------------------------------------------------------------------------
def test_exporter_sets_gauges_and_flags_from_ticks():
    thresholds = FlagThresholds(idle_window_s=3.0, saturation_window_s=3.0)
    exporter = MonitorExporter(thresholds, queue_model="encoder")
    value = exporter.registry.get_sample_value
    for i in range(5):
        exporter.observe([sample(i, 2.0), sample(i, 99.0, gpu=1)], QueueSample(T0 + i - 0.1, 6))
    assert value("triton_embed_gpu_utilization_percent", {"gpu": "1"}) == 99.0
    assert value("triton_embed_gpu_memory_total_bytes", {"gpu": "0"}) == 141 * 1024**3
    assert value("triton_embed_gpu_sm_clock_hertz", {"gpu": "0"}) == 1.98e9
    assert value("triton_embed_gpu_power_watts", {"gpu": "0"}) == 320.5
    assert value("triton_embed_gpu_info", {"gpu": "0", "name": "NVIDIA H200", "uuid": "GPU-0"}) == 1
    assert value("triton_embed_gpu_process_memory_used_bytes", {"gpu": "0", "pid": "4242"}) == 1024**3
    assert value("triton_embed_monitor_triton_pending_requests", {"model": "encoder"}) == 6
    assert value("triton_embed_monitor_samples_total") == 10
    assert value("triton_embed_gpu_idle_with_queue", {"gpu": "0"}) == 1
    assert value("triton_embed_gpu_saturated", {"gpu": "0"}) == 0
    assert value("triton_embed_gpu_saturated", {"gpu": "1"}) == 1
    exporter.observe([sample(5, 50.0), sample(5, 50.0, gpu=1)], QueueSample(T0 + 4.9, 0))
    assert value("triton_embed_gpu_idle_with_queue", {"gpu": "0"}) == 0
    assert value("triton_embed_gpu_saturated", {"gpu": "1"}) == 0
    assert exporter.flags == {
        0: {IDLE_WITH_QUEUE: False, SATURATED: False},
        1: {IDLE_WITH_QUEUE: False, SATURATED: False},
    }
    assert {"triton_embed_gpu_temperature_celsius", "triton_embed_monitor_errors_total"} <= metric_names(
        exporter.registry
    )


def test_exporter_forgets_samples_older_than_its_windows():
    exporter = MonitorExporter(FlagThresholds(idle_window_s=1.0, saturation_window_s=2.0, max_queue_age_s=1.0))
    for i in range(100):
        exporter.observe([sample(i, 99.0)], None)
    assert len(exporter._recent) <= exporter.history_s + 2


def test_cli_serves_metrics_with_a_gpu(monkeypatch, capsys):
    """The CLI's serving path, with recorded NVML answers standing in for the driver."""
    from triton_embed_monitor import cli, sampling
    from triton_embed_server.embedded import free_port

    nvml = FakeNvml([97.0])
    monkeypatch.setattr(sampling, "load_nvml", lambda: (nvml, None))
    port = free_port()
    scraped = {}

    def scrape_then_stop():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    text = response.read().decode()
                taken = re.search(r"^triton_embed_monitor_samples_total (\S+)$", text, re.MULTILINE)
                if taken and float(taken.group(1)) >= 3:
                    scraped["text"] = text
                    break
            except OSError:
                pass
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=scrape_then_stop, daemon=True).start()
    assert cli.main(["--interval", "0.05", "--port", str(port), "--saturation-window", "0.05"]) == 0
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
    assert 'triton_embed_gpu_utilization_percent{gpu="0"} 97.0' in scraped["text"]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("triton-embed-monitor: sampling every 0.05 s (0: NVIDIA H200); metrics on http://")
    assert any("GPU 0: saturated ON" in line for line in out)
