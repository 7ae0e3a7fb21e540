"""The GPU monitor on this machine (no GPU, no NVIDIA driver) and against a real Triton: CLI, API, queue reading."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from triton_embed import EmbeddingClient, ServerUnavailableError
from triton_embed_monitor import GpuMonitor, pending_requests

SCRIPT = Path(sys.executable).parent / "triton-embed-monitor"


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "triton_embed_monitor"],
        [str(SCRIPT)],
        [str(SCRIPT), "--once"],
        [str(SCRIPT), "--triton-metrics-url", "http://127.0.0.1:9/metrics", "--port", "0"],
    ],
    ids=["module", "script", "once", "with-triton-url"],
)
def test_cli_without_a_gpu_says_so_in_one_line_and_exits_0(command):
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("triton-embed-monitor: no GPU to monitor (") and "Traceback" not in done.stderr


def test_api_without_a_gpu_returns_no_samples_and_never_raises(server):
    monitor = GpuMonitor(0.05, triton_metrics_url=server.metrics_url)
    assert monitor.available is False and monitor.unavailable_reason
    with monitor:
        assert monitor.sample_once() == []
    assert monitor.samples() == [] and monitor.queue_samples() == []
    # Triton's queue can still be read on its own: a reading, not None (what a failed read gives)
    assert monitor.read_queue() is not None and monitor.errors["triton"] == 0


def test_pending_requests_in_a_real_triton_scrape(server):
    import urllib.request

    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    for model in ("embed", "tokenizer", "encoder", None):
        assert isinstance(pending_requests(text, model), int), model
    assert pending_requests(text, "no-such-model") is None
    assert GpuMonitor(triton_metrics_url=server.metrics_url, queue_model="no-such-model").read_queue() is None
    assert GpuMonitor(triton_metrics_url="http://127.0.0.1:9/metrics").read_queue() is None  # nothing listens


def test_queue_reading_sees_requests_wait_under_a_burst(server):
    """What the idle flag relies on: during a burst, Triton reports pending requests and the monitor reads them."""
    monitor = GpuMonitor(triton_metrics_url=server.metrics_url, queue_model=None)
    done = threading.Event()
    seen = []

    def client_loop(k: int) -> None:
        with EmbeddingClient(url=server.grpc_url, protocol="grpc", retries=0) as client:
            for i in range(8):
                # a request the server sheds under the burst (overloaded) is fine here: only the queue matters
                with contextlib.suppress(ServerUnavailableError):
                    client.embed([f"burst {k} {i} " + "word " * (8 * (i % 5 + 1)) + str(id(seen))])

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(24)]
    for t in threads:
        t.start()

    def watch() -> None:
        while not done.is_set():
            seen.append(monitor.read_queue())

    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    watcher.join(timeout=30)
    readings = [q.pending for q in seen if q is not None]
    assert readings and max(readings) > 0, readings
    waiting = sum(r > 0 for r in readings)
    print(f"{len(readings)} readings during the burst, {waiting} with requests pending, max {max(readings)}")
    assert monitor.errors["triton"] == 0
