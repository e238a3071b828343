"""The endpoints a router probes to identify a worker and read its load.

Found by running the routers in front of jserve and reading what they request:
- smg 1.13.0 at registration: `/health`, `/v1/models`, `/version`, `/server_info` (then the
  deprecated `/get_server_info`), `/model_info` (then `/get_model_info`), `/v1/loads`. It
  classifies a worker by `/version` (vLLM) or `/server_info` (SGLang); jserve answers both and
  smg registers it as `runtime_type: vllm` (jserve's HTTP API, metric names and KV events are
  vLLM's). Its load monitor then reads a vLLM worker's load every 10 s from `/metrics`: the
  series `vllm:num_requests_running`, `vllm:num_requests_waiting` and
  `vllm:kv_cache_usage_perc`, which /metrics carries beside the `jserve:` ones (the same
  series under vLLM's names: jserve.server.vllm_metrics).
- vllm-router 0.1.17: `/health` and `/v1/models` only.

Every value is read from the engine (the async engine's `stats()` and its fixed sizes), never
made up: fields jserve has no meaning for (data parallelism beyond one rank, disaggregation)
carry their neutral value. `/server_info`, `/model_info` and `/v1/loads` follow SGLang's
shapes, `/version` vLLM's (`{"version": ...}`).

Reading the engine's stats drains its per-iteration token counts: they go into the metrics
histogram here exactly as `/metrics` does, so neither reader loses the other's samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import metadata

from aiohttp import web

from jserve.outputs import EngineStats
from jserve.server.engine_client import EngineClient
from jserve.server.responses import json_response
from jserve.server.state import STATE, ServerState

try:
    VERSION = metadata.version("jserve")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0.0.0+source"


@dataclass
class _Throughput:
    """Generation tokens per second between two load reads (the first read reports 0)."""

    last_time: float = field(default_factory=time.monotonic)
    last_tokens: int = 0

    def update(self, generation_tokens: int) -> float:
        now = time.monotonic()
        elapsed, produced = now - self.last_time, generation_tokens - self.last_tokens
        self.last_time, self.last_tokens = now, generation_tokens
        return produced / elapsed if elapsed > 0 and produced > 0 else 0.0


_THROUGHPUT = web.AppKey("jserve_worker_throughput", _Throughput)


def _stats(state: ServerState, engine: EngineClient) -> EngineStats:
    stats = engine.stats()
    state.metrics.refresh(stats)  # keep the drained iteration tokens for /metrics
    return stats


def load_snapshot(engine: EngineClient, stats: EngineStats, gen_throughput: float) -> dict:
    """One rank's load in SGLang's `/v1/loads` shape, from the engine's snapshot."""
    capacity = engine.kv_cache_tokens
    used = round(stats.kv_cache_usage * capacity)
    hit_rate = (
        stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    )
    running, waiting = stats.num_requests_running, stats.num_requests_waiting
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": capacity,
        "token_usage": stats.kv_cache_usage,
        "gen_throughput": gen_throughput,
        "cache_hit_rate": hit_rate,
        "utilization": running / engine.max_num_seqs,
        "max_running_requests": engine.max_num_seqs,
        "queues": {"waiting": waiting},
    }


async def _loads(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    stats = _stats(state, engine)
    load = load_snapshot(engine, stats, request.app[_THROUGHPUT].update(stats.generation_tokens))
    body = {
        "timestamp": time.time(),
        "version": VERSION,
        "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {
            "total_running_reqs": load["num_running_reqs"],
            "total_waiting_reqs": load["num_waiting_reqs"],
            "total_reqs": load["num_total_reqs"],
            "avg_token_usage": load["token_usage"],
            "avg_throughput": load["gen_throughput"],
            "avg_utilization": load["utilization"],
        },
    }
    return json_response(body)


async def _version(request: web.Request) -> web.Response:
    return json_response({"version": VERSION})


def _model_fields(state: ServerState, engine: EngineClient) -> dict:
    return {
        "model_path": engine.model_name,
        "tokenizer_path": engine.model_name,
        "served_model_name": state.model_name,
        "is_generation": True,
        "is_embedding": False,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "max_model_len": engine.max_model_len,
        "context_length": engine.max_model_len,
        "weight_version": "default",
        "quantization": engine.quantization,
    }


async def _model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(_model_fields(state, state.ready_engine()))


async def _server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    stats = _stats(state, engine)
    body = {
        **_model_fields(state, engine),
        "engine": "jserve",
        "version": VERSION,
        "page_size": engine.block_size,
        "max_total_num_tokens": engine.kv_cache_tokens,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "num_kv_blocks": engine.num_kv_blocks,
        "max_running_requests": engine.max_num_seqs,
        "tp_size": engine.tensor_parallel_size,
        "dp_size": 1,
        "attn_dp_size": 1,
        "enable_dp_attention": False,
        "disaggregation_mode": "null",
        "api_key_required": state.settings.api_key is not None,
        "internal_states": [load_snapshot(engine, stats, 0.0)],
    }
    return json_response(body)


def add_worker_routes(app: web.Application) -> None:
    """Register the router-facing endpoints on the app (jserve.server.app.create_app calls this)."""
    app[_THROUGHPUT] = _Throughput()
    app.router.add_get("/version", _version)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, _server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, _model_info)
    app.router.add_get("/v1/loads", _loads)
