"""The balancing and failover policy (triton_embed.endpoints) and the several-url settings, without a server."""

from __future__ import annotations

import re
import socket
from collections import Counter

import pytest
from triton_embed import AsyncEmbeddingClient, EmbeddingClient
from triton_embed.core import Health, combined_health, endpoint_failed
from triton_embed.endpoints import (
    COOLDOWN_S,
    MAX_COOLDOWN_S,
    RESOLVE_EVERY_S,
    RESOLVE_WHEN_DOWN_S,
    Choice,
    EndpointPool,
    cooldown,
    join_host_port,
    resolve,
    resolve_all,
    split_host_port,
)
from triton_embed.errors import EmbeddingTimeoutError, InvalidInputError, ServerUnavailableError
from triton_embed.server_stats import merge, parse

A, B, C = "10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_of(*urls: str, **kwargs) -> tuple[EndpointPool, Clock]:
    clock = Clock()
    return EndpointPool(urls, clock=clock, **kwargs), clock


def send(pool: EndpointPool, avoid=(), ok: bool | None = True) -> str:
    """One attempt as the core makes it: pick (no probe expected), in flight, finished with ``ok``."""
    choice = pool.pick(avoid)
    assert not choice.probe, choice
    pool.started(choice.url)
    pool.finished(choice.url, ok)
    return choice.url


# -- balancing -----------------------------------------------------------------------------------------------------
def test_calls_one_after_another_go_round_robin():
    pool, _ = pool_of(A, B, C)
    assert [send(pool) for _ in range(7)] == [A, B, C, A, B, C, A]


def test_the_endpoint_with_fewest_requests_in_flight_is_chosen():
    pool, _ = pool_of(A, B, C)
    for url in (A, A, B):
        pool.started(url)
    assert pool.pick() == Choice(C)
    pool.started(C)
    assert pool.pick() == Choice(B)  # A 2, B 1, C 1: B is next in turn after C
    pool.finished(A, True)
    pool.finished(A, True)
    assert pool.pick() == Choice(A)
    assert [s.outstanding for s in pool.states()] == [0, 1, 1]


def test_one_endpoint_takes_every_request_and_is_never_probed():
    pool, clock = pool_of(A)
    assert send(pool, ok=False) == A
    clock.now += 60
    assert pool.pick() == Choice(A)  # down, but there is nowhere else: no probe, the request goes there
    pool.finished(A, True)
    assert pool.states()[0].up


# -- failover ------------------------------------------------------------------------------------------------------
def test_a_failed_endpoint_gets_no_requests_while_another_is_up():
    pool, clock = pool_of(A, B, C)
    assert send(pool, ok=False) == A
    clock.now += COOLDOWN_S / 2
    assert [send(pool) for _ in range(6)] == [B, C] * 3
    assert [s.up for s in pool.states()] == [False, True, True]


def test_no_verdict_leaves_the_endpoint_up():
    pool, _ = pool_of(A, B)
    assert send(pool, ok=None) == A
    assert [send(pool) for _ in range(2)] == [B, A]


def test_a_retry_goes_to_an_endpoint_the_call_has_not_tried():
    pool, _ = pool_of(A, B, C)
    pool.started(B)
    pool.started(C)  # A is the least busy ...
    assert pool.pick(avoid=[A]).url == B  # ... but tried: the next untried one in turn
    assert pool.pick(avoid=[A, B]).url == C
    assert pool.pick(avoid=[A, B, C]).url == A  # all tried: the least busy again


def test_while_every_endpoint_is_down_requests_take_turns_among_them():
    pool, clock = pool_of(A, B)
    send(pool, ok=False)
    clock.now += 0.1
    send(pool, ok=False)  # A then B went down; no endpoint is up
    seen = []
    for _ in range(4):
        clock.now += 0.1
        seen.append(send(pool, ok=False))
    assert seen == [A, B, A, B]
    assert pool.pick(avoid=[A]).url == B
    clock.now += 0.1
    assert send(pool, avoid=[A], ok=True) == B  # a success brings it back
    assert [s.up for s in pool.states()] == [False, True]


# -- coming back ---------------------------------------------------------------------------------------------------
def test_a_down_endpoint_is_probed_once_after_its_cooldown_and_comes_back_when_ready():
    pool, clock = pool_of(A, B)
    assert send(pool, ok=False) == A
    clock.now += COOLDOWN_S - 0.01
    assert pool.pick() == Choice(B)  # cooling down: not probed yet
    clock.now += 0.02
    assert pool.pick() == Choice(A, probe=True)
    assert pool.pick() == Choice(B)  # one probe at a time: others go on to B meanwhile
    pool.probed(A, True)
    assert pool.states()[0].up
    assert {send(pool) for _ in range(2)} == {A, B}


def test_each_failed_probe_doubles_the_cooldown_up_to_the_cap():
    pool, clock = pool_of(A, B)
    send(pool, ok=False)
    waits = []
    for _ in range(6):
        waited = 0.0
        while not (choice := pool.pick()).probe:
            clock.now += 0.25
            waited += 0.25
        assert choice == Choice(A, probe=True)
        pool.probed(A, False)
        waits.append(waited)
    assert waits == [COOLDOWN_S, 2.0, 4.0, 8.0, MAX_COOLDOWN_S, MAX_COOLDOWN_S]
    assert [cooldown(k) for k in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_success_resets_the_cooldown():
    pool, clock = pool_of(A, B)
    send(pool, ok=False)
    for _ in range(3):
        clock.now += MAX_COOLDOWN_S
        assert pool.pick().probe
        pool.probed(A, False)
    clock.now += MAX_COOLDOWN_S
    assert pool.pick() == Choice(A, probe=True)
    pool.probed(A, True)
    send(pool, ok=True)
    pool.finished(A, False)  # down again: the cool-down starts from the first step
    clock.now += COOLDOWN_S
    assert pool.pick() == Choice(A, probe=True)


def test_health_marks_endpoints():
    pool, _ = pool_of(A, B)
    pool.mark(A, False)
    assert [s.up for s in pool.states()] == [False, True]
    pool.mark(A, True)
    assert [s.up for s in pool.states()] == [True, True]


# -- names ---------------------------------------------------------------------------------------------------------
def test_a_name_is_resolved_before_the_first_request_then_every_30_s():
    pool, clock = pool_of("triton:8001", "10.0.0.9:8001")
    assert pool.names_due() == ["triton:8001"]
    assert pool.names_due() == []  # another caller resolves it now
    pool.resolved({"triton:8001": [A, B]})
    assert pool.urls == [A, B, "10.0.0.9:8001"]
    assert pool.version == 1
    clock.now += RESOLVE_EVERY_S - 1
    assert pool.names_due() == []
    clock.now += 1
    assert pool.names_due() == ["triton:8001"]
    pool.resolved({"triton:8001": [B, C]})  # a pod left, another came
    assert pool.urls == [B, C, "10.0.0.9:8001"]
    assert pool.version == 2


def test_endpoints_keep_their_state_across_a_resolution_and_a_failed_one_keeps_the_list():
    pool, clock = pool_of("triton:8001")
    pool.names_due()
    pool.resolved({"triton:8001": [A, B]})
    send(pool, ok=False)  # A down
    clock.now += RESOLVE_EVERY_S
    pool.names_due()
    pool.resolved({"triton:8001": None})  # DNS failed: same endpoints, same states
    assert [(s.url, s.up) for s in pool.states()] == [(A, False), (B, True)]
    assert pool.version == 1
    clock.now += RESOLVE_EVERY_S
    pool.names_due()
    pool.resolved({"triton:8001": [A, B, C]})
    assert [(s.url, s.up) for s in pool.states()] == [(A, False), (B, True), (C, True)]


def test_names_are_resolved_again_soon_when_every_endpoint_is_down():
    pool, clock = pool_of("triton:8001")
    pool.names_due()
    pool.resolved({"triton:8001": [A, B]})
    pool.finished(A, False)
    clock.now += RESOLVE_WHEN_DOWN_S
    assert pool.names_due() == []  # B is still up
    pool.finished(B, False)
    assert pool.names_due() == ["triton:8001"]  # every endpoint is down
    pool.resolved({"triton:8001": [A, B]})
    clock.now += RESOLVE_WHEN_DOWN_S - 0.01
    assert pool.names_due() == []  # not again within RESOLVE_WHEN_DOWN_S
    clock.now += 0.01
    assert pool.names_due() == ["triton:8001"]


def test_addresses_and_shared_memory_clients_are_never_resolved():
    assert pool_of(A, "[::1]:8001")[0].names_due() == []
    assert pool_of("triton:8001", expand_names=False)[0].names_due() == []


@pytest.mark.parametrize(
    ("url", "host_port"),
    [("127.0.0.1:8001", ("127.0.0.1", 8001)), ("[::1]:8001", ("::1", 8001)), ("triton:80", ("triton", 80))],
)
def test_host_port_round_trip(url, host_port):
    assert split_host_port(url) == host_port
    assert join_host_port(*host_port) == url


def loopback_addresses(name: str) -> list[str]:
    found = socket.getaddrinfo(name, 8001, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in found))


def test_resolve_with_getaddrinfo_on_loopback_names():
    assert resolve("127.0.0.1:8001") == ["127.0.0.1:8001"]
    assert resolve("[::1]:8001") == ["[::1]:8001"]
    addresses = loopback_addresses("localhost")
    expected = ["localhost:8001"] if len(addresses) == 1 else [join_host_port(a, 8001) for a in addresses]
    assert resolve("localhost:8001") == expected
    assert set(resolve_all(["localhost:8001", "no-such-host.invalid:8001"])) == {
        "localhost:8001",
        "no-such-host.invalid:8001",
    }
    assert resolve_all(["no-such-host.invalid:8001"]) == {"no-such-host.invalid:8001": None}


def answer(*addresses: str):
    """A getaddrinfo answer: each address once per family, as a resolver gives it (and one twice)."""

    def getaddrinfo(host, port, *args, **kwargs):
        assert host == "embed-headless"
        rows = [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses
        ]
        return rows + rows[:1]

    return getaddrinfo


@pytest.mark.parametrize(
    ("addresses", "expected"),
    [
        # a headless Service with two pods, single stack: one endpoint per pod
        (["10.1.0.4", "10.1.0.5"], ["10.1.0.4:8001", "10.1.0.5:8001"]),
        # dual stack: each pod as IPv6 and IPv4; the family the answer starts with counts, each pod once
        (["fd00::4", "fd00::5", "10.1.0.4", "10.1.0.5"], ["[fd00::4]:8001", "[fd00::5]:8001"]),
        # one server by two families (localhost as ::1 and 127.0.0.1): one endpoint, by its name
        (["::1", "127.0.0.1"], ["embed-headless:8001"]),
        (["10.1.0.4"], ["embed-headless:8001"]),
    ],
)
def test_a_name_with_several_addresses_becomes_one_endpoint_per_address(monkeypatch, addresses, expected):
    monkeypatch.setattr(socket, "getaddrinfo", answer(*addresses))
    assert resolve("embed-headless:8001") == expected


# -- what marks an endpoint down -------------------------------------------------------------------------------------
def test_only_unreachable_not_ready_or_draining_marks_an_endpoint_down():
    assert endpoint_failed(ServerUnavailableError("model 'embed' at a:1: failed to connect to all addresses"))
    assert endpoint_failed(ServerUnavailableError("model 'embed' at a:1: 'embed' has no available versions"))
    overloaded = "model 'embed' at a:1: overloaded[budget]: the request waited 300 ms in the encoder's queue"
    assert not endpoint_failed(ServerUnavailableError(overloaded))
    assert ServerUnavailableError(overloaded).reason == "budget"
    assert ServerUnavailableError("model 'embed' at a:1: failed to connect to all addresses").reason is None
    assert not endpoint_failed(ServerUnavailableError("model 'embed' at a:1: Exceeds maximum queue size"))
    assert not endpoint_failed(InvalidInputError("bad"))
    assert not endpoint_failed(EmbeddingTimeoutError("slow"))


def test_health_of_several_endpoints():
    up, down = Health(True, True, True), Health(False, False, False, error="failed to connect")
    assert combined_health([(A, up)]) is up
    assert combined_health([(A, down)]) is down
    both = combined_health([(A, up), (B, down), (C, Health(True, True, False))])
    assert (both.live, both.ready, both.model_ready) == (True, True, True)
    assert both.error == f"{B}: failed to connect; {C}: model not ready"
    assert not combined_health([(A, down), (B, down)]).model_ready


def test_statistics_of_several_servers_add_up():
    def entry(success, ns, inferences):
        return {
            "name": "embed",
            "inference_count": str(inferences),
            "execution_count": str(inferences),
            "inference_stats": {"success": {"count": str(success), "ns": str(ns)}, "queue": {"count": str(success)}},
        }

    total = parse(merge([entry(2, 4_000_000, 3), entry(6, 12_000_000, 7)]))
    assert (total.requests, total.inferences, total.executions, total.request_ms) == (8, 10, 10, 2.0)
    assert merge([entry(1, 1, 1)]) == entry(1, 1, 1)
    with pytest.raises(ValueError, match="no statistics"):
        merge([])


# -- settings --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [EmbeddingClient, AsyncEmbeddingClient])
@pytest.mark.parametrize(
    "url", ["127.0.0.1:1, :2,grpc://10.0.0.3:3", ["127.0.0.1:1", ":2", "grpc://10.0.0.3:3"], ("127.0.0.1:1", ":2")]
)
def test_several_urls_as_a_list_or_separated_by_commas(cls, url):
    client = cls(url=url)
    expected = ("127.0.0.1:1", "127.0.0.1:2", "10.0.0.3:3")[: len(url) if isinstance(url, tuple) else 3]
    assert client.urls == expected
    assert client.url == ",".join(expected)
    assert client.protocol == "grpc"
    assert [s.url for s in client.endpoints] == list(expected)


def test_a_single_url_is_as_before():
    client = EmbeddingClient(url="127.0.0.1:8001")
    assert (client.url, client.urls) == ("127.0.0.1:8001", ("127.0.0.1:8001",))


def test_the_environment_may_list_several_urls(monkeypatch):
    monkeypatch.setenv("TRITON_EMBED_URL", "http://10.0.0.1:8000,10.0.0.2:8000")
    client = EmbeddingClient()
    assert (client.urls, client.protocol) == (("10.0.0.1:8000", "10.0.0.2:8000"), "http")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": "a:1,,b:2"}, "url must be host:port, or several separated by commas or in a list"),
        ({"url": ["a:1", 2]}, "url must be host:port, or several separated by commas or in a list"),
        ({"url": "a:1,b"}, "url must be host:port (e.g. 127.0.0.1:8001); got 'b'"),
        ({"url": "http://a:1,grpc://b:2"}, "the urls' schemes differ"),
        ({"url": "a:1,http://b:2", "protocol": "grpc"}, "protocol 'grpc' contradicts the url's scheme"),
        ({"url": "a:1, a:1"}, "url lists a:1 more than once"),
        ({"url": "a:1,b:2", "use_shared_memory": True}, "use_shared_memory needs one url"),
        ({"url": ["a:1", "b:2"], "use_shared_memory": True}, "use_shared_memory needs one url"),
    ],
)
def test_bad_url_lists_are_refused_when_the_client_is_made(kwargs, message):
    for cls in (EmbeddingClient, AsyncEmbeddingClient):
        with pytest.raises(ValueError, match=re.escape(message)):
            cls(**kwargs)


def test_shared_memory_with_one_url_is_accepted_and_its_name_is_not_expanded():
    client = EmbeddingClient(url="localhost:8001", use_shared_memory=True)
    assert client._pool.names_due() == []


def test_round_robin_over_many_calls_is_even():
    pool, _ = pool_of(A, B, C)
    assert Counter(send(pool) for _ in range(300)) == {A: 100, B: 100, C: 100}
