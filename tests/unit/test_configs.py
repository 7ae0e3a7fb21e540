"""Every config in the model repository parses as Triton's ModelConfig protobuf (field names, nesting, types)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from triton_embed_protocol.capacity import AUTO, AdmissionConfig, Knobs, ServiceCurve
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


def test_libtorch_ensemble_is_the_default_one_without_the_tokenizers_hand_off():
    default, libtorch = parse("embed/config.pbtxt"), parse("embed/configs/libtorch.pbtxt")
    for step in default.ensemble_scheduling.step:
        for name in ("queued_ns", "bulk"):
            step.input_map.pop(name, None)
            step.output_map.pop(name, None)
    assert default == libtorch
    inputs = {i.name for i in parse("encoder/configs/libtorch.pbtxt").input}
    assert inputs == {"input_ids", "attention_mask"}


def test_every_encoder_on_our_backend_takes_the_hand_off_and_a_door_measured_where_it_runs():
    tokenizer = {o.name: o for o in parse("tokenizer/config.pbtxt").output}
    knobs = []
    for relative in ("encoder/config.pbtxt", "encoder/configs/gpu.pbtxt"):
        config = parse(relative)
        for name in ("queued_ns", "bulk"):  # what the tokenizer hands on with the tokens, as it types them
            given = next(i for i in config.input if i.name == name)
            assert given.optional and list(given.dims) == [1], relative
            assert given.data_type == tokenizer[name].data_type, (relative, name)
        values = {k: v.string_value for k, v in config.parameters.items()}
        for knob in Knobs.KNOBS[1:]:  # CPU and GPU alike: each machine measures its own
            assert values[knob] == AUTO, f"{relative}: {knob} is {values[knob]!r}, not measured"
        read = AdmissionConfig.read(values)  # every knob reads
        Knobs(read, ServiceCurve({1: 0.005, 64: 0.08}, config.max_batch_size))
        knobs.append({k: values[k] for k in (*Knobs.KNOBS, "LATENCY_BUDGET_MS", "REFUSAL_HOLD_MS", "BULK_QUEUE")})
    assert knobs[0] == knobs[1]


@pytest.mark.parametrize("relative", ["embed/config.pbtxt", "rerank/config.pbtxt"])
def test_each_ensemble_hands_the_tokenizers_stamp_and_lane_to_the_encoder(relative):
    tokenizer, encoder = parse(relative).ensemble_scheduling.step
    for name in ("queued_ns", "bulk"):
        assert tokenizer.output_map[name] == encoder.input_map[name] == name, relative


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(REPO)) for p in CONFIGS])
def test_no_model_has_a_queue_policy(path):
    """Triton 2.51 leaves requests waiting 500 ms in a queue that has one (see the configs; docs/benchmarks.md)."""
    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    assert not config.dynamic_batching.HasField("default_queue_policy")


def test_a_served_repository_lists_its_ensembles_the_default_first_and_the_gateway_refuses_one_without(
    tmp_path, capsys
):
    """What the gateway's --repository serves: the folders whose config is an ensemble, `embed` first."""
    from triton_embed_gateway.__main__ import main
    from triton_embed_protocol import served_ensembles

    for name, platform in (("alpha", "ensemble"), ("embed", "ensemble"), ("alpha_encoder", "python")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(f'name: "{name}"\nplatform: "{platform}"\n')
    assert served_ensembles(tmp_path) == ["embed", "alpha"]
    assert served_ensembles(tmp_path / "absent") == []
    assert main(["--repository", str(tmp_path / "absent")]) == 2
    assert f"--repository {tmp_path / 'absent'}: no ensemble in it" in capsys.readouterr().err
