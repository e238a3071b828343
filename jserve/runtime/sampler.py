"""On-device sampling: penalties, temperature, min-p / top-k / top-p, seeded draws, logprobs.

Semantics follow vLLM's sampler. Every row is computed from its own logits, parameters and
uniforms only, so a seeded request samples the same token whoever else is in the batch, at any
row index and in any bucket.

Per row (x = the model's raw logits):
1. logprobs of x (vLLM's default "raw" logprobs), whatever the processing below does;
2. penalties: the row's logit_bias first (vLLM's order), then repetition over prompt and
   output ids, presence and frequency over output ids; each row's banned ids (the min_tokens
   ban, decided by jserve.core.stopping) are set to -inf; tokens outside a constrained row's
   grammar bitmask (jserve.structured) are set to -inf;
3. greedy rows take the first argmax of the penalised logits;
4. random rows divide by the temperature, keep the tokens passing min-p, top-k and top-p (in
   vLLM's order: top-p measures the mass left after min-p and top-k), and draw by inverse CDF
   with the row's two host-made uniforms.

One executable per sequence bucket: features a batch does not use (penalties, grammar masks,
random rows, filters, logprobs) are skipped by `lax.switch` / `lax.cond` on batch-wide flags,
never by a static variant, so nothing multiplies the compile count. Rows not using a feature
hold neutral values, so a row's token and logprobs are the same whichever branches its batch
ran. No branch returns [S, V] logits: on XLA:CPU that costs a copy even when nothing changed.

No full-vocabulary sort (on a CPU it costs tens of times a sampler call: bench/RESULTS.md,
"Sampler", has the figures and how to re-measure them). Top-k and top-p
read the TOP_CANDIDATES largest logits; a row whose cut-off lies below them (top_k larger than
that, or top_p mass not reached inside them: about 30% of SmolLM2's rows at temperature 1,
top_p 0.95) is resolved exactly by bisection over float32 bit patterns, in a loop over only
those rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jserve.runtime.sampling_tensors import SamplingRow, SamplingTensorBuilder, SamplingTensors
from jserve.runtime.startup import StartupPhase
from jserve.sampling_params import MAX_LOGPROBS, SamplingParams

TOP_CANDIDATES = 128  # logits read by the top-k / top-p fast path
_CANDIDATE_BLOCK = 64  # vocabulary block of the candidate search
_BLOCK = 256  # inverse CDF: pick a block of the vocabulary, then a token inside it
_ARGMAX_BLOCK = 128  # vocabulary block of the greedy argmax


class SamplerOutput(NamedTuple):
    tokens: jax.Array  # [S] int32
    sampled_logprob: jax.Array  # [S] float32 raw logprob of the sampled (or forced) token
    sampled_rank: jax.Array  # [S] int32 its rank: 1 + tokens of larger logprob (0: not asked)
    top_ids: jax.Array  # [S, MAX_LOGPROBS] int32 by descending logprob (0 when no row asked)
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] float32 (0 when no row asked)


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """The logit bias, vLLM's repetition / presence / frequency penalties, then the
    min_tokens ban, [S, V].

    The bias comes first (vLLM's order), so a biased id takes the penalties on its biased
    logit. Its few ids are computed apart, [S, L], and written over the penalised row: adding
    it to [S, V] first cost one more [S, V] buffer a call, which on XLA:CPU is fresh pages
    (bench/RESULTS.md, "Sampler")."""
    s, v = logits.shape
    rows = jnp.arange(s)[:, None]
    history = t.token_history
    is_output = jnp.arange(history.shape[1])[None, :] >= t.prompt_len[:, None]
    seen = jnp.zeros((s, v), jnp.bool_).at[rows, history].set(True, mode="drop")
    output_ids = jnp.where(is_output, history, v)
    counts = jnp.zeros((s, v), jnp.int32).at[rows, output_ids].add(1, mode="drop")

    def penalised(x: jax.Array, seen: jax.Array, counts: jax.Array) -> jax.Array:
        repetition = jnp.where(seen, t.repetition_penalty[:, None], 1.0)
        x = jnp.where(x > 0, x / repetition, x * repetition)
        return (
            x - t.frequency_penalty[:, None] * counts - t.presence_penalty[:, None] * (counts > 0)
        )

    at = jnp.minimum(t.bias_ids, v - 1)  # pads (id v) read any id; their writes are dropped
    biased = penalised(
        jnp.take_along_axis(logits, at, 1) + t.bias_values,
        jnp.take_along_axis(seen, at, 1),
        jnp.take_along_axis(counts, at, 1),
    )
    logits = penalised(logits, seen, counts).at[rows, t.bias_ids].set(biased, mode="drop")
    return logits.at[rows, t.banned_ids].set(-jnp.inf, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where a row's packed bitmask [S, W] int32 has a 0 bit (bit j of word i: token
    32 i + j, llguidance's layout), [S, V]; an all-ones row (-1 words) changes nothing."""
    s, v = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(s, -1)[:, :v] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """x [S, V] as [S, ceil(V / block), block], padded with -inf."""
    s, v = x.shape
    num_blocks = -(-v // block)
    if num_blocks * block != v:
        x = jnp.pad(x, ((0, 0), (0, num_blocks * block - v)), constant_values=-jnp.inf)
    return x.reshape(s, num_blocks, block)


def _row_max(x: jax.Array) -> jax.Array:
    """Each row's max [S], taken block by block: this reads the row once, where a plain max over
    [S, V] made XLA:CPU write the max broadcast to [S, V] for its consumers."""
    return jnp.max(jnp.max(_blocks(x, _ARGMAX_BLOCK), -1), -1)


def first_argmax(x: jax.Array) -> jax.Array:
    """Index of the first maximum per row, [S] int32 (a row holding NaN still gets an id < V).

    Blocked, so the [S, V] row is read once: each block's max, the row's max, the first
    block reaching it, then the first index inside that one block. XLA's own argmax reads
    the row more than once on XLA:CPU (bench/RESULTS.md, "Where a step's time goes now").
    """
    v = x.shape[1]
    blocks = _blocks(x, _ARGMAX_BLOCK)
    block_max = jnp.max(blocks, -1)  # [S, blocks]
    row_max = jnp.max(block_max, -1, keepdims=True)
    block_ids = jax.lax.broadcasted_iota(jnp.int32, block_max.shape, 1)
    last = block_max.shape[1] - 1
    first = jnp.min(jnp.where(block_max == row_max, block_ids, last), -1)  # [S]
    block = jnp.take_along_axis(blocks, first[:, None, None], 1)[:, 0]  # [S, _ARGMAX_BLOCK]
    lane = jax.lax.broadcasted_iota(jnp.int32, block.shape, 1)
    within = jnp.min(jnp.where(block == row_max, lane, _ARGMAX_BLOCK), -1)
    return jnp.minimum(first * _ARGMAX_BLOCK + within, v - 1)


# --- cut-offs: the kept set of a row is {z >= cut} -----------------------------------------

_SIGN = np.uint32(0x80000000)


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 whose unsigned order is the float order of x (NaN excluded)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((bits & _SIGN) != 0, ~bits, bits | _SIGN)


def _from_order_key(key: jax.Array) -> jax.Array:
    bits = jnp.where((key & _SIGN) != 0, key & ~_SIGN, ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _smallest_passing(z: jax.Array, weight: jax.Array | int, limit: jax.Array) -> jax.Array:
    """The smallest float t with sum(weight[z > t]) < limit, for one row z [V].

    That sum shrinks as t grows and is 0 at max(z), so the tokens z >= t are exactly those
    whose strictly larger neighbours weigh less than `limit`. 32 halvings of the uint32 range.
    """
    hi = _order_key(jnp.max(z))
    lo = _order_key(jnp.float32(-jnp.inf)) - 1  # below -inf: taken to fail

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        passes = jnp.sum(jnp.where(z > _from_order_key(mid), weight, 0)) < limit
        active = hi - lo > 1  # once converged, mid == lo, which may be a NaN pattern
        return jnp.where(active & ~passes, mid, lo), jnp.where(active & passes, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return _from_order_key(hi)


def _largest(x: jax.Array) -> jax.Array:
    """The TOP_CANDIDATES largest values per row, descending, [S, C] (C <= V).

    The blocks holding them are among the C blocks with the largest maxima, so only those are
    searched, which is cheaper than lax.top_k over the whole row (bench/RESULTS.md, "Sampler").
    """
    s, v = x.shape
    if -(-v // _CANDIDATE_BLOCK) <= TOP_CANDIDATES:
        return jax.lax.top_k(x, min(TOP_CANDIDATES, v))[0]
    blocks = _blocks(x, _CANDIDATE_BLOCK)
    _, best = jax.lax.top_k(jnp.max(blocks, -1), TOP_CANDIDATES)
    searched = jnp.take_along_axis(blocks, best[:, :, None], 1).reshape(s, -1)
    return jax.lax.top_k(searched, TOP_CANDIDATES)[0]


class KeptSet(NamedTuple):
    """Which scaled logits z = x / temperature a row keeps: z - zmax >= log_min_p and z >= cut.

    Per-row values [S], applied to raw logits inside the fusions that read them, so no [S, V]
    mask or scaled copy is written (on XLA:CPU each is a fresh buffer, and at 64 rows their page
    faults cost more than the arithmetic). Greedy rows have temperature 1 and keep everything
    (their draw is discarded).
    """

    temperature: jax.Array
    zmax: jax.Array  # the row's largest z, always kept
    log_min_p: jax.Array  # log(0) = -inf keeps all
    cut: jax.Array  # top-k / top-p cut-off, -inf when neither is set

    def _column(self, a: jax.Array, x: jax.Array) -> jax.Array:
        return a.reshape(a.shape + (1,) * (x.ndim - 1))

    def _kept(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(z, z - zmax, kept mask) of raw logits x [S, ...]."""
        z = x / self._column(self.temperature, x)
        relative = z - self._column(self.zmax, x)
        kept = (relative >= self._column(self.log_min_p, x)) & (z >= self._column(self.cut, x))
        return z, relative, kept

    def weights(self, x: jax.Array) -> jax.Array:
        """exp(z - zmax) of the kept logits of x [S, ...] (raw logits), 0 elsewhere."""
        _, relative, kept = self._kept(x)
        return jnp.where(kept, jnp.exp(relative), 0.0)

    def scaled(self, x: jax.Array) -> jax.Array:
        """z of the kept logits of x [S, ...] (raw logits), -inf elsewhere."""
        z, _, kept = self._kept(x)
        return jnp.where(kept, z, -jnp.inf)


def _fast_cuts(
    logits: jax.Array, kept: KeptSet, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cut-offs from the TOP_CANDIDATES largest z: (top-k cut, both cuts, rows needing exact).

    `kept` has no cut yet. Division by a row's temperature keeps the order of its logits, so
    the largest z are the largest raw logits divided, and min-p, which keeps the top of that
    order, masks a tail.
    """
    candidates = kept.scaled(_largest(logits))  # [S, C] descending
    c = candidates.shape[1]
    kth = jnp.take_along_axis(candidates, jnp.clip(top_k - 1, 0, c - 1)[:, None], 1)
    topk_cut = jnp.where(top_k > 0, kth[:, 0], -jnp.inf)
    # log-sum-exp of the z left after min-p and top-k, summed block by block from the logits
    left = kept._replace(cut=topk_cut).weights(_blocks(logits, _BLOCK))
    lse = kept.zmax + jnp.log(jnp.sum(jnp.sum(left, -1), -1))
    mass = jnp.exp(jnp.where(candidates >= topk_cut[:, None], candidates, -jnp.inf) - lse[:, None])
    cumulative = jnp.cumsum(mass, -1)
    num_kept = jnp.sum(cumulative - mass < top_p[:, None], -1)  # >= 1: nothing precedes the top
    topp_cut = jnp.take_along_axis(candidates, (num_kept - 1)[:, None], 1)[:, 0]
    topp_cut = jnp.where(top_p < 1, topp_cut, -jnp.inf)
    needs_exact = (top_k > c) | ((top_p < 1) & (cumulative[:, -1] < top_p))
    return topk_cut, jnp.maximum(topk_cut, topp_cut), needs_exact


def _exact_cut(z: jax.Array, top_k: jax.Array, top_p: jax.Array, topk_cut: jax.Array) -> jax.Array:
    """One row's cut by bisection; `topk_cut` is reused unless top_k exceeds the candidates."""
    topk_cut = jax.lax.cond(
        top_k > min(TOP_CANDIDATES, z.shape[0]),
        lambda: _smallest_passing(z, 1, top_k),
        lambda: topk_cut,
    )
    z = jnp.where(z >= topk_cut, z, -jnp.inf)
    topp_cut = jax.lax.cond(
        top_p < 1,
        lambda: _smallest_passing(z, jnp.exp(z - jax.nn.logsumexp(z)), top_p),
        lambda: jnp.float32(-jnp.inf),
    )
    return jnp.maximum(topk_cut, topp_cut)


def _topk_topp_cuts(
    logits: jax.Array, kept: KeptSet, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Per-row cut (`kept` has none yet): fast for most rows, then a loop over only the rows
    that need exact."""
    topk_cut, cut, needs_exact = _fast_cuts(logits, kept, top_k, top_p)
    rows = jnp.nonzero(needs_exact, size=logits.shape[0], fill_value=0)[0]

    def fix(j: int, cut: jax.Array) -> jax.Array:
        i = rows[j]
        z = jax.tree.map(lambda a: a[i, None], kept).scaled(logits[i, None])[0]
        return cut.at[i].set(_exact_cut(z, top_k[i], top_p[i], topk_cut[i]))

    return jax.lax.fori_loop(0, jnp.sum(needs_exact), fix, cut)


def kept_set(logits: jax.Array, t: SamplingTensors) -> KeptSet:
    """The min-p / top-k / top-p set of every row of `logits` [S, V] at its temperature."""
    random_rows = t.temperature > 0
    temperature = jnp.where(random_rows, t.temperature, 1.0)
    # Division is monotonic, so the largest z is the largest logit divided: read from the raw
    # logits without forming z.
    zmax = _row_max(logits) / temperature
    no_cut = jnp.full(logits.shape[0], -jnp.inf, logits.dtype)
    kept = KeptSet(temperature, zmax, jnp.log(t.min_p), no_cut)
    top_k = jnp.where(random_rows, t.top_k, 0)
    top_p = jnp.where(random_rows, t.top_p, 1.0)
    cut = jax.lax.cond(
        jnp.any((top_k > 0) | (top_p < 1)),
        lambda: _topk_topp_cuts(logits, kept, top_k, top_p),
        lambda: no_cut,
    )
    return kept._replace(cut=cut)


# --- drawing ---------------------------------------------------------------------------------


def _inverse_cdf(cumulative: jax.Array, u: jax.Array) -> jax.Array:
    """First index whose cumulative weight exceeds u * total, [S]; never a zero-weight index.

    `cumulative` must be a running sum of non-negative weights (so it never decreases).
    """
    total = cumulative[:, -1:]
    index = jnp.sum(cumulative <= u[:, None] * total, -1)
    last_positive = jnp.sum(cumulative < total, -1)  # where the total was last raised
    return jnp.minimum(index, last_positive)


def draw(logits: jax.Array, kept: KeptSet, uniforms: jax.Array) -> jax.Array:
    """One sample per row of the kept set's softmax from two uniforms [S, 2]: a block, then a
    token inside it, [S]. The weights are summed block by block from the raw logits, and only
    the chosen block's are formed again."""
    blocks = _blocks(logits, _BLOCK)
    block = _inverse_cdf(jnp.cumsum(jnp.sum(kept.weights(blocks), -1), -1), uniforms[:, 0])
    inner = kept.weights(jnp.take_along_axis(blocks, block[:, None, None], 1))[:, 0]
    offset = _inverse_cdf(jnp.cumsum(inner, -1), uniforms[:, 1])
    return (block * _BLOCK + offset).astype(jnp.int32)


# --- the step --------------------------------------------------------------------------------


def _logprobs(logits: jax.Array, tokens: jax.Array, t: SamplingTensors) -> SamplerOutput:
    s = logits.shape[0]

    # The [S, V] logprobs are formed inside the branch: passed in from outside, XLA:CPU
    # formed them in every step, even when the branch was not taken.
    def wanted() -> tuple[jax.Array, ...]:
        logprobs = logits - jax.nn.logsumexp(logits, -1, keepdims=True)
        sampled = jnp.take_along_axis(logprobs, tokens[:, None], 1)
        rank = 1 + jnp.sum(logprobs > sampled, -1, dtype=jnp.int32)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
        return sampled[:, 0], rank, top_ids.astype(jnp.int32), top_logprobs

    def unwanted() -> tuple[jax.Array, ...]:
        top = (s, MAX_LOGPROBS)
        return (
            jnp.zeros(s, jnp.float32), jnp.zeros(s, jnp.int32), jnp.zeros(top, jnp.int32),
            jnp.zeros(top, jnp.float32),
        )  # fmt: skip

    return SamplerOutput(tokens, *jax.lax.cond(jnp.any(t.want_logprobs), wanted, unwanted))


def _any_penalty(t: SamplingTensors, vocab_size: int) -> jax.Array:
    return (
        jnp.any(t.repetition_penalty != 1)
        | jnp.any(t.presence_penalty != 0)
        | jnp.any(t.frequency_penalty != 0)
        | jnp.any(t.banned_ids < vocab_size)
        | jnp.any(t.bias_ids < vocab_size)
    )


def _any_bitmask(t: SamplingTensors) -> jax.Array:
    return jnp.any(t.token_bitmask != -1)


def _tokens(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Tokens [S] of `logits` after penalties and masks: greedy rows' first argmax, random
    rows' draw from their kept set."""
    greedy = first_argmax(logits)
    return jax.lax.cond(
        jnp.any(t.temperature > 0),
        lambda: jnp.where(t.temperature > 0, draw(logits, kept_set(logits, t), t.uniforms), greedy),
        lambda: greedy,
    )


@jax.jit
def sample(logits: jax.Array, t: SamplingTensors) -> SamplerOutput:
    """Sample one token per row of `logits` [S, V] float32 under `t` (S rows, same bucket).

    One `lax.switch` picks the batch's case and every branch returns tokens only: a branch
    that returned [S, V] logits (penalised or not) would cost a copy of them on XLA:CPU even
    when it changed nothing. A batch of plain greedy rows (offline and benchmark runs) takes
    the first argmax of the raw logits directly.
    """
    penalty, bitmask = _any_penalty(t, logits.shape[1]), _any_bitmask(t)
    random = jnp.any(t.temperature > 0)
    # Penalised batches also take the bitmask, which leaves rows without one unchanged: one
    # branch fewer to compile for every bucket, at the price of an elementwise pass.
    case = jnp.select([penalty, bitmask, random], [3, 2, 1], 0)
    tokens = jax.lax.switch(
        case,
        [
            lambda: first_argmax(logits),
            lambda: _tokens(logits, t),
            lambda: _tokens(apply_token_bitmask(logits, t.token_bitmask), t),
            lambda: _tokens(apply_token_bitmask(apply_penalties(logits, t), t.token_bitmask), t),
        ],
    )
    # A prompt row scores its prompt's next token (prompt logprobs) instead of its sample.
    tokens = jnp.where(t.forced_token >= 0, t.forced_token, tokens)
    return _logprobs(logits, tokens, t)


# Sampled for a row whose own one cannot be built or is not wanted: a greedy row, no history.
NEUTRAL_ROW = SamplingRow(SamplingParams(temperature=0.0), 0, (), ())


class SampledTokens(NamedTuple):
    """One step's sampler output on the host (one device_get), rows in batch order."""

    tokens: np.ndarray  # [S] int32
    sampled_logprob: np.ndarray  # [S] float32
    sampled_rank: np.ndarray  # [S] int32
    top_ids: np.ndarray  # [S, MAX_LOGPROBS] int32
    top_logprobs: np.ndarray  # [S, MAX_LOGPROBS] float32
    num_logprobs: list[int | None]  # per real row, SamplingParams.logprobs
    failed: dict[int, str]  # row index -> why its tensors could not be built (its token is junk)

    def row(self, i: int) -> tuple[int, list[tuple[int, float]] | None]:
        """(token, logprobs): the sampled (id, logprob) then the top n, or None if not asked."""
        token = int(self.tokens[i])
        n = self.num_logprobs[i]
        if n is None:
            return token, None
        top = zip(self.top_ids[i, :n].tolist(), self.top_logprobs[i, :n].tolist(), strict=True)
        return token, [(token, float(self.sampled_logprob[i])), *top]

    def scored(self, i: int) -> tuple[int, float, int, list[tuple[int, float]]]:
        """A row that asked for logprobs: (its token, its logprob, its rank, the top n
        (id, logprob) pairs by rank)."""
        n = self.num_logprobs[i] or 0
        top = zip(self.top_ids[i, :n].tolist(), self.top_logprobs[i, :n].tolist(), strict=True)
        rank = int(self.sampled_rank[i])
        return int(self.tokens[i]), float(self.sampled_logprob[i]), rank, list(top)


class Sampler:
    """The engine's handle: builds the tensors, runs `sample`, brings the result back.

    Args:
        vocab_size: V of the model's logits.
        seq_buckets: the engine's sequence buckets; logits come with one of them as row count.
        max_model_len: longest prompt + output; sizes the penalty history.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_buckets: Sequence[int],
        max_model_len: int,
    ) -> None:
        history_len = 1 << max(0, max_model_len - 1).bit_length()
        self.builder = SamplingTensorBuilder(seq_buckets, vocab_size, history_len)
        self._executables: dict[int, jax.stages.Compiled] = {}  # sequence bucket -> `sample`

    def check_banned_ids(self, banned_ids: Sequence[int]) -> None:
        """Raise ValueError if a row cannot ban all of `banned_ids` (call at admission)."""
        self.builder.check_banned_ids(banned_ids)

    def precompile(self, logits_sharding: jax.sharding.Sharding | None = None) -> float:
        """Compile `sample` for every sequence bucket (one executable each); returns seconds.

        Each bucket is logged as it is done (jserve.runtime.startup). `logits_sharding` is
        the model step's (known once it is compiled). Serving calls only
        these executables, so logits of any other shape or layout raise instead of compiling
        a new one in the middle of a step.
        """
        buckets = self.builder.seq_buckets
        with StartupPhase("sampler", len(buckets)) as phase:
            for s in phase.each(buckets, lambda s: f"seqs={s}"):
                self._executables[s] = self.lower(s, logits_sharding).compile()
        return phase.seconds

    def lower(
        self, seq_bucket: int, logits_sharding: jax.sharding.Sharding | None = None
    ) -> jax.stages.Lowered:
        """`sample` lowered for logits of `seq_bucket` rows placed by `logits_sharding`."""
        logits = jax.ShapeDtypeStruct(
            (seq_bucket, self.builder.vocab_size), jnp.float32, sharding=logits_sharding
        )
        return sample.lower(logits, self.builder.build([], seq_bucket))

    def sample(self, logits: jax.Array, rows: Sequence[SamplingRow]) -> SampledTokens:
        """Sample the real `rows` from `logits` [S, V] (rows past len(rows) are padding).

        A row whose tensors cannot be built fails alone: it is reported in `failed` and
        sampled as a neutral greedy row, so the rest of the batch goes on.
        """
        bucket = logits.shape[0]
        if bucket not in self._executables:
            raise RuntimeError(
                f"no sampler executable for {bucket} rows; precompiled: {sorted(self._executables)}"
            )
        tensors, failed = self._build(rows, bucket)
        out = jax.device_get(self._executables[bucket](logits, tensors))
        num_logprobs = [row.params.logprobs for row in rows]
        return SampledTokens(*out, num_logprobs=num_logprobs, failed=failed)

    def _build(
        self, rows: Sequence[SamplingRow], seq_bucket: int
    ) -> tuple[SamplingTensors, dict[int, str]]:
        try:
            return self.builder.build(rows, seq_bucket), {}
        except Exception:  # find the culprit rows one at a time (rare, so no hurry)
            failed = {}
            for i, row in enumerate(rows):
                try:
                    self.builder.build([row], self.builder.seq_buckets[0])
                except Exception as e:
                    failed[i] = f"{type(e).__name__}: {e}"
            if not failed:
                raise  # a batch-wide failure: not one request's fault
            rows = [NEUTRAL_ROW if i in failed else row for i, row in enumerate(rows)]
            return self.builder.build(rows, seq_bucket), failed
