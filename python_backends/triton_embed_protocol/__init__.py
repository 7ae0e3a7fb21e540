"""What the tokenizer and encoder backends agree on about a request: tensor names, parameters, request errors.

Installed as a package (``make install``; the image copies it into its Python's site-packages), so both backends
import it as ``triton_embed_protocol`` without editing ``sys.path``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

TEXT = "TEXT"
"""The ensemble's and the tokenizer's input: UTF-8 texts, BYTES ``[n_texts, 1]``."""

TEXT_PAIR = "TEXT_PAIR"
"""Optional input of the tokenizer, BYTES ``[n_texts, 1]``: each text's second text of a pair (a reranker's document;
``TEXT`` holds its query)."""

PROMPT_NAME = "PROMPT_NAME"
"""Optional input of the ensemble and the tokenizer, BYTES ``[n_texts, 1]``: each text's prompt name."""

TRUNCATE = "TRUNCATE"
"""Optional input of the ensemble and the tokenizer, BYTES ``[n_texts, 1]``: END, START or NONE per text."""

TOKENS = ("input_ids", "attention_mask")
"""Tensors from the tokenizer to the encoder, int64 ``[n_texts, T]``: token ids and the mask (1 = real token)."""

TOKEN_COUNT = "token_count"  # noqa: S105 - a tensor name
"""Tensor from the tokenizer, the ensemble's ``TOKEN_COUNT``, int64 ``[n_texts, 1]``: tokens the encoder sees per text
(special tokens included, after truncation), for usage accounting."""

QUEUED = "queued_ns"
"""Tensor from the tokenizer to the encoder, int64 ``[n_texts, 1]``: ``time.monotonic_ns()`` as the tokenizer hands
the request on to the encoder's queue (one clock for every process on the host)."""

BULK = "bulk"
"""Tensor from the tokenizer to the encoder, bool ``[n_texts, 1]``: True for every text of a request the tokenizer's
admission sent down the bulk lane, False for one it let through the door. The lane is decided once, at the tokenizer;
the encoder counts the texts out of flight in the lane this names."""


DEFAULT_MODEL = "embed"
"""The name of the model ``make model`` exports without ``NAME``: its ensemble and every command's default."""


def step_names(model: str) -> tuple[str, str]:
    """The tokenizer and encoder steps of the ensemble ``model``, in that order.

    ``tokenizer`` and ``encoder`` for :data:`DEFAULT_MODEL`; ``<model>_tokenizer`` and ``<model>_encoder`` for another.
    """
    return ("tokenizer", "encoder") if model == DEFAULT_MODEL else (f"{model}_tokenizer", f"{model}_encoder")


def model_of_step(step: str) -> str:
    """The ensemble a tokenizer or encoder step named ``step`` belongs to (the inverse of :func:`step_names`).

    Raises:
        ValueError: ``step`` is not named as :func:`step_names` names steps.
    """
    for suffix in ("tokenizer", "encoder"):
        if step == suffix:
            return DEFAULT_MODEL
        if step.endswith(f"_{suffix}") and len(step) > len(suffix) + 1:
            return step[: -len(suffix) - 1]
    raise ValueError(f"a step is named 'tokenizer', 'encoder', '<model>_tokenizer' or '<model>_encoder'; got {step!r}")


def shared_folder() -> Path:
    """Where the stubs of a host share small files (in-flight counts, the timing lock).

    ``/dev/shm``, or the temp folder on a host without one.
    """
    shm = Path("/dev/shm")  # noqa: S108 - the files are opened O_NOFOLLOW, mode 0600
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def served_ensembles(repository: Path) -> list[str]:
    """The models a served model repository holds: its folders whose ``config.pbtxt`` is an ensemble.

    :data:`DEFAULT_MODEL` first, then by name; empty when ``repository`` holds none (or is no folder).
    """
    names = [
        cfg.parent.name
        for cfg in repository.glob("*/config.pbtxt")
        if 'platform: "ensemble"' in cfg.read_text(encoding="utf-8")
    ]
    return sorted(names, key=lambda name: (name != DEFAULT_MODEL, name))


BUDGET = "latency_budget_ms"
"""The request parameter that sets a request's latency budget, ms (docs/overload.md)."""

MAX_BUDGET_MS = 3_600_000.0
"""The longest request parameter ``latency_budget_ms`` the server accepts, ms (an hour; 0 is "never refuse" for
longer jobs)."""


def budget_problem(value: object, name: str = "latency_budget_ms") -> str | None:
    """Why ``value`` is not a ``latency_budget_ms`` (a number of ms from 0 to :data:`MAX_BUDGET_MS`); None if it is.

    The one statement of the rule: the encoder and tokenizer refuse such a request parameter with this message, the
    client and the gateway check it before sending. ``name``: how the message names the field.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_BUDGET_MS:
        return f"{name} must be a number of ms from 0 to {MAX_BUDGET_MS:.0f} (0 = never refused); got {value!r}"
    return None


REFUSAL_REASONS = {
    "door": "MAX_IN_FLIGHT",
    "flood": "FLOOD_LATENCY_MS",
    "shared": "MAX_IN_FLIGHT",
    "bulk_queue": "BULK_QUEUE",
    "budget": "latency_budget_ms",
}
"""Why a request was refused as overloaded (gRPC UNAVAILABLE / HTTP 503), by the knob that rule reads: the door was
full, the door under a flood was full, the model's share of the door beside the server's other models was full,
the bulk lane was full, the request waited past its latency budget."""


def refusal(reason: str, detail: str) -> str:
    """The message of a request refused as overloaded: ``overloaded[<reason>]: <detail>``.

    ``reason``: a key of :data:`REFUSAL_REASONS`, which callers read back with :func:`refusal_reason`.

    Raises:
        ValueError: ``reason`` is not one of them.
    """
    if reason not in REFUSAL_REASONS:
        raise ValueError(f"refusal reason must be one of {sorted(REFUSAL_REASONS)}; got {reason!r}")
    return f"overloaded[{reason}]: {detail}"


def refusal_reason(message: str) -> str | None:
    """The reason code of an overload refusal's message (Triton may put its own words in front); None for another."""
    start = message.find("overloaded[")
    if start < 0:
        return None
    reason = message[start + len("overloaded[") :].split("]", 1)[0]
    return reason if reason in REFUSAL_REASONS else None


class RequestError(ValueError):
    """A problem with one request; becomes that request's INVALID_ARG response, naming the field, limit and value."""


def request_parameters(parameters: str | None) -> dict[str, Any]:
    """A request's parameters (JSON text from ``request.parameters()``) as a dict; {} when absent or unreadable."""
    try:
        value = json.loads(parameters or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def config_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    """A model config's ``parameters`` as ``{key: string_value}``."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}


def config_number(
    parameters: dict[str, str], key: str, default: str, *, minimum: float = 0, integer: bool = False
) -> int | float:
    """Config parameter ``key`` as a number >= ``minimum`` (an int with ``integer``), ``default`` when absent.

    Raises:
        ValueError: the value is not such a number; the message names the knob, the limit and the value.
    """
    text = parameters.get(key, default)
    kind = "an integer" if integer else "a number"
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise ValueError(f"config parameter {key} must be {kind} >= {minimum:g}; got {text!r}") from None
    if value < minimum:
        raise ValueError(f"config parameter {key} must be {kind} >= {minimum:g}; got {text!r}")
    return value
