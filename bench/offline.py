"""Offline throughput: continuous vs static scheduling on one widely varying workload, and
decode speed at fixed batch sizes next to a plain dense-KV decode loop of the same model.

Both engines (same settings except `scheduling`) load one shared copy of the model and run the
same requests (bench.workloads) side by side, through the A/B driver (bench.ab_driver): their
steps alternate, and each engine's clock runs only during its own steps, so load from other
processes hits both alike. Throughput is reported per wall second and per CPU second of this
process (the second is less sensitive to a shared machine). The decode comparison alternates
too: one engine step, then one step of the dense loop, and gives the ratio of each pair.

    python -m bench.offline --json bench/results/offline_cpu.json   # full run
    python -m bench.offline --smoke                                 # tiny, for CI
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.ab_driver import alternate, describe, ratio_stats
from bench.report_writer import markdown_table, write_json
from bench.workloads import (
    OFFLINE_WORKLOAD,
    OFFLINE_WORKLOAD_SMOKE,
    SMOKE_ENGINE,
    Workload,
    add_requests,
    greedy,
    make_workload,
    text_token_pool,
)
from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.layers.norm import rms_norm
from jserve.layers.rope import apply_rope, inverse_frequencies, rope_cos_sin
from jserve.loaders.model_source import LoadedModel, load_model
from jserve.models.config import ModelConfig
from jserve.runtime.compilation import forbid_compilation
from jserve.runtime.params import make_mesh, place_model

FULL = {
    **OFFLINE_WORKLOAD,
    "max_num_seqs": 32, "max_num_batched_tokens": 512, "max_model_len": 1024,
    "num_kv_blocks": None,
    "decode_batches": (1, 8, 32), "decode_context": 256, "decode_warmup": 2, "decode_steps": 12,
}  # fmt: skip
SMOKE = {
    **OFFLINE_WORKLOAD_SMOKE,
    **SMOKE_ENGINE,
    "decode_batches": (1, 4), "decode_context": 16, "decode_warmup": 1, "decode_steps": 3,
}  # fmt: skip
ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks")
CHECK_TOKENS = 8  # greedy tokens the dense loop must reproduce


class _TimedEngine:
    """One engine of the side-by-side run: a step at a time, its own clocks, its outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.clock = {"wall_s": 0.0, "cpu_s": 0.0, "steps": 0}
        self.lengths: dict[str, int] = {}

    def step(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = self.engine.step()
        self.clock["wall_s"] += time.perf_counter() - wall
        self.clock["cpu_s"] += time.process_time() - cpu
        self.clock["steps"] += 1
        for out in outputs:
            if out.finished:
                self.lengths[out.request_id] = len(out.outputs[0].token_ids)


def run_side_by_side(engines: dict[str, LLMEngine], workload: Workload) -> dict[str, dict]:
    """Run the workload through both engines, alternating steps; per-engine step clocks."""
    (name_a, a), (name_b, b) = ((name, _TimedEngine(e)) for name, e in engines.items())
    for side in (a, b):
        add_requests(side.engine, workload)

    def unfinished() -> bool:
        return a.engine.has_unfinished_requests() or b.engine.has_unfinished_requests()

    alternate(a.step, b.step, pairs=unfinished)
    prompt_tokens = sum(map(len, workload.prompts))
    output_tokens = sum(workload.output_lens)
    clocks = {}
    for name, side in ((name_a, a), (name_b, b)):
        got = [side.lengths[str(i)] for i in range(len(workload.prompts))]
        if got != workload.output_lens:
            raise RuntimeError(f"{name}: output lengths {got} differ from the workload's")
        clock = clocks[name] = side.clock
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


def decode_rates(
    engine: LLMEngine, dense: DenseDecodeLoop, prompts, context: int, cfg: dict
) -> tuple[dict, dict, dict]:
    """Engine and dense-loop decode at one batch size, one step of each in turn (so load from
    other processes hits both alike): each one's rate, and the dense / engine rate of each pair.

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
    dense_state = list(dense.start([0] * batch))  # [tokens, cache]
    for pos in range(context, context + warmup):  # the first call compiles this batch size
        dense_state[0], dense_state[1], _ = dense.timed_step(*dense_state, pos)
    produced = dict.fromkeys(ids, 0)

    def engine_step() -> tuple[float, bool]:
        """(seconds, whether every sequence decoded) of one engine step."""
        all_decoding = all(0 < n < max_tokens for n in produced.values())
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        for out in outputs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
        return elapsed, all_decoding

    def decode_step() -> float:
        while True:
            elapsed, all_decoding = engine_step()
            if all_decoding:
                return elapsed

    positions = itertools.count(context + warmup)

    def dense_step() -> float:
        dense_state[0], dense_state[1], seconds = dense.timed_step(*dense_state, next(positions))
        return seconds

    with forbid_compilation():
        decode_steps = 0
        while decode_steps < warmup:  # prefill, then the untimed decode steps
            decode_steps += engine_step()[1]
        pairs = alternate(decode_step, dense_step, steps)
    for rid in ids:
        engine.abort_request(rid)
    ratios = ratio_stats(pairs.ratios(lambda engine_s, dense_s: engine_s / dense_s))
    return rate(batch, pairs.a), rate(batch, pairs.b), ratios


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
        engine_rate, dense_rate, ratio = decode_rates(engine, dense, prompts, context, cfg)
        rows.append(
            {"batch": batch, "engine": engine_rate, "dense": dense_rate, "dense_over_engine": ratio}
        )
    return {
        "dense_matches_engine": dense_tokens == engine_tokens,
        "dense_tokens": dense_tokens,
        "engine_tokens": engine_tokens,
        "rows": rows,
    }


def markdown(report: dict) -> str:
    t, d = report["throughput"], report["decode"]
    rows = [
        [name, f"{r['wall_s']:.1f}", str(r["steps"]), f"{r['output_tok_per_s']:.1f}",
         f"{r['total_tok_per_s']:.1f}", f"{r['output_tok_per_cpu_s']:.1f}"]
        for name, r in ((name, t[name]) for name in ("continuous", "static"))
    ]  # fmt: skip
    rows.append(["**continuous / static**", "", "", f"**{t['ratio_wall']:.2f}x**",
                 f"{t['ratio_wall']:.2f}x", f"{t['ratio_cpu']:.2f}x"])  # fmt: skip
    header = ["scheduling", "wall s", "steps", "output tok/s", "total tok/s", "output tok/CPU-s"]
    decode_rows = []
    for row in d["rows"]:
        e, n, ratio = row["engine"], row["dense"], row["dense_over_engine"]
        decode_rows.append([
            str(row["batch"]), f"{e['step_ms']:.1f}", f"{e['tok_per_s']:.1f}",
            f"{n['step_ms']:.1f}", f"{n['tok_per_s']:.1f}",
            f"{n['tok_per_s'] / e['tok_per_s']:.2f}x", describe(ratio),
        ])  # fmt: skip
    decode_header = ["batch", "engine ms/step", "engine tok/s", "dense ms/step", "dense tok/s",
                     "dense/engine", "dense/engine by step pair"]  # fmt: skip
    return "\n".join([
        markdown_table(header, rows),
        "",
        f"Decode-only steps at context {report['config']['decode_context']}, median step; "
        f"dense loop's greedy tokens match the engine's: {d['dense_matches_engine']}",
        "",
        markdown_table(decode_header, decode_rows),
    ])  # fmt: skip


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny workload and buckets, for CI")
    parser.add_argument("--num-requests", type=int, help="default 64 (smoke 8)")
    parser.add_argument("--max-num-seqs", type=int, help="default 32 (smoke 8)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="default 512 (smoke 64)")
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
        write_json(args.json, report)


if __name__ == "__main__":
    main()
