"""The encoder's load, published for the tokenizer: one small shared-memory file per encoder instance.

Triton runs each model instance of a Python-based backend in its own stub process, so the tokenizer cannot see the
encoder's queue. Each encoder instance therefore writes, at the start and the end of every execution, what the
tokenizer needs to predict a new request's wait (:class:`EncoderLoad`) into
``/dev/shm/triton-embed-<host name>-<tritonserver pid>-<model>-<instance>.load`` (the host name keeps apart
containers that share the host's ``/dev/shm`` with ``ipc: host``, where every server may have the same pid).
The tokenizer reads every such file of the encoder model it feeds (:class:`LoadReader`).

One writer per file; readers use a sequence lock (the writer makes the counter odd, writes, makes it even; a reader
retries while it is odd or changed), so a reader never uses a half-written record. The files are a few hundred
bytes; the encoder removes its own at ``finalize``. A file left by a killed stub is overwritten by its successor
(same instance name) and its stale figures only make one prediction off; files of servers that are gone (killed
without unloading) are removed by the next encoder that starts on the host (:func:`remove_stale`).
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import struct
import tempfile
from dataclasses import astuple, dataclass
from pathlib import Path

# seq, then EncoderLoad's fields in their order: pid, 4 times (ns), 6 floats, max_rows
_FORMAT = struct.Struct("<QqqqqqddddddI")
_SIZE = 128
_READ_TRIES = 8


def board_dir() -> Path:
    """``/dev/shm`` where it exists (Linux, containers), else the temporary directory."""
    shm = Path("/dev/shm")  # noqa: S108 - the board is meant to be shared by this host's stub processes
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())  # no "-": the name's fields are split on it


def _prefix(server_pid: int, model: str) -> str:
    return f"triton-embed-{_host()}-{server_pid}-{model}-"


def remove_stale() -> list[Path]:
    """Remove this host's board files whose server process no longer exists; returns the paths removed."""
    removed = []
    for path in board_dir().glob(f"triton-embed-{_host()}-*.load"):
        pid = path.name.split("-")[3]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path)
        except PermissionError:
            pass  # alive, another user's
    return removed


def board_path(server_pid: int, model: str, instance: str) -> Path:
    """Where encoder ``instance`` of ``model`` under the ``tritonserver`` process ``server_pid`` publishes."""
    return board_dir() / f"{_prefix(server_pid, model)}{instance}.load"


@dataclass(frozen=True)
class EncoderLoad:
    """One encoder instance's published state.

    Attributes:
        pid: the stub process that wrote it.
        updated_ns: ``time.monotonic_ns()`` of the write.
        running_since_ns: when the running execution began (monotonic ns); 0 when idle.
        running_ms: its typical duration by the cost model (no margin), ms.
        newest_started_ns: the largest ``arrival_ns`` stamp among requests the encoder has taken from its queue
            (run, shed or refused); every stamp up to it has left the queue, given Triton's FIFO dynamic batcher.
        late_ns: when a request here last finished past its latency budget or was shed (monotonic ns; 0 = never).
        fixed_ms, ms_per_token, margin: the encoder's execution-time model (:class:`cost.CostModel`).
        budget_ms: its ``LATENCY_BUDGET_MS`` (0 = no shedding).
        admit_share: the share of a request's budget that admission may plan to fill (:class:`target.AdmissionTarget`).
        max_rows: the most texts one execution takes (the encoder's ``max_batch_size``).
    """

    pid: int
    updated_ns: int
    running_since_ns: int
    newest_started_ns: int
    late_ns: int
    running_ms: float
    fixed_ms: float
    ms_per_token: float
    margin: float
    budget_ms: float
    admit_share: float
    max_rows: int


class LoadBoard:
    """The writer's side: an encoder instance's file, created (or taken over) at open.

    Raises:
        OSError: the file cannot be created or mapped.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._seq = _FORMAT.unpack_from(self._map, 0)[0] | 1  # odd: continue past what a predecessor left
        self._seq += 1

    def publish(self, load: EncoderLoad) -> None:
        """Write ``load`` under the sequence lock (a few microseconds)."""
        self._seq += 1  # odd: readers retry
        struct.pack_into("<Q", self._map, 0, self._seq)
        self._map[8 : _FORMAT.size] = _FORMAT.pack(self._seq, *astuple(load))[8:]  # fields in _FORMAT's order
        self._seq += 1  # even: consistent
        struct.pack_into("<Q", self._map, 0, self._seq)

    def close(self, remove: bool = True) -> None:
        """Unmap, and remove the file unless ``remove`` is False or another process writes it now.

        A reload starts the new instance (same name, same file) before the old one finalizes: the old one must not
        remove the file its successor took over, or admission control loses that encoder's load (a new user's
        trial found it gone).
        """
        self._map.close()
        current = read_load(self.path)
        if remove and (current is None or current.pid == os.getpid()):
            self.path.unlink(missing_ok=True)


def read_load(path: Path) -> EncoderLoad | None:
    """One consistent :class:`EncoderLoad` from ``path``; None when the file is absent, empty or kept busy."""
    try:
        with path.open("rb") as handle:
            for _ in range(_READ_TRIES):
                handle.seek(0)
                raw = handle.read(_FORMAT.size)
                if len(raw) < _FORMAT.size:
                    return None
                seq, *fields = _FORMAT.unpack(raw)
                handle.seek(0)
                (again,) = struct.unpack("<Q", handle.read(8))
                if seq % 2 == 0 and seq == again and seq > 0:
                    return EncoderLoad(*fields)
    except OSError:
        return None
    return None


class LoadReader:
    """The tokenizer's side: every published encoder instance of one model under one server.

    Files are looked up again every ``rescan_s`` seconds, so instances that load later (or a restarted stub) are
    found without a restart.
    """

    def __init__(self, server_pid: int, model: str, rescan_s: float = 1.0) -> None:
        self.pattern = f"{_prefix(server_pid, model)}*.load"
        self.rescan_ns = int(rescan_s * 1e9)
        self._paths: list[Path] = []
        self._scanned_ns = -self.rescan_ns

    def read(self, now_ns: int) -> list[EncoderLoad]:
        """The current load of each instance that has published (empty before the encoder is up)."""
        if now_ns - self._scanned_ns >= self.rescan_ns:
            self._paths = sorted(board_dir().glob(self.pattern))
            self._scanned_ns = now_ns
        loads = (read_load(path) for path in self._paths)
        return [load for load in loads if load is not None]
