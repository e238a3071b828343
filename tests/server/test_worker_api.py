"""The router-facing endpoints: what smg and vllm-router probe, answered from the engine."""

from __future__ import annotations

import asyncio

from jserve.server.mock_engine import MockEngine
from jserve.server.worker_api import VERSION
from tests.server.server_harness import metric, serve


async def test_identity_endpoints_describe_the_engine():
    engine = MockEngine(max_num_seqs=8, num_kv_blocks=100, block_size=16, max_model_len=512)
    async with serve(engine, served_model_name="fleet-model") as client:
        assert await (await client.get("/version")).json() == {"version": VERSION}
        for path in ("/model_info", "/get_model_info"):
            info = await (await client.get(path)).json()
            assert info["model_path"] == "mock-model"
            assert info["served_model_name"] == "fleet-model"
            assert info["is_generation"] is True and info["max_model_len"] == 512
        for path in ("/server_info", "/get_server_info"):
            info = await (await client.get(path)).json()
            assert info["engine"] == "jserve" and info["version"] == VERSION
            assert info["page_size"] == 16 and info["max_total_num_tokens"] == 1600
            assert info["max_running_requests"] == 8 and info["tp_size"] == 1
            assert info["api_key_required"] is False


async def test_loads_and_vllm_gauges_follow_the_engine_under_load():
    engine = MockEngine(token_delay=0.05, max_num_seqs=2, num_kv_blocks=10, block_size=4)
    async with serve(engine) as client:
        body = {"prompt": "abcdefghij", "max_tokens": 200}  # 10+ tokens: 3+ blocks each
        tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)]
        for _ in range(200):  # until two run and one waits
            load = (await (await client.get("/v1/loads")).json())["loads"][0]
            if load["num_running_reqs"] == 2 and load["num_waiting_reqs"] == 1:
                break
            await asyncio.sleep(0.02)
        assert load["num_total_reqs"] == 3 and load["max_running_requests"] == 2
        assert load["utilization"] == 1.0 and load["max_total_num_tokens"] == 40
        # Two running requests of 10+ tokens hold at least 3 blocks of 4 each: 6 of 10.
        assert load["token_usage"] >= 0.6 and load["num_used_tokens"] == round(
            load["token_usage"] * 40
        )
        text = await (await client.get("/metrics")).text()
        model = 'model_name="mock-model"'
        assert metric(text, "vllm:num_requests_running", model) == 2
        assert metric(text, "vllm:num_requests_waiting", model) == 1
        assert metric(text, "vllm:kv_cache_usage_perc", model) == metric(
            text, "jserve:kv_cache_usage_perc"
        )
        for task in tasks:
            task.cancel()


async def test_worker_endpoints_need_the_api_key_and_answer_503_while_loading():
    async with serve(MockEngine(), api_key="k") as client:
        assert (await client.get("/server_info")).status == 401
        ok = await client.get("/v1/loads", headers={"Authorization": "Bearer k"})
        assert ok.status == 200
    async with serve(None) as client:
        response = await client.get("/server_info")
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "starting"


async def test_the_quantization_served_is_reported_everywhere_a_client_looks():
    engine = MockEngine(quantization="gguf:Q4_1,Q8_0")
    async with serve(engine, served_model_name="smol") as client:
        [model] = (await (await client.get("/v1/models")).json())["data"]
        info = await (await client.get("/model_info")).json()
        server = await (await client.get("/server_info")).json()
        metrics = await (await client.get("/metrics")).text()
    assert model["quantization"] == info["quantization"] == server["quantization"]
    assert model["quantization"] == "gguf:Q4_1,Q8_0"
    labels = 'model_name="smol",quantization="gguf:Q4_1,Q8_0"'
    assert metric(metrics, "jserve:model_info", labels) == 1


async def test_the_kv_pool_is_reported_in_server_info_and_metrics():
    engine = MockEngine(kv_cache_dtype="int8", num_kv_blocks=300, block_size=16)
    async with serve(engine) as client:
        server = await (await client.get("/server_info")).json()
        metrics = await (await client.get("/metrics")).text()
    assert server["kv_cache_dtype"] == "int8" and server["num_kv_blocks"] == 300
    labels = 'block_size="16",cache_dtype="int8",num_gpu_blocks="300"'
    assert metric(metrics, "jserve:cache_config_info", labels) == 1
