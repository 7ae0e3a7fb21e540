"""The two backends' admission, driven as the tokenizer and the encoder drive it, through the file they share."""

from __future__ import annotations

import time

import pytest
from triton_embed_protocol import refusal_reason
from triton_embed_protocol.admission import EncoderAdmission, HandOff, TokenizerAdmission
from triton_embed_protocol.capacity import AdmissionConfig, ServiceCurve, grid


class Backends:
    """A tokenizer's and an encoder's admission for one model, the answers they send and the refusals they count."""

    def __init__(self, root, parameters: dict[str, str]) -> None:
        for step in ("tokenizer", "encoder"):
            (root / "repo" / step).mkdir(parents=True, exist_ok=True)
        self.sent: list[tuple[str, int, str]] = []  # (step, request, message or "tokens")
        self.counted = {"tokenizer": 0, "encoder": 0}
        self.published: list[dict[str, float]] = []
        # 2 ms + 1 ms a text: the door (predicted 2 executions within 0.85 x 200 ms) holds dozens of texts
        curve = ServiceCurve({n: (2 + n) / 1000 for n in grid(64)}, 64)
        self.encoder = EncoderAdmission(
            root / "repo" / "encoder",
            "embed",
            AdmissionConfig.read(parameters),
            curve,
            threads=2,
            publish=lambda limits, _: self.published.append(limits.knobs()),
            count_refused=lambda n: self._count("encoder", n),
        )
        self.tokenizer = TokenizerAdmission(root / "repo" / "tokenizer", "embed", lambda n: self._count("tokenizer", n))

    def _count(self, step: str, n: int) -> None:
        self.counted[step] += n

    def refusal(self, step: str):
        return lambda i, message: lambda: self.sent.append((step, i, message))

    def tokenize(self, texts: list[int], parameters: list[dict] | None = None):
        """One tokenizer execution: sort, then hand on every request the door passed; returns the sorting."""
        now = time.monotonic_ns()
        door = self.tokenizer.sort(parameters or [{}] * len(texts), texts, now, self.refusal("tokenizer"))
        passed = [i for i in range(len(texts)) if i not in door.refused | door.bulk | set(door.errors)]
        bulk = {i: (texts[i], lambda i=i: self.sent.append(("lane", i, "tokens"))) for i in door.bulk}
        self.tokenizer.hand_on(sum(texts[i] for i in passed), bulk, door, self.refusal("tokenizer"))
        return door, now

    def close(self) -> None:
        self.tokenizer.close()
        self.encoder.close()
        self.encoder.in_flight.path.unlink(missing_ok=True)


@pytest.fixture
def backends(tmp_path):
    made: list[Backends] = []

    def make(**parameters: str) -> Backends:
        made.append(Backends(tmp_path, {"REFUSAL_HOLD_MS": "50", **parameters}))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_the_tokenizer_refuses_past_the_encoders_door_and_answers_when_the_hold_is_due(backends):
    b = backends(MAX_IN_FLIGHT="4", BULK_TEXTS="8")
    assert b.published[0]["MAX_IN_FLIGHT"] == 4  # the encoder's gauges get the knobs in force
    b.tokenize([3])
    door, _ = b.tokenize([1, 1, 2])  # 3 in flight: one more fits, then the door is full
    assert door.refused == {1, 2} and not door.bulk and b.sent == []  # refusals are held, not sent at once
    assert b.counted["tokenizer"] == 2
    time.sleep(0.1)
    assert [(step, i) for step, i, _ in b.sent] == [("tokenizer", 1), ("tokenizer", 2)]
    assert all(refusal_reason(message) == "door" and "the limit is 4 texts" in message for *_, message in b.sent)


def test_bulk_requests_queue_in_the_lane_and_a_bad_budget_is_the_requests_error(backends):
    b = backends(MAX_IN_FLIGHT="4", BULK_TEXTS="8", BULK_IN_FLIGHT="16", BULK_QUEUE="16")
    door, _ = b.tokenize([9, 1, 1], [{}, {"latency_budget_ms": 0}, {"latency_budget_ms": -5}])
    assert door.bulk == {0, 1} and set(door.errors) == {2} and not door.refused  # over BULK_TEXTS, or budget 0
    assert "'latency_budget_ms'" in door.errors[2] and "-5" in door.errors[2]
    time.sleep(0.05)
    assert sorted(i for step, i, _ in b.sent if step == "lane") == [0, 1]  # the lane handed both on
    full, _ = b.tokenize([9, 9])  # 10 bulk texts in flight: these wait; the lane holds 16 texts at most
    assert full.bulk == {0, 1}
    time.sleep(0.1)
    refused = [message for step, _, message in b.sent if step == "tokenizer"]
    assert len(refused) == 1 and refusal_reason(refused[0]) == "bulk_queue" and b.counted["tokenizer"] == 1


def test_an_execution_counts_its_texts_out_and_refuses_what_waited_past_its_budget(backends):
    b = backends(MAX_IN_FLIGHT="4", BULK_TEXTS="8", LATENCY_BUDGET_MS="30")
    _, stamp = b.tokenize([2, 1])
    assert b.tokenizer.in_flight.door().interactive == 3
    now = stamp + 40_000_000  # the encoder takes them 40 ms later
    assert b.encoder.begin(2) == 2  # alone on the server: every core
    late = b.encoder.ticket({}, HandOff(stamp, 2, bulk=False), now)
    own = b.encoder.ticket({"latency_budget_ms": 100}, HandOff(stamp, 1, bulk=False), now)
    assert (late.waited_ms, late.interactive, late.budget_ms, own.budget_ms) == (40.0, 2, 30.0, 100.0)
    assert b.encoder.refuse_late([late, own], b.refusal("encoder")) == {0}  # its own budget keeps the other
    assert b.tokenizer.in_flight.door().interactive == 1  # the refused texts are out at once
    b.encoder.served([own], now + 5_000_000)
    b.encoder.end(rows=1, seconds=0.005)
    assert b.tokenizer.in_flight.door().interactive == 0 and b.counted["encoder"] == 1
    time.sleep(0.05)  # due 50 ms after the stamp
    ((step, i, message),) = b.sent
    assert (step, i, refusal_reason(message)) == ("encoder", 0, "budget") and "over the 30 ms latency" in message


def test_the_encoder_counts_a_request_out_in_the_lane_the_tokenizer_chose(backends):
    b = backends(MAX_IN_FLIGHT="16", BULK_TEXTS="8", BULK_IN_FLIGHT="16")
    door, stamp = b.tokenize([3, 2], [{"latency_budget_ms": 0}, {}])  # budget 0: bulk, however few its texts
    assert door.bulk == {0}
    time.sleep(0.05)  # the lane hands it on
    state = b.tokenizer.in_flight.door()
    assert (state.interactive, state.bulk) == (2, 3)
    b.encoder.begin(2)
    # the encoder reads the lane from the hand-off, not from the request's parameters (a direct caller: none)
    tickets = [b.encoder.ticket({}, HandOff(stamp, 3, bulk=True), stamp), b.encoder.ticket({}, None, stamp)]
    tickets.append(b.encoder.ticket({}, HandOff(stamp, 2, bulk=False), stamp))
    assert [(t.interactive, t.bulk) for t in tickets] == [(0, 3), (0, 0), (2, 0)]
    assert b.encoder.refuse_late(tickets, b.refusal("encoder")) == set()
    b.encoder.served(tickets, stamp + 5_000_000)
    b.encoder.end(rows=6, seconds=0.005)
    state = b.tokenizer.in_flight.door()
    assert (state.interactive, state.bulk) == (0, 0)


def test_an_execution_that_fails_still_counts_out_what_the_tokenizer_counted_in(backends):
    b = backends(MAX_IN_FLIGHT="8", BULK_TEXTS="8")
    _, stamp = b.tokenize([1])
    b.encoder.begin(1)  # the execution dies before its tickets are read: one text a request
    b.encoder.end(rows=0, seconds=0.001)
    assert b.tokenizer.in_flight.door().interactive == 0
    b.tokenize([1])
    b.encoder.begin(1)
    bad = b.encoder.ticket({"latency_budget_ms": "soon"}, HandOff(stamp, 1, bulk=False), stamp)
    assert bad.error and b.encoder.refuse_late([bad], b.refusal("encoder")) == set()  # an error is never run
    b.encoder.served([], stamp)
    b.encoder.end(rows=0, seconds=0.001)
    assert b.tokenizer.in_flight.door().interactive == 0 and b.sent == []


def test_a_bad_knob_is_an_error_naming_it():
    with pytest.raises(ValueError, match="REFUSAL_HOLD_MS must be a number >= 0; got 'soon'"):
        AdmissionConfig.read({"REFUSAL_HOLD_MS": "soon"})
    with pytest.raises(ValueError, match="BULK_QUEUE must be an integer"):
        AdmissionConfig.read({"BULK_QUEUE": "2.5"})
