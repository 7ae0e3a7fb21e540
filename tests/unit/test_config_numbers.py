"""Config knobs read as numbers: a bad value fails the model's load with the knob, the limit and the value."""

from __future__ import annotations

import pytest
from triton_embed_protocol import config_number, config_parameters


def test_a_knob_reads_as_its_number_or_its_default():
    params = config_parameters({"parameters": {"LATENCY_BUDGET_MS": {"string_value": "180"}}})
    assert config_number(params, "LATENCY_BUDGET_MS", "0") == 180.0
    assert config_number(params, "REFUSAL_HOLD_MS", "1000") == 1000.0
    assert config_number({"MAX_TEXT_BYTES": "64"}, "MAX_TEXT_BYTES", "65536", minimum=1, integer=True) == 64


@pytest.mark.parametrize(
    ("value", "integer", "minimum", "message"),
    [
        ("abc", False, 0, "LATENCY_BUDGET_MS must be a number >= 0; got 'abc'"),
        ("-5", False, 0, "LATENCY_BUDGET_MS must be a number >= 0; got '-5'"),
        ("2.5", True, 1, "LATENCY_BUDGET_MS must be an integer >= 1; got '2.5'"),
        ("0", True, 1, "LATENCY_BUDGET_MS must be an integer >= 1; got '0'"),
    ],
)
def test_a_bad_knob_is_named_with_its_limit_and_value(value, integer, minimum, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        config_number({"LATENCY_BUDGET_MS": value}, "LATENCY_BUDGET_MS", "0", minimum=minimum, integer=integer)
