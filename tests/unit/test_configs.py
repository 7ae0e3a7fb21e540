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


def test_tokenizer_bounds_its_queue_and_encoder_has_no_queue_policy():
    encoder = text_format.Parse((REPO / "encoder" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert not encoder.dynamic_batching.HasField("default_queue_policy")  # 500 ms stalls on 2.51, see the config
    tokenizer = text_format.Parse((REPO / "tokenizer" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert tokenizer.dynamic_batching.default_queue_policy.max_queue_size > 0
