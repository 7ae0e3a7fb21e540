"""The encoder's load board (python_backends/common/loadboard.py): what one stub writes, another reads whole."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

COMMON = Path(__file__).resolve().parents[2] / "python_backends" / "common"
sys.path.insert(0, str(COMMON))

from loadboard import EncoderLoad, LoadBoard, LoadReader, board_dir, board_path, read_load, remove_stale  # noqa: E402

SAMPLE = EncoderLoad(
    pid=42,
    updated_ns=10,
    running_since_ns=20,
    newest_started_ns=30,
    late_ns=25,
    running_ms=12.5,
    fixed_ms=1.5,
    ms_per_token=0.1,
    margin=1.4,
    budget_ms=180.0,
    admit_share=0.6,
    max_rows=64,
)


def test_what_is_published_is_read_back_and_close_removes_the_file(tmp_path):
    board = LoadBoard(tmp_path / "encoder.load")
    assert read_load(board.path) is None  # created, never written
    mine = EncoderLoad(**{**SAMPLE.__dict__, "pid": os.getpid()})
    board.publish(mine)
    assert read_load(board.path) == mine
    board.close()
    assert not board.path.exists()
    assert read_load(board.path) is None


def test_a_half_written_record_is_not_read(tmp_path):
    board = LoadBoard(tmp_path / "encoder.load")
    board.publish(SAMPLE)
    with board.path.open("r+b") as handle:  # what a reader sees in the middle of a write: an odd sequence number
        (seq,) = struct.unpack("<Q", handle.read(8))
        handle.seek(0)
        handle.write(struct.pack("<Q", seq + 1))
    assert read_load(board.path) is None
    board.close()


def test_a_successor_takes_over_the_file_of_a_killed_stub(tmp_path):
    path = tmp_path / "encoder.load"
    LoadBoard(path).publish(SAMPLE)  # never closed, as when the stub is killed
    successor = LoadBoard(path)
    newer = EncoderLoad(**{**SAMPLE.__dict__, "pid": 43, "newest_started_ns": 0})
    successor.publish(newer)
    assert read_load(path) == newer
    successor.close()


def test_a_reloaded_instance_keeps_its_file_when_the_old_one_closes(tmp_path):
    """A reload starts the new instance (same file) before the old one finalizes: the old close must not remove it."""
    path = tmp_path / "encoder.load"
    old = LoadBoard(path)
    old.publish(EncoderLoad(**{**SAMPLE.__dict__, "pid": os.getpid()}))
    successor = LoadBoard(path)
    newer = EncoderLoad(**{**SAMPLE.__dict__, "pid": os.getpid() + 1})  # another stub process
    successor.publish(newer)
    old.close()
    assert read_load(path) == newer
    successor.close(remove=False)


def test_the_reader_finds_every_instance_of_its_model_and_server_only():
    pid = 2_000_000_000 + os.getpid()  # no such server: files of real ones are not touched
    boards = [LoadBoard(board_path(pid, "encoder", "encoder_0_0")), LoadBoard(board_path(pid, "other", "other_0_0"))]
    try:
        for board in boards:
            board.publish(SAMPLE)
        reader = LoadReader(pid, "encoder", rescan_s=1.0)
        assert reader.read(now_ns=0) == [SAMPLE]
        late = LoadBoard(board_path(pid, "encoder", "encoder_0_1"))  # an instance that loads later
        boards.append(late)
        late.publish(SAMPLE)
        assert len(reader.read(now_ns=500_000_000)) == 1  # not looked up again within rescan_s
        assert len(reader.read(now_ns=1_000_000_000)) == 2
        assert all(p.parent == board_dir() for p in (b.path for b in boards))
    finally:
        for board in boards:
            board.close()


def test_files_of_servers_that_are_gone_are_removed():
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)  # that process has exited
    dead = LoadBoard(board_path(dead_pid, "encoder", "encoder_0_0"))
    live = LoadBoard(board_path(os.getpid(), "encoder", "encoder_0_0"))
    try:
        assert dead.path in remove_stale()
        assert not dead.path.exists() and live.path.exists()
    finally:
        dead.close()
        live.close()
