"""A bad config knob fails the model's load at once, with the knob, the limit and the value in Triton's answer."""

from __future__ import annotations

import pytest

from bench.serving import variant_repository


def test_bad_knobs_fail_the_load_naming_the_knob_the_limit_and_the_value(tmp_path):
    from triton_embed_server.embedded import EmbeddedServer, ServerError

    knobs = {
        ("encoder", "LATENCY_BUDGET_MS"): "abc",
        ("tokenizer", "MAX_SEQ_LENGTH"): "128",  # tokenizer.json truncates at 256
    }
    repo = variant_repository(tmp_path / "repo", knobs=knobs, cache=True)
    log = tmp_path / "tritonserver.log"
    server = EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=log)
    with pytest.raises(ServerError), server:
        pass
    written = log.read_text()
    assert "config parameter LATENCY_BUDGET_MS must be a number >= 0; got 'abc'" in written
    assert "config parameter MAX_SEQ_LENGTH is 128 but" in written and "truncates at 256" in written
