"""The one writer of served configs (server/triton_embed_server/model_config.py): what it writes reads back whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from triton_embed_server import model_config

TEMPLATES = Path(__file__).resolve().parents[2] / "model_repository"
CONFIGS = sorted(TEMPLATES.glob("*/config.pbtxt")) + sorted(TEMPLATES.glob("*/configs/*.pbtxt"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(TEMPLATES)) for p in CONFIGS])
def test_a_written_template_reads_back_with_every_setting(tmp_path, path):
    written = tmp_path / "config.pbtxt"
    assert model_config.write(written, model_config.read(path), ["a header line"])
    assert model_config.read(written) == model_config.read(path)
    assert model_config.header(written) == ["a header line"]
    assert not model_config.write(written, model_config.read(path), ["a header line"])  # unchanged: not written


def test_a_model_gets_its_names_values_and_a_rerankers_logit(tmp_path):
    values = {"dim": 768, "max_seq_length": 512, "precision": "bf16"}
    written = model_config.write_configs(tmp_path, "multi", TEMPLATES, **values)
    assert sorted(str(p.relative_to(tmp_path)) for p in written) == [
        "multi/config.pbtxt",
        "multi/configs/libtorch.pbtxt",
        "multi_encoder/config.pbtxt",
        "multi_encoder/configs/gpu.pbtxt",
        "multi_encoder/configs/libtorch.pbtxt",
        "multi_tokenizer/config.pbtxt",
    ]
    ensemble = model_config.read(tmp_path / "multi" / "config.pbtxt")
    assert ensemble.name == "multi"
    assert [step.model_name for step in ensemble.ensemble_scheduling.step] == ["multi_tokenizer", "multi_encoder"]
    assert [list(o.dims) for o in ensemble.output if o.name == "EMBEDDING"] == [[768]]
    encoder = model_config.read(tmp_path / "multi_encoder" / "config.pbtxt")
    assert model_config.parameter(encoder, "PRECISION") == "bf16"
    assert model_config.buckets(encoder) == (64, model_config.cpu_bucket_lengths(512))
    assert model_config.buckets(model_config.read(tmp_path / "multi_encoder" / "configs" / "gpu.pbtxt")) == (None, [])
    tokenizer = model_config.read(tmp_path / "multi_tokenizer" / "config.pbtxt")
    assert model_config.parameter(tokenizer, "MAX_SEQ_LENGTH") == "512"
    assert "model_repository/encoder/config.pbtxt" in " ".join(
        model_config.header(tmp_path / "multi_encoder" / "config.pbtxt")
    )
    assert model_config.write_configs(tmp_path, "multi", TEMPLATES, **values) == []  # the same: nothing written

    model_config.write_configs(tmp_path, "rr", TEMPLATES, dim=1, max_seq_length=512, precision="fp32", reranker=True)
    scorer = model_config.read(tmp_path / "rr_encoder" / "config.pbtxt")
    assert [(o.name, list(o.dims)) for o in scorer.output] == [("embedding__0", [1]), ("logit__0", [1])]
    assert not (tmp_path / "rr_encoder" / "configs" / "libtorch.pbtxt").exists()
    assert model_config.read(tmp_path / "rr" / "config.pbtxt").platform == "ensemble"


def test_a_knob_the_config_lacks_is_an_error_not_a_new_parameter(tmp_path):
    config = tmp_path / "config.pbtxt"
    shutil.copy(TEMPLATES / "encoder" / "config.pbtxt", config)
    with pytest.raises(ValueError, match=r"model 'encoder' has no parameter MAX_IN_FLIGT; it has \['BULK_IN_FLIGHT'"):
        model_config.edit(config, lambda c: model_config.set_parameter(c, "MAX_IN_FLIGT", "8"))
    assert model_config.edit(config, lambda c: model_config.set_parameter(c, "MAX_IN_FLIGHT", "8"), "pinned here")
    assert model_config.parameter(model_config.read(config), "MAX_IN_FLIGHT") == "8"
    header = model_config.header(config)
    assert header[0].startswith("encoder: TorchScript") and header[-1] == "pinned here"  # the file's header kept


def test_a_file_that_is_not_a_config_is_named_in_the_error(tmp_path):
    bad = tmp_path / "config.pbtxt"
    bad.write_text('name: "x"\nmax_batch_sise: 64\n')
    with pytest.raises(ValueError, match=r"config\.pbtxt: not a Triton model config: .*max_batch_sise"):
        model_config.read(bad)
