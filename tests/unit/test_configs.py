"""Every config in the model repository parses as Triton's ModelConfig protobuf (field names, nesting, types)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

REPO = Path(__file__).resolve().parents[2] / "model_repository"
CONFIGS = sorted(REPO.glob("*/config.pbtxt")) + sorted(REPO.glob("*/configs/*.pbtxt"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO)) for p in CONFIGS])
def test_config_parses(path):
    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    assert config.name == path.parts[len(REPO.parts)]
    assert config.max_batch_size == 64


def parse(relative: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((REPO / relative).read_text(), model_config_pb2.ModelConfig())


def test_libtorch_ensemble_is_the_default_one_without_the_queued_stamp():
    default, libtorch = parse("embed/config.pbtxt"), parse("embed/configs/libtorch.pbtxt")
    for step in default.ensemble_scheduling.step:
        step.input_map.pop("queued_ns", None)
        step.output_map.pop("queued_ns", None)
    assert default == libtorch
    inputs = {i.name for i in parse("encoder/configs/libtorch.pbtxt").input}
    assert inputs == {"input_ids", "attention_mask"}


def test_every_encoder_on_our_backend_takes_the_queued_stamp_and_has_a_guard_against_overload():
    holds, bulk = [], []
    for relative in ("encoder/config.pbtxt", "encoder/configs/gpu.pbtxt"):
        config = parse(relative)
        stamp = next(i for i in config.input if i.name == "queued_ns")
        assert stamp.optional and list(stamp.dims) == [1], relative
        holds.append(config.parameters["REFUSAL_HOLD_MS"].string_value)
        door = int(config.parameters["MAX_IN_FLIGHT"].string_value)  # per hardware; 0 = no door
        budget = float(config.parameters["LATENCY_BUDGET_MS"].string_value)
        assert door > 0 or budget > 0, f"{relative}: neither a door nor a wait budget"
        bulk.append((config.parameters["BULK_TEXTS"].string_value, config.parameters["BULK_QUEUE"].string_value))
        lane = int(config.parameters["BULK_IN_FLIGHT"].string_value)  # 0 = no lane
        assert (lane > 0) == (door > 0), (
            f"{relative}: the door and the bulk lane go together (BULK_IN_FLIGHT, MAX_IN_FLIGHT)"
        )
    assert holds[0] == holds[1] and bulk[0] == bulk[1]
    assert "queued_ns" in {o.name for o in parse("tokenizer/config.pbtxt").output}


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO)) for p in CONFIGS])
def test_no_model_has_a_queue_policy(path):
    """Triton 2.51 leaves requests waiting 500 ms in a queue that has one (see the configs; docs/benchmarks.md)."""
    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    assert not config.dynamic_batching.HasField("default_queue_policy")
