"""The encoder's service curve, measured where it runs, and the admission limits derived from it.

The encoder times one execution per batch size at load (after warmup, nothing else running) and every execution it
serves after that (:meth:`ServiceCurve.observe`: the whole ``execute``, as the queue behind it waits for it). From
that curve, seconds per execution by rows, :class:`Knobs` sets the door and the bulk lane (docs/overload.md):

- ``MAX_IN_FLIGHT``: the most texts in flight whose predicted time in the service stays within
  :data:`TARGET_SHARE` of ``SLA_MS``. With ``n`` texts in flight a new one waits for the execution running (at most
  ``n`` rows) and then runs in the next: about ``2 t(n)`` while ``n`` fits one batch, ``t(B) (1 + ceil(n / B))``
  beyond (``B`` = the model's ``max_batch_size``); never below :data:`FLOOR` of the door measured at load. That
  prediction is a typical time, not a p99, and it sees neither the tokenizer nor the clients that share the cores:
  :class:`ServedLatency` scales the door by the p99 that admitted requests actually spend in the service.
- ``BULK_IN_FLIGHT``: the most bulk texts one execution may hold so that a one-text request behind it still answers
  within that share: ``2 t(b)``, as for the door.
- ``BULK_TEXTS``: a quarter of the door at load (the shipped ratio, 8 of 32): four such requests fit the door.
- ``FLOOD_LATENCY_MS``: half of ``SLA_MS``; under a flood the door follows the answers (Little's law,
  ``overload.Door``) so that an admitted request spends about that long in the service.
- ``SERVED_P99_MS``: :data:`FEEDBACK_SHARE` of ``SLA_MS``, the p99 time in the service that :class:`ServedLatency`
  steers admitted requests to by scaling the door (0: the door follows the curve alone).

A number in the config pins a knob; ``auto`` (the shipped value) derives it. Pure Python (and one lock file for the
load-time timing, :func:`timing_alone`), no torch, no Triton:
tests/unit/test_capacity.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from triton_embed_protocol import config_number, shared_folder

AUTO = "auto"
"""The config value that lets a knob follow the measured curve."""

TARGET_SHARE = 0.85
"""Predicted time in the service allowed at the door's limit, a share of ``SLA_MS``. The rest is for what the curve
does not see (the frontend, the tokenizer, a p99 above the prediction): docs/benchmarks.md, "The measured door"."""

REF_TOKENS = 16
"""Tokens per text of the executions timed at load (STS Benchmark's median is 14); the executions served refine it."""

WINDOW_S = 30.0
"""Executions served within this many seconds make a row count's figure; older ones are forgotten, s."""

SAMPLES = 16
"""The latest executions kept per row count; their median is its figure (one stalled execution moves it little)."""

MIN_SAMPLES = 3
"""Executions a row count needs within :data:`WINDOW_S` before their median replaces the load-time estimate."""

MAX_DOOR_BATCHES = 16
"""The door's limit is at most this many full batches of texts (``16 x max_batch_size``)."""

FLOOR = 0.5
"""The door never goes below this share of the door measured at load: below it the batches grow too small for the
encoder to keep its throughput (the flood rule's floor, ``overload.Door.FLOOR``, for the same reason)."""


FEEDBACK_SHARE = 0.7
"""``SERVED_P99_MS`` when ``auto``, a share of ``SLA_MS``: the p99 time in the service that :class:`ServedLatency`
steers admitted requests to. The encoder sees a request from the tokenizer's hand-off to its answer, and the
frontend, the ensemble and the tokenizer add to that on a busy machine (docs/benchmarks.md, "The measured door")."""

FEEDBACK_PERIOD_S = 0.5
""":class:`ServedLatency` moves the door at most this often, by the p99 of the answers since it last moved, s."""

FEEDBACK_MIN_SAMPLES = 200
"""Answers a period needs before their p99 moves the door (fewer: the period goes on). The p99 of 200 answers is the
second slowest; of 100 or fewer it is the slowest, and one stalled execution would halve the door (docs/benchmarks.md,
"The door under load follows the served p99")."""

FEEDBACK_IDLE_S = 5.0
"""After this long without an answer :class:`ServedLatency` forgets its factor: a flood that is over says nothing of
the next load, s."""

FEEDBACK_SCALE = (1 / 16, 4.0)
"""The lowest and highest factor :class:`ServedLatency` may put on the curve's door."""

FEEDBACK_FLOOR_SHARE = 0.25
""":class:`ServedLatency` never takes the door below the texts whose predicted time in the service is this share of
the budget: with so few in flight the encoder's own queue is not what makes the p99, and smaller batches would only
lower the throughput (a flood's refusals and the frontend take the time then, docs/overload.md)."""


TIMING_WAIT_S = 60.0
"""The longest an encoder waits for its timing lock (:func:`timing_alone`) before it times anyway, s (well within
the embedded server's wait for ready)."""


@contextlib.contextmanager
def timing_alone(
    device: str = "cpu", *, wait_s: float = TIMING_WAIT_S, path: Path | None = None
) -> Iterator[float | None]:
    """Hold the timing lock of ``device``: encoders on it warm up and time their executions at load one at a time.

    Triton loads the models of a repository in parallel, and every encoder on the host shares its cores: timed beside
    another encoder's warmup, an execution takes two to three times as long, and a door sized from that refuses what
    the machine serves (docs/benchmarks.md, "Idle models beside the busy one"). The lock is an exclusive ``flock``
    on one file per device and user in ``/dev/shm`` (the temp folder without it), so it spans every server of the
    user on the host and is released when its holder exits, a crashed one included. Encoders on different GPUs do not
    wait for each other.

    Args:
        device: what the encoder computes on (``"cpu"``, ``"cuda0"``, ...): one lock each.
        wait_s: the longest to wait for the lock, s; past it the body runs without it.
        path: the lock file (None: the shared folder's, by device and user).

    Yields:
        Seconds waited for the lock, or None where it was not taken (held past ``wait_s``, or the file cannot be
        opened).
    """
    path = path or shared_folder() / f"triton-embed-timing-{os.getuid()}-{device}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield None
        return
    start = time.monotonic()
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                waited: float | None = time.monotonic() - start
                break
            except BlockingIOError:
                if time.monotonic() - start >= wait_s:
                    waited = None
                    break
                time.sleep(0.05)
        yield waited
    finally:
        os.close(fd)  # releases the lock


def grid(max_batch: int) -> list[int]:
    """Row counts the curve holds: powers of two below ``max_batch``, then ``max_batch`` (64: 1, 2, 4, ..., 64)."""
    sizes = [1 << k for k in range(max(1, max_batch).bit_length()) if 1 << k < max_batch]
    return [*sizes, max(1, max_batch)]


class ServiceCurve:
    """Seconds per encoder execution by its rows: measured at load, then the median of the executions served.

    Each execution served is counted at the grid point at or above its rows. A point with :data:`MIN_SAMPLES`
    executions in the last :data:`WINDOW_S` takes their median (of the latest :data:`SAMPLES`); a point without takes
    its load-time figure plus the difference the nearest such point shows over its own (the frontend's and the
    backend's per-execution costs, contention from the tokenizer). The table never falls with more rows.
    """

    def __init__(self, warm_s: dict[int, float], max_batch: int) -> None:
        """A curve from load-time timings.

        Args:
            warm_s: seconds of one execution, by rows (at least one entry; rows between them are interpolated).
            max_batch: the model's ``max_batch_size``.

        Raises:
            ValueError: ``warm_s`` is empty or holds a time that is not positive.
        """
        if not warm_s or min(warm_s.values()) <= 0:
            raise ValueError(f"the load-time timings must be positive seconds by rows; got {warm_s!r}")
        self.max_batch = max(1, max_batch)
        self.points = grid(self.max_batch)
        warm = [_interpolate(sorted(warm_s.items()), rows) for rows in self.points]
        for i in range(len(warm) - 2, -1, -1):  # fewer rows never take longer: a stalled small timing is clipped
            warm[i] = min(warm[i], warm[i + 1])
        self.warm = _bounded(list(zip(self.points, warm, strict=True)))
        self.served: list[deque[tuple[float, float]]] = [deque(maxlen=SAMPLES) for _ in self.points]

    def observe(self, rows: int, seconds: float, now: float | None = None) -> None:
        """Count one execution served: ``rows`` texts in ``seconds`` (wall time of the whole execution).

        ``now``: ``time.monotonic()`` (None: read it).
        """
        if rows < 1 or seconds <= 0:
            return
        k = next((i for i, p in enumerate(self.points) if p >= rows), len(self.points) - 1)
        self.served[k].append((time.monotonic() if now is None else now, seconds))

    def table(self, now: float | None = None) -> list[tuple[int, float]]:
        """The curve in force: ``[(rows, seconds per execution)]`` on the grid, never falling with more rows."""
        now = time.monotonic() if now is None else now
        medians: dict[int, float] = {}
        for i, samples in enumerate(self.served):
            recent = sorted(s for t, s in samples if now - t <= WINDOW_S)
            if len(recent) >= MIN_SAMPLES:
                medians[i] = recent[len(recent) // 2]
        values = []
        for i, warm in enumerate(self.warm):
            if i in medians:
                values.append(medians[i])
            elif medians:
                near = min(medians, key=lambda j: abs(j - i))
                values.append(max(warm * 0.25, warm + medians[near] - self.warm[near]))
            else:
                values.append(warm)
        return list(zip(self.points, _bounded(list(zip(self.points, values, strict=True))), strict=True))

    def seconds(self, rows: int, table: list[tuple[int, float]] | None = None) -> float:
        """Predicted seconds of one execution of ``rows`` texts, interpolated on ``table`` (None: :meth:`table`)."""
        return _interpolate(table or self.table(), rows)


class ServedLatency:
    """Scales the curve's door by the p99 time in the service of the requests it admitted (a feedback loop).

    Every :data:`FEEDBACK_PERIOD_S` (and :data:`FEEDBACK_MIN_SAMPLES` answers) it reads the p99 of the answers since
    it last moved: above the budget the factor falls in proportion (``budget / p99``, by at most half at a time), so
    the door shrinks as fast as the machine turns out slower than its curve (cores shared with the tokenizer, the
    frontend, the clients, another model); under 0.8 x the budget while the door was nearly full (the in-flight count
    reached 0.8 x the door) it grows by a tenth (a quarter under half the budget), so a door set too small by a noisy
    load-time timing opens up.
    A door that is not nearly full is not what keeps the latency low, and is left alone. After
    :data:`FEEDBACK_IDLE_S` without an answer the factor goes back to 1. Pure Python; one instance per encoder.
    """

    def __init__(self, budget_ms: float) -> None:
        """Steer the p99 of the answers' time in the service to ``budget_ms`` (ms > 0)."""
        self.budget_ms = budget_ms
        self.scale = 1.0
        self.p99_ms: float | None = None
        self._answers: deque[float] = deque(maxlen=8192)
        self._peak = 0
        self._moved = self._last = time.monotonic()

    def answered(self, ms: float, now: float | None = None) -> None:
        """One admitted request answered ``ms`` after it entered the service (the tokenizer's hand-off), ms.

        ``now``: ``time.monotonic()`` (None: read it).
        """
        self._answers.append(ms)
        self._last = time.monotonic() if now is None else now

    def in_flight(self, texts: int) -> None:
        """The interactive texts in flight as an execution starts (the door's count)."""
        self._peak = max(self._peak, texts)

    def update(self, door: int, now: float | None = None) -> float:
        """Move the factor if a period has passed since it last moved; returns the factor in force.

        Args:
            door: the door the factor was applied to last, texts (whether it was nearly full).
            now: ``time.monotonic()`` (None: read it).
        """
        now = time.monotonic() if now is None else now
        if now - self._last > FEEDBACK_IDLE_S:
            self.scale, self.p99_ms, self._peak, self._moved = 1.0, None, 0, now
            self._answers.clear()
        if now - self._moved < FEEDBACK_PERIOD_S or len(self._answers) < FEEDBACK_MIN_SAMPLES:
            return self.scale
        recent = sorted(self._answers)
        self._answers.clear()
        self._moved, peak, self._peak = now, self._peak, 0
        self.p99_ms = recent[min(len(recent) - 1, int(0.99 * len(recent)))]
        low, high = FEEDBACK_SCALE
        if self.p99_ms > self.budget_ms:
            self.scale = max(low, self.scale * max(0.5, self.budget_ms / self.p99_ms))
        elif self.p99_ms < 0.8 * self.budget_ms and peak >= 0.8 * door:
            self.scale = min(high, self.scale * (1.25 if self.p99_ms < 0.5 * self.budget_ms else 1.1))
        return self.scale


def _bounded(points: list[tuple[int, float]]) -> list[float]:
    """The seconds of ``points`` (rows ascending) made to never fall with more rows and to grow at most in proportion.

    An execution of ``r`` rows costs no more than the ``r / p`` executions of ``p`` rows it could be split into, so a
    timing above ``r / p`` times the point before it (a stall while it was timed) is cut down to that.
    """
    out: list[float] = []
    for k, (rows, seconds) in enumerate(points):
        bounded = seconds
        if out:
            bounded = max(out[-1], min(seconds, out[-1] * rows / points[k - 1][0]))
        out.append(bounded)
    return out


def _interpolate(points: list[tuple[int, float]], rows: int) -> float:
    """Piecewise-linear value at ``rows`` through ``points`` (sorted by rows); flat below the first, linear beyond."""
    if rows <= points[0][0] or len(points) == 1:
        return points[0][1] * (max(rows, 1) / points[0][0] if rows > points[0][0] else 1.0)
    for (r0, s0), (r1, s1) in zip(points, points[1:], strict=False):
        if rows <= r1:
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
    return points[-1][1] * rows / points[-1][0]


def time_in_service(curve: ServiceCurve, texts: int, table: list[tuple[int, float]] | None = None) -> float:
    """Predicted seconds a new text spends in the encoder's service with ``texts`` texts in flight (itself included).

    It waits for the execution running, then runs in the next: ``2 t(n)`` while ``n`` fits a batch, else
    ``t(B) (1 + ceil(n / B))``. ``table``: the curve's :meth:`ServiceCurve.table` (None: read it).
    """
    table = table or curve.table()
    batch = curve.max_batch
    if texts <= batch:
        return 2 * curve.seconds(texts, table)
    return curve.seconds(batch, table) * (1 + math.ceil(texts / batch))


def largest_within(predict: Callable[[int], float], budget_s: float, high: int) -> int:
    """The largest ``n`` in ``[1, high]`` with ``predict(n) <= budget_s`` (``predict`` never falls); at least 1."""
    low = 1
    if predict(high) <= budget_s:
        return high
    while high - low > 1:  # predict(low) <= budget or low == 1; predict(high) > budget
        mid = (low + high) // 2
        if predict(mid) <= budget_s:
            low = mid
        else:
            high = mid
    return low


@dataclass
class Limits:
    """The admission knobs in force and how each was set.

    Attributes:
        sla_ms: ``SLA_MS``, the p99 target, ms.
        max_in_flight: the door, interactive texts in the service (0 = no door).
        bulk_in_flight: the bulk lane's share, bulk texts in the service (0 = no lane).
        bulk_texts: a request of more texts than this is bulk.
        flood_latency_ms: under a flood the door aims an admitted request at this time in the service, ms.
        served_p99_ms: the p99 time in the service the door is scaled to keep admitted requests within, ms (0: off).
        how: per knob name, ``"pinned"`` (a number in the config) or what it was derived from.
    """

    sla_ms: float
    max_in_flight: int
    bulk_in_flight: int
    bulk_texts: int
    flood_latency_ms: float
    served_p99_ms: float
    how: dict[str, str] = field(default_factory=dict)

    def knobs(self) -> dict[str, float]:
        """``{knob name: value}``, as the config names them."""
        return {
            "SLA_MS": self.sla_ms,
            "MAX_IN_FLIGHT": self.max_in_flight,
            "BULK_IN_FLIGHT": self.bulk_in_flight,
            "BULK_TEXTS": self.bulk_texts,
            "FLOOD_LATENCY_MS": self.flood_latency_ms,
            "SERVED_P99_MS": self.served_p99_ms,
        }

    def describe(self) -> str:
        """One log line: each knob, its value and how it was set."""
        return "; ".join(f"{k} {v:g} ({self.how.get(k, 'pinned')})" for k, v in self.knobs().items())


def pinned(parameters: dict[str, str], key: str, default: str, *, integer: bool = True) -> float | None:
    """A knob's number when the config pins it, None when it says ``auto`` (or is absent and ``default`` is auto).

    Raises:
        ValueError: the value is neither ``auto`` nor a number >= 0; the message names the knob and the value.
    """
    text = parameters.get(key, default).strip()
    if text.lower() == AUTO:
        return None
    kind = "an integer" if integer else "a number"
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise ValueError(f"config parameter {key} must be {AUTO!r} or {kind} >= 0; got {text!r}") from None
    if value < 0:
        raise ValueError(f"config parameter {key} must be {AUTO!r} or {kind} >= 0; got {text!r}")
    return value


@dataclass(frozen=True)
class AdmissionConfig:
    """Every admission knob of one encoder as its config parameters set it, read and checked at once.

    The derived knobs are a number where the config pins one and None where it says ``auto`` (:class:`Knobs` derives
    those from the service curve); the others are plain numbers. docs/overload.md and docs/configuration.md describe
    each.
    """

    sla_ms: float
    """``SLA_MS``: the p99 target, ms (> 0)"""
    max_in_flight: int | None
    """``MAX_IN_FLIGHT``: the door, interactive texts in the service (0: no door); None: derived"""
    bulk_in_flight: int | None
    """``BULK_IN_FLIGHT``: the bulk lane's share, bulk texts in the service (0: no lane); None: derived"""
    bulk_texts: int | None
    """``BULK_TEXTS``: a request of more texts than this is bulk; None: derived"""
    flood_latency_ms: float | None
    """``FLOOD_LATENCY_MS``: under a flood the door aims at this time in the service, ms (0: off); None: derived"""
    served_p99_ms: float | None
    """``SERVED_P99_MS``: the served p99 the door keeps admitted requests within, ms (0: off); None: derived"""
    latency_budget_ms: float
    """``LATENCY_BUDGET_MS``: a request's latency budget when it sends none, ms (0: none)"""
    refusal_hold_ns: int
    """``REFUSAL_HOLD_MS``: a refusal is answered this long after the request entered the service, ns"""
    bulk_queue: int
    """``BULK_QUEUE``: bulk texts that may wait in the tokenizer's lane (0: no bound)"""

    @classmethod
    def read(cls, parameters: dict[str, str]) -> AdmissionConfig:
        """The knobs in the encoder's config parameters (``triton_embed_protocol.config_parameters``).

        Raises:
            ValueError: a knob is not ``auto`` or a number >= 0 as it must be (``SLA_MS``: a number > 0;
                ``BULK_QUEUE``: an integer); the message names it and the value.
        """
        sla = pinned(parameters, "SLA_MS", "200", integer=False)
        if not sla:
            raise ValueError(f"config parameter SLA_MS must be a number of ms > 0; got {parameters.get('SLA_MS')!r}")
        door, bulk, texts = (pinned(parameters, key, AUTO) for key in ("MAX_IN_FLIGHT", "BULK_IN_FLIGHT", "BULK_TEXTS"))
        return cls(
            sla_ms=sla,
            max_in_flight=None if door is None else int(door),
            bulk_in_flight=None if bulk is None else int(bulk),
            bulk_texts=None if texts is None else int(texts),
            flood_latency_ms=pinned(parameters, "FLOOD_LATENCY_MS", AUTO, integer=False),
            served_p99_ms=pinned(parameters, "SERVED_P99_MS", AUTO, integer=False),
            latency_budget_ms=config_number(parameters, "LATENCY_BUDGET_MS", "0"),
            refusal_hold_ns=int(config_number(parameters, "REFUSAL_HOLD_MS", "0") * 1e6),
            bulk_queue=int(config_number(parameters, "BULK_QUEUE", "0", integer=True)),
        )


class Knobs:
    """The admission knobs of one encoder: pinned ones as the config says, the others derived from its curve.

    ``BULK_TEXTS`` is fixed at load (a request's lane does not change with the load);
    ``MAX_IN_FLIGHT`` and ``BULK_IN_FLIGHT`` follow the curve as executions are served (:meth:`limits`).
    """

    KNOBS = ("SLA_MS", "MAX_IN_FLIGHT", "BULK_IN_FLIGHT", "BULK_TEXTS", "FLOOD_LATENCY_MS", "SERVED_P99_MS")

    def __init__(self, config: AdmissionConfig, curve: ServiceCurve) -> None:
        """Derive the knobs ``config`` leaves to the curve (``auto``).

        Args:
            config: the encoder's knobs as its config sets them (:meth:`AdmissionConfig.read`).
            curve: its service curve, measured at load.
        """
        self.sla_ms = config.sla_ms
        self.curve = curve
        self._door = config.max_in_flight
        self._bulk = config.bulk_in_flight
        flood = config.flood_latency_ms
        self.flood_latency_ms = self.sla_ms / 2 if flood is None else flood
        served = config.served_p99_ms
        self.served_p99_ms = self.sla_ms * FEEDBACK_SHARE if served is None else served
        self._how = {
            "SLA_MS": "pinned",
            "FLOOD_LATENCY_MS": "half of SLA_MS" if flood is None else "pinned",
            "SERVED_P99_MS": f"{FEEDBACK_SHARE:g} x SLA_MS" if served is None else "pinned",
        }
        self.served = ServedLatency(self.served_p99_ms) if self.served_p99_ms else None
        self._load_door = self._door_now = 0
        self._load_door = self._door_now = self._door_and_lane()[0]
        texts = config.bulk_texts
        if texts is None:
            door = self._load_door or self.curve.max_batch
            texts = max(1, min(self.curve.max_batch, door // 4))
            self._how["BULK_TEXTS"] = "a quarter of the door at load"
        self.bulk_texts = int(texts)

    def _door_and_lane(self, now: float | None = None) -> tuple[int, int, dict[str, str]]:
        """``MAX_IN_FLIGHT`` and ``BULK_IN_FLIGHT`` from the curve as it stands (or pinned), with how each was set."""
        table = self.curve.table(now)
        budget_s = self.sla_ms * TARGET_SHARE / 1000
        batch = self.curve.max_batch
        how = {}
        if self._door is None:
            door = largest_within(lambda n: time_in_service(self.curve, n, table), budget_s, MAX_DOOR_BATCHES * batch)
            predicted = f"{time_in_service(self.curve, door, table) * 1000:.0f} ms predicted in service"
            how["MAX_IN_FLIGHT"] = f"measured: {predicted}"
            if door < math.ceil(self._load_door * FLOOR):
                how["MAX_IN_FLIGHT"] = f"half the door at load; the curve alone gives {door} ({predicted})"
                door = math.ceil(self._load_door * FLOOR)
            if self.served and (scale := self.served.update(self._door_now, now)) != 1.0:
                floor = largest_within(
                    lambda n: time_in_service(self.curve, n, table),
                    budget_s * FEEDBACK_FLOOR_SHARE,
                    MAX_DOOR_BATCHES * batch,
                )
                scaled = math.ceil(door * scale) if scale > 1 else round(door * scale)  # a door of 1 can open
                door = max(min(door, floor), min(MAX_DOOR_BATCHES * batch, scaled))
                how["MAX_IN_FLIGHT"] += f", x{scale:.2f} by the served p99 ({self.served.p99_ms:.0f} ms)"
            self._door_now = door
        else:
            door = int(self._door)
        if self._bulk is None:
            bulk = largest_within(lambda n: 2 * self.curve.seconds(n, table), budget_s, 4 * batch)
            how["BULK_IN_FLIGHT"] = f"measured: {self.curve.seconds(bulk, table) * 1000:.0f} ms an execution"
        else:
            bulk = int(self._bulk)
        return door, bulk, how

    def limits(self, now: float | None = None) -> Limits:
        """The knobs in force now (``time.monotonic()``; None: read it), from the curve as it stands."""
        door, bulk, how = self._door_and_lane(now)
        return Limits(
            self.sla_ms, door, bulk, self.bulk_texts, self.flood_latency_ms, self.served_p99_ms, {**self._how, **how}
        )

    def started(self, texts: int) -> None:
        """An execution starts with ``texts`` interactive texts in flight (the door's count)."""
        if self.served:
            self.served.in_flight(texts)

    def answered(self, ms: float, now: float | None = None) -> None:
        """An admitted interactive request answered ``ms`` after it entered the service, ms (``now``: monotonic s)."""
        if self.served:
            self.served.answered(ms, now)


KNOB_GAUGE = "triton_embed_admission"
"""The encoder's gauge of each knob in force, labelled ``model``, ``knob`` and ``source`` (pinned or derived)."""
CURVE_GAUGE = "triton_embed_service_seconds"
"""The encoder's gauge of its service curve, labelled ``model`` and ``rows``: seconds of one execution."""


def read_gauges(metrics_text: str, model: str = "encoder") -> tuple[dict[str, tuple[float, str]], dict[int, float]]:
    """The knobs and the curve of ``model`` from the text of Triton's metrics endpoint (Prometheus exposition).

    Returns:
        ``({knob: (value, source)}, {rows: seconds})``; both empty when the text holds none of ``model``'s gauges.
    """
    knobs: dict[str, tuple[float, str]] = {}
    curve: dict[int, float] = {}
    for line in metrics_text.splitlines():
        series, _, value = line.rpartition(" ")
        name, _, inside = series.partition("{")
        pairs = (item.split("=", 1) for item in inside.rstrip("}").split(",") if "=" in item)
        labels = {k.strip(): v.strip().strip('"') for k, v in pairs}
        if labels.get("model") != model:
            continue
        if name == KNOB_GAUGE:
            knobs[labels["knob"]] = (float(value), labels.get("source", "?"))
        elif name == CURVE_GAUGE:
            curve[int(labels["rows"])] = float(value)
    return knobs, curve
