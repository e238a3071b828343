"""--quantization int8's activation-aware scales (jserve.models.awq) and their calibration
(jserve.models.calibration), on the parallel tests' tiny random model: the calibration means
are the float model's activations, folding the scales in leaves the float model's logits as
they were, and the scales cut a projection's rounding error on activations with salient
channels below round-to-nearest's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.layers.norm import rms_norm
from jserve.models.awq import folded, input_scales
from jserve.models.calibration import activation_means, calibration_windows, input_widths
from jserve.models.int8_weights import dequantized, quantize_channels
from jserve.runtime.params import make_mesh, place_model
from tests.models.dense_generate import logits_at
from tests.parallel.workload import PROMPT_VOCAB, tiny_model


@pytest.fixture(scope="module")
def tiny(default_model):
    return tiny_model(default_model)


@pytest.fixture(scope="module")
def windows() -> np.ndarray:
    return np.random.default_rng(3).integers(3, PROMPT_VOCAB, (2, 64)).astype(np.int32)


def _logits(model, params, ids: np.ndarray) -> np.ndarray:
    graphdef, state = place_model(model.config, params, jnp.float32, make_mesh())
    rows = jnp.arange(ids.size, dtype=jnp.int32)
    return np.asarray(logits_at(graphdef, state, jnp.asarray(ids), rows))


def test_calibration_means_are_the_float_models_activations(tiny, windows):
    cfg = tiny.config
    both = activation_means(cfg, tiny.params, windows)
    assert {name: m.shape for name, m in both.items()} == {
        name: (cfg.num_layers, k) for name, k in input_widths(cfg).items()
    }
    # Layer 0's wqkv reads the first norm of the embedding: computed here directly.
    layers = tiny.params["layers"]
    h = rms_norm(tiny.params["embed"][windows], layers["attn_norm"][0], cfg.rms_norm_eps)
    np.testing.assert_allclose(both["wqkv"][0], np.abs(h).mean((0, 1)), rtol=1e-5)
    # Each window is a sequence of its own, and the means are over all of their positions.
    halves = [activation_means(cfg, tiny.params, w[None]) for w in windows]
    for name, m in both.items():
        np.testing.assert_allclose(m, (halves[0][name] + halves[1][name]) / 2, rtol=1e-5)
        assert (m > 0).all(), name  # every layer's every channel observed


def test_windows_are_equal_in_the_vocabulary_and_at_most_a_window_long():
    ids = [5, 2500, *range(10, 1210)]  # 2500 is past a vocabulary of 2000
    windows = calibration_windows(ids, vocab_size=2000)  # 1201 kept: 3 windows of 400
    np.testing.assert_array_equal(windows, np.asarray([5, *range(10, 1209)]).reshape(3, 400))
    with pytest.raises(ValueError, match="no token in the model's vocabulary"):
        calibration_windows([2500], vocab_size=2000)


def test_folding_leaves_the_float_model_as_it_was(tiny, windows):
    """Scales with outliers (as real activations have) folded into the norms, v and up: the
    float32 logits are the original's to float32 rounding, and the weights did change."""
    cfg = tiny.config
    rng = np.random.default_rng(4)
    means = {
        name: rng.lognormal(0.0, 1.0, (cfg.num_layers, k)).astype(np.float32)
        for name, k in input_widths(cfg).items()
    }
    params = folded(cfg, tiny.params, means)
    for name in ("wq", "wv", "wo", "w_up", "w_down", "attn_norm", "mlp_norm", "bv"):
        assert not np.allclose(params["layers"][name], tiny.params["layers"][name]), name
    ids = windows[0]
    original, after = _logits(tiny, tiny.params, ids), _logits(tiny, params, ids)
    np.testing.assert_allclose(after, original, atol=2e-4 * np.abs(original).max())
    np.testing.assert_array_equal(after.argmax(-1), original.argmax(-1))


def test_awq_rounds_with_less_output_error_than_round_to_nearest():
    """x W against x Q(W diag(s)) / s and x Q(W) on activations whose few salient channels
    are 20x the rest: qwix's search finds scales that cut the output error."""
    rng = np.random.default_rng(5)
    k, n = 128, 64
    x = rng.standard_normal((256, k)).astype(np.float32)
    x[:, rng.choice(k, 6, replace=False)] *= 20
    w = rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    s = input_scales(w[None], np.abs(x).mean(0)[None])[0]  # [K]
    awq = dequantized(*quantize_channels(w * s[:, None])) / s[:, None]
    rtn = dequantized(*quantize_channels(w))
    exact = x @ w
    awq_error, rtn_error = (np.linalg.norm(x @ q - exact) for q in (awq, rtn))
    assert awq_error < 0.8 * rtn_error, (awq_error, rtn_error)
