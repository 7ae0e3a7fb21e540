"""Model repositories for tests: tiny random-weight models, and copies of the shipped one with edited knobs."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def small_sentence_transformer(
    folder: Path,
    dim: int,
    *,
    pooling: str = "mean",
    max_seq_length: int = 128,
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
) -> Path:
    """A sentence-transformers folder: a 2-layer BERT of width ``dim`` with random weights, the packaged tokenizer,
    ``pooling``, a Normalize module when ``normalize``, and the given ``prompts``. Returns the model's folder."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_modules
    from transformers import AutoTokenizer, BertConfig, BertModel
    from triton_embed_server.export import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=dim, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * dim, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder / "hf")
    tokenizer.save_pretrained(folder / "hf")
    modules = [
        st_modules.Transformer(str(folder / "hf"), max_seq_length=max_seq_length),
        st_modules.Pooling(dim, pooling),
        *([st_modules.Normalize()] if normalize else []),
    ]
    model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts, default_prompt_name=default_prompt_name)
    model.save(str(folder / "model"))
    return folder / "model"


def repository_for(model: Path, repo: Path) -> Path:
    """A copy of the project's configs at ``repo`` with ``model`` exported into it (widths set to its own)."""
    from triton_embed_server import export as exporter

    shutil.copytree(REPO_ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("*.pt", "*.json"))
    exporter.export(model, repo)
    return repo
