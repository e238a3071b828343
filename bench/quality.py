"""How close a model served quantized is to the same model unquantized: teacher-forced top-1
agreement and perplexity on a fixed text, and greedy agreement.

    python -m bench.quality                       # SmolLM2's GGUF packed vs dequantized
    python -m bench.quality --model F.gguf        # another GGUF
    python -m bench.quality --reference HF_DIR    # against other weights (same tokenizer)
    python -m bench.quality --smoke               # a short text and few tokens (CI)
    python -m bench.quality --kv-cache-dtype int8 # + the candidate's K/V through an int8 pool
    python -m bench.quality --model HF_DIR --quantization int8  # int8 vs the float32 weights

The candidate is the GGUF as `--quantization auto` serves it (its blocks packed, on the native
CPU kernel), or with `--quantization int8` a float checkpoint's weights quantized to int8 as
the engine quantizes them (jserve.models.int8_weights, packed for the native kernel); the
reference is `--reference` (default: the same model unquantized, as `--quantization none`
serves it), both on the native kernels. Text: three genres (bench/texts/README.md: literature,
a license, Python source, about 12,900 positions at the default window), each tokenized once
and cut into windows of --window tokens; each window runs as one causal
forward pass, so every position's next-token distribution is scored: the share of positions
whose argmax agrees, each model's perplexity of the text, the mean KL(reference || candidate)
and the largest logit difference. Greedy: --greedy-tokens tokens after the first 16 tokens of
at most 24 windows spread evenly over the texts (20 at the default window), each model
continuing its own output; how many sequences are identical and the mean length of the common
prefix. The report goes to bench/results/quality.json and a markdown table
(docs/quantization.md has the figures).

`--int8-activations` scores the variant llama.cpp computes instead: every matmul's input row
rounded to int8 per block of 32 (scale max|x| / 127) before the product with the same weights,
which is what integer dot products over the blocks give up to float rounding. It is emulated
(the rows are rounded, then the float kernel runs), to measure its agreement, not its speed.

`--kv-cache-dtype int8` runs the candidate's attention as the engine serves it with that pool:
each window is one prefill through the paged attention, its K/V written to an int8 pool
(jserve.pallas.kv_cache) and every position's query reading them back from it, so each score
sees the quantized keys and values of the positions before it, as a decode step does. The
reference keeps its float32 attention: the gap is the KV quantization's (packed weights give
the dequantized file's logits bit for bit).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.report_writer import RESULTS_DIR, markdown_table, write_json
from jserve.config.engine_args import KVCacheDtype
from jserve.engine.setup import quantized_to_int8
from jserve.layers.attention import DenseCausal, PagedAttentionMetadata
from jserve.loaders.model_source import LoadedModel, load_model
from jserve.models import llama
from jserve.models.llama import lay_out_weights
from jserve.pallas.layer_matmul import layer_matmul
from jserve.runtime.model_runner import ModelStep
from jserve.runtime.params import make_mesh, place_model

TEXTS = tuple(
    Path(__file__).with_name("texts") / name
    for name in ("quality.txt", "quality_legal.txt", "quality_code.txt")
)
GREEDY_PROMPTS = 24  # at most this many greedy continuations, every n-th window
GREEDY_PROMPT = 16  # tokens of the text that start a greedy continuation
BLOCK_SIZE = 16  # the paged pool's, with --kv-cache-dtype


def int8_rows(x: jax.Array) -> jax.Array:
    """x [T, K] with each block of 32 of each row rounded to int8 at scale max|x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = jnp.abs(blocks).max(-1, keepdims=True) / 127
    rounded = jnp.round(blocks / jnp.where(scale == 0, 1, scale)) * scale
    return rounded.reshape(x.shape)


def int8_activations():
    """The model's matmuls with int8-rounded input rows (while traced inside this context)."""
    return mock.patch.object(
        llama, "layer_matmul", lambda x, *args, **kw: layer_matmul(int8_rows(x), *args, **kw)
    )


def paged_prefill(
    loaded: LoadedModel, graphdef: nnx.GraphDef, length: int, kv_cache_dtype: str
) -> tuple[tuple[jax.ShapeDtypeStruct, ...], PagedAttentionMetadata]:
    """The KV cache and metadata of one sequence of `length` tokens prefilled at once into
    blocks 1.. of a pool of `kv_cache_dtype` (block 0 is the sink), as the engine lays it out."""
    blocks = -(-length // BLOCK_SIZE)
    step = ModelStep.make(loaded.config, graphdef, make_mesh(), jnp.float32, "auto", kv_cache_dtype)
    meta = PagedAttentionMetadata(
        slot_mapping=BLOCK_SIZE + jnp.arange(length, dtype=jnp.int32),
        block_tables=jnp.arange(1, blocks + 1, dtype=jnp.int32)[None],
        cu_q_lens=jnp.array([0, length], jnp.int32),
        kv_lens=jnp.array([length], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
        impl=step.attn_impl,
    )
    return step.kv_cache_spec(blocks + 1, BLOCK_SIZE), meta


def forward(
    loaded: LoadedModel, length: int, int8: bool = False, kv_cache_dtype: str = KVCacheDtype.AUTO
):
    """fn(ids [length] int32) -> logits [length, V] float32: one causal pass, every position
    (with `int8`, int8-rounded matmul inputs; with an int8 `kv_cache_dtype`, attention over an
    int8 KV pool, `paged_prefill`)."""
    graphdef, state = place_model(loaded.config, loaded.params, jnp.float32, make_mesh())
    state = lay_out_weights(state, "native")
    positions, rows = jnp.arange(length, dtype=jnp.int32), jnp.arange(length, dtype=jnp.int32)
    paged = kv_cache_dtype != KVCacheDtype.AUTO
    spec, meta = paged_prefill(loaded, graphdef, length, kv_cache_dtype) if paged else (None, None)

    @jax.jit
    def run(state, ids):
        model = nnx.merge(graphdef, state)
        cache = tuple(jnp.zeros(x.shape, x.dtype) for x in spec) if paged else None
        with int8_activations() if int8 else contextlib.nullcontext():
            return model(ids, positions, cache, meta if paged else DenseCausal(), rows, "native")[0]

    return lambda ids: np.asarray(run(state, jnp.asarray(ids, jnp.int32)), np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def teacher_forced(candidate, reference, windows: list[np.ndarray]) -> dict:
    """Scores of every position of every window but its last (which has no next token)."""
    agree, nll_c, nll_r, kl, gap, n = 0, 0.0, 0.0, 0.0, 0.0, 0
    for ids in windows:
        c, r = log_softmax(candidate(ids)[:-1]), log_softmax(reference(ids)[:-1])
        nxt = ids[1:]
        agree += int((c.argmax(-1) == r.argmax(-1)).sum())
        nll_c -= c[np.arange(len(nxt)), nxt].sum()
        nll_r -= r[np.arange(len(nxt)), nxt].sum()
        kl += (np.exp(r) * (r - c)).sum()
        gap = max(gap, float(np.abs(c - r).max()))
        n += len(nxt)
    return {
        "positions": n,
        "top1_agreement": agree / n,
        "perplexity": float(np.exp(nll_c / n)),
        "reference_perplexity": float(np.exp(nll_r / n)),
        "mean_kl": float(kl / n),
        "max_log_prob_difference": gap,
    }


def greedy(model, prompt: np.ndarray, tokens: int, length: int) -> list[int]:
    """`tokens` greedy tokens after `prompt`, each pass over a buffer of `length` (one shape,
    one compilation): causal attention keeps the padding past the last token out of it."""
    buffer = np.zeros(length, np.int32)
    buffer[: len(prompt)] = prompt
    out = []
    for end in range(len(prompt), len(prompt) + tokens):
        buffer[end] = out_token = int(model(buffer)[end - 1].argmax())
        out.append(out_token)
    return out


def greedy_agreement(candidate, reference, prompts: list[np.ndarray], tokens: int, length):
    common = []
    for prompt in prompts:
        a, b = (greedy(m, prompt, tokens, length) for m in (candidate, reference))
        differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        common.append(differ[0] if differ else tokens)
    return {
        "sequences": len(prompts),
        "tokens_each": tokens,
        "identical_sequences": sum(c == tokens for c in common),
        "mean_common_prefix": float(np.mean(common)),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None,
                        help="a GGUF file (default: SmolLM2's), or a checkpoint directory for "
                        "--quantization int8")  # fmt: skip
    parser.add_argument(
        "--quantization",
        choices=("auto", "int8"),
        default="auto",
        help="the candidate's (--quantization as jserve serve takes it)",
    )
    parser.add_argument("--reference", default=None, help="default: --model dequantized")
    parser.add_argument("--window", type=int, default=128, help="tokens per forward pass")
    parser.add_argument("--int8-activations", action="store_true",
                        help="score the candidate with int8-rounded matmul inputs")  # fmt: skip
    parser.add_argument("--kv-cache-dtype", choices=list(KVCacheDtype), default="auto",
                        help="the candidate's KV pool (auto: no pool)")  # fmt: skip
    parser.add_argument("--greedy-tokens", type=int, default=48)
    parser.add_argument("--smoke", action="store_true", help="one short window, 4 tokens")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="default: %(default)s")
    args = parser.parse_args(argv)
    if args.smoke:
        args.window, args.greedy_tokens = 64, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    candidate_model = load_model(args.model, packed=args.quantization == "auto")
    if args.quantization == "int8":
        candidate_model = quantized_to_int8(candidate_model, native=True)
    reference_model = load_model(args.reference or args.model)
    texts = [np.asarray(candidate_model.tokenizer.encode(t.read_text()), np.int32) for t in TEXTS]
    windows = [
        ids[i : i + args.window]
        for ids in texts
        for i in range(0, len(ids) - args.window + 1, args.window)
    ]
    windows = windows[:1] if args.smoke else windows
    int8, kv_dtype = args.int8_activations, args.kv_cache_dtype

    def models(length: int):
        candidate = forward(candidate_model, length, int8, kv_dtype)
        return candidate, forward(reference_model, length)

    candidate, reference = models(args.window)
    scores = teacher_forced(candidate, reference, windows)
    prompts = [w[:GREEDY_PROMPT] for w in windows]
    prompts = prompts[:: -(-len(prompts) // GREEDY_PROMPTS)][: 1 if args.smoke else None]
    length = min(args.window, GREEDY_PROMPT + args.greedy_tokens)
    if length != args.window:  # the greedy buffer is its own shape
        candidate, reference = models(length)
    agreement = greedy_agreement(candidate, reference, prompts, length - GREEDY_PROMPT, length)
    report = {
        "candidate": candidate_model.quantization
        + (" int8 activations" if int8 else "")
        + (f" {kv_dtype} KV cache" if kv_dtype != KVCacheDtype.AUTO else ""),
        "reference": args.reference or f"{reference_model.quantization} (the same file)",
        "teacher_forced": scores,
        "greedy": agreement,
    }
    header = ["candidate", "reference", "positions", "top-1 agreement", "perplexity",
              "reference perplexity", "mean KL", "max |log p diff|", "greedy identical",
              "mean common prefix"]  # fmt: skip
    row = [
        report["candidate"], report["reference"], scores["positions"],
        f"{scores['top1_agreement']:.4f}", f"{scores['perplexity']:.3f}",
        f"{scores['reference_perplexity']:.3f}", f"{scores['mean_kl']:.2e}",
        f"{scores['max_log_prob_difference']:.2e}",
        f"{agreement['identical_sequences']}/{agreement['sequences']}",
        f"{agreement['mean_common_prefix']:.1f}/{agreement['tokens_each']}",
    ]  # fmt: skip
    print(markdown_table(header, [row]))
    print(f"\nwrote {write_json(args.out / 'quality.json', report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
