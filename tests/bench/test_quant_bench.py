"""The arithmetic of bench.quality and bench.quant_compare's report, on made-up models and runs
(the real ones take minutes: docs/quantization.md has their figures)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bench.quality import greedy_agreement, int8_rows, teacher_forced
from bench.quant_compare import round_rows, table

VOCAB = 8


def _model(flip_at: set[int] = frozenset()):
    """Logits favouring token (id + 1) % VOCAB after each id, or (id + 2) at `flip_at` ids."""

    def logits(ids: np.ndarray) -> np.ndarray:
        out = np.zeros((len(ids), VOCAB))
        for i, token in enumerate(ids):
            out[i, (token + (2 if int(token) in flip_at else 1)) % VOCAB] = 5.0
        return out

    return logits


def test_identical_models_agree_everywhere_and_a_flip_is_counted():
    windows = [np.arange(8) % VOCAB, (np.arange(8) + 3) % VOCAB]
    same = teacher_forced(_model(), _model(), windows)
    assert same["positions"] == 14 and same["top1_agreement"] == 1.0
    assert same["mean_kl"] == 0.0 and same["perplexity"] == same["reference_perplexity"]
    flipped = teacher_forced(_model({4}), _model(), windows)
    assert flipped["top1_agreement"] == 12 / 14  # id 4 is a scored position in both windows
    assert flipped["mean_kl"] > 0 and flipped["perplexity"] > flipped["reference_perplexity"]


def test_greedy_agreement_is_the_common_prefix():
    prompts = [np.array([0]), np.array([5])]
    same = greedy_agreement(_model(), _model(), prompts, tokens=6, length=8)
    assert same == {"sequences": 2, "tokens_each": 6, "identical_sequences": 2,
                    "mean_common_prefix": 6.0}  # fmt: skip
    # from 0: 1 2 3 then 3 -> 5 differs from 4 (third token); from 5: 6 7 0 1 2 3 all agree
    flipped = greedy_agreement(_model({3}), _model(), prompts, tokens=6, length=8)
    assert flipped["identical_sequences"] == 1 and flipped["mean_common_prefix"] == (3 + 6) / 2


def test_int8_rows_round_each_block_of_32_to_its_own_scale():
    x = np.concatenate([np.linspace(-1, 1, 32), np.linspace(-100, 100, 32)])[None]
    got = np.asarray(int8_rows(jnp.asarray(x, jnp.float32)))[0]
    for block, top in ((got[:32], 1.0), (got[32:], 100.0)):
        steps = block / (top / 127)
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)  # on the block's grid
    np.testing.assert_allclose(got, x[0], atol=100 / 127 / 2 + 1e-5)
    assert not np.asarray(int8_rows(jnp.zeros((1, 32)))).any()


def _run(workload: str, wall: float, tokens: int, first_ids: list, busy_cpu: float = 0.0):
    quiet = {"load_before": 0.5, "others_cpu_s": busy_cpu, "wall_s": wall}
    return {"workload": workload, "wall_s": wall, "cpu_s": wall, "output_tokens": tokens,
            "first_ids": first_ids, "quietness": quiet}  # fmt: skip


def test_round_rows_compare_each_side_with_float32():
    def side(walls: tuple[float, ...], ids: list, weights: int) -> dict:
        runs = [_run("batch-1", walls[0], 128, ids[:1], busy_cpu=walls[0])]
        if len(walls) > 1:
            runs.append(_run("32-seqs", walls[1], 4096, ids))
        return {"runs": runs, "weight_bytes": weights, "rss_bytes": 2 * weights}

    runs = {
        "packed": side((1.28, 20.0), [[1, 2], [3, 4]], 97_000_000),
        "float32": side((2.56, 20.48), [[1, 2], [3, 4]], 538_000_000),
        "llama.cpp": side((1.6,), [[1, 9]], 98_000_000),
    }
    rows = round_rows(runs, 0, max_load=1.0)
    by = {(r["side"], r["workload"]): r for r in rows}
    assert by["packed", "batch-1"]["ms_per_output_token"] == 10.0
    assert by["float32", "32-seqs"]["output_tok_s"] == 200.0
    assert by["packed", "32-seqs"]["first_ids_equal"] == "2/2"
    assert by["llama.cpp", "batch-1"]["first_ids_equal"] == "0/1"
    assert by["packed", "batch-1"]["busy"] and not by["packed", "32-seqs"]["busy"]
    text = table(rows)
    assert "| 1 | packed | batch-1 | 10.0 |" in text and "| 97 | 194 |" in text
