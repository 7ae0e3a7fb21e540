"""Client-side coalescing: one request per distinct text in flight; other callers wait for its row."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from triton_embed.inputs import Embeddings

Row = npt.NDArray[np.float32]
"""One text's embedding."""

AnyFuture = Future[Row] | asyncio.Future[Row]
F = TypeVar("F", Future[Row], asyncio.Future[Row])


def _claim(inflight: dict[str, F], texts: list[str], new_future: Callable[[], F]) -> tuple[dict[str, F], dict[str, F]]:
    """Split the distinct ``texts`` into ``(mine, theirs)``: new futures this call must fill, and in-flight ones."""
    mine, theirs = {}, {}
    for text in dict.fromkeys(texts):
        future = inflight.get(text)
        if future is None:
            mine[text] = inflight[text] = new_future()
        else:
            theirs[text] = future
    return mine, theirs


def _fill(mine: Mapping[str, AnyFuture], rows: Iterable[Row]) -> None:
    """Give each claimed future its row."""
    for future, row in zip(mine.values(), rows, strict=True):
        future.set_result(row)


def _fail(mine: Mapping[str, AnyFuture], exc: BaseException) -> None:
    """Pass a failure on to everyone waiting for this call's texts."""
    for future in mine.values():
        if not future.done():
            future.set_exception(exc)
            # Read back at once: the caller raises ``exc`` itself, and a future no other call awaits made asyncio
            # log "Future exception was never retrieved" with a traceback per distinct text.
            future.exception()


class Coalescer:
    """For threads: texts already being embedded by another call are awaited, not sent again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[Row]] = {}

    def run(self, texts: list[str], compute: Callable[[list[str]], Embeddings]) -> Embeddings:
        """Embed ``texts`` with ``compute`` (``list[str] -> (n, dim)``) sending each distinct text at most once."""
        with self._lock:
            mine, theirs = _claim(self._inflight, texts, Future)
        try:
            if mine:
                _fill(mine, compute(list(mine)))
        except BaseException as exc:
            _fail(mine, exc)
            raise
        finally:
            with self._lock:
                for text in mine:
                    self._inflight.pop(text, None)
        return np.stack([(mine.get(t) or theirs[t]).result() for t in texts])


class AsyncCoalescer:
    """For asyncio tasks of one event loop: the same as :class:`Coalescer`."""

    def __init__(self) -> None:
        self._inflight: dict[str, asyncio.Future[Row]] = {}

    async def run(self, texts: list[str], compute: Callable[[list[str]], Awaitable[Embeddings]]) -> Embeddings:
        """Embed ``texts`` with ``await compute(...)`` sending each distinct text at most once."""
        mine, theirs = _claim(self._inflight, texts, asyncio.get_running_loop().create_future)
        try:
            if mine:
                _fill(mine, await compute(list(mine)))
        except BaseException as exc:
            _fail(mine, exc)
            raise
        finally:
            for text in mine:
                self._inflight.pop(text, None)
        rows = {t: f.result() for t, f in mine.items()}
        for text, future in theirs.items():
            rows[text] = await asyncio.shield(future)
        return np.stack([rows[t] for t in texts])
