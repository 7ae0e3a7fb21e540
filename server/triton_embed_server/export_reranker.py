"""A cross-encoder exported as a reranker: the pair tokenizer and ``encoder_module.PairScorer``.

Checked against ``CrossEncoder.predict``, and gated at a reduced precision by its scores and by its order of each
query's documents.

``export.export`` hands a cross-encoder (:func:`is_reranker`) to :func:`export_reranker`; the manifest, the artifacts
and the configs are written as for an embedder (``export``, ``model_config``), with the ensemble template ``rerank``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from triton_embed_server import export as base
from triton_embed_server import precision as precision_rules

RERANK_MAX_SCORE_DIFF = 0.02
"""A reranker at bf16 or fp16: the largest |score - fp32 CrossEncoder.predict| allowed on the calibration pairs."""
RERANK_MIN_AGREEMENT = 0.98
"""A reranker at bf16 or fp16: the least share of each query's document pairs it must order as fp32 does."""

CHECK_BATCH = 16
"""Pairs per batch when a reranker's export scores its check and calibration pairs (padded to the batch's longest;
one batch of all of them would pad every pair to the long text's 512 tokens)."""


def is_reranker(model_path: Path) -> bool:
    """Whether ``model_path`` holds a cross-encoder.

    A sentence-transformers ``CrossEncoder`` folder, or a transformers ``*ForSequenceClassification`` folder without
    ``modules.json`` (as CrossEncoder saved before v4).
    """
    if base.json_file(model_path / "config_sentence_transformers.json").get("model_type") == "CrossEncoder":
        return True
    if base.json_file(model_path / "sentence_bert_config.json").get("transformer_task") == "sequence-classification":
        return True
    architectures = base.json_file(model_path / "config.json").get("architectures") or []
    return not (model_path / "modules.json").is_file() and any(
        str(a).endswith("ForSequenceClassification") for a in architectures
    )


def check_pairs() -> list[tuple[str, str]]:
    """The (query, document) pairs a reranker's export checks.

    Every third check text against every one, and the long one against itself and a short one, so ``longest_first``
    truncation cuts the query, the document and both.
    """
    pairs = [(q, d) for q in base.CHECK_TEXTS[::3] for d in base.CHECK_TEXTS]
    return pairs + [(base.CHECK_TEXTS[-1], base.CHECK_TEXTS[-1]), (base.CHECK_TEXTS[-1], "a")]


def export_reranker(  # noqa: PLR0913, PLR0917 - export()'s arguments, passed on
    model_path: Path,
    repository: Path,
    name: str,
    templates: Path,
    choice,
    precision: str,
    gate: str,
    corpus: Path | None,
) -> base.ExportManifest:
    """``export.export`` for a cross-encoder: the pair tokenizer and ``encoder_module.PairScorer``.

    The fp32 module's scores and logits must equal ``CrossEncoder.predict``'s (with its activation, and with none)
    within ``export.MAX_ABS_DIFF`` on :func:`check_pairs`; a bf16 or fp16 one is served only when its scores of the
    calibration pairs (the calibration texts' first 8 as queries, the next 32 as documents) stay within
    ``RERANK_MAX_SCORE_DIFF`` of fp32's and it orders at least ``RERANK_MIN_AGREEMENT`` of each query's document
    pairs alike.

    Raises:
        ExportCheckError, ValueError: as ``export.export``'s.
    """
    import numpy as np
    import torch
    from sentence_transformers import CrossEncoder

    from triton_embed_server.encoder_module import build_traced_scorer, remote_code_problem

    if problem := remote_code_problem(model_path):
        raise ValueError(f"{model_path}: {problem}; {base.SERVED}")
    torch.manual_seed(0)
    ce = CrossEncoder(str(model_path), device="cpu")

    def scorer_at(at: str):
        traced, info = build_traced_scorer(ce, precision=at)
        return base.portable(traced, "scorer"), info

    def predict(pairs: list[tuple[str, str]], activation=None):
        return ce.predict(pairs, batch_size=CHECK_BATCH, activation_fn=activation, show_progress_bar=False)

    def served_scores(module, pairs: list[tuple[str, str]]):
        return np.concatenate(
            [
                score_like_server(base.copy_tokenizer(tokenizer), module, pairs[i : i + CHECK_BATCH])
                for i in range(0, len(pairs), CHECK_BATCH)
            ]
        )

    traced, info = scorer_at("fp32")
    tokenizer = base.served_tokenizer(ce, model_path, info["max_seq_length"])
    pairs = sorted(check_pairs(), key=lambda p: len(p[0]) + len(p[1]))  # batches of like lengths: little padding
    served = served_scores(traced, pairs)
    diffs = np.abs(served - np.stack([predict(pairs), predict(pairs, torch.nn.Identity())], axis=1)).max(axis=1)
    if diffs.max() >= base.MAX_ABS_DIFF:
        worst = int(diffs.argmax())
        raise base.ExportCheckError(
            f"exported reranker differs from CrossEncoder.predict: max abs diff {diffs[worst]:.3g} (limit "
            f"{base.MAX_ABS_DIFF:g}) on pair #{worst}; {int((diffs >= base.MAX_ABS_DIFF).sum())} of {len(pairs)} "
            "pairs over the limit; this model's type is '{info['model_type']}'; {base.SERVED}"
        )
    served_at, worst, agreement = "fp32", 0.0, 1.0
    if choice.precision != "fp32":
        texts = [*precision_rules.calibration_texts(corpus), *base.CHECK_TEXTS]
        queries, documents = texts[:8], texts[8:40]
        calibration = [(q, d) for q in queries for d in documents]
        reference = predict(calibration)
        reduced, _ = scorer_at(choice.precision)
        scores = served_scores(reduced, calibration)[:, 0]
        worst = float(np.abs(scores - reference).max())
        agreement = min(
            rank_agreement(scores[k : k + len(documents)], reference[k : k + len(documents)])
            for k in range(0, len(calibration), len(documents))
        )
        figure = (
            f"{choice.precision} scores {len(calibration)} calibration pairs within {worst:.3g} of fp32 (bound "
            f"{RERANK_MAX_SCORE_DIFF:g}) and orders {agreement:.3f} of a query's document pairs alike (least "
            f"{RERANK_MIN_AGREEMENT:g})"
        )
        if worst <= RERANK_MAX_SCORE_DIFF and agreement >= RERANK_MIN_AGREEMENT:
            traced, served_at = reduced, choice.precision
        elif precision == "auto":
            print(f"precision: {figure}: serving fp32", file=sys.stderr)
        else:
            raise base.ExportCheckError(f"{figure}: export at fp32")
    manifest = base.ExportManifest(
        source=str(model_path),
        source_digest=base.source_digest(model_path),
        exporter_digest=base.exporter_digest(),
        dim=1,
        max_seq_length=info["max_seq_length"],
        vocab_size=info["vocab_size"],
        pooling="pair",
        max_abs_diff=float(diffs.max()),
        model_type=info["model_type"],
        attention=info["attention"],
        precision=served_at,
        precision_asked=choice.precision,
        precision_reason=choice.reason,
        min_cosine=1.0,
        gate=gate,
        precision_setting=precision,
        kind="reranker",
        activation=info["activation"],
        max_score_diff=worst,
        rank_agreement=agreement,
    )
    base.write_model(
        repository, name, templates, manifest, tokenizer, {"prompts": {}, "default_prompt_name": None}, traced
    )
    return manifest


def rank_agreement(scores, reference) -> float:
    """The share of pairs of items that ``scores`` orders as ``reference`` does (ties in ``reference`` left out).

    ``scores``, ``reference``: ``(n,)`` float arrays, one query's documents. 1.0 when fewer than two items differ.
    """
    import numpy as np

    i, j = np.triu_indices(len(reference), k=1)
    differ = reference[i] != reference[j]
    if not differ.any():
        return 1.0
    same = np.sign(scores[i] - scores[j]) == np.sign(reference[i] - reference[j])
    return float(same[differ].mean())


def score_like_server(tokenizer, traced, pairs: list[tuple[str, str]]):
    """Score ``pairs`` as the served reranker does (``export.tokenize_like_server`` with ``pairs``, one batch).

    Returns:
        ``(len(pairs), 2)`` float32 numpy: the score and the raw logit per pair.
    """
    import torch

    pad_id = tokenizer.padding["pad_id"] if tokenizer.padding else 0
    tokenizer.no_padding()
    ids, segments = base.tokenize_like_server(tokenizer, pairs, pad_id, pairs=True)
    with torch.no_grad():
        return traced(torch.from_numpy(ids), torch.from_numpy(segments)).numpy()
