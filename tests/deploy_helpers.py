"""Shared by the deployment tests (test_deploy.py: files and tools; test_deploy_runtime.py: real servers).

Paths of the deployment files, docker-compose resolution, the compose `triton` command line started on the CPU
build of Triton, and the metric names a PromQL expression reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml
from helpers import running_until_ready
from triton_embed_server.layout import DEFAULT_MODEL_REPOSITORY

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
MONITORING = ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "triton-embed.json"
PROMETHEUS_YML = MONITORING / "prometheus" / "prometheus.yml"
ALERTS_YML = MONITORING / "prometheus" / "alerts.yml"
# NGC release of each Triton server version we run (https://docs.nvidia.com support matrix): 2.51.0 = 24.10
NGC_RELEASE = {"2.51.0": "24.10"}
# PyTorch release of each NGC release's libtorch (NGC frameworks support matrix: 24.10 = PyTorch 2.5.0a0+e000cf0)
NGC_PYTORCH = {"24.10": "2.5.0"}
IMAGE_LOCK = ROOT / "docker" / "requirements-triton.lock"
SETTINGS = (
    "ENCODER_CONFIG",
    "TRITON_BIND",
    "TRITON_EMBED_ADMIN_KEY",
    "TRITON_EMBED_WATCH_STUBS",
    "GRAFANA_ADMIN_PASSWORD",
    "MODEL",
)


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} not found: `make system-deps` installs it (Debian packages docker-compose, prometheus)"
    return path


@contextlib.contextmanager
def prometheus_running(tmp: Path, config: dict) -> Iterator[str]:
    """Debian's prometheus with ``config`` (a prometheus.yml as a dict) on a free loopback port, its data under
    ``tmp``; yields its base URL once ``/-/ready`` answers and stops it on exit."""
    from triton_embed_server.embedded import _spawn_args, free_port

    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv, preexec = _spawn_args(
        [
            tool("prometheus"),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
    )
    log = tmp / "prometheus.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec)  # noqa: S603, PLW1509
    base = f"http://127.0.0.1:{port}"
    with running_until_ready(process, log, f"{base}/-/ready", "prometheus"):
        yield base


def prom_api(base: str, path: str, **params: str) -> dict:
    """``data`` of a Prometheus HTTP API answer (``path`` under /api/v1/, e.g. ``query`` or ``rules``).

    Raises:
        AssertionError: the answer's status is not ``success`` (with its error).
    """
    url = f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    assert body["status"] == "success", f"{params}: {body}"
    return body["data"]


def compose(*args: str, profile: bool = False, **settings: str) -> subprocess.CompletedProcess:
    """Run docker-compose on our file with only the given settings in the environment."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS} | settings
    cmd = [tool("docker-compose"), "-f", str(COMPOSE), *(["--profile", "monitoring"] if profile else []), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=120)


def resolved(**settings: str) -> dict:
    """The compose file as docker-compose resolves it (variables substituted, defaults filled in)."""
    done = compose("config", **settings)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            lines.append(current)
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def lock_pins(path: Path = ROOT / "requirements.lock") -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonical(name)] = version
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "rate",
    "irate",
    "increase",
    "delta",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "abs",
    "clamp_min",
    "clamp_max",
    "histogram_quantile",
    "topk",
    "bottomk",
    "vector",
    "scalar",
    "time",
    "absent",
}


def metric_names_in(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (strings, label matchers, ranges and grouping labels removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    return {name for name in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e) if name not in PROMQL_WORDS}


def dashboard_targets() -> list[tuple[str, dict]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


class ComposeServer:
    """tritonserver started as the compose `triton` service starts it, on free loopback ports."""

    def __init__(self, models: Path, log: Path, admin_key: str) -> None:
        from triton_embed_server.embedded import free_port

        self.models, self.log, self.admin_key = models, log, admin_key
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.process: subprocess.Popen | None = None  # the entrypoint, which stays in front of tritonserver
        self.server_pid: int | None = None  # tritonserver, the entrypoint's child
        self.watchdog_pid: int | None = None  # the entrypoint's stub watchdog, its other child

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def metadata(self) -> dict:
        with urllib.request.urlopen(f"http://{self.http_url}/v2", timeout=10) as response:  # noqa: S310 - loopback
            return json.loads(response.read())

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:]) if self.log.is_file() else ""


def entrypoint_env(**extra: str) -> dict[str, str]:
    from triton_embed_server.layout import find_layout, server_environment

    env = {k: v for k, v in server_environment(find_layout()).items() if k != "TRITON_EMBED_ADMIN_KEY"}
    return env | extra


def sync_model_repository(
    tmp: Path,
    *,
    configs: Path = ROOT / "model_repository",
    model: Path | None = None,
    models: str = "",
    models_root: Path | None = None,
) -> tuple[Path, subprocess.CompletedProcess]:
    """Run docker/sync-model-repository.sh as the model-export service does; return the repository it made.

    The image's baked artifacts are those `make model` wrote here (the packaged model); ``model``: a
    sentence-transformers folder the script exports itself, as with MODEL set; ``models``: MODELS, its folders in
    ``models_root`` (where the service mounts MODELS_DIR).
    """
    import sys

    artifacts = tmp / "artifacts"
    for rel in ("encoder/1/model.pt", "encoder/1/export.json", "tokenizer/1/tokenizer.json"):
        (artifacts / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DEFAULT_MODEL_REPOSITORY / rel, artifacts / rel)
    dest = tmp / "models"
    dest.mkdir()
    (dest / "left-over.pbtxt").write_text("from an older image")
    args = [str(configs), str(artifacts), str(dest), *([str(model)] if model else [])]
    env = os.environ | {"PYTHON": sys.executable, "MODELS": models, "MODELS_ROOT": str(models_root or tmp)}
    done = subprocess.run(
        ["bash", "docker/sync-model-repository.sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env=env,
    )
    return dest, done


def embedding_widths(repository: Path) -> dict[str, int]:
    """The embedding width (``model_config.WIDTH_OUTPUTS``) of every config in ``repository`` declaring one, by path."""
    from triton_embed_server import model_config

    return {
        str(cfg.relative_to(repository)): output.dims[0]
        for cfg in sorted(repository.rglob("*.pbtxt"))
        for output in model_config.read(cfg).output
        if output.name in model_config.WIDTH_OUTPUTS
    }


@contextlib.contextmanager
def compose_server_running(
    tmp: Path,
    model: Path | None = None,
    configs: Path = ROOT / "model_repository",
    models: str = "",
    models_root: Path | None = None,
) -> Iterator[ComposeServer]:
    """Sync the model repository as the model-export service does, start tritonserver with the compose command line.

    The command line is docker-compose's resolution of the `triton` service's ``command`` with ENCODER_CONFIG=cpu,
    run through docker/triton-entrypoint.sh with the CPU build of the same Triton; only the model repository path,
    the backend and cache folders (the image's defaults) and loopback ports differ. ``model``: as with MODEL set;
    ``configs``: the host's model configs the sync copies (default: this checkout's); ``models``, ``models_root``:
    as :func:`sync_model_repository`'s.
    """
    from triton_embed_server.embedded import _spawn_args
    from triton_embed_server.layout import DEFAULT_BUILD_DIR, assemble_backends, find_layout
    from triton_embed_server.shm import backend_regions, remove_orphans

    models, sync = sync_model_repository(tmp, configs=configs, model=model, models=models, models_root=models_root)
    assert sync.returncode == 0, sync.stderr
    # ENCODER_CONFIG=cpu: there is no configs/cpu.pbtxt, so Triton falls back to each model's config.pbtxt (the
    # CPU configs); gpu and libtorch need a GPU / the libtorch backend, which the CPU build lacks.
    assert not (ROOT / "model_repository" / "encoder" / "configs" / "cpu.pbtxt").exists()
    command = resolved(ENCODER_CONFIG="cpu")["services"]["triton"]["command"]
    layout = find_layout()
    server = ComposeServer(models, tmp / "tritonserver.log", admin_key="compose-test-key")
    args = [f"--model-repository={models}" if a == "--model-repository=/models" else a for a in command]
    # what differs from the container: the image's default backend and cache folders, and loopback ports
    args += [
        f"--backend-directory={assemble_backends(layout, DEFAULT_BUILD_DIR)}",
        f"--cache-directory={layout.cache_dir}",
        *(f"--{kind}-address=127.0.0.1" for kind in ("http", "grpc", "metrics")),
        f"--http-port={server.http_port}",
        f"--grpc-port={server.grpc_port}",
        f"--metrics-port={server.metrics_port}",
    ]
    # the watchdog from this checkout (the image copies the same file to the entrypoint's default path)
    env = entrypoint_env(
        TRITONSERVER=str(layout.binary),
        TRITON_EMBED_ADMIN_KEY=server.admin_key,
        TRITON_EMBED_WATCHDOG=str(ROOT / "server" / "triton_embed_server" / "supervisor.py"),
        TRITON_EMBED_DRAIN=str(ROOT / "server" / "triton_embed_server" / "drain.py"),
        TRITON_EMBED_DRIVER_CHECK=str(ROOT / "server" / "triton_embed_server" / "driver_check.py"),
        TRITON_EMBED_TRACING=str(ROOT / "server" / "triton_embed_server" / "tracing.py"),
        **{k: v for k, v in resolved()["services"]["triton"]["environment"].items() if k != "TRITON_EMBED_ADMIN_KEY"},
    )
    argv, preexec = _spawn_args(["bash", str(ROOT / "docker" / "triton-entrypoint.sh"), *args])
    regions_before = backend_regions()
    with open(server.log, "ab") as log:
        server.process = subprocess.Popen(  # noqa: S603 - our script, our arguments
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=preexec,  # noqa: PLW1509
        )
    try:
        deadline = time.monotonic() + 240
        while not _ready(server):
            assert server.process.poll() is None, f"tritonserver exited:\n{server.log_tail()}"
            assert time.monotonic() < deadline, f"not ready after 240 s:\n{server.log_tail()}"
            time.sleep(0.25)
        server.server_pid = _child_of(server.process.pid, b"tritonserver")
        server.watchdog_pid = _child_of(server.process.pid, b"supervisor.py")
        # the watchdog polls readiness once a second: a stub killed before it looks would not be watched
        while server.watchdog_pid and "watching the stubs" not in server.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"the stub watchdog did not start watching:\n{server.log_tail()}"
            time.sleep(0.1)
        yield server
    finally:
        # SIGTERM, as `docker compose stop` sends: a drain, then a stop (SIGINT would be ignored by bash when the
        # tests run as a background job, which starts with SIGINT ignored)
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=75)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
        _wait_gone(server.watchdog_pid, timeout_s=15)
        stopping = server.log.read_text(errors="replace").partition("Signal (15) received.")[2]
        assert "reloading the model" not in stopping, "the stub watchdog reloaded a model while tritonserver stopped"
        # a container's /dev/shm goes with it; here, remove what the stubs the tests killed left (see shm.py)
        remove_orphans(backend_regions() - regions_before)


def _child_of(parent: int, name: bytes) -> int | None:
    """PID of the child of ``parent`` whose command line holds ``name`` (the entrypoint's tritonserver, watchdog)."""
    from triton_embed_server.supervisor import proc_state

    for proc in Path("/proc").glob("[0-9]*"):
        stat = proc_state(int(proc.name))
        with contextlib.suppress(OSError):
            if stat is not None and stat.ppid == parent and name in (proc / "cmdline").read_bytes():
                return int(proc.name)
    return None


def _wait_gone(pid: int | None, timeout_s: float) -> None:
    """Wait for ``pid`` to exit; kill it (and fail) if it outlives ``timeout_s``: nothing may outlive the server."""
    from triton_embed_server.supervisor import process_alive

    deadline = time.monotonic() + timeout_s
    while pid is not None and process_alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            raise AssertionError(f"the stub watchdog (pid {pid}) outlived tritonserver by {timeout_s:.0f} s")
        time.sleep(0.2)


def _ready(server: ComposeServer) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=2) as r:  # noqa: S310
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
