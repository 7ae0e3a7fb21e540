"""Several replicas of the server on one machine, each on an address of its own, as pods are (tests/test_replicas.py).

* :func:`replica_network`: a /24 that the test makes and removes: a bridge on the host (``.1``) and one network
  namespace per replica, joined to it by a veth pair (``.11``, ``.12``, ...). Needs root (``ip netns``).
* :class:`Replica`: ``python -m triton_embed_server serve`` (what ``make serve`` runs) inside its namespace, bound to
  the namespace's address on the usual ports 8000/8001/8002, as each pod has them.
* :func:`nginx_running`: Debian's nginx on a loopback port in front of them, as an L7 ingress: ``grpc_pass`` and
  ``proxy_pass`` over an upstream of the replicas, retrying the next one on connection errors.
* :func:`scrape_config`: a Prometheus configuration scraping the replicas' metrics with ``namespace`` and ``pod``
  labels, as the PodMonitor labels them for prometheus-adapter.
"""

from __future__ import annotations

import contextlib
import getpass
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
from dataclasses import dataclass
from pathlib import Path

from deploy_helpers import prom_api, tool
from helpers import running_until_ready, serve_command
from triton_embed_server.embedded import _spawn_args, free_port
from triton_embed_server.supervisor import process_alive

NS_PREFIX = "triton-embed-test-"
"""Namespaces are named ``<prefix><pid of the test process>-<n>``: leftovers of a killed run are found by it."""
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002  # each replica's own address: the ports every pod has
K8S_NAMESPACE = "triton-embed"


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)  # noqa: S607
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr.strip()}"


def netns_unavailable() -> str:
    """Why namespaces cannot be made here ('' when they can): not root, or no iproute2."""
    if os.geteuid() != 0:
        return "needs root for `ip netns add` and veth pairs"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    return ""


@dataclass(frozen=True)
class Network:
    """The /24 of one test run: the host's bridge holds ``prefix.1``, replica ``n`` lives at ``prefix.(11 + n)``."""

    prefix: str
    bridge: str
    namespaces: tuple[str, ...]

    @property
    def host_address(self) -> str:
        return f"{self.prefix}.1"

    def address(self, n: int) -> str:
        return f"{self.prefix}.{11 + n}"


def _remove_leftovers() -> None:
    """Namespaces and bridges of earlier runs whose test process is gone (a run killed before its clean-up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)  # noqa: S607
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if m := re.fullmatch(rf"{NS_PREFIX}(\d+)-\d+", name):
            pid = int(m.group(1))
            if not process_alive(pid):
                subprocess.run(["ip", "netns", "del", name], check=False)  # noqa: S607
                subprocess.run(["ip", "link", "del", f"teb{pid}"], capture_output=True, check=False)  # noqa: S607


def _free_prefix() -> str:
    """A 10.213.x /24 that no interface of this host has an address in."""
    taken = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=False).stdout  # noqa: S607
    for x in [os.getpid() % 250, *range(250)]:
        prefix = f"10.213.{x}"
        if f" {prefix}." not in taken:
            return prefix
    raise AssertionError("no free 10.213.x.0/24 on this host")


@contextlib.contextmanager
def replica_network(count: int) -> Iterator[Network]:
    """A bridge with ``prefix.1/24`` on the host and ``count`` namespaces, each with ``prefix.(11+n)/24`` on a veth
    pair to the bridge and its loopback up; all of it removed afterwards, whatever happened (processes still in a
    namespace must be stopped first: the caller's job)."""
    _remove_leftovers()
    pid = os.getpid()
    net = Network(_free_prefix(), f"teb{pid}", tuple(f"{NS_PREFIX}{pid}-{n}" for n in range(count)))
    made: list[str] = []
    try:
        ip("link", "add", net.bridge, "type", "bridge")
        made.append(net.bridge)
        ip("addr", "add", f"{net.host_address}/24", "dev", net.bridge)
        ip("link", "set", net.bridge, "up")
        for n, ns in enumerate(net.namespaces):
            ip("netns", "add", ns)
            made.append(ns)
            host_end, ns_end = f"te{pid}h{n}", f"te{pid}n{n}"
            ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end, "netns", ns)
            ip("link", "set", host_end, "master", net.bridge, "up")
            ip("-n", ns, "addr", "add", f"{net.address(n)}/24", "dev", ns_end)
            ip("-n", ns, "link", "set", ns_end, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield net
    finally:
        for name in reversed(made):  # a namespace takes its veth pair with it
            args = ["netns", "del", name] if name.startswith(NS_PREFIX) else ["link", "del", name]
            subprocess.run(["ip", *args], capture_output=True, check=False)  # noqa: S603, S607


class Replica:
    """``python -m triton_embed_server serve`` in namespace ``ns``, bound to ``address`` (HTTP 8000, gRPC 8001,
    metrics 8002). serve drains on SIGTERM and restarts a tritonserver that died, as the pod's container would be."""

    def __init__(self, name: str, ns: str, address: str, log: Path, repository: Path | None = None) -> None:
        """``repository``: the model repository it serves (None: serve's default, ``make model``'s)."""
        self.name, self.ns, self.address, self.log, self.repository = name, ns, address, log, repository
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.address}:{HTTP_PORT}"

    @property
    def grpc_url(self) -> str:
        return f"{self.address}:{GRPC_PORT}"

    @property
    def metrics_target(self) -> str:
        return f"{self.address}:{METRICS_PORT}"

    def start(self) -> Replica:
        """Start serve in the namespace (it dies with this process: the parent-death signal)."""
        repository = ["--model-repository", str(self.repository)] if self.repository else []
        serve = serve_command(HTTP_PORT, GRPC_PORT, METRICS_PORT, "--host", self.address, *repository)
        command = ["ip", "netns", "exec", self.ns, *serve]
        argv, preexec = _spawn_args(command)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(  # noqa: S603 - our own module
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=preexec,  # noqa: PLW1509 - None when setpriv is there (embedded._spawn_args)
            )
        return self

    def is_ready(self) -> bool:
        """``/v2/models/embed/ready`` answers 200 at the replica's address (as the pod's readiness probe asks)."""
        url = f"http://{self.http_url}/v2/models/embed/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - the test's own replica
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 240.0) -> Replica:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            assert self.process is not None and self.process.poll() is None, f"{self.name} exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}"
            time.sleep(0.25)
        return self

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""

    def server_pid(self) -> int:
        """The tritonserver serve runs now (the last it reported starting or restarting)."""
        pids = re.findall(r"(?:starting tritonserver|tritonserver restarted) \(pid (\d+)\)", self.tail(10**7))
        assert pids, f"{self.name}: serve reported no tritonserver:\n{self.tail()}"
        return int(pids[-1])

    def restarts(self) -> int:
        return self.tail(10**7).count("tritonserver restarted (pid")

    def kill_server(self) -> int:
        """SIGKILL tritonserver and its stubs (its process group), as an OOM kill would; serve restarts it on the
        same address and ports. Returns the killed pid."""
        pid = self.server_pid()
        os.killpg(pid, signal.SIGKILL)
        return pid

    def terminate(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM serve, as the kubelet does after preStop: it drains, stops tritonserver, exits. Its exit status."""
        if self.process is None:
            return None
        process, self.process = self.process, None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._kill_left_servers()
        return process.returncode

    def _kill_left_servers(self) -> None:
        for pid in {int(p) for p in re.findall(r"tritonserver[^\n]*\(pid (\d+)\)", self.tail(10**7))}:
            with contextlib.suppress(OSError):
                if process_alive(pid) and Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver":
                    os.killpg(pid, signal.SIGKILL)


# -- nginx as the ingress ---------------------------------------------------------------------------------------
NGINX_CONF = """\
daemon off;
master_process on;
user {user};
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    # the ready replicas, as an ingress controller fills its upstream from the Service's endpoints
    upstream triton_grpc {{
{grpc_servers}
    }}
    upstream triton_http {{
{http_servers}
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{grpc_port} http2;
        location / {{
            grpc_pass grpc://triton_grpc;
            # gRPC calls are POSTs: a call that fails to connect or is cut before its answer goes to the next
            # replica only with non_idempotent. A gRPC status (UNAVAILABLE, NOT_FOUND while a replica drains)
            # comes in an HTTP 200 and is passed on: nginx cannot retry on it.
            grpc_next_upstream error timeout non_idempotent;
            grpc_next_upstream_tries 3;
            grpc_connect_timeout 2s;
        }}
    }}
    server {{
        listen 127.0.0.1:{http_port};
        location / {{
            proxy_pass http://triton_http;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries 3;
            proxy_connect_timeout 2s;
        }}
    }}
}}
"""


class Nginx:
    """nginx in front of the replicas: gRPC on ``grpc_url``, HTTP on ``http_url`` (loopback)."""

    def __init__(self, tmp: Path, replicas: list[Replica]) -> None:
        self.tmp, self.replicas = tmp, replicas
        self.grpc_port, self.http_port = free_port(), free_port()
        self.conf = tmp / "nginx.conf"
        self.process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def write_conf(self, out: set[str] = frozenset()) -> None:
        """The config with every replica, those named in ``out`` marked ``down`` (taken out of the upstream)."""

        def servers(port: int) -> str:
            return "\n".join(
                f"        server {r.address}:{port}{' down' if r.name in out else ''} max_fails=1 fail_timeout=2s;"
                for r in self.replicas
            )

        self.conf.write_text(
            NGINX_CONF.format(
                tmp=self.tmp,
                user=getpass.getuser(),
                grpc_servers=servers(GRPC_PORT),
                http_servers=servers(HTTP_PORT),
                grpc_port=self.grpc_port,
                http_port=self.http_port,
            )
        )

    def check(self) -> subprocess.CompletedProcess:
        return subprocess.run([tool("nginx"), "-t", "-c", str(self.conf)], capture_output=True, text=True, check=False)

    def reload(self, out: set[str] = frozenset()) -> None:
        """Take the replicas in ``out`` out of the upstream (all others in), as an ingress controller does when the
        endpoints change: a new config, SIGHUP; new workers take new connections, old ones finish theirs."""
        assert self.process is not None and self.process.poll() is None, "nginx is not running"
        self.write_conf(out)
        done = self.check()
        assert done.returncode == 0, done.stderr
        self.process.send_signal(signal.SIGHUP)


@contextlib.contextmanager
def nginx_running(tmp: Path, replicas: list[Replica]) -> Iterator[Nginx]:
    nginx = Nginx(tmp, replicas)
    nginx.write_conf()
    done = nginx.check()
    assert done.returncode == 0, done.stderr
    log = tmp / "nginx.out"
    argv, preexec = _spawn_args([tool("nginx"), "-c", str(nginx.conf)])
    with open(log, "ab") as out:
        nginx.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec)  # noqa: S603, PLW1509
    # ready once it forwards a readiness probe to a replica
    with running_until_ready(nginx.process, log, f"http://{nginx.http_url}/v2/health/ready", "nginx"):
        yield nginx


# -- Prometheus and the adapter's query -------------------------------------------------------------------------
def scrape_config(replicas: list[Replica]) -> dict:
    """A prometheus.yml scraping each replica's metrics every second, labelled ``namespace`` and ``pod`` as the
    PodMonitor labels them."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "triton",
                "static_configs": [
                    {"targets": [r.metrics_target], "labels": {"namespace": K8S_NAMESPACE, "pod": r.name}}
                    for r in replicas
                ],
            }
        ],
    }


def prom_query(base: str, query: str, at: float | None = None) -> dict[str, float]:
    """An instant query's result as ``{pod label: value}``, evaluated now or at the Unix time ``at``."""
    params = {"query": query, **({"time": f"{at:.3f}"} if at is not None else {})}
    return {r["metric"].get("pod", ""): float(r["value"][1]) for r in prom_api(base, "query", **params)["result"]}


def adapter_query(rule: dict, pods: list[str]) -> str:
    """The rule's ``metricsQuery`` as prometheus-adapter fills it in for ``.../namespaces/<ns>/pods/*/<metric>``:
    grouped by pod, matching the namespace and the pods."""
    return (
        rule["metricsQuery"]
        .replace("<<.GroupBy>>", "pod")
        .replace("<<.LabelMatchers>>", f'namespace="{K8S_NAMESPACE}",pod=~"{"|".join(pods)}"')
    )
