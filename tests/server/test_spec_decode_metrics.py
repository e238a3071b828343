"""Speculative decoding's counters on /metrics under vLLM's names, with the acceptance rate and
mean acceptance length they imply (and zeros, not NaN, before any draft)."""

from __future__ import annotations

from jserve.outputs import EngineStats
from jserve.server.metrics import ServerMetrics
from tests.server.server_harness import metric


def _render(stats: EngineStats) -> str:
    metrics = ServerMetrics()
    metrics.refresh(stats)
    return metrics.render("m").decode()


def test_spec_decode_counters_and_rates():
    text = _render(
        EngineStats(
            spec_decode_num_drafts=10,
            spec_decode_num_draft_tokens=40,
            spec_decode_num_accepted_tokens=25,
            spec_decode_num_accepted_tokens_per_pos=[9, 8, 5, 3],
        )
    )
    assert metric(text, "jserve:spec_decode_num_drafts_total") == 10
    assert metric(text, "jserve:spec_decode_num_draft_tokens_total") == 40
    assert metric(text, "jserve:spec_decode_num_accepted_tokens_total") == 25
    for position, count in enumerate([9, 8, 5, 3]):
        name = "jserve:spec_decode_num_accepted_tokens_per_pos_total"
        assert metric(text, name, f'position="{position}"') == count
    assert metric(text, "jserve:spec_decode_acceptance_rate") == 25 / 40
    assert metric(text, "jserve:spec_decode_mean_acceptance_length") == 1 + 25 / 10


def test_no_drafts_read_as_zero():
    text = _render(EngineStats())
    assert metric(text, "jserve:spec_decode_acceptance_rate") == 0
    assert metric(text, "jserve:spec_decode_mean_acceptance_length") == 0
    assert "spec_decode_num_accepted_tokens_per_pos_total{" not in text
