"""BucketedRunner on the exported module: bucketed output equals unbucketed per request; stats count paths."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from triton_embed_server.layout import DEFAULT_MODEL_REPOSITORY

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backends" / "torchscript"))

from buckets import DEFAULT_BATCH_SIZES, DEFAULT_LENGTHS, BucketTable, GraphSettings  # noqa: E402
from runners import OVERFLOW, BucketedRunner, eager_label, load_module  # noqa: E402

GRID = BucketTable.grid(DEFAULT_BATCH_SIZES, DEFAULT_LENGTHS)


@pytest.fixture(scope="module")
def module():
    return load_module(DEFAULT_MODEL_REPOSITORY / "encoder" / "1" / "model.pt", torch.device("cpu"))


def ragged_batch(rng, rows: int, max_len: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Right-padded [rows, T] ids/mask with lengths 1..max_len (one row at max_len)."""
    lengths = [int(x) for x in rng.integers(1, max_len + 1, size=rows)]
    lengths[int(rng.integers(rows))] = max_len
    ids = np.zeros((rows, max_len), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1000, 29000, size=n)
        ids[i, 0], ids[i, n - 1] = 101, 102
        mask[i, :n] = 1
    return ids, mask, lengths


def unbucketed(module, ids, mask, lengths) -> np.ndarray:
    with torch.no_grad():
        rows = [
            module(torch.from_numpy(ids[i : i + 1, :n]), torch.from_numpy(mask[i : i + 1, :n]))
            for i, n in enumerate(lengths)
        ]
    return torch.cat(rows).numpy()


@pytest.mark.parametrize(
    ("rows", "max_len"), [(1, 1), (1, 17), (3, 40), (7, 130), (17, 64), (33, 256), (64, 31), (65, 12), (2, 300)]
)
def test_bucketed_equals_unbucketed_per_request(module, rows, max_len):
    rng = np.random.default_rng(rows * 1000 + max_len)
    ids, mask, lengths = ragged_batch(rng, rows, max_len)
    runner = BucketedRunner(module, torch.device("cpu"), GraphSettings(False, GRID, False), log=lambda _: None)
    out = runner(ids, mask)
    assert out.shape == (rows, 384) and out.dtype == np.float32
    np.testing.assert_allclose(out, unbucketed(module, ids, mask, lengths), atol=1e-5)

    labels = {eager_label(k.length) for k in GRID.buckets} | {OVERFLOW}  # eager on CPU: rows stay exact
    assert set(runner.stats.executions) <= {(label, "eager") for label in labels}
    assert runner.stats.real_tokens == sum(lengths)
    one_block = rows * (GRID.lookup(rows, max_len).length if GRID.lookup(rows, max_len) else max_len)
    assert sum(lengths) <= runner.stats.padded_tokens <= one_block  # chunking never pads more than one block


def test_mixed_lengths_split_into_cheaper_chunks(module):
    # 30 short rows and 2 long ones: one block would pad all 32 rows to 256 tokens.
    rng = np.random.default_rng(11)
    ids, mask, lengths = ragged_batch(rng, 32, 12)
    long_ids, long_mask, long_lengths = ragged_batch(rng, 2, 250)
    ids = np.concatenate([np.pad(ids, ((0, 0), (0, 238))), long_ids])
    mask = np.concatenate([np.pad(mask, ((0, 0), (0, 238))), long_mask])
    order = rng.permutation(34)
    ids, mask, lengths = ids[order], mask[order], [(lengths + long_lengths)[i] for i in order]
    runner = BucketedRunner(module, torch.device("cpu"), GraphSettings(False, GRID, False), log=lambda _: None)
    out = runner(ids, mask)
    np.testing.assert_allclose(out, unbucketed(module, ids, mask, lengths), atol=1e-5)
    assert runner.stats.executions == {("*x16", "eager"): 1, ("*x256", "eager"): 1}
    assert runner.stats.padded_tokens == 32 * 16 + 2 * 256


def test_overflow_batches_run_at_their_exact_shape_and_are_counted(module):
    runner = BucketedRunner(module, torch.device("cpu"), GraphSettings(False, GRID, False), log=lambda _: None)
    for rows, length in [(65, 10), (1, 300), (4, 20)]:  # all rows of a batch equally long: no split pays
        ids = np.full((rows, length), 1000, dtype=np.int64)
        runner(ids, np.ones_like(ids))
    assert runner.stats.executions == {(OVERFLOW, "eager"): 2, ("*x32", "eager"): 1}
    assert runner.stats.padded_tokens == 65 * 10 + 1 * 300 + 4 * 32


def test_warmup_logs_the_buckets(module):
    lines = []
    table = BucketTable.grid((1, 8), (16, 32))
    BucketedRunner(module, torch.device("cpu"), GraphSettings(False, table, True), log=lines.append).warmup()
    assert len(lines) == 1 and "2 bucket lengths, eager on cpu (rows exact); lengths [16, 32]" in lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graph capture and replay)")
def test_graph_replay_equals_eager_for_every_bucket(module):
    device = torch.device("cuda", 0)
    gpu_module = load_module(DEFAULT_MODEL_REPOSITORY / "encoder" / "1" / "model.pt", device)
    runner = BucketedRunner(gpu_module, device, GraphSettings(True, GRID, False), log=lambda _: None)
    runner.warmup()
    rng = np.random.default_rng(3)
    for bucket in GRID.buckets:
        rows = max(1, bucket.batch_size - 1)
        ids, mask, lengths = ragged_batch(rng, rows, bucket.length)
        out = runner(ids, mask)
        np.testing.assert_allclose(out, unbucketed(gpu_module, ids, mask, lengths), atol=1e-3)
    assert all(path == "graph" for _, path in runner.stats.executions)
