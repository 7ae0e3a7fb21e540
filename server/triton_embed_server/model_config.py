"""The model repository's configs as typed messages: Triton's ``ModelConfig`` protobuf, read from text, written back.

Every writer of a served config goes through this module: ``make model``'s export and the compose/Kubernetes sync
(``export.write_configs``, ``export.set_config_dims``), bench's variants (``bench.serving.variant_repository``),
``make tune`` and the tests. Each reads a template or a served file with :func:`read`, changes fields of the message
with the functions below, and writes it with :func:`write`: protobuf's text format (which Triton reads) under a
header of comment lines. A template's own comments, which say why each setting is what it is, stay in the template
(``model_repository/``); the header of a written file names it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

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


def write(path: Path, config: ModelConfig, comments: list[str]) -> bool:
    """Write ``config`` to ``path`` under ``comments`` (:func:`text`), atomically; False when it already said that.

    Raises:
        OSError: the folder cannot be made or the file written.
    """
    path = Path(path)
    new = text(config, comments)
    if path.is_file() and path.read_text(encoding="utf-8") == new:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(new)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a server in a container may run as another user
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return True


def edit(path: Path, change: Callable[[ModelConfig], object], note: str | None = None) -> bool:
    """Apply ``change`` to the config in ``path`` and write it back, its header kept (plus ``note``, when given).

    Returns:
        True when the file changed.

    Raises:
        ValueError: the file is not a config (:func:`read`), or ``change`` raised it.
    """
    config = read(path)
    change(config)
    comments = header(path) + ([note] if note and note not in header(path) else [])
    return write(path, config, comments)


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


def bucket_lengths(config: ModelConfig) -> tuple[int | None, list[int]]:
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
        batch, _ = bucket_lengths(config)
        if batch is None:
            return
    specs = config.optimization.cuda.graph_spec
    del specs[:]
    for length in lengths:
        spec = specs.add(batch_size=batch)
        spec.input[TOKEN_INPUT].dim.append(length)
