"""The scheduler's host cost under a steady synthetic load (jserve.simulate.host_cost): the
load it names is the load it measures, at any context a target compiles for."""

from __future__ import annotations

import pytest

from jserve.simulate.host_cost import measure_iterations, percentile


@pytest.mark.parametrize("max_model_len", [256, 2048])
def test_the_running_set_fills_and_stays_full_at_any_context(max_model_len):
    """At a short context requests finish within tens of steps: arrivals go on while the
    running set fills (without them the queue once drained first, and the warm-up never
    ended), and every timed iteration runs at the load named."""
    costs = measure_iterations(1024, 512, 10, seed=3, max_model_len=max_model_len)
    stats = costs.stats
    assert 0.95 * 1024 <= stats.num_running <= 1024 and 0.95 * 512 <= stats.num_waiting <= 512
    assert len(costs.wall_ms) == len(costs.cpu_ms) == 10
    assert 0 < percentile(costs.cpu_ms, 50) <= percentile(costs.cpu_ms, 99)


def test_percentiles_interpolate_between_ranks():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
