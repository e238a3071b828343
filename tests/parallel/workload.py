"""One serving workload for the parallel tests, and a tiny random model to run it on.

The workload pushes a small engine through everything the sharded path must not change:
chunked prefill (prompts longer than a step's token budget), preemption (a pool too small for
the running batch), and a prefix-cache hit (a second round re-sending an earlier prompt).
Greedy tokens of every request are returned, so runs on 1 and N devices can be compared
token for token.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jserve.loaders.model_source import LoadedModel
from jserve.models.config import ModelConfig
from jserve.sampling_params import SamplingParams

# 4 sequences, 32-token steps, 12 usable 16-token blocks: the first round's ~300 prompt
# tokens prefill in chunks and do not fit at once.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=13, max_model_len=128)
PROMPT_LENGTHS = (5, 100, 12, 70, 40, 20, 60)
MAX_TOKENS = 12
PROMPT_VOCAB = 384  # prompt ids are drawn below this, so they suit the tiny model too


def tiny_model(default: LoadedModel) -> LoadedModel:
    """A random 2-layer Qwen2-style model (biases, untied vocab-split lm_head) with 6 query
    and 3 KV heads: every axis tensor parallelism splits divides by 3. It borrows the default
    model's tokenizer (ids below PROMPT_VOCAB decode with it)."""
    cfg = ModelConfig(
        architecture="qwen2", vocab_size=PROMPT_VOCAB, hidden_size=48, intermediate_size=96,
        num_layers=2, num_heads=6, num_kv_heads=3, head_dim=8, attention_bias=True,
        tie_word_embeddings=False, max_position_embeddings=512,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hq, Hkv, Hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def w(*shape: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal(shape) * scale / np.sqrt(shape[-2 if len(shape) > 1 else 0])

    layers = {
        "attn_norm": 1 + 0.1 * rng.standard_normal((L, D)),
        "mlp_norm": 1 + 0.1 * rng.standard_normal((L, D)),
        "wq": w(L, D, Hq, Hd) * 4, "wk": w(L, D, Hkv, Hd) * 4, "wv": w(L, D, Hkv, Hd),
        "bq": 0.5 * rng.standard_normal((L, Hq, Hd)), "bk": 0.5 * rng.standard_normal((L, Hkv, Hd)),
        "bv": 0.5 * rng.standard_normal((L, Hkv, Hd)),
        "wo": w(L, Hq, Hd, D), "w_gate": w(L, D, F), "w_up": w(L, D, F), "w_down": w(L, F, D),
    }  # fmt: skip
    params = {
        "embed": rng.standard_normal((V, D)),
        "final_norm": np.ones(D),
        "lm_head": w(D, V) * 8,  # well-separated logits: greedy never hinges on a rounding
        "layers": layers,
    }
    f32 = lambda tree: {  # noqa: E731
        k: f32(v) if isinstance(v, dict) else np.asarray(v, np.float32) for k, v in tree.items()
    }
    return dataclasses.replace(default, name="tiny-random", config=cfg, params=f32(params))


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    shared = rng.integers(3, PROMPT_VOCAB, 48).tolist()  # two prompts share 3 blocks of it
    out = [rng.integers(3, PROMPT_VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    out[3] = shared + out[3][48:]
    out[6] = shared + out[6][48:]
    return out


def run_workload(engine) -> dict:
    """Two rounds of greedy requests; returns tokens per request and what the pool did."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = prompts()
    rounds = [list(enumerate(first)), [(len(first), first[1]), (len(first) + 1, first[4])]]
    tokens = {}
    for batch in rounds:
        for i, ids in batch:
            engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
    stats = engine.scheduler.stats()
    return {
        "tokens": tokens,
        "preemptions": stats.num_preemptions,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "serving_compilations": engine.stats().serving_compilations,
    }
