"""`make model`: the export writes checked artifacts, skips when up to date, and sets the configs' width."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from conftest import reference_embed
from triton_embed_server import export as exporter
from triton_embed_server import model_config
from triton_embed_server.encoder_module import device_problems
from triton_embed_server.layout import DEFAULT_MODEL_REPOSITORY

ROOT = Path(__file__).resolve().parents[1]


def copy_configs(dst: Path) -> Path:
    shutil.copytree(
        ROOT / "model_repository", dst, ignore=shutil.ignore_patterns("model.pt", "tokenizer.json", "*.json")
    )
    return dst


def test_export_writes_checked_artifacts_and_skips_when_up_to_date(tmp_path, reference):
    """The exported module embeds as in-process sentence-transformers does (checked here on its own, not through the
    export's check), and a second export of an unchanged model writes nothing."""
    repo = copy_configs(tmp_path / "repo")
    model = exporter.default_model_path()
    manifest = exporter.export(model, repo, precision="fp32")
    assert manifest.dim == 384 and manifest.max_seq_length == 256 and manifest.pooling == "mean"
    module = torch.jit.load(str(repo / "encoder" / "1" / "model.pt"))
    sentences = ["A man is playing a guitar.", "hello"]
    features = reference.tokenize(sentences)
    with torch.no_grad():
        out = module(features["input_ids"], features["attention_mask"])
    np.testing.assert_allclose(out.numpy(), reference_embed(reference, sentences), atol=1e-5)
    tokenizer = json.loads((repo / "tokenizer" / "1" / "tokenizer.json").read_text())
    assert tokenizer["truncation"]["max_length"] == 256

    assert exporter.is_up_to_date(model, repo, "fp32")
    mtime = (repo / "encoder" / "1" / "model.pt").stat().st_mtime
    time.sleep(0.01)
    exporter.export(model, repo, precision="fp32")
    assert (repo / "encoder" / "1" / "model.pt").stat().st_mtime == mtime


def test_set_config_dims_rewrites_every_width_limit_and_bucket_list(tmp_path):
    repo = copy_configs(tmp_path / "repo")
    changed = model_config.set_config_dims(repo, 768)
    names = sorted(str(p.relative_to(repo)) for p in changed)
    assert names == [
        "embed/config.pbtxt",
        "embed/configs/libtorch.pbtxt",
        "encoder/config.pbtxt",
        "encoder/configs/gpu.pbtxt",
        "encoder/configs/libtorch.pbtxt",
    ]
    assert [o.dims for o in model_config.read(repo / "embed" / "config.pbtxt").output if o.name == "EMBEDDING"] == [
        [768]
    ]
    assert model_config.set_config_dims(repo, 768) == []
    assert model_config.set_config_dims(repo, 768, 256) == []  # the shipped limit and buckets
    assert model_config.set_config_dims(repo, 768, 512) == [
        repo / "encoder" / "config.pbtxt",
        repo / "tokenizer" / "config.pbtxt",
    ]
    assert model_config.parameter(model_config.read(repo / "tokenizer" / "config.pbtxt"), "MAX_SEQ_LENGTH") == "512"
    batch, lengths = model_config.buckets(model_config.read(repo / "encoder" / "config.pbtxt"))
    assert batch == 64 and len(lengths) == 12 and lengths[-3:] == [256, 384, 512]
    assert model_config.set_config_dims(repo, 768, 256) == [
        repo / "encoder" / "config.pbtxt",
        repo / "tokenizer" / "config.pbtxt",
    ]
    shipped = model_config.read(ROOT / "model_repository" / "encoder" / "config.pbtxt")
    model_config.set_width(shipped, 768)
    assert model_config.read(repo / "encoder" / "config.pbtxt") == shipped  # the template's values, at 768 wide
    # a file written again keeps its header: here the template's own first comment lines
    assert model_config.header(repo / "encoder" / "config.pbtxt")[0].startswith("encoder: TorchScript")


def test_cli_reports_missing_model_folder(tmp_path, capsys):
    try:
        exporter.main(["--model", str(tmp_path), "--repository", str(tmp_path)])
    except SystemExit as exc:
        assert exc.code == 2
    assert "no modules.json" in capsys.readouterr().err


def test_without_model_the_exported_model_is_kept_and_default_goes_back(tmp_path, capsys):
    """`make model MODEL=mine` then `make serve` (which runs `make model` without MODEL) keeps the user's model;
    `MODEL=default` goes back to the packaged all-MiniLM-L6-v2, and says so."""
    default = exporter.default_model_path()
    mine = tmp_path / "mine"
    shutil.copytree(default, mine)  # a user's own sentence-transformers folder
    repo = copy_configs(tmp_path / "repo")
    assert exporter.chosen_model(None, repo) == (default, "")  # nothing exported yet: the packaged one
    manifest = repo / "encoder" / "1" / exporter.MANIFEST_NAME
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"source": str(mine)}))  # what `make model MODEL=mine` leaves
    path, note = exporter.chosen_model(None, repo)
    assert path == mine and "kept the model exported last" in note and "MODEL=default" in note
    path, note = exporter.chosen_model("default", repo)  # `make test` / `make bench`: the reference model
    assert path == default and f"replaced the exported {mine}" in note
    shutil.rmtree(mine)  # the folder is gone: nothing to keep
    path, note = exporter.chosen_model(None, repo)
    assert path == default and note == f"replaced the exported {mine} with the packaged all-MiniLM-L6-v2"


def test_cli_names_what_is_wrong_with_the_model_path(tmp_path, capsys):
    (tmp_path / "file.py").write_text("")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "modules.json").write_text("not json")
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path / "file.py"): "is a file; give the sentence-transformers folder",
        str(tmp_path / "junk"): "modules.json is not valid JSON (Expecting value",
    }
    for path, message in cases.items():
        try:
            exporter.main(["--model", path, "--repository", str(tmp_path / "repo")])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{path} was accepted")
        assert message in capsys.readouterr().err


def test_exported_module_is_device_portable():
    """The model.pt `make model` wrote holds no device constant and runs with weights and inputs on `meta`."""
    module = torch.jit.load(str(DEFAULT_MODEL_REPOSITORY / "encoder" / "1" / "model.pt"))
    assert device_problems(module) == []


def test_device_check_catches_a_module_pinned_to_the_cpu():
    """transformers' own mask builder, traced with a 2-D mask, hard-codes the tracing device: the check says so."""
    from transformers import AutoModel

    transformer = AutoModel.from_pretrained(
        str(exporter.default_model_path()), attn_implementation="eager", return_dict=False
    ).eval()

    class TwoDimMask(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids, attention_mask):
            return self.transformer(input_ids=input_ids, attention_mask=attention_mask)[0][:, 0]

    ids = torch.randint(1000, 2000, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        pinned = torch.jit.trace(TwoDimMask().eval(), (ids, mask), check_trace=False)
    problems = device_problems(pinned)
    assert any('Device = prim::Constant[value="cpu"]' in p for p in problems), problems
    assert any("meta device failed" in p and "Cannot copy out of meta tensor" in p for p in problems), problems


def test_a_model_that_needs_its_own_code_is_refused_in_one_line(tmp_path, capsys):
    """NomicBERT-style: config.json's auto_map points at the model's own modeling file, which the export never runs."""
    model = tmp_path / "nomic-embed-text-v1.5"
    model.mkdir()
    (model / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}])
    )
    config = {"model_type": "nomic_bert", "auto_map": {"AutoModel": "modeling_hf_nomic_bert.NomicBertModel"}}
    (model / "config.json").write_text(json.dumps(config))
    assert exporter.main(["--model", str(model), "--repository", str(tmp_path / "repo")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "model_type 'nomic_bert' runs code shipped with the model" in err[0]
    assert "trust_remote_code" in err[0] and "tested on model types bert, distilbert, roberta" in err[0]
    assert not (tmp_path / "repo" / "encoder" / "1" / "model.pt").exists()
