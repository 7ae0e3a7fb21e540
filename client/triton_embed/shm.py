"""System shared memory regions for requests and responses, registered once and reused.

Each in-flight request takes one region from the pool: the serialized ``TEXT`` tensor at offset 0, the
``EMBEDDING`` output after it. Regions grow as needed (sizes are rounded up to a power of two, at least 64 KiB)
and go back to the pool after the response is read. :meth:`ShmPool.close` waits for in-flight requests before
it unregisters and destroys the regions. Only for a client and server on the same host (same ``/dev/shm``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import tritonclient.utils.shared_memory as shm

from triton_embed.settings import copied

MIN_REGION_BYTES = 64 * 1024
ALIGN = 64
RELEASE_WAIT_S = 5.0  # how long an unregister waits for the server to let go of a region


def region_in_use(error: Exception) -> bool:
    """True if the server refused to unregister a region because a request still holds it.

    For a Triton 2.51 workaround (docs/troubleshooting.md): the clients retry such an unregister.
    Triton 2.50+ counts the requests that use a region and refuses an unregister while any does
    (``Cannot unregister shared memory region '<name>', it is currently in use``, INTERNAL; server pull request
    7567). Triton 2.51 lets go of a request's regions only after it has sent the response, so an unregister right
    after the client read that response can come too early (1 close in 300 on busy cores).
    """
    return "currently in use" in str(error)


def release_pauses(timeout_s: float = RELEASE_WAIT_S) -> Iterator[float]:
    """Pauses (s) between tries of an unregister that the server refused as in use.

    5 ms, doubling up to 200 ms; in all at most ``timeout_s``.
    """
    waited, pause = 0.0, 0.005
    while waited + pause <= timeout_s:
        yield pause
        waited += pause
        pause = min(2 * pause, 0.2)


def unregister_when_released(unregister: Callable[[str], None], name: str, timeout_s: float = RELEASE_WAIT_S) -> None:
    """``unregister(name)``, tried again while the server refuses it as in use (see :func:`region_in_use`).

    Raises:
        Exception: what ``unregister`` raised last: at once for any other error, or the in-use error when the
            server still held the region after ``timeout_s`` seconds.
    """
    for pause in (*release_pauses(timeout_s), None):
        try:
            unregister(name)
            return
        except Exception as exc:
            if pause is None or not region_in_use(exc):
                raise
        time.sleep(pause)


@dataclass(eq=False)
class Region:
    """One registered (or about to be) shared memory region.

    Attributes:
        name: Triton's name of the region (what requests refer to).
        key: the ``/dev/shm`` key.
        byte_size: size in bytes.
        handle: tritonclient's handle.
        registered: True once the server knows it.
    """

    name: str
    key: str
    byte_size: int
    handle: object = field(repr=False)
    registered: bool = False


def output_offset(input_bytes: int) -> int:
    """Where the output starts in a region: after the input, aligned to 64 bytes."""
    return (input_bytes + ALIGN - 1) // ALIGN * ALIGN


class ShmPool:
    """A thread-safe pool of :class:`Region` objects owned by one client (and one process)."""

    def __init__(self, prefix: str = "triton_embed") -> None:
        """Regions are named ``<prefix>_<pid>_<random>_<n>``."""
        self._prefix = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._free: list[Region] = []
        self._all: list[Region] = []
        self._in_use = 0
        self._count = 0
        self._cond = threading.Condition()
        self.closed = False

    def acquire(self, nbytes: int) -> Region:
        """A free region of at least ``nbytes`` (new regions are not yet registered).

        Raises:
            RuntimeError: the pool is closed.
        """
        with self._cond:
            if self.closed:
                raise RuntimeError("shared memory pool is closed")
            fits = [r for r in self._free if r.byte_size >= nbytes]
            if fits:
                region = min(fits, key=lambda r: r.byte_size)
                self._free.remove(region)
            else:
                size = max(MIN_REGION_BYTES, 1 << (nbytes - 1).bit_length())
                self._count += 1
                name = f"{self._prefix}_{self._count}"
                region = Region(name, "/" + name, size, shm.create_shared_memory_region(name, "/" + name, size))
                self._all.append(region)
            self._in_use += 1
            return region

    def release(self, region: Region) -> None:
        """Give a region back after its response has been read."""
        with self._cond:
            self._in_use -= 1
            self._free.append(region)
            self._cond.notify_all()

    def discard(self, region: Region) -> None:
        """Destroy a region that never worked (registration failed)."""
        with self._cond:
            self._in_use -= 1
            if region in self._all:
                self._all.remove(region)
            shm.destroy_shared_memory_region(region.handle)
            self._cond.notify_all()

    @property
    def regions(self) -> list[str]:
        """Names of the regions this pool holds."""
        with self._cond:
            return [r.name for r in self._all]

    def close(self, unregister: Callable[[str], None], timeout_s: float = 30.0) -> None:
        """Wait up to ``timeout_s`` for in-flight requests, then unregister (server) and destroy every region.

        ``unregister(name)`` is tried again while the server still holds the region (:func:`unregister_when_released`);
        other errors are ignored (the server may be gone). Local regions are destroyed anyway.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self.closed = True
            while self._in_use and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            regions, self._all, self._free = self._all, [], []
        for region in regions:
            if region.registered:
                with contextlib.suppress(Exception):  # best effort: the server may already be gone
                    unregister_when_released(unregister, region.name)
            shm.destroy_shared_memory_region(region.handle)


def close_pool_at_exit(pool: ShmPool, protocol: str, url: str, headers: dict[str, str] | None) -> None:
    """Interpreter-exit cleanup of a client (sync or asyncio) that was never closed.

    Unregisters its regions with the client's headers (the shared-memory API is behind the admin header) over a
    connection of its own (``tritonclient.grpc`` or ``tritonclient.http``), and destroys them.
    """
    if pool.closed:
        return
    client = importlib.import_module(f"tritonclient.{protocol}").InferenceServerClient(url)
    try:
        pool.close(lambda name: client.unregister_system_shared_memory(name, headers=copied(headers)), timeout_s=5.0)
    finally:
        client.close()
