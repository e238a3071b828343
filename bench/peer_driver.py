"""One engine's side of `bench.peer_compare`: run a token-id workload offline and time it.

    python -m bench.peer_driver --engine jserve --workloads W1.json W2.json --out R.json
    VENV/bin/python -m bench.peer_driver --engine vllm --model HF_DIR --workloads ... --out R.json
    VENV/bin/python -m bench.peer_driver --engine llamacpp --model F.gguf --workloads ... --out R

Run from the repository root (bench.peer_compare and bench.quant_compare do). It runs under
each engine's interpreter (the vLLM and llama-cpp-python virtualenvs have no jserve, and
jserve's has neither), so it imports only the engine it drives, and from bench only bench.quiet
(which needs aiohttp, as vLLM does; the llama.cpp virtualenv installs it too). llama.cpp
(llama-cpp-python) has no batching: its requests run one after the other, so it is only
compared at batch 1.
The protocol is the same for all: build the engine once, run one short warm-up request, then
for each workload wait for a quiet machine, submit every request at once (greedy, EOS ignored,
so each generates exactly its max_tokens) and time that one `generate` call: its wall time,
the CPU seconds of this process and its children (vLLM's engine core is a child process), and
how quiet the machine was (bench.quiet).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.quiet import QuietMeter, wait_for_quiet

FIRST_IDS = 16  # greedy ids per request kept to check both engines generated the same thing


def _jserve(args: argparse.Namespace):
    from jserve import LLM, SamplingParams

    settings = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    if args.max_num_batched_tokens:
        settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_kv_blocks:
        settings["num_kv_blocks"] = args.num_kv_blocks
    llm = LLM(
        args.model, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, **settings
    )

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    return llm, params, lambda r: r.outputs[0].token_ids


def _vllm(args: argparse.Namespace):
    from vllm import LLM, SamplingParams

    settings = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    if args.max_num_batched_tokens:
        settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(args.model, dtype="float32", enable_prefix_caching=True, seed=0, **settings)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    return llm, params, lambda r: list(r.outputs[0].token_ids)


def _llamacpp(args: argparse.Namespace):
    """llama.cpp on the GGUF file `args.model`, on --threads threads, greedy: an object whose
    `generate` takes what LLM.generate takes here and runs the requests one by one."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=args.model, n_ctx=args.max_model_len, n_threads=args.threads,
        n_threads_batch=args.threads, verbose=False, seed=0,
    )  # fmt: skip

    class OneByOne:
        def generate(self, prompts: list[dict], max_tokens: list[int] | int, use_tqdm=False):
            if isinstance(max_tokens, int):
                max_tokens = [max_tokens] * len(prompts)
            outputs = []
            for prompt, n in zip(prompts, max_tokens, strict=True):
                ids = []  # llama.cpp's own greedy sampler; its generate never stops at EOS
                for token in llm.generate(prompt["prompt_token_ids"], temp=0.0, reset=True):
                    ids.append(token)
                    if len(ids) == n:
                        break
                outputs.append(ids)
            return outputs

    return OneByOne(), lambda n: n, lambda ids: ids


def _resident(llm, engine: str, args: argparse.Namespace) -> dict:
    """The weights' bytes (jserve: its parameters as served; llama.cpp: the GGUF it maps) and
    this process's resident memory, after the run."""
    if engine == "jserve":
        from jserve.engine.setup import weight_bytes

        weights = weight_bytes(llm.engine.runner.state)
    else:
        weights = os.path.getsize(args.model) if engine == "llamacpp" else None
    with open("/proc/self/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {"weight_bytes": weights, "rss_bytes": rss_kib * 1024}


def run_workload(llm, params, token_ids, workload: dict, args: argparse.Namespace) -> dict:
    """Submit every request of `workload` at once and time that one generate call."""
    requests = workload["requests"]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    sampling = [params(r["max_tokens"]) for r in requests]
    wait_for_quiet(args.max_load, args.settle_timeout)
    with QuietMeter(os.getpid()) as meter:
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
    generated = [token_ids(out) for out in outputs]
    return {
        "workload": workload["name"],
        "wall_s": meter.result.wall_s,
        "cpu_s": meter.result.own_cpu_s,
        "quietness": meter.result.as_dict(),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "output_tokens": sum(len(ids) for ids in generated),
        "first_ids": [list(ids[:FIRST_IDS]) for ids in generated],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["jserve", "vllm", "llamacpp"], required=True)
    parser.add_argument(
        "--model", default=None, help="jserve: default SmolLM2; vllm: HF dir; llamacpp: GGUF"
    )
    parser.add_argument("--quantization", default="auto", help="jserve's --quantization")
    parser.add_argument("--kv-cache-dtype", default="auto", help="jserve's --kv-cache-dtype")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--workloads", nargs="+", required=True, help="JSON files from peer.py")
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None,
        help="jserve's --num-kv-blocks (default: sized from its KV memory)",
    )  # fmt: skip
    parser.add_argument("--max-load", type=float, default=1.0, help="wait for this load first")
    parser.add_argument("--settle-timeout", type=float, default=120.0, help="seconds, at most")
    args = parser.parse_args()
    workloads = [json.loads(Path(w).read_text()) for w in args.workloads]
    started = time.perf_counter()
    drivers = {"jserve": _jserve, "vllm": _vllm, "llamacpp": _llamacpp}
    llm, params, token_ids = drivers[args.engine](args)
    startup_s = time.perf_counter() - started
    first = workloads[0]["requests"][0]["prompt_token_ids"][:8]
    llm.generate([{"prompt_token_ids": first}], params(4), use_tqdm=False)  # warm-up
    runs = [run_workload(llm, params, token_ids, w, args) for w in workloads]
    settings = {k: v for k, v in vars(args).items() if k.startswith("max_num")}
    settings["quantization"] = args.quantization if args.engine == "jserve" else None
    settings["kv_cache_dtype"] = args.kv_cache_dtype if args.engine == "jserve" else None
    result = {"engine": args.engine, "startup_s": startup_s, "settings": settings, "runs": runs,
              **_resident(llm, args.engine, args)}  # fmt: skip
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
