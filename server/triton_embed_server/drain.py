"""Graceful drain before shutdown: unload every served ensemble, let their requests in flight finish, then stop.

A Triton 2.51 workaround (docs/troubleshooting.md, "Triton 2.51 defects"): Triton 2.51's shutdown (SIGINT/SIGTERM)
stops every model's scheduler at once, the ensemble's second step included, so a request whose encoder step has not
started is refused with ``Server is stopping``. Unloading the ensembles first, through the repository API, refuses
new requests (Triton answers ``... has no available versions``, which the client treats as unavailable) and keeps
the tokenizer and encoder loaded until every request already in the ensemble has its answer; the readiness endpoint
turns false at once, so a load balancer stops sending.

Run as a script (``python3 drain.py --http-port 8000 --admin-header H``, key in ``TRITON_EMBED_ADMIN_KEY``; stdlib
only, Python >= 3.10) it is the compose deployment's drain: docker/triton-entrypoint.sh runs it on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

IN_FLIGHT_STATES = ("READY", "UNLOADING")


def model_states(http_url: str, headers: dict[str, str]) -> dict[str, str] | None:
    """Every model's state in the repository index (``READY``, ``UNLOADING``, ...); None without an answer."""
    request = urllib.request.Request(  # noqa: S310 - our own loopback server
        f"http://{http_url}/v2/repository/index", data=b"{}", method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
            index = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return {entry.get("name", ""): entry.get("state", "") for entry in index}


def model_state(http_url: str, model: str, headers: dict[str, str]) -> str | None:
    """``model``'s state in the repository index (``READY``, ``UNLOADING``, ``UNAVAILABLE``), None if unknown."""
    return (model_states(http_url, headers) or {}).get(model)


def is_ensemble(http_url: str, model: str) -> bool:
    """Whether ``model``'s config (``GET /v2/models/<model>/config``, an open API) says ``platform: ensemble``."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/config", timeout=5) as response:  # noqa: S310
            return json.loads(response.read()).get("platform") == "ensemble"
    except (urllib.error.URLError, OSError, ValueError):
        return False


class DrainError(RuntimeError):
    """The unload that starts a drain failed: the server did not answer (not up yet) or refused it."""


def ready_ensembles(http_url: str, headers: dict[str, str]) -> list[str]:
    """The ensembles READY in the repository index.

    Raises:
        DrainError: the index could not be read.
    """
    states = model_states(http_url, headers)
    if states is None:
        raise DrainError(f"could not read the repository index at {http_url}")
    return [name for name, state in states.items() if state == "READY" and is_ensemble(http_url, name)]


def drain(http_url: str, models: Sequence[str] | None, headers: dict[str, str], timeout_s: float) -> float | None:
    """Unload the ensembles ``models`` and wait until none has a request in flight; return the seconds it took.

    ``models`` None: every ready ensemble.

    Returns None when requests were still in flight after ``timeout_s`` seconds: the caller stops the server
    anyway, and Triton's own exit timeout takes over.

    Raises:
        DrainError: the unload request failed (no answer within 10 s, connection refused, HTTP error such as 403
            without the admin key); nothing was drained.
    """
    start = time.monotonic()
    if models is None:
        models = ready_ensembles(http_url, headers)
    for model in models:
        request = urllib.request.Request(  # noqa: S310 - our own loopback server
            f"http://{http_url}/v2/repository/models/{model}/unload", data=b"{}", method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
                response.read()
        except (urllib.error.URLError, OSError) as exc:
            raise DrainError(f"could not unload '{model}' at {http_url}: {exc}") from exc
    while time.monotonic() - start < timeout_s:
        states = model_states(http_url, headers) or {}
        if all(states.get(model) not in IN_FLIGHT_STATES for model in models):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def main(argv: list[str] | None = None) -> int:
    """Command line: drain the server on ``127.0.0.1:--http-port``; prints what happened; always exits 0."""
    parser = argparse.ArgumentParser(description="Unload the ensembles and wait for their requests in flight.")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--admin-header", required=True, help="the header the repository API is locked to")
    parser.add_argument("--model", action="append", help="an ensemble to drain (repeatable; default: every one)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="longest wait for requests in flight, seconds")
    args = parser.parse_args(argv)
    headers = {args.admin_header: os.environ.get("TRITON_EMBED_ADMIN_KEY", "")}
    url = f"127.0.0.1:{args.http_port}"
    try:
        models = args.model or ready_ensembles(url, headers)
        took = drain(url, models, headers, args.timeout_s)
    except DrainError as exc:  # e.g. a stop before the server was up: nothing to drain
        print(f"triton-embed: no drain ({exc}); stopping", file=sys.stderr, flush=True)
        return 0
    said = f"drained in {took:.1f} s" if took is not None else f"did not drain within {args.timeout_s:g} s; stopping"
    print(f"triton-embed: {', '.join(repr(m) for m in models)} {said}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
