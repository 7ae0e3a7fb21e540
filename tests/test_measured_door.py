"""The door follows the machine it serves from, with the shipped configuration and no knob touched.

A faster machine is stood in for by a tiny model (a 2-layer, width-32 BERT): the door it measures is wider than a
2-core machine's knee with all-MiniLM-L6-v2, and a closed loop of one-text clients past that width is never refused.
A slower one is the server held to one CPU core (its stubs inherit the affinity): under clients that retry at once
the accepted p99 stays within the SLA and the goodput near the best the machine gives. A container's CPU limit is
stood in for by a cgroup with a CPU quota the server starts in: the encoder runs one torch thread per CPU of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time

import pytest
from helpers import infer, scrape, text_tensor
from small_models import repository_for, small_sentence_transformer
from test_overload import closed_loop
from triton_embed_protocol.cpu import cpu_cgroups, usable_cores
from triton_embed_server.embedded import EmbeddedServer

from bench.loops import no_backoff_loop
from bench.serving import variant_repository

SLA_MS = 200  # SLA_MS as shipped
FAST_CLIENTS = 72
"""One-text clients of the tiny model: past all-MiniLM-L6-v2's knee on 2 cores (32-64 texts). Not 96: on the one
core of a make test worker, shared with its clients, their p99 reaches the served-p99 target (140 ms) now and then,
and the door then narrows below 96 as it should (docs/benchmarks.md, "The door under load follows the served p99")."""


def admission(server) -> dict[str, float]:
    """The admission knobs in force, from the gauge ``triton_embed_admission``."""
    rows = scrape(server.metrics_url)
    return {k.split('knob="')[1].split('"')[0]: v for k, v in rows.items() if k.startswith("triton_embed_admission{")}


def load_time_door(log: str) -> int:
    """The door the encoder measured at load, from its start-up line."""
    return int(re.search(r"admission .*MAX_IN_FLIGHT (\d+) \(measured", log).group(1))


def texts(tag: str, count: int = 200_000) -> list[str]:
    """Texts never sent before: the response cache must not answer them."""
    return [f"{tag} {time.time_ns()} sentence number {i} about something new" for i in range(count)]


@contextlib.contextmanager
def on_cores(cores: set[int]):
    """Processes started inside inherit ``cores`` as their CPU affinity; this process gets its own back after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture(scope="module")
def fast_server(tmp_path_factory):
    """A tiny BERT behind the shipped configs: a machine many times faster than the one the old constants fit."""
    tmp = tmp_path_factory.mktemp("fast")
    model = small_sentence_transformer(tmp / "st", 32)
    repo = repository_for(model, tmp / "repo")
    with EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp / "log") as srv:
        yield srv


def test_a_faster_machine_measures_a_wider_door_and_a_loop_past_the_old_one_is_never_refused(fast_server):
    knobs = admission(fast_server)
    log = fast_server.config.log_file.read_text()
    print(knobs, load_time_door(log))
    assert knobs["SLA_MS"] == SLA_MS and knobs["MAX_IN_FLIGHT"] > FAST_CLIENTS
    cores, how = usable_cores()  # the test's own cgroup and affinity, which the server inherited
    assert f"torch threads {cores} ({how})" in log
    answers, errors = closed_loop(fast_server.grpc_url, texts("fast"), clients=FAST_CLIENTS, seconds=5)
    assert answers >= FAST_CLIENTS and errors == [], errors[:3]


@pytest.mark.whole_machine
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores: the server on one, the clients on another"
)
def test_a_slower_machine_keeps_the_accepted_p99_within_the_sla_past_its_door(tmp_path):
    repo = variant_repository(tmp_path / "repo", None)  # the shipped configs, the response cache off
    server_core, client_core = sorted(os.sched_getaffinity(0))[:2]
    with on_cores({server_core}):
        server = EmbeddedServer(
            model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log"
        )
        server.start()
    try:
        server.wait_ready(timeout_s=240)
        door = load_time_door((tmp_path / "log").read_text())
        with on_cores({client_core}):
            best = asyncio.run(no_backoff_loop(server.grpc_url, texts("slow-best"), clients=8, seconds=6))
            flood = asyncio.run(no_backoff_loop(server.grpc_url, texts("slow-flood"), clients=64, seconds=8))
        print(door, admission(server), best, flood)  # shown when the test fails
    finally:
        server.stop()
    assert door >= 8  # what one core holds depends on the CPU (an AMX core at bf16 measures 64): not asserted
    assert best.refused_per_s == 0 and best.other_errors == 0 and flood.other_errors == 0
    assert flood.p99_ms <= SLA_MS
    # generous for a noisy CI on 2 cores shared with the clients; docs/benchmarks.md carries the figure (0.81-1.13x)
    assert flood.ok_per_s >= 0.7 * best.ok_per_s


@contextlib.contextmanager
def in_cpu_quota(cpus: float):
    """Yields a function whose context starts processes under a cgroup CPU quota of ``cpus`` (a container's CPU
    limit): they inherit the cgroup, and this process goes back to its own after. The cgroup is removed at the end,
    once its processes have exited. Skips where the cgroup cannot be made (no cpu controller, not root)."""
    found = cpu_cgroups()  # where the encoder looks for its quota
    if not found:
        pytest.skip("no cgroup cpu controller here: a CPU quota cannot be set")
    mount, own, v2 = found[0]
    home = mount / own.strip("/")  # this process's cgroup; a container's mount shows it at its root
    home = home if home.is_dir() else mount
    folder = home / f"triton-embed-test-{os.getpid()}"
    try:
        folder.mkdir()
        if v2:
            (folder / "cpu.max").write_text(f"{int(cpus * 100_000)} 100000")
        else:
            (folder / "cpu.cfs_period_us").write_text("100000")
            (folder / "cpu.cfs_quota_us").write_text(str(int(cpus * 100_000)))
    except OSError as exc:
        with contextlib.suppress(OSError):
            folder.rmdir()
        pytest.skip(f"cannot make a cgroup with a CPU quota in {home} ({exc}): needs root")

    @contextlib.contextmanager
    def joined():
        (folder / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (home / "cgroup.procs").write_text(str(os.getpid()))

    try:
        yield joined
    finally:
        for _ in range(50):  # the server's processes leave the cgroup as they exit
            with contextlib.suppress(OSError):
                folder.rmdir()
                break
            time.sleep(0.1)


@pytest.mark.whole_machine
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores: a 1-CPU quota on one changes nothing")
def test_a_cpu_quota_gives_the_encoder_one_torch_thread_per_cpu_it_may_use(tmp_path):
    """Kubernetes ``limits: {cpu: 1}`` on a larger node: a thread per core of the affinity serves 0.55-0.77x the
    answers of one thread per CPU of the quota (docs/benchmarks.md, "Cores under a CPU quota")."""
    repo = repository_for(small_sentence_transformer(tmp_path / "st", 32), tmp_path / "repo")
    with in_cpu_quota(1) as joined:
        with joined():
            server = EmbeddedServer(
                model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log"
            )
            server.start()
        try:
            server.wait_ready(timeout_s=240)
            answer = infer(server.grpc_url, "embed", {"TEXT": text_tensor(["under a CPU limit"])}, ["EMBEDDING"])
        finally:
            server.stop()
    log = (tmp_path / "log").read_text()
    cores = len(os.sched_getaffinity(0))
    assert f"torch threads 1 (1 of the {cores} cores of the CPU affinity: a CPU quota of 1 CPU (" in log, [
        line for line in log.splitlines() if "torch threads" in line
    ]
    assert answer["EMBEDDING"].shape == (1, 32)
