"""A plain generation loop with no KV cache: the whole sequence is recomputed each token.

It is the single-sequence reference that the paged engine is checked against, and it needs
nothing but the model. Sequences are padded to a multiple of `PAD_MULTIPLE` so a run compiles
only a handful of shapes; causality keeps the padding out of real positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.layers.attention import DenseCausal

PAD_MULTIPLE = 64


@partial(jax.jit, static_argnums=0)
def logits_at(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    token_ids: jax.Array,  # [T] int32, padded
    indices: jax.Array,  # [N] int32, positions of real tokens
) -> jax.Array:
    """Logits [N, V] float32 of the token after each position in `indices`."""
    model = nnx.merge(graphdef, state)
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    logits, _, _ = model(token_ids, positions, None, DenseCausal(), indices)
    return logits


def padded(tokens: list[int]) -> jax.Array:
    """`tokens` padded with zeros to a multiple of PAD_MULTIPLE."""
    buf = np.zeros(-(-len(tokens) // PAD_MULTIPLE) * PAD_MULTIPLE, np.int32)
    buf[: len(tokens)] = tokens
    return jnp.asarray(buf)


def last_token_logits(graphdef: nnx.GraphDef, state: nnx.State, tokens: list[int]) -> jax.Array:
    """Logits [V] float32 of the token after `tokens`."""
    return logits_at(graphdef, state, padded(tokens), jnp.array([len(tokens) - 1], jnp.int32))[0]


def greedy_choices(
    graphdef: nnx.GraphDef, state: nnx.State, prompt_ids: list[int], continuation: list[int]
) -> list[int]:
    """The model's greedy token after the prompt and after each prefix of `continuation`, from
    one pass over both: equal to `continuation` exactly when it is the model's greedy
    continuation (each token is the choice given the tokens before it)."""
    tokens = list(prompt_ids) + list(continuation)
    indices = jnp.arange(len(prompt_ids) - 1, len(tokens) - 1, dtype=jnp.int32)
    return np.asarray(jnp.argmax(logits_at(graphdef, state, padded(tokens), indices), -1)).tolist()


def generate_dense(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_token_ids: frozenset[int] = frozenset(),
) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids; stops after a stop token (which is yielded)."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token")
    tokens = list(prompt_ids)
    key = jax.random.key(seed)
    for _ in range(max_tokens):
        logits = last_token_logits(graphdef, state, tokens)
        if temperature == 0.0:
            token = int(jnp.argmax(logits))
        else:
            key, sub = jax.random.split(key)
            token = int(jax.random.categorical(sub, logits / temperature))
        tokens.append(token)
        yield token
        if token in stop_token_ids:
            return
