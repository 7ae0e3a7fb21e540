"""Turn what users pass as texts into a list of str, or fail before anything is sent."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from triton_embed.errors import InvalidInputError

TextsLike = str | bytes | npt.NDArray[Any] | Iterable[str | bytes]
"""A str, bytes, an iterable (list, tuple, generator) of str/bytes, or a NumPy array of ``<U``, ``|S`` or object."""

Embeddings = npt.NDArray[np.float32]
"""``(n, dim)`` float32 rows, one per text."""

Scores = npt.NDArray[np.float32]
"""A reranker's scores, one per document: float32 ``(n,)``."""


def as_texts(texts: TextsLike) -> list[str]:
    """Return the texts as a list of str, in order.

    Accepts a single str or bytes (one text), a list/tuple/generator of str or UTF-8 bytes, or a NumPy array of
    shape ``(n,)`` or ``(n, 1)`` with dtype ``<U..``, ``|S..`` or object (str/bytes items).

    Raises:
        InvalidInputError: an item is not text (names its index and type), bytes that are not UTF-8, an array
            of another shape or dtype, or a dict (its keys or its values? say which).
    """
    return [_as_str(i, item) for i, item in enumerate(_items(texts))]


def _items(texts: TextsLike) -> list[object]:
    if isinstance(texts, str | bytes):
        return [texts]
    if isinstance(texts, np.ndarray):
        if texts.ndim == 2 and texts.shape[1] == 1:
            texts = texts[:, 0]
        if texts.ndim != 1:
            raise InvalidInputError(f"a texts array must have shape (n,) or (n, 1); got {texts.shape}")
        if texts.dtype.kind not in "USO":
            raise InvalidInputError(f"a texts array must hold str or bytes (dtype <U, |S or object); got {texts.dtype}")
        items: list[object] = texts.tolist()
        return items
    if isinstance(texts, Mapping):  # keys or values? iterating would embed the keys without a word
        raise InvalidInputError(
            f"texts must be a str or an iterable of str; got a {type(texts).__name__}: pass list(d.values()) or "
            "list(d) (its keys)"
        )
    try:
        return list(texts)
    except TypeError:
        raise InvalidInputError(f"texts must be a str or an iterable of str; got {type(texts).__name__}") from None


def _as_str(i: int, item: object) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, bytes):
        try:
            return item.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInputError(
                f"texts[{i}] is not valid UTF-8: byte 0x{item[exc.start]:02x} at offset {exc.start} "
                f"({exc.reason}); nothing was sent"
            ) from None
    raise InvalidInputError(f"texts[{i}] is {type(item).__name__}; every text must be str or UTF-8 bytes")
