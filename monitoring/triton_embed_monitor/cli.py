"""``triton-embed-monitor`` (``python -m triton_embed_monitor``): GPU metrics and flags on a Prometheus endpoint.

    triton-embed-monitor --triton-metrics-url http://127.0.0.1:8002/metrics     # serves :9455/metrics
    triton-embed-monitor --once                                                  # one JSON line per GPU, exit

Without a GPU, driver or ``nvidia-ml-py`` it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict

from triton_embed_monitor.flags import IDLE_WITH_QUEUE, FlagThresholds
from triton_embed_monitor.sampling import GpuMonitor, GpuSample
from triton_embed_monitor.triton_queue import QueueSample

DEFAULT_PORT = 9455
"""The monitor's metrics port (Triton uses 8000-8002, Prometheus 9090, Grafana 3000, DCGM exporter 9400)."""
PROG = "triton-embed-monitor"


def _parser() -> argparse.ArgumentParser:
    d = FlagThresholds()
    p = argparse.ArgumentParser(prog=PROG, description="Sample NVIDIA GPUs with NVML; serve Prometheus metrics.")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="metrics bind address (default %(default)s: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="metrics port (default %(default)s)")
    p.add_argument("--triton-metrics-url", help="Triton's /metrics URL, for the flag 'GPU idle while requests wait'")
    p.add_argument("--queue-model", default="encoder", help="model whose queue counts; 'all' sums every model")
    p.add_argument("--idle-below", type=float, default=d.idle_below_pct, help="idle under this utilisation, %%")
    p.add_argument("--idle-window", type=float, default=d.idle_window_s, help="seconds idle-with-queue must last")
    p.add_argument("--saturation-above", type=float, default=d.saturation_above_pct, help="saturated above, %%")
    p.add_argument("--saturation-window", type=float, default=d.saturation_window_s, help="seconds it must last")
    p.add_argument("--once", action="store_true", help="print one JSON line per GPU and exit")
    return p


def _log_transitions(
    before: dict[int, dict[str, bool]], after: dict[int, dict[str, bool]], thresholds: FlagThresholds
) -> None:
    """Print one line per flag that turned on or off between two ticks (``MonitorExporter.flags``)."""
    t = thresholds
    for gpu, flags in after.items():
        for kind, on in flags.items():
            if on != before.get(gpu, {}).get(kind, False):
                what = (
                    f"utilisation under {t.idle_below_pct:g}% for {t.idle_window_s:g} s with requests pending"
                    if kind == IDLE_WITH_QUEUE
                    else f"utilisation over {t.saturation_above_pct:g}% for {t.saturation_window_s:g} s"
                )
                print(f"{PROG}: GPU {gpu}: {kind} {'ON' if on else 'off'} ({what})", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the monitor until SIGINT/SIGTERM. Returns 0 (also without a GPU), 1 when the port cannot be bound."""
    args = _parser().parse_args(argv)
    thresholds = FlagThresholds(args.idle_below, args.idle_window, args.saturation_above, args.saturation_window)
    queue_model = None if args.queue_model == "all" else args.queue_model
    monitor = GpuMonitor(args.interval, triton_metrics_url=args.triton_metrics_url, queue_model=queue_model)
    if not monitor.available:
        print(f"{PROG}: no GPU to monitor ({monitor.unavailable_reason}); exiting", file=sys.stderr)
        return 0
    if args.once:
        for sample in monitor.sample_once():
            print(json.dumps(asdict(sample)))
        monitor.stop()
        return 0

    from triton_embed_monitor.exporter import MonitorExporter  # needs prometheus-client, only for serving

    exporter = MonitorExporter(thresholds, queue_model=queue_model, monitor=monitor)

    def on_tick(samples: list[GpuSample], queue: QueueSample | None) -> None:
        before = exporter.flags
        exporter.observe(samples, queue)
        _log_transitions(before, exporter.flags, thresholds)

    monitor.on_tick = on_tick
    try:
        server, _ = exporter.serve(args.host, args.port)
    except OSError as exc:
        print(f"{PROG}: cannot serve metrics on {args.host}:{args.port}: {exc}", file=sys.stderr)
        monitor.stop()
        return 1
    # a plain list, not a threading.Event: a handler that interrupts Event.wait() while it holds the Event's lock
    # would wait for that lock forever (see triton_embed_server.embedded.StopFlag)
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda n, _: stop.append(n)) for sig in (signal.SIGINT, signal.SIGTERM)}
    names = ", ".join(f"{s.index}: {s.name}" for s in monitor.sample_once())
    print(
        f"{PROG}: sampling every {args.interval:g} s ({names}); metrics on http://{args.host}:{server.server_port}/metrics"
        + (
            f"; Triton queue from {args.triton_metrics_url} (model {args.queue_model})"
            if args.triton_metrics_url
            else ""
        ),
        flush=True,
    )
    monitor.start()
    try:
        while not stop:
            time.sleep(0.2)
    finally:
        monitor.stop()
        server.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
