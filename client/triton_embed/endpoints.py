"""Which server the next request goes to: the clients' balancing and failover policy, without I/O.

A client given several endpoints (``host:port`` each) keeps an :class:`EndpointPool`:

- **Balancing**: each attempt goes to the up endpoint with the fewest requests in flight from this client; ties go
  round robin, so calls made one after another visit every endpoint in turn.
- **Failover**: an endpoint whose request fails as unreachable, not ready or draining is *down*: no request goes to
  it while another endpoint is up, and a retry goes to an endpoint the call has not tried yet when one is up.
- **Coming back**: once a down endpoint's cool-down has passed (:data:`COOLDOWN_S`, doubling after each failed
  probe up to :data:`MAX_COOLDOWN_S`), the next request first probes it (the client asks its model's readiness) and
  it is up again if the model is ready. While no endpoint is up, requests still go to the down ones (the one whose
  cool-down ends first), and a success brings that one back; one endpoint alone therefore behaves as a client
  without a pool.
- **Names**: a ``host:port`` whose host is a DNS name that resolves to several addresses of one family (a Kubernetes
  headless Service) stands for one endpoint per address; a name that resolves to one address per family stays one
  endpoint by that name (see :func:`resolve`).
  Names are resolved before the first request, every :data:`RESOLVE_EVERY_S`, and again when every endpoint is down
  (at most every :data:`RESOLVE_WHEN_DOWN_S`).

The pool only decides; the clients do the I/O: :func:`resolve_all` is handed to them as a blocking step, and the
probe is one of their calls. Thread-safe: the sync client's threads share one pool.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

COOLDOWN_S = 1.0
"""How long a failed endpoint gets no requests before its first probe, seconds."""
MAX_COOLDOWN_S = 10.0
"""The cool-down doubles after each failed probe, up to this, seconds."""
RESOLVE_EVERY_S = 30.0
"""How often DNS names are resolved again, seconds."""
RESOLVE_WHEN_DOWN_S = 1.0
"""While every endpoint is down, names are resolved again at most this often, seconds."""


def split_host_port(url: str) -> tuple[str, int]:
    """``("host", port)`` of a normalised ``host:port`` (an IPv6 host loses its brackets).

    Raises:
        ValueError: no numeric port.
    """
    host, _, port = url.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"url must be host:port (e.g. 127.0.0.1:8001); got {url!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (``[::1]:8001``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_address(host: str) -> bool:
    """True if ``host`` is an IPv4 or IPv6 address (with or without brackets), not a name to resolve."""
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def resolve(url: str) -> list[str]:
    """The endpoints ``url`` (``host:port``) stands for.

    An address is itself. A name is looked up with :func:`socket.getaddrinfo` (TCP), and the addresses of the
    family the answer starts with count (a dual-stack name gives each server as IPv4 and as IPv6: it counts once;
    ``localhost`` as ``::1`` and ``127.0.0.1`` is one server): several give one ``address:port`` each, in the
    resolver's order; one gives ``[url]``, so the connection keeps the name (and resolves it itself).

    Raises:
        OSError: the name does not resolve (``socket.gaierror``).
        ValueError: ``url`` is not ``host:port``.
    """
    host, port = split_host_port(url)
    if is_address(host):
        return [url]
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family = found[0][0] if found else None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found if info[0] == family))
    return [join_host_port(a, port) for a in addresses] if len(addresses) > 1 else [url]


def resolve_all(urls: Iterable[str]) -> dict[str, list[str] | None]:
    """:func:`resolve` of each of ``urls``; None for one that did not resolve (the pool keeps what it had)."""
    results: dict[str, list[str] | None] = {}
    for url in urls:
        try:
            results[url] = resolve(url)
        except OSError:
            results[url] = None
    return results


def cooldown(failed_probes: int) -> float:
    """Seconds a down endpoint waits for its next probe after ``failed_probes`` failed ones (0-based)."""
    return min(MAX_COOLDOWN_S, COOLDOWN_S * 2.0**failed_probes)


@dataclass
class Endpoint:
    """One ``host:port`` and what the pool knows of it.

    Attributes:
        url: ``host:port`` requests go to.
        outstanding: this client's requests in flight there.
        down: a request failed there as unreachable/not ready (or a probe found it not ready).
        retry_at: when a down endpoint may be probed, in the pool's clock (seconds).
        failed_probes: failed probes since it went down; each doubles the cool-down.
        probing: a probe of it is in flight.
    """

    url: str
    outstanding: int = 0
    down: bool = False
    retry_at: float = 0.0
    failed_probes: int = 0
    probing: bool = False


@dataclass(frozen=True)
class Choice:
    """Where the next step goes: a request to ``url``, or (``probe``) first a readiness probe of ``url``."""

    url: str
    probe: bool = False


@dataclass(frozen=True)
class EndpointState:
    """An endpoint as :attr:`triton_embed.EmbeddingClient.endpoints` reports it.

    Attributes:
        url: ``host:port``.
        up: True unless its last request failed as unreachable/not ready and no probe has found it ready since.
        outstanding: this client's requests in flight there.
    """

    url: str
    up: bool
    outstanding: int


class EndpointPool:
    """The endpoints of one client and the choice of the next one; see the module docstring for the policy."""

    def __init__(
        self, urls: Collection[str], *, expand_names: bool = True, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Start with ``urls`` (normalised ``host:port``, at least one), all up; names are resolved when due.

        Args:
            urls: the endpoints as the caller gave them, in order.
            expand_names: resolve DNS names into their addresses (off: each url is one endpoint as it is).
            clock: monotonic time in seconds (a test's own clock).

        Raises:
            ValueError: no urls.
        """
        if not urls:
            raise ValueError("need at least one endpoint")
        self._given = tuple(urls)
        self._names = tuple(u for u in self._given if expand_names and not is_address(split_host_port(u)[0]))
        self._resolved: dict[str, list[str]] = {u: [u] for u in self._given}
        self._members = [Endpoint(u) for u in dict.fromkeys(self._given)]
        self._clock = clock
        self._lock = threading.Lock()
        self._next = 0  # round-robin position
        self._resolving = False
        self._last_resolved: float | None = None
        self.version = 0
        """Counts changes of the endpoint list (a client closes connections to endpoints that left it)."""

    # -- the endpoint list ----------------------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        """The endpoints now, in order."""
        with self._lock:
            return [ep.url for ep in self._members]

    def states(self) -> list[EndpointState]:
        """Each endpoint's url, whether it is up and its requests in flight."""
        with self._lock:
            return [EndpointState(ep.url, not ep.down, ep.outstanding) for ep in self._members]

    def names_due(self) -> list[str]:
        """The names to resolve now (none while another caller resolves them); the caller then calls :meth:`resolved`.

        Due before the first request, :data:`RESOLVE_EVERY_S` after the last resolution, and
        :data:`RESOLVE_WHEN_DOWN_S` after it while every endpoint is down.
        """
        with self._lock:
            if not self._names or self._resolving:
                return []
            last, now = self._last_resolved, self._clock()
            all_down = all(ep.down for ep in self._members)
            if last is None or now - last >= RESOLVE_EVERY_S or (all_down and now - last >= RESOLVE_WHEN_DOWN_S):
                self._resolving = True
                return list(self._names)
            return []

    def resolved(self, results: Mapping[str, list[str] | None]) -> None:
        """Take the endpoints each name stands for now (None or missing: keep the last ones); end the resolution.

        Endpoints seen before keep their state; new ones start up; those no name stands for any more leave.
        """
        with self._lock:
            self._resolving = False
            self._last_resolved = self._clock()
            for name, urls in results.items():
                if urls:
                    self._resolved[name] = list(urls)
            wanted = list(dict.fromkeys(u for given in self._given for u in self._resolved[given]))
            if wanted == [ep.url for ep in self._members]:
                return
            known = {ep.url: ep for ep in self._members}
            self._members = [known.get(u) or Endpoint(u) for u in wanted]
            self._next %= len(self._members)
            self.version += 1

    # -- choosing -------------------------------------------------------------------------------------------------
    def pick(self, avoid: Collection[str] = ()) -> Choice:
        """Where the next attempt goes.

        While some endpoint is up: first a probe of a down endpoint whose cool-down has passed (one probe at a time
        per endpoint; the caller reports it with :meth:`probed`), else the up endpoint not in ``avoid`` with the
        fewest requests in flight (ties round robin; all in ``avoid``: the same among all up ones). While none is
        up: a request to the down endpoint not in ``avoid`` whose cool-down ends first.

        Args:
            avoid: endpoints this call has tried already.
        """
        with self._lock:
            now = self._clock()
            up = [ep for ep in self._members if not ep.down]
            if not up:
                fresh = [ep for ep in self._members if ep.url not in avoid] or self._members
                return Choice(min(fresh, key=lambda ep: ep.retry_at).url)
            for ep in self._members:
                if ep.down and not ep.probing and now >= ep.retry_at:
                    ep.probing = True
                    return Choice(ep.url, probe=True)
            fresh = [ep for ep in up if ep.url not in avoid] or up
            n, start = len(self._members), self._next
            order = {id(ep): i for i, ep in enumerate(self._members)}
            best = min(fresh, key=lambda ep: (ep.outstanding, (order[id(ep)] - start) % n))
            self._next = (order[id(best)] + 1) % n
            return Choice(best.url)

    # -- what came of it ------------------------------------------------------------------------------------------
    def started(self, url: str) -> None:
        """A request to ``url`` is in flight."""
        with self._lock:
            if ep := self._find(url):
                ep.outstanding += 1

    def finished(self, url: str, ok: bool | None) -> None:
        """A request to ``url`` ended: ``ok`` True (answered: up), False (unreachable/not ready: down) or None.

        None: neither, e.g. bad input, an overload refusal or a timeout; the endpoint stays as it was.
        """
        with self._lock:
            if ep := self._find(url):
                ep.outstanding = max(0, ep.outstanding - 1)
                self._note(ep, ok)

    def mark(self, url: str, ready: bool) -> None:
        """What a health check found: ``url``'s model is ready (up) or not (down)."""
        with self._lock:
            if ep := self._find(url):
                self._note(ep, ready)

    def probed(self, url: str, ready: bool) -> None:
        """The probe that :meth:`pick` asked for ended: ready (up) or not (down; the cool-down doubles)."""
        with self._lock:
            if ep := self._find(url):
                ep.probing = False
                if ready:
                    self._note(ep, True)
                else:
                    ep.failed_probes += 1
                    ep.retry_at = self._clock() + cooldown(ep.failed_probes)

    def _note(self, ep: Endpoint, ok: bool | None) -> None:
        if ok is True:
            ep.down = False
        elif ok is False:
            # going down starts the cool-down over; a failure while already down pushes it on at the same length:
            # while every endpoint is down, requests go to the one whose cool-down ends first, so they take turns
            ep.failed_probes = ep.failed_probes if ep.down else 0
            ep.down = True
            ep.retry_at = self._clock() + cooldown(ep.failed_probes)

    def _find(self, url: str) -> Endpoint | None:
        return next((ep for ep in self._members if ep.url == url), None)
