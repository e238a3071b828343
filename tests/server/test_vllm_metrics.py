"""vLLM's metric names on /metrics: each with vLLM's type, buckets and `model_name` label, each the
same observations as its `jserve:` twin, and the numbers they carry after a few mock requests
checked against what the responses themselves say."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from jserve.outputs import RequestMetrics
from jserve.server.metrics import ServerMetrics
from jserve.server.mock_engine import MockEngine
from jserve.server.vllm_metrics import VllmAlias
from tests.server.server_harness import serve

MODEL = "smol"
# vLLM's families (as the text parser names them: a counter without `_total`), their types, and
# the jserve family each one re-emits: the reference is vLLM's v1 Prometheus logger.
VLLM_FAMILIES = {
    "vllm:num_requests_running": ("gauge", "jserve:num_requests_running"),
    "vllm:num_requests_waiting": ("gauge", "jserve:num_requests_waiting"),
    "vllm:kv_cache_usage_perc": ("gauge", "jserve:kv_cache_usage_perc"),
    "vllm:cache_config_info": ("gauge", "jserve:cache_config_info"),
    "vllm:prefix_cache_queries": ("counter", "jserve:prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("counter", "jserve:prefix_cache_hits"),
    "vllm:num_preemptions": ("counter", "jserve:num_preemptions"),
    "vllm:prompt_tokens": ("counter", "jserve:prompt_tokens"),
    "vllm:generation_tokens": ("counter", "jserve:generation_tokens"),
    "vllm:request_success": ("counter", "jserve:request_success"),
    "vllm:spec_decode_num_drafts": ("counter", "jserve:spec_decode_num_drafts"),
    "vllm:spec_decode_num_draft_tokens": ("counter", "jserve:spec_decode_num_draft_tokens"),
    "vllm:spec_decode_num_accepted_tokens": ("counter", "jserve:spec_decode_num_accepted_tokens"),
    "vllm:spec_decode_num_accepted_tokens_per_pos": (
        "counter",
        "jserve:spec_decode_num_accepted_tokens_per_pos",
    ),
    "vllm:iteration_tokens_total": ("histogram", "jserve:iteration_tokens"),
    "vllm:request_prompt_tokens": ("histogram", "jserve:request_prompt_tokens"),
    "vllm:request_generation_tokens": ("histogram", "jserve:request_generation_tokens"),
    "vllm:request_max_num_generation_tokens": (
        "histogram",
        "jserve:request_max_num_generation_tokens",
    ),
    "vllm:request_params_n": ("histogram", "jserve:request_params_n"),
    "vllm:time_to_first_token_seconds": ("histogram", "jserve:time_to_first_token_seconds"),
    "vllm:inter_token_latency_seconds": ("histogram", "jserve:inter_token_latency_seconds"),
    "vllm:time_per_output_token_seconds": ("histogram", "jserve:inter_token_latency_seconds"),
    "vllm:e2e_request_latency_seconds": ("histogram", "jserve:e2e_request_latency_seconds"),
    "vllm:request_queue_time_seconds": ("histogram", "jserve:request_queue_time_seconds"),
    "vllm:request_inference_time_seconds": ("histogram", "jserve:request_inference_time_seconds"),
    "vllm:request_prefill_time_seconds": ("histogram", "jserve:request_prefill_time_seconds"),
    "vllm:request_decode_time_seconds": ("histogram", "jserve:request_decode_time_seconds"),
}
# (prompt, max_tokens, n, stop): three end on length, one on a stop string, one has two choices.
REQUESTS = [("hello", 5, 1, None), ("abcdefgh", 7, 1, None), ("xyz", 3, 1, None),
            ("stop here", 20, 1, ["p"]), ("twice", 4, 2, None)]  # fmt: skip


async def _serve_requests() -> tuple[str, list[dict]]:
    async with serve(MockEngine(token_delay=0.002), served_model_name=MODEL) as client:
        bodies = []
        for prompt, max_tokens, n, stop in REQUESTS:
            body = {"prompt": prompt, "max_tokens": max_tokens, "n": n, "stop": stop}
            response = await client.post("/v1/completions", json=body)
            assert response.status == 200, await response.text()
            bodies.append(await response.json())
        return await (await client.get("/metrics")).text(), bodies


@pytest.fixture(scope="module")
def served() -> tuple[str, list[dict]]:
    """/metrics after REQUESTS, and the REQUESTS' response bodies."""
    return asyncio.run(_serve_requests())


@pytest.fixture(scope="module")
def families(served) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(served[0])}


def _samples(family) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for s in family.samples}


def test_each_vllm_name_is_exported_with_its_type_and_the_model_label(families, served):
    for name, (kind, _) in VLLM_FAMILIES.items():
        assert name in families, f"{name} is not exported"
        assert families[name].type == kind, (name, families[name].type)
        for sample in families[name].samples:
            assert sample.labels.get("model_name") == MODEL, sample
    text = served[0]
    exact = ("vllm:prompt_tokens_total", "vllm:request_success_total",
             "vllm:iteration_tokens_total_bucket", "vllm:num_requests_running")  # fmt: skip
    for sample_name in exact:
        assert f"\n{sample_name}{{" in text, sample_name
    # One series per name: the router-facing gauges are not exported twice.
    assert text.count("\nvllm:num_requests_running{") == 1


def test_each_vllm_series_is_its_jserve_twin_at_vllms_bucket_bounds(families):
    for name, (kind, twin) in VLLM_FAMILIES.items():
        ours = _samples(families[twin])
        theirs = families[name].samples
        assert theirs or kind != "histogram", f"{name} has no samples"
        for sample in theirs:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = (twin + sample.name[len(name) :], frozenset(labels.items()))
            assert ours[key] == sample.value, (sample, key)
        if kind == "counter":  # every jserve series of a counter has its vLLM twin
            assert len(theirs) == len(ours), name


def _bounds(family) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]


def test_vllms_histogram_bounds_are_vllms(families):
    ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, math.inf]  # fmt: skip
    itl = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
           10.0, 20.0, 40.0, 80.0, math.inf]  # fmt: skip
    request = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0, math.inf]  # fmt: skip
    steps = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, math.inf]
    assert _bounds(families["vllm:request_params_n"]) == [1, 2, 5, 10, 20, math.inf]
    assert _bounds(families["vllm:time_to_first_token_seconds"]) == ttft
    assert _bounds(families["vllm:inter_token_latency_seconds"]) == itl
    assert _bounds(families["vllm:time_per_output_token_seconds"]) == itl
    for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                  "request_decode_time", "request_inference_time"):  # fmt: skip
        assert _bounds(families[f"vllm:{phase}_seconds"]) == request, phase
    assert _bounds(families["vllm:iteration_tokens_total"]) == steps
    tokens = _bounds(families["vllm:request_prompt_tokens"])
    assert tokens[:10] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]  # vLLM's 1-2-5 series


def _value(family, suffix: str = "", **labels: str) -> float:
    """The sum of a family's samples named <family><suffix> carrying these labels."""
    return sum(
        s.value
        for s in family.samples
        if s.name == family.name + suffix and labels.items() <= s.labels.items()
    )


def test_the_counts_are_the_requests(families, served):
    bodies = served[1]
    choices = [c for body in bodies for c in body["choices"]]
    assert _value(families["vllm:request_success"], "_total", finished_reason="length") == 5
    assert _value(families["vllm:request_success"], "_total", finished_reason="stop") == 1
    prompt_tokens = sum(b["usage"]["prompt_tokens"] * len(b["choices"]) for b in bodies)
    generated = sum(b["usage"]["completion_tokens"] for b in bodies)
    for name, total in (("prompt", prompt_tokens), ("generation", generated)):
        family = families[f"vllm:request_{name}_tokens"]
        assert _value(family, "_count") == len(choices)
        assert _value(family, "_sum") == total
        assert _value(family, "_bucket", le="+Inf") == len(choices)
    assert _value(families["vllm:generation_tokens"], "_total") == generated
    longest = [max(len(c["text"]) for c in b["choices"]) for b in bodies if len(b["choices"]) > 1]
    assert longest == [4]  # the one request with n=2; the others' choice is their longest
    max_generated = families["vllm:request_max_num_generation_tokens"]
    assert _value(max_generated, "_count") == len(REQUESTS)
    assert _value(max_generated, "_sum") == generated - 4  # n=2: 4 + 4 generated, 4 the longest
    n = families["vllm:request_params_n"]
    assert (_value(n, "_count"), _value(n, "_sum")) == (len(REQUESTS), len(choices))
    assert _value(n, "_bucket", le="1.0") == len(REQUESTS) - 1
    per_request = ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                   "request_prefill_time", "request_decode_time",
                   "request_inference_time")  # fmt: skip
    for name in per_request:
        assert _value(families[f"vllm:{name}_seconds"], "_count") == len(REQUESTS), name
    # One interval between each two tokens of a request (its choices are as long as each other).
    intervals = sum(b["usage"]["completion_tokens"] // len(b["choices"]) - 1 for b in bodies)
    assert _value(families["vllm:inter_token_latency_seconds"], "_count") == intervals


def test_a_requests_prefill_and_decode_make_up_its_time_running(families):
    def total(phase: str) -> float:
        return _value(families[f"vllm:request_{phase}_time_seconds"], "_sum")

    # The mock schedules a request and emits its first token in one step: no prefill time.
    assert total("prefill") == 0 and total("decode") > 0
    assert math.isclose(total("prefill") + total("decode"), total("inference"), rel_tol=1e-9)
    e2e = _value(families["vllm:e2e_request_latency_seconds"], "_sum")
    assert total("queue") + total("inference") <= e2e + 1e-9


def test_the_phases_of_a_request_are_vllms():
    metrics = ServerMetrics()
    timing = RequestMetrics(arrival_time=1.0, first_scheduled_time=2.0, first_token_time=5.0,
                            last_token_time=12.0, finished_time=13.0)  # fmt: skip
    metrics.observe_phases(timing)
    metrics.observe_phases(RequestMetrics(arrival_time=1.0, first_scheduled_time=2.0))  # no token
    families = {f.name: f for f in text_string_to_metric_families(metrics.render("m").decode())}
    for phase, seconds in (("inference", 10.0), ("prefill", 3.0), ("decode", 7.0)):
        family = families[f"vllm:request_{phase}_time_seconds"]
        assert (_value(family, "_count"), _value(family, "_sum")) == (1, seconds), phase


def test_a_sample_is_renamed_without_losing_its_labels():
    source = Metric("jserve:x", "doc", "histogram")
    for le, value in (("0.1", 1), ("0.2", 2), ("+Inf", 3)):
        source.samples.append(Sample("jserve:x_bucket", {"le": le, "lane": "batch"}, value))
    source.samples.append(Sample("jserve:x_count", {"lane": "batch"}, 3))
    family = VllmAlias("jserve:x", "vllm:y", "doc", (0.2,)).family(source, "m")
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("vllm:y_bucket", {"le": "0.2", "lane": "batch", "model_name": "m"}, 2),
        ("vllm:y_bucket", {"le": "+Inf", "lane": "batch", "model_name": "m"}, 3),
        ("vllm:y_count", {"lane": "batch", "model_name": "m"}, 3),
    ]
