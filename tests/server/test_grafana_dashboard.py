"""docs/grafana/jserve.json queries only series the server exports: every metric named in a
panel's PromQL or a variable's query is one /metrics carries, with a suffix its type has."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from jserve.server.mock_engine import MockEngine
from tests.server.server_harness import serve

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "jserve.json"
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"\{[^}]*\}|\[[^\]]*\]")  # label matchers and range selectors
_CLAUSES = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*+)(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,")
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def series_names(expr: str) -> set[str]:
    """The series a PromQL expression selects: identifiers that are not functions, keywords,
    label names (in matchers, `by (...)`, `on (...)`...), strings, durations or variables."""
    expr = _CLAUSES.sub(" ", _BRACKETS.sub(" ", _STRINGS.sub(" ", expr)))
    return {name for name in _NAME.findall(expr) if name.lower() not in _KEYWORDS}


def _queries(node: object) -> Iterator[str]:
    """Every panel target's `expr` (rows' nested panels too) and every variable's query."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "definition" and isinstance(value, str):
                yield from _LABEL_VALUES.findall(value)
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def dashboard_series(dashboard: dict) -> set[str]:
    return {name for query in _queries(dashboard) for name in series_names(query)}


def exported_series(exposition: str) -> set[str]:
    """Every series name the exposition's families allow (a counter's `_total`, a histogram's
    `_bucket`/`_sum`/`_count`, a gauge's own name), samples yet or not."""
    return {
        family.name + suffix
        for family in text_string_to_metric_families(exposition)
        for suffix in _SUFFIXES.get(family.type, ())
    }


async def _exposition() -> str:
    async with serve(MockEngine(token_delay=0.002), served_model_name="smol") as client:
        for prompt in ("hello", "abcabc"):
            body = {"prompt": prompt, "max_tokens": 4}
            assert (await client.post("/v1/completions", json=body)).status == 200
        return await (await client.get("/metrics")).text()


def test_the_extractor_finds_the_series_of_each_kind_of_query():
    quantile = (
        "histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket"
        '{model_name="$model_name"}[$__rate_interval])))'
    )
    assert series_names(quantile) == {"vllm:e2e_request_latency_seconds_bucket"}
    ratio = (
        'sum by(position) (rate(a_total{model_name="x"}[5m]))\n/ ignoring(position) group_left\n'
        '1 + sum(rate(b:c_total[1m] offset 5m)) and on(instance) d_info{k="v"} > bool 0.5e3'
    )
    assert series_names(ratio) == {"a_total", "b:c_total", "d_info"}
    assert series_names("jserve:engine_restarts_total") == {"jserve:engine_restarts_total"}


async def test_every_query_in_the_dashboard_names_an_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series(await _exposition())
    used = dashboard_series(dashboard)
    assert len(used) >= 30, sorted(used)  # the walk found the panels' queries
    assert not used - exported, sorted(used - exported)
    # The check can fail: a planted panel naming a series the server lacks, or a counter
    # without its `_total`, is caught.
    planted = {"panels": [{"targets": [
        {"expr": 'rate(vllm:no_such_series_total{model_name="$model_name"}[1m])'},
        {"expr": "rate(vllm:prompt_tokens[1m])"},
    ]}]}  # fmt: skip
    missing = dashboard_series(planted) - exported
    assert missing == {"vllm:no_such_series_total", "vllm:prompt_tokens"}


async def test_vllms_example_dashboard_finds_every_series_it_queries():
    # The series vLLM's own example dashboard (examples/observability/prometheus_grafana/
    # grafana.json in vLLM's repository) queries, all filtered on model_name.
    vllm_dashboard = {
        f"vllm:{name}"
        for name in (
            "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
            "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
            "inter_token_latency_seconds_bucket", "inter_token_latency_seconds_sum",
            "inter_token_latency_seconds_count", "num_requests_running", "num_requests_waiting",
            "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum",
            "time_to_first_token_seconds_count", "kv_cache_usage_perc",
            "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
            "request_success_total", "request_queue_time_seconds_sum",
            "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
            "request_max_num_generation_tokens_sum",
        )
    }  # fmt: skip
    exposition = await _exposition()
    assert not vllm_dashboard - exported_series(exposition)
    samples = {
        sample.name
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.labels.get("model_name") == "smol"
    }
    assert vllm_dashboard <= samples  # each has a sample for the model_name variable to pick


def test_the_dashboard_imports_with_a_datasource_input_and_a_model_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model_name"]["definition"].startswith("label_values(")
    targets = [t for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    for target in targets:
        assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
        # Each query follows the model picked: vLLM's series by their label, jserve's (which
        # have none) joined on the instance serving that model.
        assert '$model_name"' in target["expr"], target["expr"]
