"""Tenants over HTTP, SLO refusals (429/503 with Retry-After), per-tenant metrics, the stream
idle timeout and the /admin/scheduler endpoint."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest
from server_harness import echo_text, metric, serve, serve_guarded

from jserve.errors import RequestRejected
from jserve.server.generation import StreamIdle, write_stream
from jserve.server.mock_engine import MockEngine

COMPLETIONS = "/v1/completions"
AUTH = {"Authorization": "Bearer k"}


async def test_the_tenant_is_the_header_else_the_user_field_else_default():
    engine = MockEngine()
    async with serve(engine) as client:
        body = {"prompt": "ab", "max_tokens": 2}
        for headers, extra, expected in [
            ({"X-Tenant": "gateway-said"}, {"user": "client-said"}, "gateway-said"),
            ({}, {"user": "client-said"}, "client-said"),
            ({}, {}, "default"),
        ]:
            response = await client.post(COMPLETIONS, json={**body, **extra}, headers=headers)
            assert response.status == 200
            request_id = (await response.json())["id"]
            assert engine.tenants[request_id] == expected
        for headers, extra, param in [
            ({"X-Tenant": ""}, {}, "X-Tenant"),
            ({}, {"user": "x" * 257}, "user"),
            ({}, {"user": 5}, "user"),
        ]:
            response = await client.post(COMPLETIONS, json={**body, **extra}, headers=headers)
            assert response.status == 400
            assert (await response.json())["error"]["param"] == param


class _Refuses(MockEngine):
    def __init__(self, error: RequestRejected) -> None:
        super().__init__()
        self.error = error

    async def generate(self, prompt, params, request_id, **_):
        raise self.error
        yield  # an async generator, like the real one


@pytest.mark.parametrize(
    ("error", "status", "code", "retry_after"),
    [
        (RequestRejected("deadline", "the deadline cannot be met: 4.1 s", 3.2), 429,
         "deadline_unmeetable", "4"),
        (RequestRejected("kv_full", "KV cache usage is 96.0%", 1.0), 503, "kv_cache_full", "1"),
        (RequestRejected("queue_full", "1024 sequences are already waiting"), 429,
         "queue_full", "1"),
    ],
)  # fmt: skip
async def test_slo_refusals_say_which_limit_and_when_to_retry(error, status, code, retry_after):
    async with serve(_Refuses(error)) as client:
        response = await client.post(
            COMPLETIONS, json={"prompt": "a", "lane": "batch"}, headers={"X-Tenant": "t1"}
        )
        assert response.status == status
        assert response.headers["Retry-After"] == retry_after
        body = (await response.json())["error"]
        assert body["code"] == code and body["message"] == str(error)
        metrics = await (await client.get("/metrics")).text()
    labels = f'lane="batch",reason="{error.reason}",tenant="t1"'
    assert metric(metrics, "jserve:tenant_request_rejected_total", labels) == 1


async def test_metrics_are_split_by_lane_and_tenant_with_bounded_labels():
    async with serve(MockEngine(), max_tenant_labels=1) as client:
        for tenant in ("alice", "bob", "carol"):
            response = await client.post(
                COMPLETIONS, json={"prompt": "abc", "max_tokens": 3, "user": tenant}
            )
            assert response.status == 200
        metrics = await (await client.get("/metrics")).text()
    ttft = "jserve:tenant_time_to_first_token_seconds_count"
    assert metric(metrics, ttft, 'lane="interactive",tenant="alice"') == 1
    assert metric(metrics, ttft, 'lane="interactive",tenant="other"') == 2  # bob, carol
    assert 'tenant="bob"' not in metrics
    tokens = "jserve:tenant_served_tokens_total"
    assert metric(metrics, tokens, 'kind="prompt",lane="interactive",tenant="alice"') == 3
    assert metric(metrics, tokens, 'kind="generation",lane="interactive",tenant="other"') == 6
    finished = "jserve:tenant_request_finished_total"
    labels = 'finished_reason="length",lane="interactive",tenant="alice"'
    assert metric(metrics, finished, labels) == 1


async def test_a_write_the_client_does_not_read_times_out():
    class Stuck:
        async def write(self, data: bytes) -> None:
            await asyncio.Event().wait()

    with pytest.raises(StreamIdle):
        await write_stream(Stuck(), b"data", 0.05)


async def test_a_stream_whose_client_stops_reading_is_aborted_and_freed():
    engine = MockEngine(max_model_len=400_000, token_delay=0.0, block_size=16)
    async with serve_guarded(engine, stream_idle_timeout=0.3) as address:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(address)
        # Eight choices with logprobs: kilobytes per step, so the socket buffers fill fast.
        body = json.dumps(
            {"prompt": "x" * 50, "max_tokens": 300_000, "n": 8, "logprobs": 5, "stream": True}
        )
        sock.sendall(
            f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )  # then never read
        try:
            for _ in range(200):
                await asyncio.sleep(0.05)
                if engine.stats().num_requests_running == 0 and engine.tenants:
                    break
            assert engine.stats().num_requests_running == 0
            assert engine.stats().kv_cache_usage == 0
        finally:
            sock.close()


async def test_admin_reads_and_changes_scheduler_settings_within_limits(caplog):
    async with serve(MockEngine(max_num_seqs=16), api_key="k") as client:
        assert (await client.get("/admin/scheduler")).status == 401
        settings = await (await client.get("/admin/scheduler", headers=AUTH)).json()
        assert settings["max_num_seqs"] == 16 and settings["tenant_weights"] == {"gold": 2.0}
        with caplog.at_level(logging.INFO, logger="jserve.core.control"):
            response = await client.post(
                "/admin/scheduler", headers=AUTH,
                json={"max_num_seqs": 8, "kv_reject_watermark": 0.95,
                      "tenant_weights": {"gold": 3}, "decision_log": True},
            )  # fmt: skip
        assert response.status == 200, await response.text()
        after = await response.json()
        assert after["max_num_seqs"] == 8 and after["kv_reject_watermark"] == 0.95
        assert after["tenant_weights"] == {"gold": 3.0} and after["decision_log"] is True
        assert "max_num_seqs changed: 16 -> 8" in caplog.text
        assert logging.getLogger("jserve.decisions").isEnabledFor(logging.DEBUG)
        bad = [
            ({"max_num_seqs": 64}, "above the 16 the engine precompiled for"),
            ({"max_num_batched_tokens": 1024}, "above the 512 the engine precompiled for"),
            ({"kv_reject_watermark": 1.5}, "kv_reject_watermark must be a finite number in (0, 1]"),
            (
                {"free_block_watermark": 1.0},
                "free_block_watermark must be a finite number in [0, 1)",
            ),
            ({"tenant_weights": {"nobody": 1}}, "unknown tenants ['nobody']"),
            ({"tenant_weights": {"gold": 0}}, "weight must be a finite number > 0"),
            ({"max_num_seqs": "8"}, "max_num_seqs must be an integer in [1, 2**31-1], got '8'"),
            ({"batch_size": 8}, "unknown setting 'batch_size'"),
            ({"target_itl_ms": 50.0}, "needs measured step costs"),
        ]
        for changes, message in bad:
            response = await client.post("/admin/scheduler", headers=AUTH, json=changes)
            assert response.status == 400, changes
            error = (await response.json())["error"]
            assert message in error["message"], changes
            assert error["param"] == next(iter(changes)), changes
        response = await client.post("/admin/scheduler", headers=AUTH, json={})
        assert response.status == 400
        assert "send a JSON object of settings" in (await response.json())["error"]["message"]
        unchanged = await (await client.get("/admin/scheduler", headers=AUTH)).json()
        assert unchanged["max_num_seqs"] == 8 and unchanged["tenant_weights"] == {"gold": 3.0}
        off = {"decision_log": False}
        assert (await client.post("/admin/scheduler", headers=AUTH, json=off)).status == 200
    assert not logging.getLogger("jserve.decisions").isEnabledFor(logging.DEBUG)


def _strict_json(text: str) -> dict:
    """JSON as the standard has it: Infinity and NaN are not numbers."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a JSON body")

    return json.loads(text, parse_constant=refuse)


HUGE = "1" + "0" * 400  # a 400-digit integer, as a JSON literal


MALFORMED = {  # test id: (body, the field the 400 names)
    "400-digit watermark": (f'{{"free_block_watermark": {HUGE}}}', "free_block_watermark"),
    "400-digit count": (f'{{"max_num_seqs": {HUGE}}}', "max_num_seqs"),
    "past int32": ('{"aging_iterations": 2147483648}', "aging_iterations"),
    "1e400": ('{"target_itl_ms": 1e400}', "target_itl_ms"),
    "-1e400": ('{"kv_reject_watermark": -1e400}', "kv_reject_watermark"),
    "bool for a number": ('{"long_lane_max_share": true}', "long_lane_max_share"),
    "number for a bool": ('{"deadline_admission": 1}', "deadline_admission"),
    "list for a choice": ('{"fairness": ["vtc"]}', "fairness"),
    "string for a bool": ('{"decision_log": "yes"}', "decision_log"),
    "float for an int": ('{"max_num_batched_tokens": 64.0}', "max_num_batched_tokens"),
    "list for a map": ('{"tenant_weights": [["gold", 2]]}', "tenant_weights"),
    "infinite weight": ('{"tenant_weights": {"gold": 1e400}}', "tenant_weights.gold"),
    "400-digit weight": (f'{{"tenant_weights": {{"gold": {HUGE}}}}}', "tenant_weights"),
    "5000 weights": (
        json.dumps({"tenant_weights": {f"t{i}": 1 for i in range(5000)}}),
        "tenant_weights",
    ),
    "1000 unknown tenants": (
        json.dumps({"tenant_weights": {f"t{i}": 1 for i in range(1000)}}),
        "tenant_weights",
    ),
    "huge tenant name": (json.dumps({"tenant_weights": {"x" * 100_000: 1}}), "tenant_weights"),
    "huge unknown field": (json.dumps({"k" * 100_000: 1}), "k" * 64),
    "valid then invalid": ('{"max_num_seqs": 8, "fairness": "lottery"}', "fairness"),
    # Not JSON: refused while the body is read, and still named.
    "NaN": ('{"long_lane_max_share": NaN}', "long_lane_max_share"),
}


@pytest.mark.parametrize(("body", "param"), MALFORMED.values(), ids=MALFORMED.keys())
async def test_admin_refuses_each_malformed_value_naming_it_and_the_engine_serves_on(body, param):
    engine = MockEngine(token_delay=0.001)
    async with serve(engine, api_key="k") as client:
        before = await (await client.get("/admin/scheduler", headers=AUTH)).text()
        response = await client.post(
            "/admin/scheduler", data=body, headers={**AUTH, "Content-Type": "application/json"}
        )
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["param"] == param, error
        assert len(error["message"]) < 600, "an error must not echo the body back"
        after = await client.get("/admin/scheduler", headers=AUTH)
        assert after.status == 200
        assert _strict_json(await after.text()) == _strict_json(before)  # nothing changed
        body = {"prompt": "abc", "max_tokens": 5}
        response = await client.post(COMPLETIONS, json=body, headers=AUTH)
        assert (await response.json())["choices"][0]["text"] == echo_text("abc", 5)


async def test_admin_needs_an_api_key_to_be_configured():
    async with serve(MockEngine()) as client:
        response = await client.get("/admin/scheduler")
        assert response.status == 403
        assert (await response.json())["error"]["code"] == "admin_disabled"
