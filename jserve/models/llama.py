"""A Llama-family decoder (Llama, Mistral, Qwen2) in Flax NNX over a flat token axis.

Layer weights are stacked on a leading layer axis and the layers run under `lax.scan`, so XLA
compiles one layer's body rather than one copy per layer. Every parameter carries a partition
annotation over one mesh axis, "model": attention is split by KV head groups and the MLP by its
hidden units (column-parallel in, row-parallel out), so a device mesh shards the model with no
code change.

Projections that read the same input are fused into one weight, so each layer runs one matmul
for Q, K and V and one for gate and up (fewer, wider dots; at one token a step is bound by
reading weights). Every projection is one 2-D product `layer_matmul(x, w, layer)` over the
weight viewed as [L, K, N]: the scan never slices the big weights itself, so on CPU the native
kernel reads each layer's weight in place, from the packed layout `lay_out_weights` gives the
parameters once at load time (jserve.pallas.layer_matmul). The attention output is
flattened to [T, Hq * Hd] before `wo`, so XLA never transposes that weight per step.
Fused weights are stored as the [L, K, N] matrices the projections read, their columns ordered
so that an even split of N over the mesh is the split tensor parallelism needs (a reshape of a
sharded weight inside the step would make XLA gather it whole, every step, and on TPU re-tile
it):
- `wqkv` [L, D, Hkv * (G + 2) * Hd]: for each KV head, its G query heads, then its key, then its
  value, so splitting N splits the KV heads and keeps every device's query heads with theirs;
- `w_gate_up` [L, D, F * 2]: column 2 f is gate unit f, column 2 f + 1 up unit f, so splitting N
  splits the hidden units F.
Loaders produce the unfused HF names; `fuse_projections` converts once at load time. Both orders
are `fused_columns`', which also builds the fused projections of a GGUF file's quantized blocks
(`pack_block_projections`), served packed by the native CPU kernel (jserve.pallas.quant_blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from jax.experimental import io_callback

from jserve.layers.attention import attention
from jserve.layers.norm import rms_norm
from jserve.layers.rope import apply_rope, inverse_frequencies, rope_cos_sin
from jserve.models.config import ModelConfig
from jserve.pallas.layer_matmul import (
    MatmulImpl,
    is_packed_blocks,
    layer_matmul,
    pack_layer_weight,
    packed_columns,
)
from jserve.pallas.quant_blocks import INT8_GROUP, BlockMatrix, pack_weight, take_columns
from jserve.pallas.ragged_common import dot_precision

MODEL_AXIS = "model"
PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")  # the layers' weights layer_matmul reads
# observe(projection, layer, sums): a projection's input rows' |x| summed per input channel [K],
# handed to the host (a calibration pass: jserve.models.calibration)
Observer = Callable[[str, np.ndarray, np.ndarray], None]


def _param(shape: tuple[int, ...], sharding: tuple[str | None, ...], dtype: Any) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=sharding, eager_sharding=False)


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, each with a leading [L] axis. With `int8_weights` the
    projections are int8 and each has its float scales [L, K / 16, N] beside it, `NAME_scale`
    (jserve.models.int8_weights), split over the mesh as the weight is."""

    def __init__(self, cfg: ModelConfig, dtype: Any, int8_weights: bool = False) -> None:
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        Hq, Hkv, Hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        m = MODEL_AXIS
        G = Hq // Hkv
        wdtype = jnp.int8 if int8_weights else dtype
        self.attn_norm = _param((L, D), (None, None), dtype)
        self.wqkv = _param((L, D, Hkv * (G + 2) * Hd), (None, None, m), wdtype)
        if cfg.attention_bias:
            self.bqkv = _param((L, Hkv, G + 2, Hd), (None, m, None, None), dtype)
        self.wo = _param((L, Hq, Hd, D), (None, m, None, None), wdtype)
        self.mlp_norm = _param((L, D), (None, None), dtype)
        self.w_gate_up = _param((L, D, F * 2), (None, None, m), wdtype)
        self.w_down = _param((L, F, D), (None, m, None), wdtype)
        if int8_weights:  # a scale per 16 inputs of each output column, split as the weight
            g = INT8_GROUP
            self.wqkv_scale = _param((L, D // g, Hkv * (G + 2) * Hd), (None, None, m), dtype)
            self.wo_scale = _param((L, Hq * Hd // g, D), (None, m, None), dtype)
            self.w_gate_up_scale = _param((L, D // g, F * 2), (None, None, m), dtype)
            self.w_down_scale = _param((L, F // g, D), (None, m, None), dtype)


class LlamaModel(nnx.Module):
    """With `int8_weights` (--quantization int8 where XLA runs the projections), the
    projections and the output head (the embedding, when tied) are int8 with a float scale per
    16 inputs of each output column (`NAME_scale`: jserve.models.int8_weights)."""

    def __init__(
        self, cfg: ModelConfig, dtype: Any = jnp.float32, int8_weights: bool = False
    ) -> None:
        self.cfg = cfg
        self.int8_weights = int8_weights
        V, D = cfg.vocab_size, cfg.hidden_size
        wdtype = jnp.int8 if int8_weights else dtype
        tied = cfg.tie_word_embeddings
        self.embed = _param((V, D), (None, None), wdtype if tied else dtype)
        self.layers = DecoderLayers(cfg, dtype, int8_weights)
        self.final_norm = _param((D,), (None,), dtype)
        if not tied:
            self.lm_head = _param((D, V), (None, MODEL_AXIS), wdtype)
        if int8_weights:  # the tied table's [V, D / 16], the untied head's [D / 16, V]
            if tied:
                self.embed_scale = _param((V, D // INT8_GROUP), (None, None), dtype)
            else:
                self.lm_head_scale = _param((D // INT8_GROUP, V), (None, MODEL_AXIS), dtype)

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32, this step's tokens of all sequences, flat
        positions: jax.Array,  # [T] int32, each token's position in its sequence
        kv_cache: Any,  # the attention implementation's cache (None for dense attention)
        attn_meta: Any,  # attention metadata; its type selects the implementation
        logits_indices: jax.Array,  # [S] int32, rows of T whose next-token logits are wanted
        matmul_impl: MatmulImpl | str = MatmulImpl.XLA,  # how the projections run
        real_rows: tuple[jax.Array, jax.Array] | None = None,  # (tokens, logit rows) not padding
        observe: Observer | None = None,  # sees every projection's input (calibration only)
    ) -> tuple[jax.Array, jax.Array, Any]:
        """Returns (logits [S, V] float32, the final hidden states [S, D] float32 they are
        computed from (after the final norm: what pooling reads), updated kv_cache).

        With `real_rows`, the first `tokens` rows of T and `logit rows` rows of S are the step's
        real ones and the rest its bucket's padding, which the projections may skip: a padding
        row's hidden state and logits are then 0 (jserve.pallas.layer_matmul's `rows`)."""
        cfg = self.cfg
        x = self._embedding(token_ids, matmul_impl)  # [T, D]
        inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        rope = rope_cos_sin(positions, jnp.asarray(inv_freq))  # (cos, sin), [T, Hd] each
        real_tokens, real_logits = (None, None) if real_rows is None else real_rows
        weights, matmul = self._layer_weights(matmul_impl, real_tokens, observe)

        def layer_step(carry, xs):
            (x, kv_cache), (w, layer) = carry, xs
            return self._decoder_layer(x, kv_cache, w, layer, matmul, rope, attn_meta), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, kv_cache), _ = jax.lax.scan(layer_step, (x, kv_cache), (weights, layer_ids))
        h = rms_norm(x[logits_indices], self.final_norm[...], cfg.rms_norm_eps)  # [S, D]
        logits = self.head_logits(h, matmul_impl, real_logits).astype(jnp.float32)
        return logits, h.astype(jnp.float32), kv_cache

    def _layer_weights(
        self,
        matmul_impl: MatmulImpl | str,
        real_tokens: jax.Array | None,
        observe: Observer | None = None,
    ) -> tuple[dict[str, Any], Callable[[jax.Array, str, jax.Array], jax.Array]]:
        """The layers' small weights (each [L, ...]), which the scan slices per layer, and
        `matmul(x, name, layer)` over the projections' weights, which layer_matmul reads per
        layer where they lie (the scan never copies them out of the stack): viewed as
        [L, K, N] here, or already packed for "native" by lay_out_weights. With `observe`,
        each matmul first hands its input's per-channel sums of |x| to the host (an
        io_callback inside the scan); without it the traced step is unchanged."""
        cfg = self.cfg
        weights = nnx.to_pure_dict(nnx.state(self.layers, nnx.Param))
        proj = {name: weights.pop(name) for name in PROJECTIONS}
        scales = {name: weights.pop(name + "_scale", None) for name in PROJECTIONS}
        if matmul_impl == MatmulImpl.XLA:
            proj = {name: _as_layer_matrices(name, w) for name, w in proj.items()}
        group = cfg.num_heads // cfg.num_kv_heads
        widths = {  # N of each projection
            "wqkv": cfg.num_kv_heads * (group + 2) * cfg.head_dim,
            "wo": cfg.hidden_size,
            "w_gate_up": 2 * cfg.intermediate_size,
            "w_down": cfg.hidden_size,
        }

        def matmul(x: jax.Array, name: str, layer: jax.Array) -> jax.Array:
            if observe is not None:
                io_callback(functools.partial(observe, name), None, layer, jnp.abs(x).sum(0))
            return layer_matmul(
                x, proj[name], layer, matmul_impl, widths[name], real_tokens, scales[name]
            )

        return weights, matmul

    def _decoder_layer(
        self,
        x: jax.Array,  # [T, D]
        kv_cache: Any,
        w: dict[str, jax.Array],  # this layer's small weights
        layer: jax.Array,  # int32 scalar
        matmul: Callable[[jax.Array, str, jax.Array], jax.Array],
        rope: tuple[jax.Array, jax.Array],
        attn_meta: Any,
    ) -> tuple[jax.Array, Any]:
        """One decoder layer: attention, then the gated MLP, each on the normed stream and
        added back to it. Returns (x, kv_cache) with this layer's K/V written."""
        cfg = self.cfg
        t, group, hd = x.shape[0], cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        cos, sin = rope
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        qkv = matmul(h, "wqkv", layer).reshape(t, cfg.num_kv_heads, group + 2, hd)
        if cfg.attention_bias:
            qkv = qkv + w["bqkv"]
        q = qkv[:, :, :group].reshape(t, cfg.num_heads, hd)  # [T, Hq, Hd]
        k, v = qkv[:, :, group], qkv[:, :, group + 1]  # [T, Hkv, Hd] each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a, kv_cache = attention(
            q, k, v, kv_cache, attn_meta, layer,
            sm_scale=hd**-0.5, sliding_window=cfg.sliding_window,
        )  # fmt: skip
        x = x + matmul(a.reshape(t, -1), "wo", layer)  # [T, D]
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        gate_up = matmul(h, "w_gate_up", layer).reshape(t, -1, 2)  # [T, F, 2]
        gate, up = gate_up[..., 0], gate_up[..., 1]  # [T, F] each
        x = x + matmul(jax.nn.silu(gate) * up, "w_down", layer)  # [T, D]
        return x, kv_cache

    def _embedding(self, token_ids: jax.Array, matmul_impl: MatmulImpl | str) -> jax.Array:
        table = self.embed[...]
        packed = matmul_impl == MatmulImpl.NATIVE and self.cfg.tie_word_embeddings
        if packed or is_packed_blocks(table):
            # Packed as the output head's weight [1, D, V] (lay_out_weights, or a GGUF's
            # blocks): token v is its column v.
            return packed_columns(table, token_ids, self.cfg.hidden_size)
        if self.int8_weights and self.cfg.tie_word_embeddings:  # int8, a scale per 16
            scale = jnp.repeat(self.embed_scale[...][token_ids], INT8_GROUP, axis=1)
            return table[token_ids].astype(scale.dtype) * scale
        return table[token_ids]

    def head_logits(
        self, h: jax.Array, matmul_impl: MatmulImpl | str, rows: jax.Array | None
    ) -> jax.Array:
        """The output head's logits [S, V] of final hidden states h [S, D] (after the final
        norm); `rows` (the step's real rows, or None) lets the native kernel skip padding."""
        tied = self.cfg.tie_word_embeddings
        head = self.embed[...] if tied else self.lm_head[...]
        if matmul_impl == MatmulImpl.NATIVE:  # packed by lay_out_weights
            return layer_matmul(h, head, jnp.int32(0), MatmulImpl.NATIVE, self.cfg.vocab_size, rows)
        spec = "SD,VD->SV" if tied else "SD,DV->SV"
        if self.int8_weights:  # int8 quants and a scale per 16 of them along D
            scale = (self.embed_scale if tied else self.lm_head_scale)[...]
            return qwix.einsum(spec, h, qwix.QArray(head, scale))
        return jnp.einsum(spec, h, head, precision=dot_precision(h, head))


def _as_layer_matrices(name: str, w: jax.Array) -> jax.Array:
    """A projection's weight [L, ...] viewed as [L, K, N], K being its input features: `wo`
    [L, Hq, Hd, D] merges its leading (major) axes, which moves no data on any backend; the
    others are stored so."""
    if name == "wo":
        return w.reshape(w.shape[0], -1, w.shape[-1])
    return w


def lay_out_weights(state: nnx.State, matmul_impl: MatmulImpl | str) -> nnx.State:
    """The model's parameters laid out for `matmul_impl`, as `LlamaModel.__call__` then reads
    them: unchanged for "xla"; for "native", the projections and the output head (the
    embedding, when tied: the lookup then reads the packed table) packed by `pack_weights`.
    Once, at load time; the other parameters are shared with `state`, and so are GGUF blocks
    packed at load (`pack_block_projections`), which only "native" reads."""
    weights = {} if matmul_impl == MatmulImpl.XLA else weights_to_pack(state)
    if not weights:  # XLA's dot reads them as they are, or a GGUF brought them all packed
        return state
    return with_packed_weights(state, pack_weights(weights, matmul_impl))


def weights_to_pack(state: nnx.State) -> dict[str, Any]:
    """The parameters `pack_weights` lays out, by name: the projections and the output head,
    less those a GGUF's quantized blocks brought packed already."""
    head = "lm_head" if "lm_head" in state else "embed"
    weights = {name: _variable(state, name).get_value() for name in (*PROJECTIONS, head)}
    return {name: w for name, w in weights.items() if not is_packed_blocks(w)}


@functools.partial(jax.jit, static_argnums=1)
def pack_weights(
    weights: dict[str, jax.Array], matmul_impl: MatmulImpl | str
) -> dict[str, jax.Array]:
    """`weights_to_pack`'s arrays packed by `pack_layer_weight`, in one executable: the one
    the engine runs at load time, which `jserve compile` compiles too (the steps take the
    shardings XLA gives its outputs)."""
    matrices = {
        name: _as_layer_matrices(name, w) for name, w in weights.items() if name in PROJECTIONS
    }
    if "lm_head" in weights:  # [D, V]
        matrices["lm_head"] = weights["lm_head"][None]
    if "embed" in weights:  # tied: the embedding [V, D] is the head's weight transposed
        matrices["embed"] = weights["embed"].T[None]
    return {name: pack_layer_weight(w, matmul_impl) for name, w in matrices.items()}


def with_packed_weights(state: nnx.State, packed: dict[str, Any]) -> nnx.State:
    """`state` in new containers, the parameters named in `packed` replaced by its values."""
    out = jax.tree.map(lambda x: x, state)  # new containers, the same arrays
    for name, value in packed.items():
        _variable(out, name).set_value(value)
    return out


def _variable(state: nnx.State, name: str) -> Any:
    return state["layers"][name] if name in PROJECTIONS else state[name]


def fused_columns(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
    """Each fused projection's loader weights and the order of its N columns, as indices into
    those weights' output features laid end to end (see the module docstring): `wqkv` from
    wq, wk, wv, `w_gate_up` from w_gate, w_up."""
    Hkv, Hd, F = cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    G = cfg.num_heads // Hkv
    q = np.arange(Hkv * G * Hd).reshape(Hkv, G * Hd)
    k = Hkv * G * Hd + np.arange(Hkv * Hd).reshape(Hkv, Hd)
    v = k + Hkv * Hd
    gate_up = np.stack([np.arange(F), F + np.arange(F)], axis=1)
    return {
        "wqkv": (("wq", "wk", "wv"), np.concatenate([q, k, v], axis=1).reshape(-1)),
        "w_gate_up": (("w_gate", "w_up"), gate_up.reshape(-1)),
    }


def fuse_projections(cfg: ModelConfig, layers: dict[str, Any]) -> dict[str, Any]:
    """Loader layer weights (HF names: wq [L, D, Hq, Hd], wk, wv, w_gate [L, D, F], w_up, and
    biases bq, bk, bv) -> this model's fused `wqkv`, `bqkv`, `w_gate_up` (`fused_columns`);
    other entries pass through, so do projections a packed GGUF brings fused already
    (`pack_block_projections`). Runs on host numpy, once per load."""
    out = {k: v for k, v in layers.items() if k not in _UNFUSED}
    L, D, Hkv, Hd = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // Hkv
    columns = fused_columns(cfg)
    for fused, (sources, order) in columns.items():
        if sources[0] in layers:
            laid = [np.asarray(layers[name]).reshape(L, D, -1) for name in sources]
            out[fused] = np.concatenate(laid, axis=-1)[..., order]
    if cfg.attention_bias:
        biases = [np.asarray(layers[name]).reshape(L, -1) for name in ("bq", "bk", "bv")]
        order = columns["wqkv"][1]
        out["bqkv"] = np.concatenate(biases, axis=-1)[:, order].reshape(L, Hkv, G + 2, Hd)
    return out


def pack_block_projections(
    cfg: ModelConfig, layers: list[dict[str, BlockMatrix]]
) -> dict[str, np.ndarray]:
    """The projections of a GGUF file's quantized blocks, each layer a dict of its loader
    weights (wq, wk, wv, wo, w_gate, w_up, w_down), fused in `fused_columns`' order and packed
    for the native CPU kernel (jserve.pallas.quant_blocks.pack_weight: one uint8 array each).
    Raises ValueError where a panel of 16 fused columns would mix formats (e.g. gate and up
    in different types)."""
    columns = fused_columns(cfg)
    out = {}
    for fused, (sources, order) in columns.items():
        runs = [take_columns([layer[name] for name in sources], order) for layer in layers]
        out[fused] = pack_weight(runs)
    out["wo"] = pack_weight([[layer["wo"]] for layer in layers])
    out["w_down"] = pack_weight([[layer["w_down"]] for layer in layers])
    return out


_UNFUSED = ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up")
