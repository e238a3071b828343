"""A real `jserve serve` process on the default model, driven as users drive it.

One server for the module, of the shared engine's sizes: its start-up loads the steps the
shared engine compiled from the persistent compilation cache, and its greedy text must be the
shared engine's. The last test stops it with SIGTERM mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
from server_harness import metric, metric_sum

from jserve.engine.beam_search import beam_search_offline
from jserve.sampling_params import BeamSearchParams, SamplingParams
from tests.shared_engine import SHARED, engine_flags, run_to_completion

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = SHARED["max_model_len"]


@pytest.fixture(scope="module")
def server(shared_engine):  # built first: it fills the conversion and compilation caches
    proc = subprocess.Popen(
        [sys.executable, "-m", "jserve.server.cli", "serve", "--port", "0",
         "--shutdown-timeout", "30", *engine_flags()],
        cwd=REPO_ROOT, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    url = None
    deadline = time.monotonic() + 600
    while url is None:
        line = proc.stderr.readline()
        assert line and time.monotonic() < deadline, f"server exited (rc {proc.poll()})"
        found = re.search(r"listening on (http://\S+)", line)
        url = found.group(1) if found else None
    while True:  # /health says "starting" until the engine has precompiled
        line = proc.stderr.readline()
        assert line and time.monotonic() < deadline, f"server exited (rc {proc.poll()})"
        if "engine ready" in line:
            break
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused")


def _offline_text(engine, prompt, params: SamplingParams) -> list[str]:
    engine.add_request("x", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return [o.text for o in out.outputs]
    raise AssertionError("no output")


def _metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics") as response:
        return response.read().decode()


def test_completions_greedy_match_offline_api(client, engine):
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    params = dict(max_tokens=16, temperature=0.0)
    full = client.completions.create(model=model, prompt=prompt, **params)
    expected = _offline_text(engine, prompt, SamplingParams(**params))[0]
    assert full.choices[0].text == expected
    assert full.usage.completion_tokens == 16 or full.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=model, prompt=prompt, stream=True, **params)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_logit_bias_as_the_openai_client_sends_it_is_the_offline_bias(client, engine):
    """The openai client's logit_bias (string keys) gives the offline engine's tokens for the
    same bias with int keys; a bias past 100 is clamped to 100, as vLLM clamps it."""
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    free = _offline_text(engine, prompt, SamplingParams(max_tokens=4, temperature=0.0))[0]
    first = engine.tokenizer.encode(free, add_special_tokens=False)[0]
    bias = {first: -100.0, 314: 5.0}
    params = dict(max_tokens=4, temperature=0.0)
    expected = _offline_text(engine, prompt, SamplingParams(**params, logit_bias=bias))[0]
    assert expected != free
    sent = {str(k): v for k, v in bias.items()}
    full = client.completions.create(model=model, prompt=prompt, logit_bias=sent, **params)
    assert full.choices[0].text == expected
    clamped = {**sent, str(first): -1e9}
    again = client.completions.create(model=model, prompt=prompt, logit_bias=clamped, **params)
    assert again.choices[0].text == expected


def test_return_token_ids_are_the_engines_ids(client, engine):
    """vLLM's return_token_ids through the openai client: the prompt's ids are the tokenizer's,
    the output's decode to the text and are the offline engine's greedy ids."""
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    full = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0.0,
        extra_body={"return_token_ids": True},
    ).choices[0].to_dict()  # fmt: skip
    engine.add_request("ids", prompt, SamplingParams(max_tokens=6, temperature=0.0))
    offline = run_to_completion(engine)["ids"].outputs[0]
    assert full["prompt_token_ids"] == engine.tokenizer.encode(prompt)
    assert full["token_ids"] == list(offline.token_ids)
    assert engine.tokenizer.decode(full["token_ids"]) == full["text"]


def test_beam_search_matches_the_offline_api(client, engine):
    """use_beam_search through the server (its steps through the async engine's generate)
    gives the offline engine's beams (their search is tested against transformers)."""
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    full = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, n=3, temperature=0.0,
        extra_body={"use_beam_search": True},
    )  # fmt: skip

    def run(ids: list[str]) -> list:
        final = run_to_completion(engine)
        return [final[i] for i in ids]

    (offline,) = beam_search_offline(engine, [prompt], BeamSearchParams(3, 6), run)
    assert [c.text for c in full.choices] == [b.text for b in offline.sequences]
    assert [c.finish_reason for c in full.choices] == [b.finish_reason for b in offline.sequences]


def test_chat_greedy_match_offline_api(client, engine):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0
    )
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    expected = _offline_text(
        engine, {"prompt_token_ids": ids}, SamplingParams(max_tokens=24, temperature=0)
    )[0]
    assert reply.choices[0].message.content == expected
    assert "Paris" in expected
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_responses_api_text_is_chats_and_continues_the_conversation(client):
    """/v1/responses generates through the chat path: greedy, its text is chat's for the same
    messages, and previous_response_id sends the first exchange along with the next input."""
    model = client.models.list().data[0].id
    greedy = dict(model=model, temperature=0)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.responses.create(
        input=question[0]["content"], max_output_tokens=24, top_logprobs=3,
        include=["message.output_text.logprobs"], **greedy,
    )  # fmt: skip
    chat = client.chat.completions.create(
        messages=question, max_tokens=24, logprobs=True, top_logprobs=3, **greedy
    )
    assert first.output_text == chat.choices[0].message.content
    logprobs = first.output[0].content[0].logprobs  # the model's own, as chat gives them
    assert [e.to_dict() for e in logprobs] == [
        e.to_dict() for e in chat.choices[0].logprobs.content
    ]
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    follow_up = "And of Germany?"
    second = client.responses.create(
        input=follow_up, previous_response_id=first.id, max_output_tokens=12, **greedy
    )
    conversation = [
        *question,
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow_up},
    ]
    chat = client.chat.completions.create(messages=conversation, max_tokens=12, **greedy)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens


def test_n_logprobs_and_stop_strings(client):
    model = client.models.list().data[0].id
    two = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=8, n=2, seed=3, temperature=1.0
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    lp = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(len(top) >= 3 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    stopped = client.completions.create(
        model=model, prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[" 6"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert " 6" not in stopped.choices[0].text and " 5" in stopped.choices[0].text


async def _stream(session, url, prompt, max_tokens, read_events=None) -> tuple[str, dict | None]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    text, usage, events = "", None, 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            text += "".join(c["text"] for c in event["choices"])
            events += 1
            if read_events is not None and events >= read_events:
                return text, None  # leave mid-stream: the connection closes
    return text, usage


def test_32_concurrent_streams_and_metrics_add_up(server, engine):
    url = server[1]
    prompts = [f"Item {i}: the best thing about number {i} is" for i in range(32)]
    before = _metrics(url)

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(_stream(session, url, p, 12) for p in prompts))

    results = asyncio.run(main())
    after = _metrics(url)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"c{i}", prompt, greedy)
    expected = {}
    while engine.has_unfinished_requests():
        expected |= {o.request_id: o.outputs[0].text for o in engine.step() if o.finished}
    for i, (text, usage) in enumerate(results):
        assert usage["completion_tokens"] == 12
        assert text == expected[f"c{i}"]
    gained = metric_sum(after, "jserve:request_success_total") - metric_sum(
        before, "jserve:request_success_total"
    )
    assert gained == 32
    generated = metric(after, "jserve:generation_tokens_total") - metric(
        before, "jserve:generation_tokens_total"
    )
    assert generated == sum(u["completion_tokens"] for _, u in results)


def test_disconnected_clients_free_kv_within_a_second(server):
    url = server[1]

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(
                *(_stream(session, url, f"Story {i}:", 500, read_events=2) for i in range(8))
            )
        gone = time.monotonic()
        while time.monotonic() - gone < 1.0:
            text = _metrics(url)
            if metric(text, "jserve:num_requests_running") == 0 and (
                metric(text, "jserve:kv_cache_usage_perc") == 0
            ):
                return time.monotonic() - gone
            await asyncio.sleep(0.02)
        raise AssertionError(f"KV still in use 1 s after the clients left:\n{text}")

    asyncio.run(main())

    async def again():
        async with aiohttp.ClientSession() as session:
            return await _stream(session, url, "Still serving?", 4)

    assert asyncio.run(again())[1]["completion_tokens"] == 4


BAD_INPUTS = [
    ("malformed JSON", b"{not json", 400, "invalid_request_error"),
    ("temperature out of range", {"prompt": "hi", "temperature": -1}, 400, None),
    ("prompt too long", {"prompt": [7] * (MAX_MODEL_LEN - 4), "max_tokens": 100}, 400, None),
    ("unknown model", {"prompt": "hi", "model": "gpt-unknown"}, 404, None),
    ("wrong type", {"prompt": "hi", "max_tokens": "ten"}, 400, None),
]


def test_bad_inputs_get_openai_errors_and_the_server_stays_healthy(server):
    import urllib.error
    import urllib.request

    url = server[1]
    for name, body, status, error_type in BAD_INPUTS:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(request)
            raise AssertionError(f"{name}: accepted")
        except urllib.error.HTTPError as e:
            assert e.code == status, name
            error = json.loads(e.read())["error"]
            assert error["message"], name
            assert error_type is None or error["type"] == error_type, (name, error)
            if name == "prompt too long":
                message = error["message"]
                assert f"{MAX_MODEL_LEN - 4} tokens" in message, error
                assert f"max_model_len={MAX_MODEL_LEN}" in message, error
    with urllib.request.urlopen(f"{url}/health") as response:
        assert response.status == 200


def test_sigterm_mid_stream_completes_it_and_exits_0(server):
    proc, url = server

    async def main():
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(_stream(session, url, "A long tale:", 40))
            await asyncio.sleep(1.0)  # the stream is under way
            proc.send_signal(signal.SIGTERM)
            return await task

    text, usage = asyncio.run(main())
    assert usage["completion_tokens"] == 40 and text
    assert proc.wait(timeout=60) == 0
