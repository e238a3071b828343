"""Per-step sampling inputs: the SamplingTensors pytree, built on the host in staging buffers.

The pytree has the same fields every step (neutral values where a feature is unused), so only
its row count S (the sequence bucket) reaches the compilation key. Buffers are sized for the
largest bucket once; `build` fills a prefix and hands out views, valid until the next `build`
(the engine reads the sampled tokens, which ends the device's use of them, before that).

Neutral values, also used for pad rows: temperature 0 (greedy), top_k 0, top_p 1, min_p 0,
repetition 1, presence and frequency 0, no logprobs, no forced token, banned ids and logit
bias ids all `vocab_size` (an id the device's scatters drop), a token bitmask of all ones
(every token allowed). A row without penalties keeps whatever history its slot last held: neutral
penalties make that history a no-op, and skipping it saves copying whole prompts.

Randomness is drawn here, not on the device: each row gets two uniforms hashed from its seed
and its number of output tokens alone, so a seeded request's draws cannot depend on its batch
(and cost no device PRNG: threefry over a [32, 49152] batch of logits costs far more than a
hash of two words per row; bench/RESULTS.md, "Sampler", has the figures).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from jserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams

# vLLM's _SAMPLING_EPS: temperatures below it mean greedy.
GREEDY_TEMPERATURE = 1e-5


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    """One step's sampling inputs; S is the sequence bucket, P the token-history length."""

    temperature: np.ndarray  # [S] float32, 0 = greedy
    top_k: np.ndarray  # [S] int32, 0 = off
    top_p: np.ndarray  # [S] float32, 1 = off
    min_p: np.ndarray  # [S] float32, 0 = off
    uniforms: np.ndarray  # [S, 2] float32 in [0, 1): this step's randomness for the row
    repetition_penalty: np.ndarray  # [S] float32, 1 = off
    presence_penalty: np.ndarray  # [S] float32, 0 = off
    frequency_penalty: np.ndarray  # [S] float32, 0 = off
    token_history: np.ndarray  # [S, P] int32 prompt then output ids, pads = vocab_size
    prompt_len: np.ndarray  # [S] int32 history entries before this index are the prompt
    banned_ids: np.ndarray  # [S, B] int32 ids forced to -inf (min_tokens), pads = vocab_size
    bias_ids: np.ndarray  # [S, L] int32 ids of the row's logit_bias, pads = vocab_size
    bias_values: np.ndarray  # [S, L] float32 the bias added to each of them
    want_logprobs: np.ndarray  # [S] bool the row asked for logprobs (rank and top 20)
    token_bitmask: np.ndarray  # [S, W] int32 bit j of word i allows token 32 i + j; -1 = all
    # [S] int32 a prompt row's next prompt token, whose logprob (and rank) the row scores in
    # place of a sampled one; -1 = sample
    forced_token: np.ndarray


class SamplingRow(NamedTuple):
    """What the builder needs to know about one real sequence this step."""

    params: SamplingParams
    seed: int | None  # None: a fresh random seed this step
    prompt_token_ids: Sequence[int]  # buffer-protocol objects (numpy, array.array) copy fastest
    output_token_ids: Sequence[int]  # its length is the step number folded into the seed
    banned_ids: Sequence[int] = ()  # forced to -inf this step (jserve.core.stopping: min_tokens)
    # [W] int32 packed mask of the tokens a grammar allows next (jserve.structured); None: all
    allowed_tokens: np.ndarray | None = None
    # A prompt logprobs row: the prompt's next token, scored instead of sampling (-1: sample)
    forced_token: int = -1


_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_uniforms(seeds: np.ndarray, generated_counts: np.ndarray) -> np.ndarray:
    """Two uniforms in [0, 1) per row, a function of (seed, count) only, [N, 2] float32.

    24 random bits each: every float32 step of [0, 1) below 1 is reachable, 1 is not.
    """
    state = _splitmix64(_splitmix64(seeds.astype(np.uint64)) ^ generated_counts.astype(np.uint64))
    streams = _splitmix64(state[:, None] ^ np.array([1, 2], np.uint64))
    return ((streams >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def bitmask_width(vocab_size: int) -> int:
    """W: int32 words of a packed token bitmask over `vocab_size` ids (llguidance's layout)."""
    return -(-vocab_size // 32)


def token_bitmask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """[W] int32 packed bitmask allowing exactly `token_ids` (ids in [0, vocab_size))."""
    words = np.zeros(bitmask_width(vocab_size), np.uint32)
    ids = np.asarray(token_ids, np.int64)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


class SamplingTensorBuilder:
    """Fills SamplingTensors for one step; owns the staging buffers.

    Args:
        seq_buckets: the engine's sequence buckets (sorted); S of every step is one of them.
        vocab_size: V, the logits' last axis.
        history_len: P, room for prompt plus output ids of a penalised row (the engine passes
            max_model_len rounded up to a power of two).
        max_banned_ids: B, room for a row's banned ids.
    """

    def __init__(
        self,
        seq_buckets: Sequence[int],
        vocab_size: int,
        history_len: int,
        max_banned_ids: int = 32,
    ) -> None:
        self.seq_buckets = tuple(seq_buckets)
        self.vocab_size = vocab_size
        self.history_len = history_len
        self.max_banned_ids = max_banned_ids
        s, v = self.seq_buckets[-1], vocab_size
        self._temperature = np.zeros(s, np.float32)
        self._top_k = np.zeros(s, np.int32)
        self._top_p = np.ones(s, np.float32)
        self._min_p = np.zeros(s, np.float32)
        self._uniforms = np.zeros((s, 2), np.float32)
        self._repetition = np.ones(s, np.float32)
        self._presence = np.zeros(s, np.float32)
        self._frequency = np.zeros(s, np.float32)
        self._history = np.full((s, history_len), v, np.int32)
        self._prompt_len = np.zeros(s, np.int32)
        self._banned = np.full((s, max_banned_ids), v, np.int32)
        self._bias_ids = np.full((s, MAX_LOGIT_BIAS), v, np.int32)
        self._bias_values = np.zeros((s, MAX_LOGIT_BIAS), np.float32)
        self._want_logprobs = np.zeros(s, np.bool_)
        self._bitmask = np.full((s, bitmask_width(v)), -1, np.int32)
        self._forced = np.full(s, -1, np.int32)

    def check_banned_ids(self, banned_ids: Sequence[int]) -> None:
        """Raise ValueError if a row could not hold `banned_ids` (call it at admission)."""
        if len(banned_ids) > self.max_banned_ids:
            raise ValueError(
                f"min_tokens must suppress {len(banned_ids)} stop and EOS ids, more than the "
                f"{self.max_banned_ids} the sampler has room for: pass fewer stop_token_ids or "
                "drop min_tokens"
            )

    def build(self, rows: Sequence[SamplingRow], seq_bucket: int) -> SamplingTensors:
        """Sampling tensors for `rows` padded to `seq_bucket` rows (views of the buffers)."""
        n, s = len(rows), seq_bucket
        if s not in self.seq_buckets or n > s:
            raise ValueError(
                f"{n} rows in a sequence bucket of {s}: the bucket must be one of "
                f"{self.seq_buckets} (the precompiled ones) and hold every row"
            )
        params = [row.params for row in rows]
        v = self.vocab_size
        self._temperature[:n] = [
            p.temperature if p.temperature >= GREEDY_TEMPERATURE else 0.0 for p in params
        ]
        self._top_k[:n] = [p.top_k if p.top_k < v else 0 for p in params]
        self._top_p[:n] = [p.top_p for p in params]
        self._min_p[:n] = [p.min_p for p in params]
        self._repetition[:n] = [p.repetition_penalty for p in params]
        self._presence[:n] = [p.presence_penalty for p in params]
        self._frequency[:n] = [p.frequency_penalty for p in params]
        self._want_logprobs[:n] = [p.logprobs is not None for p in params]
        self._forced[:n] = [row.forced_token for row in rows]
        self._fill_neutral(n, s)
        self._fill_uniforms(rows)
        self._banned[:s] = v
        self._bias_ids[:s] = v
        self._bitmask[:s] = -1
        for i, row in enumerate(rows):
            if row.allowed_tokens is not None:
                self._bitmask[i] = row.allowed_tokens
            if row.banned_ids:
                self.check_banned_ids(row.banned_ids)
                self._banned[i, : len(row.banned_ids)] = row.banned_ids
            if row.params.logit_bias:
                bias = row.params.logit_bias
                self._bias_ids[i, : len(bias)] = list(bias)
                self._bias_values[i, : len(bias)] = list(bias.values())
            if _has_penalties(row.params):
                self._fill_history(i, row)
        return SamplingTensors(
            temperature=self._temperature[:s],
            top_k=self._top_k[:s],
            top_p=self._top_p[:s],
            min_p=self._min_p[:s],
            uniforms=self._uniforms[:s],
            repetition_penalty=self._repetition[:s],
            presence_penalty=self._presence[:s],
            frequency_penalty=self._frequency[:s],
            token_history=self._history[:s],
            prompt_len=self._prompt_len[:s],
            banned_ids=self._banned[:s],
            bias_ids=self._bias_ids[:s],
            bias_values=self._bias_values[:s],
            want_logprobs=self._want_logprobs[:s],
            token_bitmask=self._bitmask[:s],
            forced_token=self._forced[:s],
        )

    def _fill_neutral(self, start: int, stop: int) -> None:
        self._temperature[start:stop] = 0.0
        self._top_k[start:stop] = 0
        self._top_p[start:stop] = 1.0
        self._min_p[start:stop] = 0.0
        self._repetition[start:stop] = 1.0
        self._presence[start:stop] = 0.0
        self._frequency[start:stop] = 0.0
        self._want_logprobs[start:stop] = False
        self._forced[start:stop] = -1

    def _fill_uniforms(self, rows: Sequence[SamplingRow]) -> None:
        seeds = np.array(
            [row.seed & _MASK64 if row.seed is not None else secrets.randbits(64) for row in rows],
            np.uint64,
        )
        counts = np.array([len(row.output_token_ids) for row in rows], np.uint64)
        self._uniforms[: len(rows)] = seeded_uniforms(seeds, counts)

    def _fill_history(self, i: int, row: SamplingRow) -> None:
        num_prompt, num_output = len(row.prompt_token_ids), len(row.output_token_ids)
        end = num_prompt + num_output
        if end > self.history_len:
            raise ValueError(
                f"a penalised row has {num_prompt} prompt + {num_output} output ids, more than "
                f"history_len={self.history_len}: build the sampler with history_len >= "
                "max_model_len"
            )
        self._history[i, :num_prompt] = row.prompt_token_ids
        self._history[i, num_prompt:end] = row.output_token_ids
        self._history[i, end:] = self.vocab_size
        self._prompt_len[i] = num_prompt
