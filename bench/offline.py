"""Offline throughput: continuous vs static scheduling on one widely varying workload, and
decode speed at fixed batch sizes next to a plain dense-KV decode loop of the same model.

Both engines (same settings except `scheduling`) load one shared copy of the model and run the
same requests side by side: their steps alternate, and each engine's clock runs only during its
own steps, so load from other processes hits both alike. Throughput is reported per wall second
and per CPU second of this process (the second is less sensitive to a shared machine). The
decode comparison alternates too: one engine step, then one step of the dense loop.

    python bench/offline.py --json bench/results/offline_cpu.json   # full run
    python bench/offline.py --smoke                                 # tiny, for CI
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.layers.norm import rms_norm
from jserve.layers.rope import apply_rope, inverse_frequencies, rope_cos_sin
from jserve.loaders.model_source import LoadedModel, load_model
from jserve.models.config import ModelConfig
from jserve.runtime.compilation import forbid_compilation
from jserve.runtime.params import make_mesh, place_model
from jserve.sampling_params import SamplingParams

TEXT_MODULES = ("argparse", "collections", "dataclasses", "functools", "json", "logging",
                "pathlib", "statistics", "textwrap", "threading")  # fmt: skip
# prompt_len / output_len: (median, min, max) of a log-normal with sigma 1.
FULL = {
    "num_requests": 64, "prompt_len": (80, 10, 500), "output_len": (48, 4, 256),
    "max_num_seqs": 32, "max_num_batched_tokens": 512, "max_model_len": 1024,
    "num_kv_blocks": None,
    "decode_batches": (1, 8, 32), "decode_context": 256, "decode_warmup": 2, "decode_steps": 12,
}  # fmt: skip
SMOKE = {
    "num_requests": 8, "prompt_len": (20, 10, 40), "output_len": (8, 4, 16),
    "max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 128, "num_kv_blocks": 64,
    "decode_batches": (1, 4), "decode_context": 16, "decode_warmup": 1, "decode_steps": 3,
}  # fmt: skip
ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks")
CHECK_TOKENS = 8  # greedy tokens the dense loop must reproduce


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def text_token_pool(tokenizer) -> list[int]:
    """Real English prose that is the same on every run: some standard-library docstrings."""
    docs = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module))
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            is_documented = inspect.isclass(obj) or inspect.isfunction(obj)
            if is_documented and getattr(obj, "__module__", None) == name:
                docs.append(inspect.getdoc(obj))
    return tokenizer.encode("\n\n".join(d for d in docs if d), add_special_tokens=False)


def lognormal_lengths(rng, n: int, spec: tuple[int, int, int]) -> list[int]:
    """`n` lengths, log-normal around `median` (sigma 1), clipped to [lo, hi]."""
    median, lo, hi = spec
    draws = rng.lognormal(math.log(median), 1.0, size=n)
    return [int(x) for x in np.clip(np.rint(draws), lo, hi)]


def make_workload(pool: list[int], n: int, prompt_len, output_len, seed: int) -> Workload:
    """Prompts are slices of the text pool at random offsets, of log-normal token lengths."""
    rng = np.random.default_rng(seed)
    lens = lognormal_lengths(rng, n, prompt_len)
    starts = [int(rng.integers(0, len(pool) - length)) for length in lens]
    prompts = [pool[s : s + length] for s, length in zip(starts, lens, strict=True)]
    return Workload(prompts, lognormal_lengths(rng, n, output_len))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def add_requests(engine: LLMEngine, workload: Workload) -> None:
    """Queue the workload; request ids are the indices "0", "1", ..."""
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(out_len))


def run_side_by_side(engines: dict[str, LLMEngine], workload: Workload) -> dict[str, dict]:
    """Run the workload through every engine, alternating steps; per-engine step clocks."""
    for engine in engines.values():
        add_requests(engine, workload)
    clocks = {name: {"wall_s": 0.0, "cpu_s": 0.0, "steps": 0} for name in engines}
    lengths: dict[str, dict[str, int]] = {name: {} for name in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            wall, cpu = time.perf_counter(), time.process_time()
            outputs = engine.step()
            clocks[name]["wall_s"] += time.perf_counter() - wall
            clocks[name]["cpu_s"] += time.process_time() - cpu
            clocks[name]["steps"] += 1
            for out in outputs:
                if out.finished:
                    lengths[name][out.request_id] = len(out.outputs[0].token_ids)
    prompt_tokens = sum(map(len, workload.prompts))
    output_tokens = sum(workload.output_lens)
    for name, clock in clocks.items():
        got = [lengths[name][str(i)] for i in range(len(workload.prompts))]
        if got != workload.output_lens:
            raise RuntimeError(f"{name}: output lengths {got} differ from the workload's")
        clock["output_tok_per_s"] = output_tokens / clock["wall_s"]
        clock["total_tok_per_s"] = (prompt_tokens + output_tokens) / clock["wall_s"]
        clock["output_tok_per_cpu_s"] = output_tokens / clock["cpu_s"]
    return clocks


def rate(batch: int, step_times: list[float]) -> dict:
    """Median step time and the output tokens/s it gives (medians shrug off load spikes)."""
    median = statistics.median(step_times)
    return {"step_ms": 1e3 * median, "tok_per_s": batch / median, "steps": len(step_times)}


def make_dense_decode_step(cfg: ModelConfig):
    """One greedy decode step of the model over a dense KV cache [L, B, M, Hkv, D].

    Every sequence sits at the same position `pos`; K/V go in with dynamic_update_slice and
    attention reads all M slots, masked past `pos`. The cache rides the layer scan's carry.
    """
    if cfg.attention_bias or cfg.sliding_window or not cfg.tie_word_embeddings:
        raise ValueError("the dense baseline covers tied-embedding Llama models without bias")
    inv_freq = jnp.asarray(inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    groups = cfg.num_heads // cfg.num_kv_heads

    def step(params, cache, tokens, pos):
        batch, max_len = tokens.shape[0], cache[0].shape[2]
        x = params["embed"][tokens]  # [B, D]
        cos, sin = rope_cos_sin(jnp.full((batch,), pos), inv_freq)  # [B, Hd]
        visible = jnp.arange(max_len) <= pos  # [M]

        def layer_step(carry, xs):
            x, k_cache, v_cache = carry
            w, layer = xs
            h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
            qkv = (h @ w["wqkv"]).reshape(batch, cfg.num_kv_heads, groups + 2, cfg.head_dim)
            q = qkv[:, :, :groups].reshape(batch, cfg.num_heads, cfg.head_dim)
            q = apply_rope(q, cos, sin)  # [B, Hq, Hd]
            k = apply_rope(qkv[:, :, groups], cos, sin)  # [B, Hkv, Hd]
            v = qkv[:, :, groups + 1]  # [B, Hkv, Hd]
            at = (layer, 0, pos, 0, 0)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k[None, :, None], at)
            v_cache = jax.lax.dynamic_update_slice(v_cache, v[None, :, None], at)
            keys, values = k_cache[layer], v_cache[layer]  # [B, M, Hkv, Hd]
            qg = q.reshape(batch, cfg.num_kv_heads, groups, cfg.head_dim)
            scores = jnp.einsum("BKGD,BMKD->BKGM", qg, keys) * cfg.head_dim**-0.5
            probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
            a = jnp.einsum("BKGM,BMKD->BKGD", probs, values).reshape(batch, cfg.num_heads, -1)
            x = x + jnp.einsum("BNH,NHD->BD", a, w["wo"])
            h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
            gate_up = (h @ w["w_gate_up"]).reshape(batch, -1, 2)  # [B, F, 2] (fused layout)
            gate, up = gate_up[..., 0], gate_up[..., 1]
            x = x + (jax.nn.silu(gate) * up) @ w["w_down"]
            return (x, k_cache, v_cache), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, *cache), _ = jax.lax.scan(layer_step, (x, *cache), (params["layers"], layer_ids))
        logits = rms_norm(x, params["final_norm"], cfg.rms_norm_eps) @ params["embed"].T
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), tuple(cache)

    return jax.jit(step, donate_argnums=(1,))


class DenseDecodeLoop:
    """The engine's model driven by a plain jitted decode loop: no paging, no scheduler. It
    places its own copy of the parameters in the model's layout (the engine's runner keeps
    them laid out for its matmul kernel)."""

    def __init__(self, loaded: LoadedModel, max_len: int) -> None:
        self.cfg = loaded.config
        _, state = place_model(self.cfg, loaded.params, jnp.float32, make_mesh())
        self.params = nnx.to_pure_dict(state)
        self.step = make_dense_decode_step(self.cfg)
        self.max_len = max_len
        # Inputs laid out like the step's outputs, so the first call compiles the only version.
        mesh = self.params["embed"].sharding.mesh
        self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def start(self, tokens: list[int]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        c = self.cfg
        shape = (c.num_layers, len(tokens), self.max_len, c.num_kv_heads, c.head_dim)
        dtype = self.params["embed"].dtype
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.replicated)
        return self.put(tokens), (zeros(), zeros())  # two buffers: both get donated

    def put(self, tokens: list[int]) -> jax.Array:
        return jax.device_put(np.asarray(tokens, np.int32), self.replicated)

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """Feed the prompt one token per step, then decode: the model's greedy continuation."""
        tokens, cache = self.start(prompt[:1])
        out = []
        for pos in range(len(prompt) + num_tokens - 1):
            tokens = self.put([prompt[pos] if pos < len(prompt) else out[-1]])
            next_token, cache = self.step(self.params, cache, tokens, pos)
            if pos >= len(prompt) - 1:
                out.append(int(next_token[0]))
        return out

    def timed_step(self, tokens: jax.Array, cache, pos: int):
        start = time.perf_counter()
        tokens, cache = self.step(self.params, cache, tokens, pos)
        return tokens.block_until_ready(), cache, time.perf_counter() - start


def decode_rates(engine: LLMEngine, dense: DenseDecodeLoop, prompts, context: int, cfg: dict):
    """Engine and dense-loop decode at one batch size, one step of each in turn (so load from
    other processes hits both alike).

    Only engine steps (schedule, run, sample, postprocess) in which every sequence decodes
    count; requests get enough tokens to outlast a chunked prefill and are aborted once
    `decode_steps` such steps (after `decode_warmup` of them) are timed.
    """
    warmup, steps, batch = cfg["decode_warmup"], cfg["decode_steps"], len(prompts)
    max_tokens = math.ceil(sum(map(len, prompts)) / cfg["max_num_batched_tokens"]) + warmup
    max_tokens += steps + 2
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(max_tokens))
    tokens, cache = dense.start([0] * batch)
    for pos in range(context, context + warmup):  # the first call compiles this batch size
        tokens, cache, _ = dense.timed_step(tokens, cache, pos)
    produced = dict.fromkeys(ids, 0)
    decode_steps, engine_times, dense_times = 0, [], []
    with forbid_compilation():
        while len(engine_times) < steps:
            all_decoding = all(0 < n < max_tokens for n in produced.values())
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            for out in outputs:
                produced[out.request_id] = len(out.outputs[0].token_ids)
            decode_steps += all_decoding
            if all_decoding and decode_steps > warmup:
                engine_times.append(elapsed)
                pos = context + warmup + len(dense_times)
                tokens, cache, seconds = dense.timed_step(tokens, cache, pos)
                dense_times.append(seconds)
    for rid in ids:
        engine.abort_request(rid)
    return rate(batch, engine_times), rate(batch, dense_times)


def decode_table(
    engine: LLMEngine, loaded: LoadedModel, pool: list[int], cfg: dict, seed: int
) -> dict:
    """Decode speed at each batch size, engine vs dense loop, after checking they agree."""
    context, warmup, steps = cfg["decode_context"], cfg["decode_warmup"], cfg["decode_steps"]
    dense = DenseDecodeLoop(loaded, context + warmup + steps + 1)
    check_prompt = pool[: context // 2]
    dense_tokens = dense.greedy(check_prompt, CHECK_TOKENS)
    engine.add_request("check", {"prompt_token_ids": check_prompt}, greedy(CHECK_TOKENS))
    while engine.has_unfinished_requests():
        for out in engine.step():
            engine_tokens = out.outputs[0].token_ids
    rng = np.random.default_rng(seed + 1)
    rows = []
    for batch in cfg["decode_batches"]:
        print(f"decode at batch {batch} ...", file=sys.stderr, flush=True)
        starts = rng.integers(0, len(pool) - context, size=batch)
        prompts = [pool[s : s + context] for s in starts]
        engine_rate, dense_rate = decode_rates(engine, dense, prompts, context, cfg)
        rows.append({"batch": batch, "engine": engine_rate, "dense": dense_rate})
    return {
        "dense_matches_engine": dense_tokens == engine_tokens,
        "dense_tokens": dense_tokens,
        "engine_tokens": engine_tokens,
        "rows": rows,
    }


def markdown(report: dict) -> str:
    t, d = report["throughput"], report["decode"]
    lines = [
        "| scheduling | wall s | steps | output tok/s | total tok/s | output tok/CPU-s |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("continuous", "static"):
        r = t[name]
        lines.append(
            f"| {name} | {r['wall_s']:.1f} | {r['steps']} | {r['output_tok_per_s']:.1f} | "
            f"{r['total_tok_per_s']:.1f} | {r['output_tok_per_cpu_s']:.1f} |"
        )
    lines += [
        f"| **continuous / static** | | | **{t['ratio_wall']:.2f}x** | {t['ratio_wall']:.2f}x "
        f"| {t['ratio_cpu']:.2f}x |",
        "",
        f"Decode-only steps at context {report['config']['decode_context']}, median step; "
        f"dense loop's greedy tokens match the engine's: {d['dense_matches_engine']}",
        "",
        "| batch | engine ms/step | engine tok/s | dense ms/step | dense tok/s | dense/engine |",
        "|---|---|---|---|---|---|",
    ]
    for row in d["rows"]:
        e, n = row["engine"], row["dense"]
        lines.append(
            f"| {row['batch']} | {e['step_ms']:.1f} | {e['tok_per_s']:.1f} | "
            f"{n['step_ms']:.1f} | {n['tok_per_s']:.1f} | {n['tok_per_s'] / e['tok_per_s']:.2f}x |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny workload and buckets, for CI")
    parser.add_argument("--num-requests", type=int, help="default 64 (smoke 8)")
    parser.add_argument("--max-num-seqs", type=int, help="default 32 (smoke 4)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="default 512 (smoke 32)")
    parser.add_argument(
        "--decode-batches",
        type=lambda text: tuple(int(b) for b in text.split(",")),
        help="comma-separated batch sizes, default 1,8,32 (smoke 1,4)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    cfg.update({k: v for k, v in vars(args).items() if k in cfg and v is not None})
    if max(cfg["decode_batches"]) > cfg["max_num_seqs"]:
        parser.error(f"--decode-batches {cfg['decode_batches']} exceed --max-num-seqs")
    return args, cfg


def main(argv: list[str] | None = None) -> None:
    args, cfg = parse_args(argv)
    load_before = os.getloadavg()[0]
    loaded = load_model(None)
    pool = text_token_pool(loaded.tokenizer)
    workload = make_workload(
        pool, cfg["num_requests"], cfg["prompt_len"], cfg["output_len"], args.seed
    )
    settings = {k: cfg[k] for k in ENGINE_KEYS}
    engines = {
        policy: LLMEngine(EngineArgs(scheduling=policy, **settings), loaded=loaded)
        for policy in ("continuous", "static")
    }
    print("running the workload side by side ...", file=sys.stderr, flush=True)
    throughput = run_side_by_side(engines, workload)
    c, s = throughput["continuous"], throughput["static"]
    throughput["ratio_wall"] = c["output_tok_per_s"] / s["output_tok_per_s"]
    throughput["ratio_cpu"] = c["output_tok_per_cpu_s"] / s["output_tok_per_cpu_s"]
    del engines["static"]  # frees its KV pool before the decode runs
    report = {
        "config": {**cfg, "seed": args.seed, "cpus": os.cpu_count()},
        "workload": {
            "prompt_tokens": sum(map(len, workload.prompts)),
            "output_tokens": sum(workload.output_lens),
            "prompt_lens": [len(p) for p in workload.prompts],
            "output_lens": workload.output_lens,
        },
        "throughput": throughput,
        "decode": decode_table(engines["continuous"], loaded, pool, cfg, args.seed),
        "loadavg_1min": {"before": load_before, "after": os.getloadavg()[0]},
    }
    print(markdown(report))
    print(f"load average (1 min) before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
