"""The model repository's configs as typed messages: Triton's ``ModelConfig`` protobuf, read from text, written back.

Every writer of a served config goes through this module: ``make model``'s export and the compose/Kubernetes sync
(:func:`write_configs`, :func:`set_config_dims`), bench's variants (``bench.serving.variant_repository``),
``make tune`` and the tests. Each reads a template or a served file with :func:`read`, changes fields of the message
with the functions below, and writes it with :func:`write`: protobuf's text format (which Triton reads) under a
header of comment lines. A template's own comments, which say why each setting is what it is, stay in the template
(``model_repository/``); the header of a written file names it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from google.protobuf import text_format
from triton_embed_protocol import step_names
from tritonclient.grpc import model_config_pb2

from triton_embed_server.layout import REPO_ROOT

ModelConfig = model_config_pb2.ModelConfig

WIDTH_OUTPUTS = ("embedding__0", "EMBEDDING")
"""The outputs whose one dimension is the model's embedding width (a reranker's encoder: 1, its score)."""
MAX_SEQ_LENGTH = "MAX_SEQ_LENGTH"
"""The tokenizer's parameter holding the exported model's ``max_seq_length``."""
PRECISION = "PRECISION"
"""The encoder's parameter holding what its ``model.pt`` computes at (``fp32``, ``bf16``, ``fp16``)."""
LOGIT = "logit__0"
"""A reranker encoder's second output: its raw logit per pair (``embedding__0`` holds the score)."""
TOKEN_INPUT = "input_ids"  # noqa: S105 - a tensor name
"""The input a ``graph_spec`` entry sizes: its ``dim`` is the bucket's length in tokens."""
BUCKETS_FILE = REPO_ROOT / "python_backends" / "torchscript" / "buckets.py"
"""The backend's bucket rules, which :func:`cpu_bucket_lengths` follows."""


def read(path: Path) -> ModelConfig:
    """The config in ``path`` (protobuf text format).

    Raises:
        ValueError: the file is not a ``ModelConfig`` in text format; the message names the file and the parse error.
        OSError: it cannot be read.
    """
    try:
        return text_format.Parse(Path(path).read_text(encoding="utf-8"), ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"{path}: not a Triton model config: {exc}") from None


def header(path: Path) -> list[str]:
    """The comment lines at the top of the file ``path``, without their ``#``; empty for a file that has none."""
    lines = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].removeprefix(" "))
    return lines


def text(config: ModelConfig, comments: list[str]) -> str:
    """``config`` in protobuf text format, below ``comments`` as ``#`` lines (repeated numbers on one line)."""
    lines = "".join(f"# {line}".rstrip() + "\n" for line in comments)
    return lines + text_format.MessageToString(config, use_short_repeated_primitives=True)


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call ``write(tmp_path)``, then rename the file onto ``path``: a crash never leaves half a file of the repository.

    Raises:
        OSError: the folder cannot be made or the file written.
    """
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


def write(path: Path, config: ModelConfig, comments: list[str]) -> bool:
    """Write ``config`` to ``path`` under ``comments`` (:func:`text`), atomically; False when it already said that.

    Raises:
        OSError: the folder cannot be made or the file written.
    """
    path = Path(path)
    new = text(config, comments)
    if path.is_file() and path.read_text(encoding="utf-8") == new:
        return False
    atomic_write(path, lambda tmp: Path(tmp).write_text(new, encoding="utf-8"))
    return True


def edit(path: Path, change: Callable[[ModelConfig], object], note: str | None = None) -> bool:
    """Apply ``change`` to the config in ``path`` and write it back, its header kept (plus ``note``, when given).

    Returns:
        True when the file changed.

    Raises:
        ValueError: the file is not a config (:func:`read`), or ``change`` raised it.
    """
    config, comments = read(path), header(path)
    change(config)
    return write(path, config, comments + ([note] if note and note not in comments else []))


def written_from(template: Path, writer: str) -> list[str]:
    """The header of a config ``writer`` wrote from ``template``: where the setting's reasons are, what rewrites it."""
    return [
        f"Written by {writer}",
        f"from {template}, whose comments say why each setting is what it is.",
        "Change the template to keep a change: the next export writes this file again.",
    ]


def parameter(config: ModelConfig, key: str) -> str | None:
    """The string value of the config parameter ``key``; None when the config has none."""
    return config.parameters[key].string_value if key in config.parameters else None


def set_parameter(config: ModelConfig, key: str, value: str) -> None:
    """Set the existing config parameter ``key`` to ``value``.

    Raises:
        ValueError: the config has no parameter ``key`` (a misspelt knob would otherwise be a new, unread one).
    """
    if key not in config.parameters:
        raise ValueError(f"model {config.name!r} has no parameter {key}; it has {sorted(config.parameters)}")
    config.parameters[key].string_value = value


def set_width(config: ModelConfig, dim: int) -> None:
    """Set the one dimension of the width outputs (:data:`WIDTH_OUTPUTS`) the config declares to ``dim``."""
    for output in config.output:
        if output.name in WIDTH_OUTPUTS:
            output.dims[:] = [dim]


def rename(config: ModelConfig, names: dict[str, str]) -> None:
    """Rename the model and its ensemble steps' models as ``names`` maps them (names not in it stay)."""
    config.name = names.get(config.name, config.name)
    for step in config.ensemble_scheduling.step:
        step.model_name = names.get(step.model_name, step.model_name)


def add_logit(config: ModelConfig) -> None:
    """Give a reranker's encoder the output :data:`LOGIT` (float32 ``[1]``) beside its score, once."""
    if all(output.name != LOGIT for output in config.output):
        config.output.add(name=LOGIT, data_type=model_config_pb2.TYPE_FP32, dims=[1])


def set_response_cache(config: ModelConfig, enable: bool) -> None:
    """Switch the ensemble's response cache on or off (the server needs ``--cache-config`` for it to act)."""
    config.response_cache.enable = enable


def set_queue_delay(config: ModelConfig, microseconds: int) -> None:
    """Set the dynamic batcher's ``max_queue_delay_microseconds``.

    Raises:
        ValueError: the config has no dynamic batcher.
    """
    if not config.HasField("dynamic_batching"):
        raise ValueError(f"model {config.name!r} has no dynamic_batching")
    config.dynamic_batching.max_queue_delay_microseconds = microseconds


def set_instances(config: ModelConfig, count: int) -> None:
    """Set the instance count of the config's one instance group.

    Raises:
        ValueError: the config has not exactly one instance group.
    """
    if len(config.instance_group) != 1:
        raise ValueError(f"model {config.name!r} has {len(config.instance_group)} instance groups; expected one")
    config.instance_group[0].count = count


def buckets(config: ModelConfig) -> tuple[int | None, list[int]]:
    """The ``graph_spec`` list as (its one batch size, its lengths); (None, []) when it has several or none."""
    specs = config.optimization.cuda.graph_spec
    batches = {spec.batch_size for spec in specs}
    if len(batches) != 1 or any(set(spec.input) != {TOKEN_INPUT} for spec in specs):
        return None, []
    return batches.pop(), [spec.input[TOKEN_INPUT].dim[0] for spec in specs]


def set_bucket_lengths(config: ModelConfig, lengths: list[int], batch: int | None = None) -> None:
    """Make the ``graph_spec`` list one entry per length in ``lengths``, each of ``batch`` rows.

    ``batch`` None: the list's own batch size. A list of several batch sizes (a user's own grid) is kept as it is
    unless ``batch`` is given; so is a config without a list.
    """
    if batch is None:
        batch, _ = buckets(config)
        if batch is None:
            return
    specs = config.optimization.cuda.graph_spec
    del specs[:]
    for length in lengths:
        spec = specs.add(batch_size=batch)
        spec.input[TOKEN_INPUT].dim.append(length)


def _buckets_module():
    """``python_backends/torchscript/buckets.py``, the backend's bucket rules (a file of the backend, not a package)."""
    import importlib.util

    name = "triton_embed_buckets"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BUCKETS_FILE)
        sys.modules[name] = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(sys.modules[name])  # type: ignore[union-attr]
    return sys.modules[name]


def cpu_bucket_lengths(max_seq_length: int, *, half_steps: bool = True) -> list[int]:
    """The CPU config's length buckets for a model of ``max_seq_length`` tokens: ``buckets.bucket_lengths``.

    ``half_steps`` False: powers of two only (8, 16, 32, ...), fewer buckets and more padding (``make tune`` tries
    both).
    """
    return list(_buckets_module().bucket_lengths(max_seq_length, half_steps=half_steps))


def set_model_values(config: ModelConfig, dim: int, max_seq_length: int | None, precision: str | None) -> None:
    """Set the model's width, and its token limit and buckets and its precision (each when given), where declared.

    The width is the one dimension of the outputs :data:`WIDTH_OUTPUTS`; the limit, the tokenizer's parameter
    :data:`MAX_SEQ_LENGTH`; the buckets, a ``graph_spec`` list of one batch size (the CPU config's), whose lengths
    become :func:`cpu_bucket_lengths`; the precision, the encoder's parameter :data:`PRECISION`.
    """
    set_width(config, dim)
    if max_seq_length is not None:
        if parameter(config, MAX_SEQ_LENGTH) is not None:
            set_parameter(config, MAX_SEQ_LENGTH, str(max_seq_length))
        set_bucket_lengths(config, cpu_bucket_lengths(max_seq_length))
    if precision is not None and parameter(config, PRECISION) is not None:
        set_parameter(config, PRECISION, precision)


def set_config_dims(
    repository: Path, dim: int, max_seq_length: int | None = None, precision: str | None = None
) -> list[Path]:
    """:func:`set_model_values` in every config of ``repository`` (the compose and Kubernetes sync calls it).

    A config that changes is written again, its header kept.

    Returns:
        The config files that changed (empty when they already said all of it).

    Raises:
        ValueError: a file is not a Triton model config.
    """
    changed = []
    for cfg in sorted(repository.glob("*/config.pbtxt")) + sorted(repository.glob("*/configs/*.pbtxt")):
        config = read(cfg)
        before = config.SerializeToString(deterministic=True)
        set_model_values(config, dim, max_seq_length, precision)
        if config.SerializeToString(deterministic=True) != before:
            write(cfg, config, header(cfg))
            changed.append(cfg)
    return changed


def write_configs(  # noqa: PLR0913 - the model's name, where from and to, and its values
    repository: Path,
    name: str,
    templates: Path,
    *,
    dim: int,
    max_seq_length: int,
    precision: str,
    reranker: bool = False,
) -> list[Path]:
    """Write the model ``name``'s configs into ``repository`` from ``templates``, with its ensemble's version folder.

    Each template folder (``embed``, or ``rerank`` for a reranker; ``tokenizer``, ``encoder``: ``config.pbtxt`` and
    ``configs/*.pbtxt``) goes to the folder ``triton_embed_protocol.step_names`` names, with the names inside set
    alike and the model's values (:func:`set_model_values`). A reranker's encoder gets the output :data:`LOGIT` beside
    its score and no libtorch config.

    Returns:
        The files written (those whose text changed).

    Raises:
        ValueError: a template is not a Triton model config.
    """
    tokenizer, encoder = step_names(name)
    ensemble = "rerank" if reranker else "embed"
    renames = {ensemble: name, "tokenizer": tokenizer, "encoder": encoder}
    written = []
    for template, target in renames.items():
        source = templates / template
        for cfg in [source / "config.pbtxt", *sorted((source / "configs").glob("*.pbtxt"))]:
            if reranker and cfg.name == "libtorch.pbtxt":
                continue  # Triton's libtorch backend has no second output: a reranker runs on ours in every config
            config = read(cfg)
            rename(config, renames)
            set_model_values(config, dim, max_seq_length, precision)
            if reranker and template == "encoder":
                add_logit(config)
            dst = repository / target / cfg.relative_to(source)
            shown = cfg.relative_to(REPO_ROOT) if cfg.is_relative_to(REPO_ROOT) else cfg
            if write(dst, config, written_from(shown, "make model (triton_embed_server.export)")):
                written.append(dst)
        (repository / target / "1").mkdir(parents=True, exist_ok=True)
    return written
