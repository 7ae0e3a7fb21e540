"""The TorchScript encoder: a BERT-like transformer, pooling over the attention mask and L2 normalisation."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F


class PooledEncoder(torch.nn.Module):
    """Transformer + pooling + L2 normalisation, the computation of a Transformer/Pooling/Normalize pipeline.

    ``forward(input_ids int64 [B, T], attention_mask int64 [B, T]) -> float32 [B, dim]``, unit-norm rows.
    Pooling follows sentence-transformers' ``Pooling``: ``mean`` averages token embeddings where the mask is 1
    (denominator clamped at 1e-9), ``cls`` takes the first token. Normalisation is ``F.normalize(p=2, dim=1)``, as
    sentence-transformers' ``Normalize`` and ``encode(normalize_embeddings=True)`` do.
    """

    def __init__(self, transformer: torch.nn.Module, pooling: str) -> None:
        """Wrap ``transformer`` (called with ``return_dict=False``) and pool with ``pooling`` (``mean``/``cls``)."""
        super().__init__()
        self.transformer = transformer
        self.use_cls = pooling == "cls"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embed a padded batch; padding positions (mask 0) do not change any row's result."""
        tokens = self.transformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        if self.use_cls:
            pooled = tokens[:, 0]
        else:
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


def describe(st_model, model_path: Path) -> dict:
    """Check that ``st_model`` is Transformer -> Pooling [-> Normalize] and return what the export needs.

    Returns:
        ``{"transformer_path": Path, "pooling": "mean"|"cls", "dim": int, "max_seq_length": int}``.

    Raises:
        ValueError: another module layout (Dense layers, a non-BERT tokenizer module) or an unsupported pooling.
    """
    modules = json.loads((model_path / "modules.json").read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ValueError(f"{model_path}: modules {kinds} are not Transformer, Pooling[, Normalize]")
    pooling = st_model[1].get_config_dict().get("pooling_mode")
    if pooling not in ("mean", "cls"):
        raise ValueError(f"{model_path}: pooling_mode {pooling!r} is not supported; supported: mean, cls")
    # sentence-transformers 6 renamed get_sentence_embedding_dimension to get_embedding_dimension.
    get_dim = getattr(st_model, "get_embedding_dimension", None) or st_model.get_sentence_embedding_dimension
    return {
        "transformer_path": model_path / modules[0]["path"],
        "pooling": pooling,
        "dim": int(get_dim()),
        "max_seq_length": int(st_model.max_seq_length),
    }


def build_traced_encoder(st_model, model_path: Path) -> tuple[torch.jit.ScriptModule, dict]:
    """Trace :class:`PooledEncoder` for the model in ``model_path``.

    The transformer is reloaded with eager attention and tuple outputs (``attn_implementation="eager"``,
    ``return_dict=False``), which trace to a module that is correct at every (B, T), and traced once under
    ``torch.no_grad()`` at (2, 16).

    Returns:
        (traced module in eval mode on CPU, :func:`describe` output plus ``vocab_size``).
    """
    from transformers import AutoModel

    info = describe(st_model, model_path)
    transformer = AutoModel.from_pretrained(
        str(info["transformer_path"]), attn_implementation="eager", return_dict=False
    ).eval()
    info["vocab_size"] = int(transformer.config.vocab_size)
    wrapper = PooledEncoder(transformer, info["pooling"]).eval()
    example_ids = torch.randint(1000, 2000, (2, 16), dtype=torch.int64)
    example_mask = torch.ones_like(example_ids)
    example_mask[1, 9:] = 0
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, (example_ids, example_mask), check_trace=False)
    return traced.eval(), info
