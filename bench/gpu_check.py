"""GPU check of the CUDA-graph runner: replay equals eager per bucket; eager vs graph throughput and p99.

Runs on a machine with a CUDA GPU and torch + transformers, without Triton and without the model package: the
encoder is all-MiniLM-L6-v2's architecture (BertConfig below, the values of the packaged ``config.json``) with
random weights, which costs the same time as the trained one. Usage (under 8 minutes on an H200)::

    python bench/gpu_check.py --out results/            # writes gpu_check.json and gpu_check.md

Checks, for every bucket of the default grid (batch 1..64 x length 16..256):
* graph replay of a ragged batch equals the eager module on each row alone (max abs diff < 1e-3, fp32);
* per batch bucket at length 32 (STS-B p95 is 31 tokens): eager and graph throughput (sentences/s) and p99 per
  call, and their ratio (target: graph >= 2x eager for batch <= 8).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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


def main() -> int:
    """Run the checks; exit 1 when a replay differs from eager."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--calls", type=int, default=200, help="timed calls per bucket and path")
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

    worst = max(diffs.values())
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "load_log": log_lines,
        "max_abs_diff_per_bucket": diffs,
        "worst_diff": worst,
        "speed_length_32": speed,
        "graph_executions": {f"{k[0]}/{k[1]}": v for k, v in graph.stats.executions.items()},
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
    (args.out / "gpu_check.md").write_text("\n".join(lines) + "\n\n" + "\n".join(log_lines) + "\n")
    print("\n".join(lines))
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
