"""The on-device sampler against float64 numpy references (vLLM's definitions), transformers'
repetition penalty and sequence bias (logit_bias), and hand-computed penalty cases.

Logits are a shuffled, strictly increasing grid (gaps >= 1e-4), and every min_p / top_p is set
halfway between two neighbouring reference values, so no float32 rounding can move a token
across a threshold: kept sets must match exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.core.stopping import StopConditions
from jserve.runtime.compilation import compilation_count, forbid_compilation
from jserve.runtime.sampler import (
    TOP_CANDIDATES,
    KeptSet,
    Sampler,
    _largest,
    apply_penalties,
    draw,
    first_argmax,
    kept_set,
)
from jserve.runtime.sampling_tensors import SamplingRow, SamplingTensorBuilder, seeded_uniforms
from jserve.sampling_params import MAX_LOGPROBS, SamplingParams
from tests.runtime.conftest import BUCKETS, MAX_MODEL_LEN, V  # the shared sampler's sizes

EOS = 2


def filter_logits(logits: jax.Array, t) -> jax.Array:
    """Temperature-scaled logits, -inf outside the min-p / top-k / top-p set, [S, V]: the
    [S, V] form of the sampler's `kept_set`, which sampling never forms."""
    return kept_set(logits, t).scaled(logits)


def distinct_logits(rng: np.random.Generator, rows: int, scale: float = 2.0) -> np.ndarray:
    """[rows, V] float32, each row a shuffled strictly increasing grid (no ties)."""
    grid = np.sort(rng.standard_normal((rows, V)), -1) * scale + np.arange(V) * 1e-4
    return rng.permuted(grid, axis=1).astype(np.float32)


def row(params: SamplingParams, seed: int | None = 0, prompt=(), output=()) -> SamplingRow:
    """The row the engine would build: banned ids from the stop rules, EOS = `EOS`."""
    stop = StopConditions.from_params(params, [EOS], params.max_tokens or 16)
    return SamplingRow(params, seed, list(prompt), list(output), stop.banned_ids(len(output)))


# --- numpy reference (float64) ---------------------------------------------------------------


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def ref_keep(x, temperature, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """vLLM's order: temperature, min-p, top-k, then top-p on what is left."""
    z = x.astype(np.float64) / temperature
    keep = softmax(z) >= min_p * softmax(z).max()
    if top_k:
        keep &= z >= np.sort(z[keep])[::-1][min(top_k, keep.sum()) - 1]
    if top_p < 1:
        q = softmax(np.where(keep, z, -np.inf))
        order = np.argsort(-z, kind="stable")
        above = np.concatenate([[0.0], np.cumsum(q[order])])
        heavier = above[np.searchsorted(-z[order], -z, "left")]  # mass strictly above each
        keep &= heavier < top_p
    return keep


def midpoint_params(x, temperature, top_k=0, min_p_keep=0, top_p_keep=0) -> SamplingParams:
    """Params whose min_p keeps `min_p_keep` tokens and top_p `top_p_keep`, with wide margins."""
    z = x.astype(np.float64) / temperature
    min_p = 0.0
    if min_p_keep:
        ratio = np.sort(softmax(z) / softmax(z).max())[::-1]
        assert (ratio[min_p_keep - 1] - ratio[min_p_keep]) / ratio[min_p_keep - 1] > 1e-4
        min_p = (ratio[min_p_keep - 1] + ratio[min_p_keep]) / 2
    keep = ref_keep(x, temperature, top_k, 1.0, min_p)
    top_p = 1.0
    if top_p_keep:
        q = np.sort(softmax(np.where(keep, z, -np.inf)))[::-1]
        before = np.cumsum(q) - q
        assert before[top_p_keep] - before[top_p_keep - 1] > 2e-5
        top_p = (before[top_p_keep - 1] + before[top_p_keep]) / 2
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


# --- penalties, masks, greedy -----------------------------------------------------------------


def _penalised(builder, x, rows) -> np.ndarray:
    return np.asarray(jax.jit(apply_penalties)(x, builder.build(rows, x.shape[0])))


def test_repetition_penalty_matches_transformers():
    """transformers' RepetitionPenaltyLogitsProcessor over prompt + output ids is vLLM's rule."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(1)
    x = distinct_logits(rng, 4)
    prompt, output = [7, 7, 9, 400, 9999], [9, 11, 11, 11, 400, 3]
    x[:, 11] = -np.abs(x[:, 11])  # both signs among the penalised ids
    x[:, 9] = np.abs(x[:, 9])
    penalties = [1.3, 0.8, 2.0, 1.0]
    rows = [
        row(SamplingParams(repetition_penalty=p), prompt=prompt, output=output) for p in penalties
    ]
    got = _penalised(SamplingTensorBuilder((4,), V, MAX_MODEL_LEN), x, rows)
    ids = torch.tensor([prompt + output])
    for i, penalty in enumerate(penalties):
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids, torch.tensor(x[i : i + 1]))[0]
        np.testing.assert_allclose(got[i], want.numpy(), rtol=1e-6, atol=0)


def test_logit_bias_is_added_before_the_repetition_penalty():
    """logit_bias is transformers' SequenceBiasLogitsProcessor over one-token sequences, and
    vLLM applies it before the penalties: bias, then repetition, as transformers' processors
    compose in that order. A row without a bias in a biased batch passes bit-exact."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    rng = np.random.default_rng(2)
    x = distinct_logits(rng, 3)
    prompt, output = [7, 9], [9, 11]
    x[:, 11] = np.abs(x[:, 11]) + 0.5  # a penalised id whose bias flips its logit's sign
    bias = {11: -3.0, 7: 2.5, 12: 100.0, V - 1: -100.0}
    params = [
        SamplingParams(logit_bias=bias),
        SamplingParams(logit_bias=bias, repetition_penalty=1.5),
        SamplingParams(),
    ]
    rows = [row(p, prompt=prompt, output=output) for p in params]
    got = _penalised(
        SamplingTensorBuilder((4,), V, MAX_MODEL_LEN), np.pad(x, ((0, 1), (0, 0))), rows
    )
    ids = torch.tensor([prompt + output])
    biased = SequenceBiasLogitsProcessor([[[k], v] for k, v in bias.items()])
    for i, p in enumerate(params[:2]):
        want = biased(ids, torch.tensor(x[i : i + 1], dtype=torch.float64))
        if p.repetition_penalty != 1:
            want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, want)
        np.testing.assert_allclose(got[i], want[0].numpy(), rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[2], x[2])


def test_a_logit_bias_alone_moves_greedy_and_sampled_tokens(sampler):
    """A batch whose only processing is a logit bias takes the processed path: greedy takes
    the biased argmax, and a +100 bias makes a token all but certain for a sampled row."""
    rng = np.random.default_rng(6)
    x = distinct_logits(rng, 4)
    x[1] = x[0]
    low = int(np.argmin(x[0]))
    rows = [
        row(SamplingParams(temperature=0, logit_bias={low: 100.0})),
        row(SamplingParams(temperature=1.0, logit_bias={low: 100.0}), seed=5),
    ]
    assert sampler.sample(jnp.asarray(x), rows).tokens[:2].tolist() == [low, low]
    second = int(np.argsort(x[0])[-2])
    top_banned = row(SamplingParams(temperature=0, logit_bias={int(np.argmax(x[0])): -100.0}))
    assert sampler.sample(jnp.asarray(x), [top_banned]).tokens[0] == second


def test_presence_frequency_and_min_tokens_on_hand_computed_logits():
    """vLLM's documented rules: presence subtracts once per id present in the output,
    frequency once per occurrence in the output (prompt ids are not counted); repetition
    (prompt and output) applies first; the min_tokens ban sets EOS and stop ids to -inf."""
    x = np.zeros((4, V), np.float32)
    x[:, [7, 9, 11, 12, EOS, 5]] = [3.0, 2.0, -1.0, 0.5, 4.0, 1.0]
    prompt, output = [7, 7, 9], [9, 11, 11, 11]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0, min_tokens=5, stop_token_ids=[5]),
        SamplingParams(),
    ]
    rows = [row(p, prompt=prompt if i != 2 else (), output=output) for i, p in enumerate(params)]
    got = _penalised(SamplingTensorBuilder((4,), V, MAX_MODEL_LEN), x, rows)
    want = x.astype(np.float64).copy()
    want[0, [9, 11]] = [2.0 - 0.25 - 0.5, -1.0 - 0.75 - 0.5]  # 7 is only in the prompt
    want[1, [7, 9, 11]] = [3.0 / 2, 2.0 / 2 - 0.25 - 0.5, -1.0 * 2 - 0.75 - 0.5]
    want[2, [9, 11]] = [2.0 + 1.0, -1.0 + 1.0]
    want[2, [EOS, 5]] = -np.inf  # 4 output tokens < min_tokens=5
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The same slots now neutral (their history left stale on purpose): logits pass bit-exact.
    neutral = SamplingTensorBuilder((4,), V, MAX_MODEL_LEN)
    neutral.build(rows, 4)
    np.testing.assert_array_equal(
        _penalised(neutral, x, [row(SamplingParams(), output=output)] * 2), x
    )


def test_filter_masks_match_reference_on_fast_and_exact_paths():
    rng = np.random.default_rng(2)
    x = distinct_logits(rng, 8)
    flat = distinct_logits(rng, 1, scale=0.3)[0]  # top_p=0.5 needs hundreds of tokens
    x[7] = flat
    params = [
        midpoint_params(x[0], 0.7, min_p_keep=40),
        SamplingParams(temperature=1.3, top_k=17),
        SamplingParams(temperature=1.0, top_k=TOP_CANDIDATES + 300),  # exact top-k
        midpoint_params(x[3], 0.9, top_p_keep=12),
        midpoint_params(x[4], 1.1, top_k=60, min_p_keep=90, top_p_keep=25),
        midpoint_params(x[5], 0.5, top_k=500, min_p_keep=30),  # top_k beyond the min-p set
        midpoint_params(x[6], 2.0, top_k=TOP_CANDIDATES + 50, top_p_keep=150),  # exact both
        midpoint_params(x[7], 1.0, top_p_keep=1200),  # exact top-p
    ]
    builder = SamplingTensorBuilder((8,), V, MAX_MODEL_LEN)
    filtered = jax.jit(filter_logits)
    got = np.asarray(filtered(x, builder.build([row(p) for p in params], 8)))
    for i, p in enumerate(params):
        keep = ref_keep(x[i], p.temperature, p.top_k, p.top_p, p.min_p)
        np.testing.assert_array_equal(np.isfinite(got[i]), keep, err_msg=f"row {i}: {p}")
        np.testing.assert_allclose(got[i][keep], x[i][keep] / p.temperature, rtol=1e-6)
    # Fast-path rows give the same set when no row in the batch takes the exact branch.
    fast_only = [params[i] if i in (0, 1, 3, 4) else SamplingParams() for i in range(8)]
    again = np.asarray(filtered(x, builder.build([row(p) for p in fast_only], 8)))
    np.testing.assert_array_equal(again[[0, 1, 3, 4]], got[[0, 1, 3, 4]])


def test_filter_keeps_tokens_whose_softmax_weight_underflows():
    x = np.zeros((2, V), np.float32)
    x[:, 7] = 200.0  # every other token's exp(z - zmax) is 0 in float32, yet it is kept
    builder = SamplingTensorBuilder((2,), V, MAX_MODEL_LEN)
    rows = [row(SamplingParams(temperature=1.0)), row(SamplingParams(temperature=0.5, top_k=3))]
    got = np.asarray(jax.jit(filter_logits)(x, builder.build(rows, 2)))
    np.testing.assert_array_equal(got[0], x[0])  # no filter: every token, scaled by 1
    assert np.isfinite(got[1]).sum() == V  # top_k 3 with ties at 0: all tied tokens stay


def test_candidate_search_returns_the_largest_values_even_with_ties():
    rng = np.random.default_rng(3)
    for v in (V, 64 * TOP_CANDIDATES + 1, 300):
        z = rng.integers(-50, 50, (3, v)).astype(np.float32)  # many ties
        z[1, ::2] = -np.inf
        got = np.asarray(jax.jit(_largest)(z))
        want = -np.sort(-z, -1)[:, : min(TOP_CANDIDATES, v)]
        np.testing.assert_array_equal(got, want)


def test_greedy_is_first_argmax_of_penalised_logits(sampler):
    rng = np.random.default_rng(4)
    x = distinct_logits(rng, 4)
    x[1, [10, 20]] = x[1].max() + 1  # a tie: the first index wins
    top = int(np.argmax(x[2]))
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=1e-6)),  # below vLLM's epsilon: greedy
        row(SamplingParams(temperature=0, repetition_penalty=2.0), output=[top]),
    ]
    got = sampler.sample(jnp.asarray(x), rows).tokens
    assert got[0] == np.argmax(x[0]) and got[1] == 10
    penalised = x[2].copy()
    penalised[top] = penalised[top] / 2.0 if penalised[top] > 0 else penalised[top] * 2.0
    assert got[2] == np.argmax(penalised) and got[2] != top


@pytest.mark.parametrize("v", [V, 4096, 130, 7])
def test_first_argmax_takes_the_first_maximum_of_any_row(v):
    rng = np.random.default_rng(5)
    x = rng.integers(-5, 5, (8, v)).astype(np.float32)  # ties everywhere
    x[1] = -np.inf  # every token masked: the first one
    x[2, [v // 3, v - 1]] = 9  # a tie between blocks: the first index wins
    x[3, -1] = 9  # the maximum in the last, partial block
    x[4, v // 2] = np.nan  # a broken row (or an all-NaN pad row) still gives an id
    x[5, :] = np.nan
    got = np.asarray(jax.jit(first_argmax)(x))
    np.testing.assert_array_equal(got[[0, 1, 2, 3, 6, 7]], np.argmax(x[[0, 1, 2, 3, 6, 7]], -1))
    assert got[2] == v // 3 and got[3] == v - 1
    assert ((got[4:6] >= 0) & (got[4:6] < v)).all()


def test_plain_greedy_batch_gives_the_tokens_a_processed_batch_gives(sampler):
    rng = np.random.default_rng(6)
    x = distinct_logits(rng, 8)
    x[:, 1234] = x.max() + 1  # every row's maximum; row 3 bans it below
    x[5, [17, 9999]] = x.max() + 2  # a tie: the first index wins
    plain = [row(SamplingParams(temperature=0)) for _ in range(6)]
    banned = row(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1234]))
    processed = [*plain[:3], banned, row(SamplingParams(temperature=0.7, seed=1)), *plain[5:]]
    got_plain = sampler.sample(jnp.asarray(x), plain).tokens
    got_processed = sampler.sample(jnp.asarray(x), processed).tokens
    assert got_plain[:6].tolist() == [1234] * 5 + [17]
    assert got_processed[[0, 1, 2, 5]].tolist() == [1234, 1234, 1234, 17]
    assert got_processed[3] == np.argmax(np.where(np.arange(V) == 1234, -np.inf, x[3]))


def test_min_tokens_bans_eos_and_stop_ids_until_reached(sampler):
    x = np.zeros((4, V), np.float32)
    x[:, EOS], x[:, 5], x[:, 6] = 10, 9, 8
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    rows = [row(params, output=[1] * n) for n in range(3)]
    assert sampler.sample(jnp.asarray(x), rows).tokens[:3].tolist() == [6, 6, EOS]


# --- seeded random draws ----------------------------------------------------------------------


def generate(sampler, logits, batch, index, steps=10) -> list[int]:
    """Tokens of batch[index] over `steps` steps, every row growing its output."""
    outputs = [list(r.output_token_ids) for r in batch]
    mine = []
    s = next(b for b in BUCKETS if b >= len(batch))
    for step in range(steps):
        rows = [r._replace(output_token_ids=o) for r, o in zip(batch, outputs, strict=True)]
        padded = np.zeros((s, V), np.float32)
        padded[: len(batch)] = np.roll(logits, step, axis=1)
        tokens = sampler.sample(jnp.asarray(padded), rows).tokens
        for o, t in zip(outputs, tokens, strict=False):
            o.append(int(t))
        mine.append(int(tokens[index]))
    return mine


def test_seeded_request_samples_the_same_alone_elsewhere_and_in_any_batch(sampler):
    rng = np.random.default_rng(5)
    x = distinct_logits(rng, 16, scale=0.5)
    me = row(
        SamplingParams(
            temperature=0.9, top_k=400, top_p=0.9, min_p=0.001, repetition_penalty=1.2,
            presence_penalty=0.3, seed=42, logprobs=3,
        ),
        seed=42, prompt=[1, 2, 3], output=[4],
    )  # fmt: skip
    others = [
        row(SamplingParams(temperature=0), seed=1),
        row(SamplingParams(temperature=1.5, top_p=0.999), seed=None),  # exact top-p path
        row(SamplingParams(temperature=0.3, frequency_penalty=1.0), seed=7, output=[9, 9]),
        row(SamplingParams(temperature=1.0, top_k=TOP_CANDIDATES + 1, logprobs=20), seed=8),
    ]
    alone = generate(sampler, x[:1], [me], 0)
    at_row_5 = [others[i % 4] for i in range(5)] + [me] + others[:2]
    logits_5 = np.concatenate([x[1:6], x[:1], x[6:8]])
    big = [others[i % 4] for i in range(11)] + [me] + others
    logits_11 = np.concatenate([x[1:12], x[:1], x[12:16]])
    assert generate(sampler, logits_5, at_row_5, 5) == alone
    assert generate(sampler, logits_11, big, 11) == alone
    assert len(set(alone)) > 3  # it really is random


def test_seeds_and_steps_give_different_streams(sampler):
    x = np.zeros((1, V), np.float32)  # uniform over the vocabulary
    stream = {s: generate(sampler, x, [row(SamplingParams(), seed=s)], 0) for s in (1, 2)}
    assert stream[1] != stream[2]
    assert len(set(stream[1])) == len(stream[1])  # each step draws afresh
    unseeded = [generate(sampler, x, [row(SamplingParams(), seed=None)], 0) for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_seeded_uniforms_depend_only_on_seed_and_count():
    seeds = np.array([0, 1, 2**64 - 1, 0], np.uint64)
    counts = np.array([0, 0, 0, 1], np.uint64)
    u = seeded_uniforms(seeds, counts)
    assert u.dtype == np.float32 and u.shape == (4, 2)
    assert ((u >= 0) & (u < 1)).all() and len(np.unique(u)) == 8
    np.testing.assert_array_equal(seeded_uniforms(seeds[::-1], counts[::-1]), u[::-1])


def test_sampled_frequencies_match_the_filtered_softmax(sampler):
    """8,000 seeded draws per case; fixed seeds, so the bound is checked, never flaky."""
    rng = np.random.default_rng(6)
    x = np.full(V, -30, np.float32)
    heavy = rng.choice(V, 12, replace=False)  # spread over many inverse-CDF blocks
    x[heavy] = np.linspace(0.0, 3.0, 12)
    cases = [
        SamplingParams(temperature=0.8),
        midpoint_params(x, 1.2, top_k=10, min_p_keep=11, top_p_keep=7),
    ]
    for params in cases:
        keep = ref_keep(x, params.temperature, params.top_k, params.top_p, params.min_p)
        want = softmax(np.where(keep, x / params.temperature, -np.inf))
        counts = np.zeros(V)
        logits = jnp.asarray(np.tile(x, (16, 1)))
        for step in range(500):
            rows = [row(params, seed=s, output=[0] * step) for s in range(16)]
            np.add.at(counts, sampler.sample(logits, rows).tokens, 1)
        freq = counts / counts.sum()
        assert freq[~keep].sum() == 0
        assert 0.5 * np.abs(freq - want).sum() < 0.02, (freq[heavy], want[heavy])


def test_draw_never_returns_a_masked_token_at_extreme_uniforms():
    z = np.full((4, 1000), -np.inf, np.float32)
    z[:, 256:258] = 0.0  # kept tokens at a block's start, the rest of the row masked
    z[2:, 999] = 0.0  # and the very last token
    u = np.array([[0, 0], [1 - 2**-24, 1 - 2**-24], [0, 1 - 2**-24], [1 - 2**-24, 0]])
    none = np.full(4, -np.inf, np.float32)
    kept = KeptSet(np.ones(4, np.float32), z.max(-1), none, none)  # keep every finite z
    got = np.asarray(jax.jit(draw)(z, kept, u.astype(np.float32)))
    assert np.isfinite(z[np.arange(4), got]).all(), got


# --- logprobs and padding ---------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top(sampler):
    rng = np.random.default_rng(7)
    x = distinct_logits(rng, 4)
    rows = [
        row(SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=5),
            output=[int(np.argmax(x[0]))]),
        row(SamplingParams(temperature=0, logprobs=0)),
        row(SamplingParams(temperature=1.0, logprobs=MAX_LOGPROBS)),
        row(SamplingParams(temperature=1.0)),
    ]  # fmt: skip
    out = sampler.sample(jnp.asarray(x), rows)
    for i in range(3):
        ref = x[i].astype(np.float64) - np.log(np.exp(x[i].astype(np.float64)).sum())
        token = out.tokens[i]
        np.testing.assert_allclose(out.sampled_logprob[i], ref[token], atol=2e-5)
        np.testing.assert_array_equal(out.top_ids[i], np.argsort(-ref)[:MAX_LOGPROBS])
        np.testing.assert_allclose(out.top_logprobs[i], np.sort(ref)[::-1][:20], atol=2e-5)
    assert out.row(3) == (out.tokens[3], None)
    assert out.row(1)[1] == [(out.tokens[1], pytest.approx(out.sampled_logprob[1]))]
    token, top = out.row(0)
    assert len(top) == 6 and top[0][0] == token
    assert [t for t, _ in top[1:]] == out.top_ids[0, :5].tolist()


def test_garbage_in_padding_rows_leaves_real_rows_unchanged(sampler):
    rng = np.random.default_rng(8)
    x = distinct_logits(rng, 8)
    rows = [
        row(SamplingParams(temperature=1.0, top_p=0.999, logprobs=2), seed=3),
        row(SamplingParams(temperature=0, presence_penalty=1.0, min_tokens=3), output=[5]),
        row(SamplingParams(temperature=0.5, top_k=TOP_CANDIDATES + 5), seed=4),
    ]
    clean = sampler.sample(jnp.asarray(x), rows)
    x[3:] = np.nan
    x[5, :7] = np.inf
    x[6, 9:] = -np.inf
    dirty = sampler.sample(jnp.asarray(x), rows)
    for field in ("tokens", "sampled_logprob", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(dirty, field)[:3], getattr(clean, field)[:3])
    assert np.isfinite(dirty.sampled_logprob[:3]).all()
    assert ((dirty.tokens >= 0) & (dirty.tokens < V)).all()


# --- compilation and the host builder ---------------------------------------------------------


def test_after_precompile_no_batch_compiles(sampler):
    fresh = Sampler(V, (2, 4), MAX_MODEL_LEN)
    assert fresh.precompile() > 0
    rng = np.random.default_rng(9)
    batches = [
        [row(SamplingParams(temperature=0))],
        [row(SamplingParams(temperature=0.8, seed=1))],
        [row(SamplingParams(top_k=3, top_p=0.5, min_p=0.1)), row(SamplingParams(top_p=0.9999))],
        [row(SamplingParams(top_k=TOP_CANDIDATES + 1))],
        [row(SamplingParams(repetition_penalty=1.5, min_tokens=4), prompt=[1], output=[2])],
        [row(SamplingParams(logprobs=20)), row(SamplingParams(temperature=0, logprobs=1))],
    ]
    logits = {s: jnp.asarray(distinct_logits(rng, s)) for s in (2, 4)}  # jnp.asarray compiles
    before = compilation_count()
    with forbid_compilation():
        for s in (2, 4):
            for batch in batches:
                fresh.sample(logits[s], batch)
    assert compilation_count() == before


def test_builder_pads_with_neutral_values_in_reused_buffers():
    builder = SamplingTensorBuilder((4, 8), V, MAX_MODEL_LEN)
    full = SamplingParams(
        temperature=0.5, top_k=V + 5, top_p=0.5, min_p=0.2, repetition_penalty=1.5,
        presence_penalty=1, frequency_penalty=1, logprobs=2, min_tokens=1, stop_token_ids=[3],
    )  # fmt: skip
    first = builder.build([row(full, prompt=[1, 2], output=[3])] * 8, 8)
    assert first.top_k[0] == 0  # top_k beyond the vocabulary is off
    assert first.token_history[0, :4].tolist() == [1, 2, 3, V] and first.prompt_len[0] == 2
    second = builder.build([row(SamplingParams(temperature=1e-6))], 8)
    assert np.shares_memory(first.temperature, second.temperature)
    assert second.temperature.tolist() == [0.0] * 8
    assert second.top_p.tolist() == [1.0] * 8 and second.min_p.tolist() == [0.0] * 8
    assert second.repetition_penalty.tolist() == [1.0] * 8
    assert not second.want_logprobs.any() and (second.banned_ids == V).all()
    biased = builder.build([row(SamplingParams(logit_bias={5: 1.5, 9: -2.0}))] * 2, 4)
    assert biased.bias_ids[:, :3].tolist() == [[5, 9, V]] * 2 + [[V, V, V]] * 2
    assert biased.bias_values[:2, :2].tolist() == [[1.5, -2.0]] * 2
    assert (builder.build([row(SamplingParams())], 4).bias_ids == V).all()


def test_builder_rejects_what_it_cannot_hold():
    builder = SamplingTensorBuilder((4, 8), V, 8, max_banned_ids=2)
    with pytest.raises(ValueError, match="bucket"):
        builder.build([row(SamplingParams())], 5)
    with pytest.raises(ValueError, match="bucket"):
        builder.build([row(SamplingParams())] * 5, 4)
    with pytest.raises(ValueError, match="history_len=8"):
        builder.build([row(SamplingParams(presence_penalty=1), prompt=[1] * 6, output=[2] * 3)], 4)
    with pytest.raises(ValueError, match="stop_token_ids"):
        builder.check_banned_ids([1, 2, 3])
    with pytest.raises(ValueError, match="stop_token_ids"):
        builder.build([row(SamplingParams(min_tokens=1, stop_token_ids=[1, 3]))], 4)
