"""GPU deployment (issue 6) as far as a machine without Docker engine or GPU can check it, with the real tools.

* docker-compose.yml: Debian's docker-compose 1.29 validates and resolves it; the resolved file is checked.
* docker/Dockerfile: its versions agree with requirements.lock and the Makefile; the image's Python (3.10) can
  install the locked runtime packages and parse our backends.
* The compose `triton` service's tritonserver command line, run through docker/triton-entrypoint.sh on the
  model repository docker/sync-model-repository.sh assembles, with the CPU build of the same Triton (2.51.0):
  it serves, its healthcheck passes, its admin APIs are locked.
* Prometheus (Debian's 2.42): promtool checks and unit-tests the config and alert rules; a real Prometheus with
  monitoring/prometheus/prometheus.yml scrapes that server and a monitor exporter, evaluates the alert rules and
  every query of the Grafana dashboard.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
MONITORING = ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "triton-embed.json"
PROMETHEUS_YML = MONITORING / "prometheus" / "prometheus.yml"
ALERTS_YML = MONITORING / "prometheus" / "alerts.yml"
# NGC release of each Triton server version we run (https://docs.nvidia.com support matrix): 2.51.0 = 24.10
NGC_RELEASE = {"2.51.0": "24.10"}
SETTINGS = ("ENCODER_CONFIG", "TRITON_BIND", "TRITON_EMBED_ADMIN_KEY", "GRAFANA_ADMIN_PASSWORD")


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} not found: `make system-deps` installs it (Debian packages docker-compose, prometheus)"
    return path


def compose(*args: str, profile: bool = False, **settings: str) -> subprocess.CompletedProcess:
    """Run docker-compose on our file with only the given settings in the environment."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS} | settings
    cmd = [_tool("docker-compose"), "-f", str(COMPOSE), *(["--profile", "monitoring"] if profile else []), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=120)


def resolved(**settings: str) -> dict:
    """The compose file as docker-compose resolves it (variables substituted, defaults filled in)."""
    done = compose("config", **settings)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonical(name)] = version
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# -- docker-compose.yml ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", [False, True], ids=["triton-alone", "monitoring"])
def test_compose_file_is_valid(profile):
    done = compose("config", "-q", profile=profile)
    assert done.returncode == 0, done.stderr
    # the validator does reject a broken file (so the check above means something)
    broken = COMPOSE.read_text().replace("shm_size: 1gb", "shm_size: [1]")
    bad = subprocess.run(
        [_tool("docker-compose"), "-f", "-", "config", "-q"],
        input=broken, cwd=ROOT, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "shm_size" in bad.stderr


def test_plain_up_starts_triton_alone_and_the_profile_adds_the_monitoring_stack():
    services = resolved()["services"]
    profiles = {name: tuple(s.get("profiles", ())) for name, s in services.items()}
    assert profiles == {
        "model-export": (),
        "triton": (),
        "gpu-monitor": ("monitoring",),
        "prometheus": ("monitoring",),
        "grafana": ("monitoring",),
    }
    for name, service in services.items():
        if not profiles[name]:  # `docker compose up` fails if a default service depends on a profiled one
            assert all(not profiles[dep] for dep in service.get("depends_on", {})), name


def test_triton_service():
    triton = resolved()["services"]["triton"]
    (gpu,) = triton["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"] and gpu["count"] == 1
    assert triton["build"]["target"] == "triton" and triton["build"]["dockerfile"] == "docker/Dockerfile"
    assert triton["depends_on"] == {"model-export": {"condition": "service_completed_successfully"}}
    assert triton["ipc"] == "shareable" and triton["init"] is True
    shm = re.fullmatch(r"(\d+)([kmg])b?", str(triton["shm_size"]).lower())
    assert (
        shm and int(shm.group(1)) * 1024 ** "kmg".index(shm.group(2)) >= 256 * 1024
    )  # KiB; Docker's default 64 MB runs out
    # loopback by default, as the embedded server; TRITON_BIND opens them deliberately
    assert sorted(triton["ports"]) == [f"127.0.0.1:{p}:{p}/tcp" for p in (8000, 8001, 8002)]
    opened = resolved(TRITON_BIND="0.0.0.0")["services"]["triton"]  # noqa: S104 - what the setting is for
    assert sorted(opened["ports"]) == [f"0.0.0.0:{p}:{p}/tcp" for p in (8000, 8001, 8002)]
    # the model repository: read-only in Triton, written only by the one-shot model-export from read-only configs
    assert triton["volumes"] == ["model-repository:/models:ro"]
    export = resolved()["services"]["model-export"]
    assert sorted(export["volumes"]) == sorted(
        [f"{ROOT / 'model_repository'}:/src/configs:ro", "model-repository:/models:rw"]
    )
    assert export["build"]["target"] == "export" and export.get("restart") == "no"
    health = triton["healthcheck"]
    assert health["test"][0] == "CMD" and "http://127.0.0.1:8000/v2/health/ready" in " ".join(health["test"])
    assert health["start_period"] and health["retries"] >= 1
    command = triton["command"]
    assert "--model-repository=/models" in command and "--metrics-config=summary_latencies=true" in command
    assert "--model-control-mode=none" in command


@pytest.mark.parametrize(("setting", "config"), [(None, "gpu"), ("libtorch", "libtorch"), ("gpu", "gpu")])
def test_encoder_config_is_chosen_by_environment(setting, config):
    command = resolved(**({"ENCODER_CONFIG": setting} if setting else {}))["services"]["triton"]["command"]
    assert f"--model-config-name={config}" in command
    assert (ROOT / "model_repository" / "encoder" / "configs" / f"{config}.pbtxt").is_file()


def test_monitoring_services_point_at_each_other_and_at_files_that_exist():
    from triton_embed.monitor.cli import DEFAULT_PORT

    services = resolved()["services"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("/"):
                assert Path(source).exists(), f"{name} mounts {source}, which is not in the repository"
    monitor = services["gpu-monitor"]
    assert "--triton-metrics-url=http://triton:8002/metrics" in monitor["command"]
    assert f"--port={DEFAULT_PORT}" in monitor["command"] and monitor["restart"] == "on-failure"
    assert monitor["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    scrape = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape}
    assert targets == {"triton": ["triton:8002"], "gpu-monitor": [f"gpu-monitor:{DEFAULT_PORT}"]}
    # the Prometheus image is the release that tests this configuration here
    version = subprocess.run([_tool("promtool"), "--version"], capture_output=True, text=True, check=True)
    release = re.search(r"version (\d+\.\d+\.\d+)", version.stdout + version.stderr).group(1)
    assert services["prometheus"]["image"] == f"prom/prometheus:v{release}"
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/triton-embed.yml").read_text())
    grafana = services["grafana"]
    assert f"{MONITORING / 'grafana/dashboards'}:{provider['providers'][0]['options']['path']}:ro" in grafana["volumes"]


# -- docker/Dockerfile -----------------------------------------------------------------------------------------
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


def pip_installs() -> list[list[str]]:
    """Arguments of every ``pip install`` in the Dockerfile's RUN lines (after ``install``)."""
    installs = []
    for instruction, args in dockerfile_instructions():
        if instruction == "RUN":
            for command in args.split("&&"):
                words = shlex.split(command)
                if "pip" in words and "install" in words:
                    installs.append(words[words.index("install") + 1 :])
    return installs


def test_dockerfile_pins_agree_with_the_lock_and_the_makefile():
    pins = lock_pins()
    makefile = (ROOT / "Makefile").read_text()
    for tool in ("pip", "setuptools"):
        pins[tool] = re.search(rf"\b{tool}==([\w.]+)", makefile).group(1)
    pinned = re.findall(r"\b([A-Za-z][\w.-]*)==([\w.+]+)", DOCKERFILE.read_text())
    assert pinned, "the Dockerfile pins pip and setuptools at least"
    for name, version in pinned:
        assert pins.get(canonical(name)) == version, (
            f"Dockerfile {name}=={version}, project {pins.get(canonical(name))}"
        )
    installs = pip_installs()
    assert len(installs) >= 5
    for args in installs:
        packages, skip_next = [], False
        for word in args:
            if skip_next or "$" in word:
                skip_next = False
                continue
            if word in ("-c", "--index-url", "--extra-index-url", "--constraint"):
                skip_next = True
            elif not word.startswith("-"):
                packages.append(word)
        if any("==" in p for p in packages):
            continue  # pip/setuptools themselves, checked above
        assert "-c" in args, f"pip install {args} does not take its versions from the lock"
        for package in packages:  # "." is the project: its own pins are checked by tests/test_pins.py
            name = re.sub(r"\[.*\]$", "", package)
            assert name == "." or canonical(name) in pins, f"{package} is installed but not locked"


def test_image_versions_match_the_embedded_server_and_the_lock(compose_server):
    args = dict(a.split("=", 1) for i, a in dockerfile_instructions() if i == "ARG" and "=" in a)
    version = compose_server.metadata()["version"]
    assert args["TRITON_IMAGE"] == f"nvcr.io/nvidia/tritonserver:{NGC_RELEASE[version]}-py3"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11,<3.12" and args["PYTHON_IMAGE"].startswith("python:3.11-")


def _closure(roots: list[str], python: str) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions ``roots`` need on ``python`` (markers evaluated for it), by canonical name."""
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    found, todo = {}, list(roots)
    while todo:
        name = canonical(todo.pop())
        if name in found:
            continue
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.distribution(name)
            for text in found[name].requires or []:
                requirement = Requirement(text)
                if requirement.marker is None or requirement.marker.evaluate(env):
                    todo.append(requirement.name)
    return found


def test_runtime_constraints_leave_out_exactly_the_locked_versions_python_310_cannot_install():
    """The image's Python is 3.10; a lock pin that needs 3.11 would make pip fail, one left out needlessly drifts."""
    from packaging.specifiers import SpecifierSet

    run = next(a for i, a in dockerfile_instructions() if i == "RUN" and "constraints-py310" in a)
    skipped = set(re.search(r"grep -v -E '\^\(([^)]*)\)==' ", run).group(1).split("|"))
    roots = ["torch", "tokenizers", "numpy"]
    assert re.search(r"constraints-py310.txt\s+(\$\{[^}]*\}\s+)?" + r"\s+".join(roots), run)
    needs_311 = {
        name
        for name, dist in _closure(roots, "3.10").items()
        if name in lock_pins() and not SpecifierSet(dist.metadata.get("Requires-Python") or "").contains("3.10.12")
    }
    assert skipped == needs_311
    assert not skipped & set(roots), "the packages our backends import must keep their locked versions"


# Modules and names added to the standard library after Python 3.10 (the image's interpreter).
ADDED_AFTER_310 = {"tomllib", "wsgiref.types", "typing.Self", "typing.LiteralString", "typing.Never",
                   "typing.assert_never", "typing.reveal_type", "enum.StrEnum", "datetime.UTC", "asyncio.TaskGroup",
                   "asyncio.timeout", "typing.override", "itertools.batched"}  # fmt: skip


@pytest.mark.parametrize("path", sorted((ROOT / "python_backends").rglob("*.py")), ids=lambda p: p.name)
def test_backends_are_python_310(path):
    tree = ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            used |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            used.add(f"{node.value.id}.{node.attr}")
    assert not used & ADDED_AFTER_310


def test_dockerfile_installs_every_backend_and_the_context_carries_what_it_copies():
    copies = [a.split() for i, a in dockerfile_instructions() if i == "COPY" and not a.startswith("--from")]
    backends = sorted(p.parent.name for p in (ROOT / "python_backends").glob("*/model.py"))
    for name in backends:
        assert [f"python_backends/{name}/", f"/opt/tritonserver/backends/{name}/"] in copies
    configs = "".join(p.read_text() for p in ROOT.glob("model_repository/**/*.pbtxt"))
    assert set(re.findall(r'backend: "(\w+)"', configs)) == set(backends)
    patterns = [
        line.strip()
        for line in (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "send nothing by default (.venv alone is gigabytes)"
    for source in {src.rstrip("/").split("/")[0] for c in copies for src in c[:-1]}:
        assert f"!{source}" in patterns, f"COPY {source} but the .dockerignore leaves it out"
    assert "model_repository/*/1/*" in patterns  # a host-side export never reaches the image


def test_the_monitor_image_install_carries_the_monitor(tmp_path):
    """The monitor image runs `pip install .[monitor]`: the built wheel must hold the package and its script."""
    for name in ("pyproject.toml", "README.md", "client", "server"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", "."],
        cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    import zipfile

    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "triton_embed/monitor/cli.py" in names and "triton_embed/monitor/__main__.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "triton-embed-monitor = triton_embed.monitor.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


# -- the compose `triton` service's command line, run for real ---------------------------------------------------
class ComposeServer:
    """tritonserver started as the compose `triton` service starts it, on free loopback ports."""

    def __init__(self, models: Path, log: Path, admin_key: str) -> None:
        from triton_embed_server.embedded import free_port

        self.models, self.log, self.admin_key = models, log, admin_key
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.process: subprocess.Popen | None = None

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


@pytest.fixture(scope="module")
def compose_server(tmp_path_factory):
    from triton_embed_server.embedded import _spawn_args
    from triton_embed_server.layout import DEFAULT_BUILD_DIR, assemble_backends, find_layout

    tmp = tmp_path_factory.mktemp("compose")
    # what the export stage of the image holds: the artifacts only (here: those `make model` wrote)
    artifacts = tmp / "artifacts"
    for rel in ("encoder/1/model.pt", "encoder/1/export.json", "tokenizer/1/tokenizer.json"):
        (artifacts / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "model_repository" / rel, artifacts / rel)
    models = tmp / "models"
    models.mkdir()
    (models / "left-over.pbtxt").write_text("from an older image")
    sync = subprocess.run(
        ["bash", "docker/sync-model-repository.sh", str(ROOT / "model_repository"), str(artifacts), str(models)],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
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
    env = entrypoint_env(TRITONSERVER=str(layout.binary), TRITON_EMBED_ADMIN_KEY=server.admin_key)
    argv, preexec = _spawn_args(["bash", str(ROOT / "docker" / "triton-entrypoint.sh"), *args])
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
        yield server
    finally:
        server.process.send_signal(2)  # SIGINT, as the embedded server stops it
        try:
            server.process.wait(timeout=45)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def _ready(server: ComposeServer) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=2) as r:  # noqa: S310
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def post_status(url: str, headers: dict | None = None) -> int:
    request = urllib.request.Request(url, data=b"{}", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - our loopback server
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_compose_command_serves_embeddings_with_the_admin_apis_locked(compose_server):
    import numpy as np
    from triton_embed import EmbeddingClient

    with EmbeddingClient(url=compose_server.grpc_url, protocol="grpc") as client:
        vectors = client.embed(["A man is playing a guitar.", "Someone plays music."])
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    index = f"http://{compose_server.http_url}/v2/repository/index"
    assert post_status(index) == 403
    assert post_status(index, {"triton-embed-admin-key": "wrong"}) == 403
    assert post_status(index, {"triton-embed-admin-key": compose_server.admin_key}) == 200
    # the synced repository: configs from the host, artifacts from the image, nothing left from before
    files = sorted(str(p.relative_to(compose_server.models)) for p in compose_server.models.rglob("*") if p.is_file())
    assert "left-over.pbtxt" not in files and "encoder/1/model.pt" in files and "embed/config.pbtxt" in files
    assert (compose_server.models / "embed" / "1").is_dir() and ".gitkeep" not in " ".join(files)


def test_healthcheck_passes_on_a_ready_server_and_fails_without_one(compose_server):
    from triton_embed_server.embedded import free_port

    kind, interpreter, *args = resolved()["services"]["triton"]["healthcheck"]["test"]
    assert (kind, interpreter) == ("CMD", "python3")

    def run(port: int) -> int:
        here = [a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in args]
        return subprocess.run([sys.executable, *here], capture_output=True, check=False, timeout=30).returncode

    assert run(compose_server.http_port) == 0
    assert run(free_port()) != 0


def test_entrypoint_locks_admin_apis_like_the_embedded_server():
    from triton_embed_server.embedded import ADMIN_HEADER, RESTRICTED_APIS

    script = str(ROOT / "docker" / "triton-entrypoint.sh")

    def run(**env: str) -> subprocess.CompletedProcess:
        # TRITONSERVER=echo prints the command line the entrypoint would exec
        return subprocess.run(
            ["bash", script, "--model-repository=/models"], env=entrypoint_env(TRITONSERVER="echo", **env),
            capture_output=True, text=True, check=False, timeout=30,
        )  # fmt: skip

    given = run(TRITON_EMBED_ADMIN_KEY="s3cret-key")
    assert given.returncode == 0 and given.stdout.split() == [
        "--model-repository=/models",
        f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}=s3cret-key",
        f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}=s3cret-key",
    ]
    keys = []
    for _ in range(2):  # unset: a random key per start, so the admin APIs are closed to everyone
        done = run()
        assert done.returncode == 0 and "random key" in done.stderr
        keys.append(re.search(rf"--http-restricted-api=[^:]+:{ADMIN_HEADER}=(\S+)", done.stdout).group(1))
        assert f"{ADMIN_HEADER}={keys[-1]}" in done.stdout.split()[-1]
    assert keys[0] != keys[1] and all(len(k) >= 24 for k in keys)
    bad = run(TRITON_EMBED_ADMIN_KEY="has space")
    assert bad.returncode == 2 and "TRITON_EMBED_ADMIN_KEY" in bad.stderr


# -- Prometheus and the Grafana dashboard -------------------------------------------------------------------------
def test_promtool_accepts_the_config_and_the_rules_and_their_unit_tests():
    promtool = _tool("promtool")
    for args in (
        ["check", "config", str(PROMETHEUS_YML)],  # loads alerts.yml too
        ["check", "rules", str(ALERTS_YML)],
        ["test", "rules", str(MONITORING / "prometheus" / "alerts_test.yml")],
    ):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, check=False, timeout=120)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
        assert "SUCCESS" in done.stdout + done.stderr


def recorded_gpu_sample(timestamp: float, gpu: int, util: float):
    from triton_embed.monitor import GpuSample

    return GpuSample(timestamp, gpu, "NVIDIA H200", f"GPU-{gpu}", util, util / 3, 9 << 30, 141 << 30, 1980.0, 250.0,
                     40.0, ((1234, 8 << 30),))  # fmt: skip


@pytest.fixture(scope="module")
def monitor_exporter():
    """The monitor's real exporter fed with recorded samples (this machine has no GPU): GPU 1 saturated."""
    from triton_embed.monitor import FlagThresholds, QueueSample
    from triton_embed.monitor.exporter import MonitorExporter

    exporter = MonitorExporter(FlagThresholds(idle_window_s=2.0, saturation_window_s=2.0))
    start = time.time() - 5
    for i in range(5):
        samples = [recorded_gpu_sample(start + i, 0, 3.0), recorded_gpu_sample(start + i, 1, 99.0)]
        exporter.observe(samples, QueueSample(start + i - 0.1, 4))
    server, _ = exporter.serve("127.0.0.1", 0)
    yield exporter, server.server_port
    server.shutdown()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, compose_server, monitor_exporter):
    """Debian's prometheus with monitoring/prometheus/prometheus.yml, pointed at loopback targets, scraping each 1 s."""
    from triton_embed_server.embedded import _spawn_args, free_port

    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["rule_files"] == ["alerts.yml"] and (PROMETHEUS_YML.parent / "alerts.yml").is_file()
    config["rule_files"] = [str(ALERTS_YML)]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    targets = {"triton": f"127.0.0.1:{compose_server.metrics_port}", "gpu-monitor": f"127.0.0.1:{monitor_exporter[1]}"}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv, preexec = _spawn_args(
        [
            _tool("prometheus"),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
    )
    log = tmp / "prometheus.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec)  # noqa: S603, PLW1509
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:  # noqa: S310
                if response.status == 200:
                    break
            assert time.monotonic() < deadline, f"prometheus not ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def prom_api(base: str, path: str, **params: str) -> dict:
    url = f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    assert body["status"] == "success", f"{params}: {body}"
    return body["data"]


def wait_for(check, timeout_s: float = 30.0, what: str = ""):
    """Poll ``check()`` until it returns a truthy value; return it."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return result


def test_prometheus_scrapes_triton_and_the_monitor(prometheus):
    def both_up():
        up = {r["metric"]["job"]: r["value"][1] for r in prom_api(prometheus, "query", query="up")["result"]}
        return up if up == {"triton": "1", "gpu-monitor": "1"} else None

    wait_for(both_up, what="up == 1 for the triton and gpu-monitor jobs")
    # what was scraped is Triton's: the ensemble's counters carry the job label of the triton scrape
    series = prom_api(prometheus, "query", query='nv_inference_request_success{model="embed"}')["result"]
    assert series and series[0]["metric"]["job"] == "triton"


def test_alert_rules_load_and_evaluate_without_errors(prometheus):
    def evaluated():
        groups = prom_api(prometheus, "rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules) else None

    rules = wait_for(evaluated, what="a first evaluation of every rule")
    # the recorded GPU 1 is saturated: its alert turns pending (it would fire after `for: 2m`)
    saturated = wait_for(
        lambda: [
            a["labels"]["gpu"]
            for g in prom_api(prometheus, "rules")["groups"]
            for r in g["rules"]
            if r["name"] == "TritonEmbedGpuSaturated"
            for a in r["alerts"]
        ],
        what="the saturation alert of the recorded GPU",
    )
    assert saturated == ["1"]
    assert {r["name"] for r in rules} == {
        "TritonEmbedGpuIdleWithQueue",
        "TritonEmbedGpuSaturated",
        "TritonEmbedP99OverSla",
        "TritonEmbedDown",
        "TritonEmbedGpuMonitorDown",
    }
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "delta", "by", "without", "on",
                "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "abs", "clamp_min",
                "clamp_max", "histogram_quantile", "topk", "bottomk", "vector", "scalar", "time", "absent"}  # fmt: skip


def metric_names_in(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (strings, label matchers, ranges and grouping labels removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    return {name for name in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e) if name not in PROMQL_WORDS}


def test_metric_name_extraction():
    assert metric_names_in(
        'sum by (model) (rate(a_total{model=~"x|y"}[$__rate_interval]) + rate(b{q="0.99"}[1m])) / max(c) / 1000'
    ) == {"a_total", "b", "c"}


def dashboard_targets() -> list[tuple[str, dict]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def test_dashboard_is_well_formed_and_covers_the_issue():
    dashboard = json.loads(DASHBOARD.read_text())
    provisioned = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = provisioned["datasources"][0]["uid"]
    panels = dashboard["panels"]
    assert dashboard["uid"] == "triton-embed" and len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["gridPos"]["x"] >= 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid and panel["targets"] and panel["description"], panel["title"]
            assert all(t["datasource"]["uid"] == uid for t in panel["targets"])
    exprs = " ".join(t["expr"] for _, t in dashboard_targets())
    for needed in (
        "nv_inference_request_success",  # request rate
        'quantile="0.99"',  # p99
        "nv_inference_queue_duration_us",  # queue vs compute per step
        "nv_inference_compute_infer_duration_us",
        "nv_inference_exec_count",  # average batch
        "triton_embed_gpu_utilization_percent",
        "triton_embed_gpu_memory_used_bytes",
        "triton_embed_gpu_power_watts",
    ):
        assert needed in exprs, needed


def test_every_dashboard_and_alert_query_names_real_metrics_and_returns_data(
    prometheus, compose_server, monitor_exporter
):
    """Names: a real scrape of the compose-command server plus the monitor's exporter. Data: Prometheus answers."""
    import secrets

    from triton_embed import EmbeddingClient
    from triton_embed.monitor.exporter import metric_names

    with EmbeddingClient(url=compose_server.grpc_url, protocol="grpc") as client:
        for i in range(3):  # traffic in two bursts a few scrapes apart, so rate() has an increase to show
            client.embed([f"sentence {secrets.token_hex(4)} number {i}" for _ in range(3)])
            client.embed(["the same text twice hits the response cache"])
            time.sleep(1.5)
    with urllib.request.urlopen(compose_server.metrics_url, timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    # sample names exactly as Prometheus stores them (a client-side parser would add _total to Triton's counters)
    scraped = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and line[0] != "#"}
    known = scraped | metric_names(monitor_exporter[0].registry) | {"ALERTS", "up"}  # the last two: Prometheus' own
    alert_exprs = [r["expr"] for g in yaml.safe_load(ALERTS_YML.read_text())["groups"] for r in g["rules"]]
    for expr in [t["expr"] for _, t in dashboard_targets()] + alert_exprs:
        assert metric_names_in(expr) <= known, f"{expr} reads {metric_names_in(expr) - known}, which nobody exports"

    for title, target in dashboard_targets():
        expr = target["expr"].replace("$__rate_interval", "1m")

        def answered(expr=expr):
            result = prom_api(prometheus, "query", query=expr)["result"]
            return result or expr.startswith("ALERTS")  # no alert firing is a fine answer

        wait_for(answered, timeout_s=20, what=f"data for panel {title!r}: {expr}")
