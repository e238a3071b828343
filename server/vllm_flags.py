"""vLLM's `serve` command line, as jserve takes it.

A vLLM user's usual `vllm serve MODEL --flag ...` line should start jserve unchanged, or stop
at once with one line saying what to use instead, never with argparse's bare "unrecognized
arguments". `VLLM_SERVE_FLAGS` lists vLLM's common serve flags, each with its outcome:

- ACCEPTED: a jserve setting takes it with vLLM's meaning (its field's `vllm=` name:
  jserve.config.settings gives a setting vLLM's flag as a second name where they differ);
- NO_EFFECT: parsed, and a one-line note on stderr says why it changes nothing here;
- REFUSED: `jserve serve` exits 2 with one line naming jserve's equivalent.

The model may also be given as vLLM's positional MODEL (`take_model_tag`).
tests/cli/test_vllm_flags.py walks the table; docs and README's "Coming from vLLM" table are
written from it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    ACCEPTED = "accepted"
    NO_EFFECT = "no effect"
    REFUSED = "refused"


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM serve flag. `setting`: the jserve setting an ACCEPTED flag sets; `note`: what
    a NO_EFFECT or REFUSED flag prints (for REFUSED, what to use instead); `example`: the
    values a vLLM command line gives it (none for a switch)."""

    flag: str
    outcome: Outcome
    setting: str = ""
    note: str = ""
    example: tuple[str, ...] = ()


def _ok(flag: str, setting: str, *example: str) -> VllmFlag:
    return VllmFlag(flag, Outcome.ACCEPTED, setting=setting, example=example)


def _noop(flag: str, note: str, *example: str) -> VllmFlag:
    return VllmFlag(flag, Outcome.NO_EFFECT, note=note, example=example)


def _no(flag: str, note: str, *example: str) -> VllmFlag:
    return VllmFlag(flag, Outcome.REFUSED, note=note, example=example)


_LOCAL = "jserve serves a local path: download it first (hf download MODEL --local-dir DIR)"
_LORA = "LoRA adapters are not supported: merge the adapter into the weights and serve that"
_PROXY = "put a reverse proxy (nginx, envoy) in front of jserve for it"
_BUCKETS = (
    "jserve runs one XLA executable per step bucket, compiled at start (or ahead with "
    "`jserve compile`); the buckets follow --max-num-batched-tokens and --max-num-seqs"
)

VLLM_SERVE_FLAGS: tuple[VllmFlag, ...] = (
    _ok("--model", "model", "model.gguf"),
    _ok("--host", "host", "0.0.0.0"),
    _ok("--port", "port", "8001"),
    _ok("--api-key", "api_key", "secret"),
    _ok("--served-model-name", "served_model_name", "my-model"),
    _ok("--max-model-len", "max_model_len", "4096"),
    _ok("--dtype", "dtype", "bfloat16"),
    _ok("--quantization", "quantization", "none"),
    _ok("--tensor-parallel-size", "tensor_parallel_size", "2"),
    _ok("--max-num-seqs", "max_num_seqs", "8"),
    _ok("--max-num-batched-tokens", "max_num_batched_tokens", "1024"),
    _ok("--enable-prefix-caching", "enable_prefix_caching"),
    _ok("--no-enable-prefix-caching", "enable_prefix_caching"),
    _ok("--enable-chunked-prefill", "enable_chunked_prefill"),
    _ok("--no-enable-chunked-prefill", "enable_chunked_prefill"),
    _ok("--long-prefill-token-threshold", "long_prefill_token_threshold", "256"),
    _ok("--async-scheduling", "async_scheduling"),
    _ok("--seed", "seed", "7"),
    _ok("--block-size", "block_size", "32"),
    _ok("--speculative-config", "speculative_config", '{"method": "ngram"}'),
    _ok("--download-dir", "cache_dir", "/tmp/models"),
    _ok("--kv-cache-memory-bytes", "kv_cache_memory", "1000000"),
    _ok("--num-gpu-blocks-override", "num_kv_blocks", "64"),
    _ok("--gpu-memory-utilization", "gpu_memory_utilization", "0.5"),
    _ok("--chat-template", "chat_template", "{{ messages[0]['content'] }}"),
    _ok("--enable-auto-tool-choice", "enable_auto_tool_choice"),
    _ok("--tool-call-parser", "tool_call_parser", "hermes"),
    _ok("--max-logprobs", "max_logprobs", "5"),
    _ok("--trust-request-chat-template", "trust_request_chat_template"),
    _ok("--generation-config", "generation_config", "vllm"),
    _ok("--enable-log-requests", "enable_log_requests"),
    _ok("--uvicorn-log-level", "log_level", "warning"),
    _ok("--shutdown-timeout", "shutdown_timeout", "5.0"),
    _noop(
        "--trust-remote-code",
        "jserve runs no code from model repositories (chat templates run in a sandbox), so "
        "--trust-remote-code changes nothing",
    ),
    _noop(
        "--disable-log-requests",
        "requests are not logged unless --enable-log-requests is given, so "
        "--disable-log-requests changes nothing",
    ),
    _noop(
        "--disable-log-stats",
        "jserve logs no periodic stats (/metrics has them), so --disable-log-stats changes nothing",
    ),
    _noop(
        "--disable-frontend-multiprocessing",
        "jserve's server and engine share one process, so --disable-frontend-multiprocessing "
        "changes nothing",
    ),
    _noop(
        "--disable-fastapi-docs",
        "jserve serves no /docs pages, so --disable-fastapi-docs changes nothing",
    ),
    _no(
        "--swap-space",
        "jserve keeps no KV in host memory (a preempted request recomputes its prefix); size "
        "the KV pool with --kv-cache-memory or --gpu-memory-utilization",
        "4",
    ),
    _no(
        "--cpu-offload-gb",
        "weights stay on the devices: shard them with --tensor-parallel-size",
        "4",
    ),
    _no(
        "--pipeline-parallel-size",
        "pipeline parallelism is not supported; shard over devices with --tensor-parallel-size",
        "2",
    ),
    _no(
        "--data-parallel-size",
        "serve replicas behind a router with `jserve fleet --replicas N -- SERVE_FLAGS`",
        "2",
    ),
    _no(
        "--distributed-executor-backend",
        "a multi-process run is set with --coordinator-address, --num-processes and --process-id",
        "ray",
    ),
    _ok("--kv-cache-dtype", "kv_cache_dtype", "int8"),
    _no("--enforce-eager", _BUCKETS),
    _no("--max-seq-len-to-capture", _BUCKETS, "8192"),
    _no("--compilation-config", _BUCKETS, "3"),
    _no("--cuda-graph-sizes", _BUCKETS, "8"),
    _no(
        "--load-format",
        "jserve reads the model path's own format (a .gguf file, a safetensors directory or a "
        "jserve checkpoint); drop --load-format",
        "safetensors",
    ),
    _no(
        "--tokenizer",
        "jserve reads the tokenizer with the model (a GGUF's metadata, or tokenizer.json in "
        "its directory); put it there",
        "org/tokenizer",
    ),
    _no("--tokenizer-mode", "jserve has one tokenizer (HF tokenizers); drop the flag", "slow"),
    _no("--revision", _LOCAL + " --revision REV", "main"),
    _no("--tokenizer-revision", _LOCAL + " --revision REV", "main"),
    _no("--hf-token", _LOCAL, "hf_xxx"),
    _no("--enable-lora", _LORA),
    _no("--lora-modules", _LORA, "name=path"),
    _no("--max-lora-rank", _LORA, "16"),
    _no("--max-loras", _LORA, "4"),
    _no(
        "--override-pooler-config",
        "/v1/embeddings pools by --pooling-type (last or mean)",
        '{"pooling_type": "MEAN"}',
    ),
    _no("--limit-mm-per-prompt", "jserve serves text-only models", '{"image": 1}'),
    _no(
        "--reasoning-parser",
        "jserve has no reasoning parser: reasoning text stays in the content",
        "deepseek_r1",
    ),
    _no(
        "--tool-parser-plugin",
        "jserve parses tool calls in the formats --tool-call-parser lists",
        "plugin.py",
    ),
    _no(
        "--structured-outputs-config",
        "structured outputs always use llguidance; drop the flag",
        '{"backend": "xgrammar"}',
    ),
    _no(
        "--guided-decoding-backend",
        "structured outputs always use llguidance; drop the flag",
        "xgrammar",
    ),
    _no(
        "--scheduling-policy",
        "jserve schedules by lane and tenant, not by integer priority: see --scheduling, "
        "--fairness and the request's 'lane' field",
        "priority",
    ),
    _no("--preemption-mode", "a preempted request always recomputes its prefix", "swap"),
    _no(
        "--kv-events-config",
        "publish KV events with --kv-events-endpoint (and --kv-events-replay-endpoint)",
        '{"enable_kv_cache_events": true}',
    ),
    _no(
        "--kv-transfer-config",
        "disaggregated prefill is not supported; route between replicas with `jserve fleet`",
        "{}",
    ),
    _no("--ssl-keyfile", _PROXY + " (TLS)", "key.pem"),
    _no("--ssl-certfile", _PROXY + " (TLS)", "cert.pem"),
    _no("--allowed-origins", _PROXY + " (CORS)", '["*"]'),
    _no("--root-path", _PROXY + " (a path prefix)", "/api"),
    _no(
        "--chat-template-content-format",
        "text content parts are joined into one string (vLLM's 'string' format); drop the flag",
        "openai",
    ),
    _no(
        "--otlp-traces-endpoint",
        "jserve exports no traces; scrape /metrics (Prometheus)",
        "localhost:4317",
    ),
    _no("--config", "give each setting as its own flag (jserve serve --help)", "serve.yaml"),
)


class _Note(argparse.Action):
    """A NO_EFFECT flag: say on stderr why it changes nothing, then go on parsing."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        print(f"jserve: note: {self.const}", file=sys.stderr)


class _Refuse(argparse.Action):
    """A REFUSED flag: stop with one line naming what to use instead."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        parser.exit(2, f"{parser.prog}: error: {option_string} is vLLM's; {self.const}\n")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's positional MODEL, and the table's NO_EFFECT and REFUSED flags (hidden from
    --help: they are vLLM's, not jserve's; the ACCEPTED ones are jserve's own settings)."""
    parser.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the model to serve, as --model (vLLM's way)"
    )
    for entry in VLLM_SERVE_FLAGS:
        if entry.outcome is Outcome.ACCEPTED:
            continue
        action = _Note if entry.outcome is Outcome.NO_EFFECT else _Refuse
        parser.add_argument(
            entry.flag, action=action, nargs=len(entry.example) or 0, dest="vllm_ignored",
            default=argparse.SUPPRESS, const=entry.note, help=argparse.SUPPRESS,
        )  # fmt: skip


def take_model_tag(ns: argparse.Namespace) -> None:
    """Set `ns.model` from the positional MODEL; ValueError if --model names another."""
    tag = getattr(ns, "model_tag", None)
    if tag is None:
        return
    if ns.model is not None and ns.model != tag:
        raise ValueError(
            f"the model is given twice, as MODEL {tag!r} and --model {ns.model!r}; give one"
        )
    ns.model = tag
