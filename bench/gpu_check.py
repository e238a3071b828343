"""The engine on a real GPU, checked against this CPU's tokens.

A GPU is lent only now and then, for minutes, with no network and a 64 MiB limit on what
travels, so the check is prepared here and run there in one go (bench/gpu_check.sh):

    python -m bench.gpu_check cut GGUF OUT.gguf --layers 10   # the default model's first layers
    python -m bench.gpu_check reference --model OUT.gguf --json REF.json   # here, on the CPU
    python -m bench.gpu_check engine --model OUT.gguf --reference REF.json --json GPU.json

`cut` keeps a GGUF's first layers (the default model's 30 layers do not travel with the
embedding); the tokens it produces mean nothing as text, but both sides run the same weights, so
they check the engine. `reference` runs every mode on this machine's CPU (float32; int8 KV and
int8 weights in their CPU form) and `engine` runs the same modes on the GPU: greedy tokens, the
fraction equal to the reference's (prefix agreement: tokens before the first difference), the
compilations after warm-up (must be 0) and output tokens per second for the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# mode -> (engine arguments, the reference mode it is compared with). fp8 pools are GPU-only:
# their tokens are compared with float32's. int8 weights load from the safetensors copy.
MODES = {
    "float32": ({"dtype": "float32"}, "float32"),
    "bfloat16": ({"dtype": "bfloat16"}, "float32"),
    "int8 KV": ({"dtype": "float32", "kv_cache_dtype": "int8"}, "int8 KV"),
    "fp8_e4m3 KV": ({"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"}, "float32"),
    "int8 weights": ({"dtype": "float32", "quantization": "int8"}, "int8 weights"),
}
CPU_MODES = ("float32", "int8 KV", "int8 weights")
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 32, 48, 64


def cut_gguf(src: Path, dst: Path, layers: int) -> None:
    """Copy `src` with only blocks 0..layers-1 and its block count set to `layers`."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, value, field.types[0], sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(
            tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def prompts(tokenizer) -> list[dict]:
    """NUM_PROMPTS prompts of PROMPT_LEN tokens from one fixed text, a different window each."""
    text = (Path(__file__).parent / "texts" / "quality.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    step = (len(ids) - PROMPT_LEN) // NUM_PROMPTS
    return [{"prompt_token_ids": ids[i * step : i * step + PROMPT_LEN]} for i in range(NUM_PROMPTS)]


def model_for(mode: str, model: Path) -> str:
    """int8 weights quantize a safetensors checkpoint: the GGUF's copy beside it."""
    return str(model.with_suffix(".hf")) if mode == "int8 weights" else str(model)


def run_mode(mode: str, model: Path) -> dict:
    """Greedy tokens of every prompt in one batch, the compilations after warm-up and tok/s."""
    from jserve.engine.llm import LLM
    from jserve.runtime.compilation import serving_compilation_count
    from jserve.sampling_params import SamplingParams

    llm = LLM(model_for(mode, model), max_num_seqs=NUM_PROMPTS, **MODES[mode][0])
    batch = prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(batch[:2], params, use_tqdm=False)  # first use of each step: not timed
    before = serving_compilation_count()
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    return {
        "tokens": tokens,
        "compilations_after_warmup": serving_compilation_count() - before,
        "output_tok_per_s": sum(map(len, tokens)) / seconds,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Prefix agreement: per sequence, tokens before the first difference, over all tokens."""
    same = [_common_prefix(t, r) for t, r in zip(tokens, reference, strict=True)]
    return {
        "prefix_agreement": sum(same) / sum(map(len, reference)),
        "identical_sequences": sum(s == len(r) for s, r in zip(same, reference, strict=True)),
    }


def run_modes(modes: list[str], model: Path, reference: dict | None) -> dict:
    import jax

    report = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}
    for mode in modes:
        try:
            result = run_mode(mode, model)
        except Exception as error:  # one mode failing must not hide the others' results
            result = {"error": f"{type(error).__name__}: {error}"}
        if reference is not None and "tokens" in result:
            result |= agreement(result["tokens"], reference[MODES[mode][1]]["tokens"])
        report[mode] = result
        print(mode, {k: v for k, v in result.items() if k != "tokens"}, flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("cut", help="a GGUF with only its first layers")
    cut.add_argument("src", type=Path)
    cut.add_argument("dst", type=Path)
    cut.add_argument("--layers", type=int, required=True)
    for name in ("reference", "engine"):
        run = sub.add_parser(name)
        run.add_argument("--model", type=Path, required=True)
        run.add_argument("--json", type=Path, required=True)
    sub.choices["engine"].add_argument("--reference", type=Path, required=True)
    sub.choices["engine"].add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="default: all"
    )
    args = parser.parse_args()
    if args.command == "cut":
        cut_gguf(args.src, args.dst, args.layers)
        return
    if args.command == "reference":
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts: the CUDA or TPU plugin must not
        report = run_modes(list(CPU_MODES), args.model, None)
    else:
        report = run_modes(args.modes, args.model, json.loads(args.reference.read_text()))
    args.json.write_text(json.dumps(report, default=int))


if __name__ == "__main__":
    main()
