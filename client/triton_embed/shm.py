"""System shared memory regions for requests and responses, registered once and reused.

Each in-flight request takes one region from the pool: the serialized ``TEXT`` tensor at offset 0, the
``EMBEDDING`` output after it. Regions grow as needed (sizes are rounded up to a power of two, at least 64 KiB)
and go back to the pool after the response is read. :meth:`ShmPool.close` waits for in-flight requests before
it unregisters and destroys the regions. Only for a client and server on the same host (same ``/dev/shm``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import tritonclient.utils.shared_memory as shm

MIN_REGION_BYTES = 64 * 1024
ALIGN = 64


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

        ``unregister(name)`` errors are ignored (the server may be gone); local regions are destroyed anyway.
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
                    unregister(region.name)
            shm.destroy_shared_memory_region(region.handle)
