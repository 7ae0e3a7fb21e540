"""Client-side coalescing: one request per distinct text in flight; other callers wait for its row."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

import numpy as np


class Coalescer:
    """For threads: texts already being embedded by another call are awaited, not sent again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[str, Future] = {}

    def run(self, texts: list[str], compute: Callable[[list[str]], np.ndarray]) -> np.ndarray:
        """Embed ``texts`` with ``compute`` (``list[str] -> (n, dim)``) sending each distinct text at most once."""
        mine: dict[str, Future] = {}
        theirs: dict[str, Future] = {}
        with self._lock:
            for text in dict.fromkeys(texts):
                future = self._inflight.get(text)
                if future is None:
                    mine[text] = self._inflight[text] = Future()
                else:
                    theirs[text] = future
        try:
            if mine:
                for future, row in zip(mine.values(), compute(list(mine)), strict=True):
                    future.set_result(row)
        except BaseException as exc:
            for future in mine.values():
                if not future.done():
                    future.set_exception(exc)
            raise
        finally:
            with self._lock:
                for text in mine:
                    self._inflight.pop(text, None)
        return np.stack([(mine.get(t) or theirs[t]).result() for t in texts])


class AsyncCoalescer:
    """For asyncio tasks of one event loop: the same as :class:`Coalescer`."""

    def __init__(self) -> None:
        self._inflight: dict[str, asyncio.Future] = {}

    async def run(self, texts: list[str], compute: Callable[[list[str]], Awaitable[np.ndarray]]) -> np.ndarray:
        """Embed ``texts`` with ``await compute(...)`` sending each distinct text at most once."""
        loop = asyncio.get_running_loop()
        mine: dict[str, asyncio.Future] = {}
        theirs: dict[str, asyncio.Future] = {}
        for text in dict.fromkeys(texts):
            future = self._inflight.get(text)
            if future is None:
                mine[text] = self._inflight[text] = loop.create_future()
            else:
                theirs[text] = future
        try:
            if mine:
                for future, row in zip(mine.values(), await compute(list(mine)), strict=True):
                    future.set_result(row)
        except BaseException as exc:
            for future in mine.values():
                if not future.done():
                    future.set_exception(exc)
            raise
        finally:
            for text in mine:
                self._inflight.pop(text, None)
        rows = {t: f.result() for t, f in mine.items()}
        for text, future in theirs.items():
            rows[text] = await asyncio.shield(future)
        return np.stack([rows[t] for t in texts])
