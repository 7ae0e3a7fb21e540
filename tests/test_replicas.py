"""Three replicas on three addresses, as three pods behind a headless Service: our client given the three addresses,
and nginx in front of them as an L7 ingress would be.

Each replica is ``python -m triton_embed_server serve`` in a network namespace of its own (a /24 this file makes
and removes, tests/replicas.py), on ports 8000/8001/8002 of its own address. Under steady loops of calls:

* calls reach all three, through the client and through nginx (each replica's ``embed`` statistics grow);
* a replica's tritonserver SIGKILLed mid-run and started again on its address costs the client no call, and the
  client sends to it again once it is ready;
* a rolling restart (out of the ingress's upstream, SIGTERM: drain and stop, start, ready, back in; next) loses no
  call, through the client and through nginx;
* Debian's Prometheus scrapes the three, and prometheus-adapter's query for the autoscaler
  (deploy/kubernetes/prometheus-adapter/config.yaml) reads each replica's encoder queue time per request: it rises
  under load and reads 0 when the replicas are idle.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from deploy_helpers import prometheus_running
from helpers import counts, read_counts
from replicas import (
    Nginx,
    Replica,
    adapter_query,
    netns_unavailable,
    nginx_running,
    prom_query,
    replica_network,
    scrape_config,
)
from small_models import repository_for, small_sentence_transformer
from triton_embed import EmbeddingClient

ROOT = Path(__file__).resolve().parents[1]
ADAPTER_CONFIG = ROOT / "deploy" / "kubernetes" / "prometheus-adapter" / "config.yaml"
HPA_METRIC = "triton_embed_encoder_queue_us_per_request"
NEVER_REFUSED = {"latency_budget_ms": 0}
"""Budget 0 for the client's loops: while one replica loads its model (seconds of both cores) the others' encoder
queues grow, and refusals would be the overload policy's (tested on its own), not failover."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three replicas, each in its own namespace and address, started together. They serve a tiny model (a 2-layer,
    width-32 BERT): what is tested here is failover, rollout and the autoscaler's signal, not the model, and each
    start and restart shares the 2 cores with the others' load."""
    if reason := netns_unavailable():
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("replicas")
    repository = repository_for(small_sentence_transformer(logs / "st", 32), logs / "repo")
    with replica_network(3) as net:
        replicas = [
            Replica(f"triton-embed-{n}", ns, net.address(n), logs / f"replica-{n}.log", repository)
            for n, ns in enumerate(net.namespaces)
        ]
        try:
            for r in replicas:
                r.start()
            for r in replicas:
                r.wait_ready()
            yield replicas
        finally:
            for r in replicas:  # SIGTERM to all at once: they drain and stop side by side
                if r.process is not None:
                    r.process.terminate()
            for r in replicas:
                r.terminate(timeout_s=60)


@pytest.fixture(scope="module")
def ingress(cluster, tmp_path_factory):
    """nginx on loopback ports in front of the three (None, with the reason printed, when nginx is not installed)."""
    if shutil.which("nginx") is None:
        print("nginx not found (`make system-deps` installs Debian's): the ingress checks are skipped")
        yield None
        return
    with nginx_running(tmp_path_factory.mktemp("nginx"), cluster) as nginx:
        yield nginx


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    with prometheus_running(tmp_path_factory.mktemp("prometheus"), scrape_config(cluster)) as base:
        yield base


def unique(label: str) -> str:
    """A text no replica has cached."""
    return f"{label} {secrets.token_hex(6)}"


def inferences(replicas: list[Replica]) -> list[int]:
    """Texts each replica's ``embed`` ensemble has run, once its statistics have settled."""
    return [counts(r.grpc_url, "embed")[0] for r in replicas]


# -- steady loops of calls --------------------------------------------------------------------------------------
@dataclass
class Loop:
    """``threads`` threads calling ``client.embed`` on one new text after another, ``pause_s`` apart, until
    :meth:`stop` or ``max_s`` seconds (every loop ends by itself)."""

    name: str
    client: EmbeddingClient
    threads: int = 1
    pause_s: float = 0.05
    max_s: float = 240.0
    calls: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Loop:
        deadline = time.monotonic() + self.max_s
        for n in range(self.threads):
            t = threading.Thread(target=self._run, args=(n, deadline), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _run(self, n: int, deadline: float) -> None:
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                self.client.embed([unique(f"{self.name} {n}")])
                with self._lock:
                    self.calls += 1
            except Exception as exc:  # noqa: BLE001 - counted; the tests assert on them
                with self._lock:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {exc!r}"[:300])
            self._stop.wait(self.pause_s)

    def stop(self) -> Loop:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self._threads), f"{self.name}: a call did not end within 60 s"
        self.client.close()
        return self


@contextlib.contextmanager
def loops(*made: Loop):
    """Start the loops; stop them whatever happens (a failed assertion ends the test instead of hanging it)."""
    for loop in made:
        loop.start()
    try:
        yield made
    finally:
        for loop in made:
            with contextlib.suppress(Exception):
                loop.stop()


def client_loop(cluster: list[Replica], protocol: str = "grpc", threads: int = 2) -> Loop:
    """Our client given the three addresses, default retries and backoff."""
    urls = [r.grpc_url if protocol == "grpc" else r.http_url for r in cluster]
    return Loop(f"client {protocol}", EmbeddingClient(url=urls, protocol=protocol, **NEVER_REFUSED), threads)


def nginx_loop(nginx: Nginx, protocol: str = "grpc", threads: int = 1) -> Loop:
    """Calls through nginx with no client retries: a failure nginx lets through is counted, not hidden."""
    url = nginx.grpc_url if protocol == "grpc" else nginx.http_url
    client = EmbeddingClient(url=url, protocol=protocol, retries=0, **NEVER_REFUSED)
    return Loop(f"nginx {protocol}", client, threads)


def wait_until(check: Callable[[], object], timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.25)
    return result


def grows(replica: Replica, since: int, within_s: float) -> int:
    """Texts ``replica`` has run beyond ``since``, polled until there are some or ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    while (now := read_counts(replica.grpc_url, "embed")[0] - since) == 0 and time.monotonic() < deadline:
        time.sleep(0.25)
    return now


# -- the autoscaler's signal (first: the replicas have served nothing yet) -------------------------------------
def test_the_autoscaling_metric_reads_zero_when_idle_and_rises_under_load(cluster, prometheus):
    """prometheus-adapter's query, filled in as the adapter does for every pod, on a real Prometheus scraping the
    three: each replica reads 0 while idle (the rule's clamp_min: 0/0 would be NaN and stall scaling down), and its
    encoder queue time per request rises above 1 ms while the three are loaded. Run before the other tests of this
    file, so that the rule's one-minute rate window holds no earlier calls: the idle reading needs no wait for the
    window to empty."""
    (rule,) = [r for r in yaml.safe_load(ADAPTER_CONFIG.read_text())["rules"] if r["name"]["as"] == HPA_METRIC]
    pods = [r.name for r in cluster]
    query = adapter_query(rule, pods)
    wait_until(lambda: len(prom_query(prometheus, "up == 1")) == 3, 30, "Prometheus scraping the three")
    idle = wait_until(lambda: (v := prom_query(prometheus, query)) and len(v) == len(pods) and v, 30, "an idle read")
    print(f"idle: {idle}")
    assert sorted(idle) == sorted(pods), idle
    assert all(v == 0.0 for v in idle.values()), f"idle replicas read their queue time as 0: {idle}"
    load = client_loop(cluster, threads=12)
    load.pause_s = 0.0
    with loops(load):
        time.sleep(12.0)
        busy = prom_query(prometheus, query)
    assert not load.failures, load.failures[:3]
    print(f"encoder queue us/request under load ({load.calls} calls in 12 s): {busy}")
    assert sorted(busy) == sorted(pods), busy
    assert all(v > 1000 for v in busy.values()), f"12 calls in flight on 2 cores queue for milliseconds: {busy}"


# -- spreading --------------------------------------------------------------------------------------------------
def spread(cluster: list[Replica], loop: Loop, calls: int = 30) -> tuple[list[int], int]:
    """Texts each replica ran while ``loop`` made at least ``calls`` calls (60 s at most), and the calls it made."""
    before = inferences(cluster)
    with loops(loop):
        wait_until(lambda: loop.calls >= calls or loop.failures, 60, f"{calls} calls")
    got = [n - b for n, b in zip(inferences(cluster), before, strict=True)]
    assert not loop.failures, loop.failures[:3]
    return got, loop.calls


def test_the_client_spreads_calls_over_all_three_replicas(cluster):
    got, calls = spread(cluster, client_loop(cluster, threads=3))
    assert sum(got) == calls >= 30, (got, calls)
    # fewest in flight first: a replica slowed by the 2 shared cores gets fewer (3 of 34 seen), but never none
    assert min(got) > 0, f"every replica should get calls: {got}"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_nginx_spreads_calls_over_all_three_replicas(cluster, ingress, protocol):
    if ingress is None:
        pytest.skip("nginx not installed: `make system-deps` installs Debian's")
    got, calls = spread(cluster, nginx_loop(ingress, protocol, threads=3))
    assert sum(got) == calls >= 30, (got, calls)
    assert min(got) > 0, f"nginx's round robin should reach every replica: {got}"


# -- failover ---------------------------------------------------------------------------------------------------
def test_a_killed_replica_costs_no_call_and_gets_traffic_again_once_ready(cluster, ingress):
    """tritonserver of one replica SIGKILLed mid-run (and its stubs); serve starts it again on the same address and
    ports. The client (default retries) fails no call. nginx sends a call that cannot reach the killed replica to the
    next one (grpc_next_upstream); a call in flight there at the kill can still come back as 502 (0, 0 and 1 of ~50
    in three runs; 7 of 50 with grpc_next_upstream off). Once the replica is ready, the client sends to it again."""
    victim = cluster[2]
    restarts = victim.restarts()
    client = client_loop(cluster)
    through_nginx = [nginx_loop(ingress)] if ingress is not None else []
    with loops(client, *through_nginx):
        time.sleep(2.0)
        calls_before_kill = client.calls
        assert calls_before_kill > 0, "the loop should be calling"
        victim.kill_server()
        killed_at = time.monotonic()
        wait_until(
            lambda: [s.up for s in client.client.endpoints] == [True, True, False], 10, "the client sees it down"
        )
        wait_until(lambda: victim.restarts() > restarts and victim.is_ready(), 240, f"{victim.name} restarted")
        ready_after = time.monotonic() - killed_at
        for loop in through_nginx:
            loop.stop()
        since = read_counts(victim.grpc_url, "embed")[0]
        back = grows(victim, since, within_s=30)  # a probe after the cool-down (10 s at most) finds it ready
    print(
        f"kill: ready again {ready_after:.0f} s after; client {client.calls} calls; "
        f"nginx (calls, failures) {[(n.calls, len(n.failures)) for n in through_nginx]}"
    )
    assert not client.failures, client.failures[:3]
    assert client.calls > calls_before_kill + 10
    assert back > 0, f"no call of the client reached {victim.name} within 30 s of it being ready"
    for loop in through_nginx:
        lost = f"{len(loop.failures)} of {loop.calls} through nginx: {loop.failures[:3]}"
        assert len(loop.failures) <= 2 and all("502" in f for f in loop.failures), lost


def test_a_rolling_restart_loses_no_call(cluster, ingress):
    """Each replica in turn, as a Deployment's rollout: out of nginx's upstream (an ingress controller following the
    endpoints; the pod's preStop gives it the time), SIGTERM (serve drains: new calls are refused as draining, those
    in flight finish; then tritonserver stops), started again, ready, back in. No call fails: the client moves off a
    draining replica and retries elsewhere; nginx no longer sends to it. A reload closes the old workers' idle client
    connections: an HTTP call sent on one as it closes is sent again on a new connection, with no retries too."""
    running = [client_loop(cluster, "grpc")]
    if ingress is not None:
        running += [nginx_loop(ingress, "grpc"), nginx_loop(ingress, "http")]
    stops = []
    try:
        with loops(*running):
            time.sleep(1.0)
            for replica in cluster:
                if ingress is not None:
                    ingress.reload(out={replica.name})
                time.sleep(1.0)  # preStop
                started = time.monotonic()
                assert replica.terminate() == 0, replica.tail()  # drained and stopped cleanly
                stops.append(round(time.monotonic() - started, 1))
                replica.start().wait_ready()
                if ingress is not None:
                    ingress.reload()
            time.sleep(2.0)
    finally:
        for replica in cluster:  # the next test needs all three
            if replica.process is None:
                replica.start().wait_ready()
    summary = {loop.name: (loop.calls, len(loop.failures)) for loop in running}
    print(f"rolling restart: (calls, failures) {summary}; seconds from SIGTERM to exit {stops}")
    for loop in running:
        assert loop.calls > 50, summary
        assert not loop.failures, f"{loop.name}: {len(loop.failures)} of {loop.calls} failed: {loop.failures[:3]}"
