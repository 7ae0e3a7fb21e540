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


def test_encoder_sheds_load_and_tokenizer_bounds_its_queue():
    encoder = text_format.Parse((REPO / "encoder" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    policy = encoder.dynamic_batching.default_queue_policy
    assert policy.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT and policy.max_queue_size > 0
    tokenizer = text_format.Parse((REPO / "tokenizer" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert tokenizer.dynamic_batching.default_queue_policy.max_queue_size > 0
