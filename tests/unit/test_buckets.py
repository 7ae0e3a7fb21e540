"""Bucket list and lookup (python_backends/torchscript/buckets.py): pure logic, no server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_backends" / "torchscript"))

from buckets import (  # noqa: E402
    DEFAULT_BATCH_SIZES,
    DEFAULT_LENGTHS,
    Bucket,
    BucketConfigError,
    BucketTable,
    bucket_lengths,
    default_grid,
    plan_chunks,
    settings_from_model_config,
)

GRID = BucketTable.grid(DEFAULT_BATCH_SIZES, DEFAULT_LENGTHS)


@pytest.mark.parametrize(
    ("batch", "length", "expected"),
    [
        ((1, 1), None, Bucket(1, 16)),
        ((3, 17), None, Bucket(4, 32)),
        ((5, 16), None, Bucket(8, 16)),
        ((64, 256), None, Bucket(64, 256)),
        ((33, 129), None, Bucket(64, 256)),
        ((65, 10), None, None),
        ((1, 257), None, None),
    ],
)
def test_default_grid_examples(batch, length, expected):
    assert GRID.lookup(*batch) == expected


def test_every_shape_maps_to_the_smallest_bucket_that_holds_it():
    for batch in range(1, 65):
        for length in range(1, 257):
            got = GRID.lookup(batch, length)
            holding = [k for k in GRID.buckets if k.batch_size >= batch and k.length >= length]
            assert got in holding
            assert got.tokens == min(k.tokens for k in holding), (batch, length, got)


def test_sparse_list_picks_fewest_padded_tokens_and_prefers_shorter_on_ties():
    table = BucketTable([(8, 128), (64, 16), (16, 64), (2, 512)])
    assert table.lookup(4, 20) == Bucket(16, 64)  # 8x128 and 16x64 hold it, both 1024 tokens: the shorter wins
    table = BucketTable([(8, 128), (64, 16)])
    assert table.lookup(30, 16) == Bucket(64, 16)
    assert table.lookup(9, 17) is None  # inside the maxima, but no single bucket holds it
    assert table.lookup(1, 200) is None


def test_buckets_are_ordered_largest_first_for_capture():
    tokens = [k.tokens for k in GRID.buckets]
    assert tokens == sorted(tokens, reverse=True)
    assert GRID.buckets[0] == Bucket(64, 256) and GRID.buckets[-1] == Bucket(1, 16)
    assert len(GRID) == len(DEFAULT_BATCH_SIZES) * len(DEFAULT_LENGTHS)


def spec(batch, dims, key="input_ids"):
    return {"batch_size": batch, "input": {key: {"dim": dims}}}


def test_graph_spec_present_gives_the_buckets():
    config = {
        "max_batch_size": 64,
        "optimization": {"cuda": {"graphs": True, "graph_spec": [spec(1, ["16"]), spec(8, ["32"]), spec(64, [128])]}},
    }
    settings = settings_from_model_config(config)
    assert settings.graphs and settings.from_config
    assert sorted(settings.table.buckets) == [Bucket(1, 16), Bucket(8, 32), Bucket(64, 128)]


def test_graph_spec_absent_gives_the_default_grid():
    settings = settings_from_model_config({"max_batch_size": 64})
    assert not settings.graphs and not settings.from_config
    assert sorted(settings.table.buckets) == sorted(GRID.buckets)
    assert settings_from_model_config({"optimization": {"cuda": {"graphs": True}}}).graphs


def test_bucket_lengths_reach_the_model_limit_in_steps_of_at_most_one_and_a_half():
    assert bucket_lengths(256) == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256]  # the CPU config's list as shipped
    assert bucket_lengths(128) == [8, 16, 24, 32, 48, 64, 96, 128]
    assert bucket_lengths(8192)[-6:] == [1536, 2048, 3072, 4096, 6144, 8192]  # ModernBERT's limit
    assert bucket_lengths(500)[-3:] == [256, 384, 500]  # a limit off the steps is the last bucket itself
    assert bucket_lengths(5) == [5]
    assert bucket_lengths(512, smallest=16, half_steps=False) == [16, 32, 64, 128, 256, 512]
    for limit in (17, 300, 32768):
        lengths = bucket_lengths(limit)
        assert lengths == sorted(set(lengths)) and lengths[-1] == limit
        assert all(b / a <= 2 for a, b in zip(lengths, lengths[1:], strict=False))
        assert all(b / a <= 1.5 for a, b in zip(lengths[1:], lengths[2:], strict=False) if b < limit)
    with pytest.raises(ValueError, match="max_seq_length and smallest must be >= 1; got 0, 8"):
        bucket_lengths(0)


def test_the_default_grid_covers_a_long_model_with_buckets_no_larger_than_64x256():
    assert default_grid(256).buckets == GRID.buckets
    long = default_grid(8192)
    assert long.max_length == 8192 and long.lookup(2, 5000) == Bucket(2, 8192)
    assert long.lookup(3, 5000) is None  # past 16,384 tokens: runs at its exact shape
    assert max(k.tokens for k in long.buckets) == 64 * 256
    assert default_grid(128).max_length == 128  # no bucket the model cannot reach


def test_graph_spec_entries_past_the_model_limit_are_left_out():
    config = {"optimization": {"cuda": {"graph_spec": [spec(64, ["64"]), spec(64, ["256"])]}}}
    assert settings_from_model_config(config, max_seq_length=128).table.max_length == 64
    assert settings_from_model_config({}, max_seq_length=1024).table.max_length == 1024
    with pytest.raises(
        BucketConfigError, match=r"every entry is longer than the model's max_seq_length 32; got lengths \[64, 256\]"
    ):
        settings_from_model_config(config, max_seq_length=32)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (spec(0, ["16"]), r"graph_spec\[1\]\.batch_size must be a positive integer; got 0"),
        (spec(128, ["16"]), r"graph_spec\[1\]\.batch_size is 128; the model's max_batch_size is 64"),
        (spec(8, ["16"], key="attention_mask"), r"graph_spec\[1\]\.input has no 'input_ids' entry"),
        (spec(8, ["16", "2"]), r"graph_spec\[1\]\.input\['input_ids'\]\.dim must hold one length; got \['16', '2'\]"),
        (spec(8, ["abc"]), r"graph_spec\[1\]\.input\['input_ids'\]\.dim\[0\] must be a positive integer; got 'abc'"),
        (
            {"input": {"input_ids": {"dim": ["16"]}}},
            r"graph_spec\[1\]\.batch_size must be a positive integer; got None",
        ),
    ],
)
def test_malformed_graph_spec_names_the_field_and_value(entry, message):
    config = {"max_batch_size": 64, "optimization": {"cuda": {"graph_spec": [spec(1, ["16"]), entry]}}}
    with pytest.raises(BucketConfigError, match=message):
        settings_from_model_config(config)


def eager_cost(table):
    def cost(rows, length):
        bucket = table.lookup(rows, length)
        return rows * (bucket.length if bucket else length)

    return cost


def test_plan_keeps_uniform_batches_whole():
    assert plan_chunks([14] * 20, eager_cost(GRID), overhead=32) == [(0, 20)]


def test_plan_splits_off_long_rows():
    lengths = [10] * 30 + [200, 250]
    assert plan_chunks(lengths, eager_cost(GRID), overhead=32) == [(0, 30), (30, 32)]


def test_plan_is_optimal_against_brute_force():
    import itertools
    import random

    rnd = random.Random(5)
    cost = eager_cost(GRID)
    for _ in range(30):
        lengths = sorted(rnd.randint(1, 256) for _ in range(rnd.randint(1, 9)))
        plan = plan_chunks(lengths, cost, overhead=20)
        assert plan[0][0] == 0 and plan[-1][1] == len(lengths)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(plan))

        def total(chunks, lengths=lengths):
            return sum(20 + cost(e - s, lengths[e - 1]) for s, e in chunks)

        best = min(
            total(list(itertools.pairwise([0, *cuts, len(lengths)])))
            for k in range(len(lengths))
            for cuts in itertools.combinations(range(1, len(lengths)), k)
        )
        assert total(plan) == best
