"""GPU check of the CUDA-graph runner: replay equals eager per bucket; eager vs graph throughput and p99.

Runs on a machine with a CUDA GPU and torch + transformers, without Triton and without the model package: the
encoder is all-MiniLM-L6-v2's architecture (BertConfig below, the values of the packaged ``config.json``) with
random weights, which costs the same time as the trained one. Usage (under 8 minutes on an H200)::

    python bench/gpu_check.py --out results/            # writes gpu_check.json and gpu_check.md

Checks, for every bucket of the default grid (batch 1..64 x length 16..256):
* graph replay of a ragged batch equals the eager module on each row alone (max abs diff < 1e-3, fp32);
* per batch bucket at length 32 (STS-B p95 is 31 tokens): eager and graph throughput (sentences/s) and p99 per
  call, and their ratio (target: graph >= 2x eager for batch <= 8).
* the GPU monitor (``triton_embed.monitor``, issue 6): sampling every 0.2 s, it must report this GPU (its NVML
  UUID or name) and see its utilisation rise while graph replays of batch 64 x 256 run, over an idle baseline
  (mean during the load >= idle mean + 20 points). Needs ``nvidia-ml-py`` (carry its wheel,
  ``nvidia_ml_py-13.615.71-py3-none-any.whl``, where nothing can be downloaded); without it the section is
  reported as not checked. tritonclient is not needed: the monitor is imported without the client package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backends" / "torchscript"))
sys.path.insert(0, str(ROOT / "server"))

from buckets import DEFAULT_BATCH_SIZES, DEFAULT_LENGTHS, BucketTable, GraphSettings  # noqa: E402
from runners import BucketedRunner  # noqa: E402
from triton_embed_server.encoder_module import PooledEncoder  # noqa: E402

MINILM = {
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
    "hidden_act": "gelu",
    "type_vocab_size": 2,
}


def build_module(device: torch.device) -> torch.jit.ScriptModule:
    """Trace MiniLM-L6's architecture (random weights) + mean pooling + L2 norm, as ``make model`` does."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(**MINILM, attn_implementation="eager", return_dict=False)
    model = PooledEncoder(BertModel(config).eval(), "mean").eval().to(device)
    ids = torch.randint(1000, 2000, (2, 16), device=device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return torch.jit.trace(model, (ids, mask), check_trace=False)


def ragged(rng, rows: int, length: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Rows of 1..length tokens (one of exactly ``length``), right-padded."""
    lengths = [int(x) for x in rng.integers(1, length + 1, size=rows)]
    lengths[0] = length
    ids = np.zeros((rows, length), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1000, 29000, size=n)
        mask[i, :n] = 1
    return ids, mask, lengths


def time_calls(fn, calls: int) -> list[float]:
    """Milliseconds per call (each call returns host data, so it includes the device sync)."""
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def load_monitor():
    """``triton_embed.monitor`` without running ``triton_embed/__init__`` (which imports tritonclient).

    Returns:
        The ``triton_embed.monitor`` module.
    """
    if "triton_embed" not in sys.modules:
        package = types.ModuleType("triton_embed")
        package.__path__ = [str(ROOT / "client" / "triton_embed")]
        sys.modules["triton_embed"] = package
    import triton_embed.monitor

    return triton_embed.monitor


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
        from triton_embed.monitor.exporter import MonitorExporter
    except ImportError as exc:  # prometheus-client not installed here
        result["exporter"] = f"not checked: {exc}"
    else:
        from prometheus_client import generate_latest

        exporter = MonitorExporter()
        exporter.observe([s for s in samples if s.timestamp == samples[-1].timestamp], None)
        text = generate_latest(exporter.registry).decode()
        result["exporter"] = [line for line in text.splitlines() if line.startswith("triton_embed_gpu_utilization")]
    return result


def monitor_summary(monitor: dict, seconds: float) -> str:
    """One line for gpu_check.md about :func:`check_monitor`'s result."""
    if not monitor["checked"]:
        return f"GPU monitor NOT CHECKED: {monitor['reason']}"
    return (
        f"GPU monitor {'OK' if monitor['ok'] else 'FAILED'}: reported {monitor['gpu']}; utilisation idle "
        f"{monitor['idle_util_pct_mean']:.0f}% -> {monitor['load_util_pct_mean']:.0f}% mean "
        f"({monitor['load_util_pct_max']:.0f}% max) under graph replays of 64 x 256 for {seconds:g} s; "
        f"{monitor['samples']} samples; episodes {monitor['episodes']}"
    )


def main() -> int:
    """Run the checks; exit 1 when a replay differs from eager or the GPU monitor does not see the load."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--calls", type=int, default=200, help="timed calls per bucket and path")
    parser.add_argument("--monitor-seconds", type=float, default=8.0, help="seconds of load for the monitor check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    device = torch.device("cuda", 0)
    module = build_module(device)
    table = BucketTable.grid(DEFAULT_BATCH_SIZES, DEFAULT_LENGTHS)
    log_lines: list[str] = []
    graph = BucketedRunner(module, device, GraphSettings(True, table, False), log=log_lines.append)
    graph.warmup()
    eager = BucketedRunner(module, device, GraphSettings(False, table, False), log=log_lines.append)
    eager.warmup()
    rng = np.random.default_rng(0)

    diffs = {}
    for bucket in table.buckets:
        rows = max(1, bucket.batch_size - 1) if bucket.batch_size > 1 else 1
        ids, mask, lengths = ragged(rng, rows, bucket.length)
        out = graph(ids, mask)
        with torch.no_grad():
            ref = (
                torch.cat(
                    [
                        module(
                            torch.from_numpy(ids[i : i + 1, :n]).to(device),
                            torch.from_numpy(mask[i : i + 1, :n]).to(device),
                        )
                        for i, n in enumerate(lengths)
                    ]
                )
                .cpu()
                .numpy()
            )
        diffs[str(bucket)] = float(np.abs(out - ref).max())

    speed = []
    for batch in DEFAULT_BATCH_SIZES:
        ids = rng.integers(1000, 29000, size=(batch, 32)).astype(np.int64)
        mask = np.ones_like(ids)
        row = {"batch": batch, "length": 32}
        for name, runner in (("eager", eager), ("graph", graph)):
            times = time_calls(lambda r=runner, i=ids, m=mask: r(i, m), args.calls)
            row[f"{name}_per_s"] = batch * 1000 / float(np.mean(times))
            row[f"{name}_p99_ms"] = float(np.percentile(times, 99))
        row["graph_over_eager"] = row["graph_per_s"] / row["eager_per_s"]
        speed.append(row)

    big_ids = rng.integers(1000, 29000, size=(64, 256)).astype(np.int64)
    big_mask = np.ones_like(big_ids)

    def load() -> None:
        end = time.monotonic() + args.monitor_seconds
        while time.monotonic() < end:
            graph(big_ids, big_mask)

    monitor = check_monitor(load, device)

    worst = max(diffs.values())
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "load_log": log_lines,
        "max_abs_diff_per_bucket": diffs,
        "worst_diff": worst,
        "speed_length_32": speed,
        "graph_executions": {f"{k[0]}/{k[1]}": v for k, v in graph.stats.executions.items()},
        "monitor": monitor,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"GPU check on {result['device']}, torch {result['torch']}; worst |graph - eager| = {worst:.2e} "
        f"over {len(diffs)} buckets (limit 1e-3).",
        "",
        "| batch x 32 tokens | eager sent/s | graph sent/s | graph / eager | eager p99 ms | graph p99 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in speed:
        lines.append(
            f"| {r['batch']} | {r['eager_per_s']:.0f} | {r['graph_per_s']:.0f} | {r['graph_over_eager']:.2f} "
            f"| {r['eager_p99_ms']:.2f} | {r['graph_p99_ms']:.2f} |"
        )
    lines += ["", monitor_summary(monitor, args.monitor_seconds)]
    (args.out / "gpu_check.md").write_text("\n".join(lines) + "\n\n" + "\n".join(log_lines) + "\n")
    print("\n".join(lines))
    return 0 if worst < 1e-3 and (monitor["ok"] or not monitor["checked"]) else 1


if __name__ == "__main__":
    sys.exit(main())
