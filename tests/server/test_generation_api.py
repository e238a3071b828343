"""Exact responses of /v1/completions and /v1/chat/completions on the hand-computable mock."""

from __future__ import annotations

import asyncio

from server_harness import chat_prompt, echo_text, serve, stream_events

from jserve.server.mock_engine import CharTokenizer, MockEngine

USER_HI = [{"role": "user", "content": "Hi"}]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _fast_mock(**kwargs) -> MockEngine:
    return MockEngine(token_delay=0.001, **kwargs)


def _streamed_text(events: list, choice: int = 0, key: str = "text") -> str:
    parts = []
    for event in events:
        if isinstance(event, dict):
            for c in event["choices"]:
                if c["index"] == choice:
                    parts.append(c[key] if key == "text" else c["delta"].get("content", ""))
    return "".join(parts)


async def test_completion_exact_text_and_usage():
    async with serve(_fast_mock()) as client:
        response = await client.post(
            "/v1/completions", json={"model": "mock-model", "prompt": "Hello", "max_tokens": 7}
        )
        assert response.status == 200
        body = await response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == "mock-model"
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "text": "HelloHe", "logprobs": None, "finish_reason": "length",
         "stop_reason": None}
    ]  # fmt: skip
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


async def test_completion_default_max_tokens_is_16_and_token_id_prompts():
    async with serve(_fast_mock()) as client:
        default = await (await client.post("/v1/completions", json={"prompt": "abc"})).json()
        ids = await (await client.post("/v1/completions", json={"prompt": [72, 105]})).json()
        one_of_list = await (
            await client.post("/v1/completions", json={"prompt": ["Hi"], "max_tokens": 3})
        ).json()
    assert default["choices"][0]["text"] == echo_text("abc", 16)
    assert ids["choices"][0]["text"] == echo_text("Hi", 16)
    assert ids["usage"]["prompt_tokens"] == 2
    assert one_of_list["choices"][0]["text"] == "HiH"


async def test_completion_stream_framing_without_usage():
    async with serve(_fast_mock()) as client:
        events = await stream_events(
            client, "/v1/completions", {"prompt": "Hello", "max_tokens": 7}
        )
    chunks = events[:-1]
    assert events[-1] == "[DONE]"
    assert len(chunks) == 7  # one token per mock step, one chunk each
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert _streamed_text(events) == "HelloHe"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]


async def test_completion_stream_include_usage():
    async with serve(_fast_mock()) as client:
        events = await stream_events(
            client,
            "/v1/completions",
            {"prompt": "Hello", "max_tokens": 4, "stream_options": {"include_usage": True}},
        )
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


async def test_continuous_usage_stats_report_each_choices_tokens_so_far():
    """vLLM's stream_options.continuous_usage_stats: every chunk's usage counts the prompt and
    that choice's tokens so far (n=2: each choice its own), then the totals' chunk; alone it
    implies include_usage (vLLM's default), with include_usage false it is a 400 naming it."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "Hello", "max_tokens": 3, "n": 2, "stream_options": options}
    async with serve(_fast_mock()) as client:
        events = await stream_events(client, "/v1/completions", body)
        alone = {**body, "stream_options": {"continuous_usage_stats": True}}
        implied = await stream_events(client, "/v1/completions", alone)
        contradicted = {**options, "include_usage": False}
        refused = await client.post(
            "/v1/completions", json={**body, "stream_options": contradicted, "stream": True}
        )
        error = (await refused.json())["error"]
    *chunks, totals, done = events
    assert done == "[DONE]" and totals["usage"]["completion_tokens"] == 6
    seen = {0: 0, 1: 0}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        seen[choice["index"]] += 1 if choice["text"] else 0
        assert chunk["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": seen[choice["index"]],
            "total_tokens": 5 + seen[choice["index"]],
        }
    assert seen == {0: 3, 1: 3}
    assert [e["usage"] for e in implied[:-1]] == [e["usage"] for e in events[:-1]]
    assert (refused.status, error["param"]) == (400, "stream_options.continuous_usage_stats")


async def test_return_token_ids_puts_the_ids_where_vllm_does():
    """vLLM's return_token_ids: each choice's output ids, and the prompt's ids in a
    completion's choices or at a chat response's top level; streamed, each chunk's new ids and
    the prompt's in each choice's first chunk (the mock's ids are code points)."""
    codes = lambda text: [ord(c) for c in text]  # noqa: E731
    messages = [{"role": "user", "content": "Hi"}]
    completion = {"prompt": "Hello", "max_tokens": 4, "n": 2, "return_token_ids": True}
    chat = {"messages": messages, "max_tokens": 4, "return_token_ids": True}
    async with serve(_fast_mock()) as client:
        full = await (await client.post("/v1/completions", json=completion)).json()
        events = await stream_events(client, "/v1/completions", completion)
        chat_full = await (await client.post("/v1/chat/completions", json=chat)).json()
        chat_events = await stream_events(client, "/v1/chat/completions", chat)
        plain = await (await client.post("/v1/completions", json={"prompt": "Hello"})).json()
        beams = {**completion, "use_beam_search": True, "temperature": 0}
        beamed = await (await client.post("/v1/completions", json=beams)).json()
    for choice in full["choices"]:
        assert choice["prompt_token_ids"] == codes("Hello")
        assert choice["token_ids"] == codes(echo_text("Hello", 4, choice["index"]))
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert chunks[0]["prompt_token_ids"] == codes("Hello")
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        streamed = [t for c in chunks for t in c["token_ids"]]
        assert streamed == codes(echo_text("Hello", 4, index))
    prompt = codes(chat_prompt(messages))
    assert chat_full["prompt_token_ids"] == prompt
    assert chat_full["choices"][0]["token_ids"] == codes(echo_text(chat_prompt(messages), 4))
    assert chat_events[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in e for e in chat_events[1:-1])
    streamed = [t for e in chat_events[:-1] for t in e["choices"][0]["token_ids"]]
    assert streamed == chat_full["choices"][0]["token_ids"]
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    assert len(beamed["choices"]) == 2
    for choice in beamed["choices"]:  # each beam's own ids
        assert choice["token_ids"] == codes(choice["text"])


class _BosTokenizer(CharTokenizer):
    """Adds a BOS (id 1) when asked for special tokens, as Llama's tokenizers do."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + super().encode(text)


async def test_add_special_tokens_follows_vllms_defaults():
    """vLLM's add_special_tokens: a completion's text prompt takes special tokens unless it is
    false, a chat's rendered prompt only when it is true (the template holds them); /tokenize
    follows the same rule for messages."""
    engine = _fast_mock()
    engine.tokenizer = _BosTokenizer()
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = [ord(c) for c in chat_prompt(messages)]
    ids = {"max_tokens": 1, "return_token_ids": True}
    async with serve(engine) as client:

        async def prompt_ids(path: str, body: dict) -> list[int]:
            answer = await (await client.post(path, json={**body, **ids})).json()
            return answer.get("prompt_token_ids") or answer["choices"][0]["prompt_token_ids"]

        async def tokenized(body: dict) -> list[int]:
            return (await (await client.post("/tokenize", json=body)).json())["tokens"]

        got = [
            await prompt_ids("/v1/completions", {"prompt": "Hello"}),
            await prompt_ids("/v1/completions", {"prompt": "Hello", "add_special_tokens": False}),
            await prompt_ids("/v1/chat/completions", {"messages": messages}),
            await prompt_ids(
                "/v1/chat/completions", {"messages": messages, "add_special_tokens": True}
            ),
            await tokenized({"messages": messages}),
            await tokenized({"messages": messages, "add_special_tokens": True}),
        ]
    hello = [ord(c) for c in "Hello"]
    assert got == [[1, *hello], hello, chat_ids, [1, *chat_ids], chat_ids, [1, *chat_ids]]


async def test_n2_both_choices_stream_and_not():
    body = {"prompt": "Hello", "max_tokens": 7, "n": 2}
    async with serve(_fast_mock()) as client:
        full = await (await client.post("/v1/completions", json=body)).json()
        events = await stream_events(client, "/v1/completions", body)
    texts = [c["text"] for c in sorted(full["choices"], key=lambda c: c["index"])]
    assert texts == ["HelloHe", "elloHel"]
    assert full["usage"]["completion_tokens"] == 14
    assert [_streamed_text(events, 0), _streamed_text(events, 1)] == texts
    assert all(len(e["choices"]) == 1 for e in events[:-1])  # one choice per chunk


async def test_stop_strings_cut_text_and_never_leak_while_streaming():
    # "abcdefabcd": the first "cd" starts at index 2.
    body = {"prompt": "abcdef", "max_tokens": 10, "stop": ["zz", "cd"]}
    async with serve(_fast_mock()) as client:
        full = await (await client.post("/v1/completions", json=body)).json()
        events = await stream_events(client, "/v1/completions", body)
        single = await (
            await client.post(
                "/v1/completions", json={"prompt": "abcdef", "max_tokens": 7, "stop": "zz"}
            )
        ).json()
        # The 4th and last allowed token completes "cd": still a stop, cut before it.
        at_length = {**body, "max_tokens": 4}
        last = await (await client.post("/v1/completions", json=at_length)).json()
        last_events = await stream_events(client, "/v1/completions", at_length)
    choice = last["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("ab", "stop", "cd")
    assert _streamed_text(last_events) == "ab"
    choice = full["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("ab", "stop", "cd")
    assert full["usage"]["completion_tokens"] == 4  # a, b, c, d were generated
    assert _streamed_text(events) == "ab"
    # A stop string that never matches holds nothing back at the end.
    assert single["choices"][0]["text"] == "abcdefa"
    assert single["choices"][0]["finish_reason"] == "length"


async def test_stop_token_and_stop_string_count_from_min_tokens_as_in_the_engine():
    # Tokens a, b, c, a, b, ...: "b" (98) is the 2nd token, so min_tokens=2 lets it stop there
    # (the engine's rule is "at least min_tokens", jserve.core.stopping); a stop string found before
    # min_tokens is not searched again later.
    token = {"prompt": "abc", "max_tokens": 8, "min_tokens": 2, "stop_token_ids": [98]}
    text = {"prompt": "abc", "max_tokens": 8, "min_tokens": 3, "stop": ["ab"]}
    async with serve(_fast_mock()) as client:
        by_token = await (await client.post("/v1/completions", json=token)).json()
        by_text = await (await client.post("/v1/completions", json=text)).json()
    choice = by_token["choices"][0]  # the stop token's text is left out, as vLLM leaves it
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("a", "stop", 98)
    choice = by_text["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("abc", "stop", "ab")


async def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_tokens_text():
    # Tokens a, b, c, d, ...: "cd" ends with the 4th token; "c" (99) is the 3rd.
    keep = {"prompt": "abcdef", "max_tokens": 10, "include_stop_str_in_output": True}
    by_text, by_token = {**keep, "stop": ["cd"]}, {**keep, "stop_token_ids": [99]}
    async with serve(_fast_mock()) as client:
        text = await (await client.post("/v1/completions", json=by_text)).json()
        token = await (await client.post("/v1/completions", json=by_token)).json()
        events = await stream_events(client, "/v1/completions", by_text)
    choice = text["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == ("abcd", "cd")
    assert _streamed_text(events) == "abcd"
    choice = token["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == ("abc", 99)
    assert text["choices"][0]["finish_reason"] == choice["finish_reason"] == "stop"


async def test_completion_logprobs_legacy_shape():
    body = {"prompt": "Hi!", "max_tokens": 3, "logprobs": 2}
    expected = {
        "tokens": ["H", "i", "!"],
        "token_logprobs": [-0.5, -0.5, -0.5],
        "top_logprobs": [{"H": -0.5, "I": -1.5}, {"i": -0.5, "j": -1.5}, {"!": -0.5, '"': -1.5}],
        "text_offset": [0, 1, 2],
    }
    async with serve(_fast_mock()) as client:
        full = await (await client.post("/v1/completions", json=body)).json()
        events = await stream_events(client, "/v1/completions", body)
    assert full["choices"][0]["logprobs"] == expected
    merged = {key: [] for key in expected}
    for event in events[:-1]:
        for key in expected:
            merged[key] += event["choices"][0]["logprobs"][key]
    assert merged == expected  # text_offset keeps counting across chunks


async def test_chat_exact_message_and_usage():
    prompt = chat_prompt(USER_HI)
    async with serve(_fast_mock()) as client:
        response = await client.post(
            "/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 5}
        )
        body = await response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": echo_text(prompt, 5)}
    assert (choice["finish_reason"], choice["logprobs"]) == ("length", None)
    assert body["usage"] == {
        "prompt_tokens": len(prompt), "completion_tokens": 5, "total_tokens": len(prompt) + 5
    }  # fmt: skip


async def test_chat_template_controls_and_vllm_defaults_that_change_nothing():
    """add_generation_prompt=false leaves the assistant header out; chat_template_kwargs reach
    the template; vLLM's unhonoured extensions at their defaults are accepted."""
    body = {
        "messages": USER_HI, "max_tokens": 3, "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": False},
        "use_beam_search": False, "length_penalty": 1,
        "spaces_between_special_tokens": True,
    }  # fmt: skip
    async with serve(_fast_mock()) as client:
        answer = await (await client.post("/v1/chat/completions", json=body)).json()
    prompt = "enable_thinking=False\n" + chat_prompt(USER_HI).removesuffix("assistant:")
    assert answer["choices"][0]["message"]["content"] == echo_text(prompt, 3)
    assert answer["usage"]["prompt_tokens"] == len(prompt)


async def test_documents_reach_the_chat_template():
    """vLLM's documents (for a RAG template) are the template's `documents` variable; the
    mock's template writes each variable on a line of its own."""
    documents = [{"title": "Notes", "text": "The sky is green."}]
    body = {"messages": USER_HI, "max_tokens": 3, "documents": documents}
    async with serve(_fast_mock()) as client:
        answer = await (await client.post(CHAT, json=body)).json()
    prompt = f"documents={documents}\n" + chat_prompt(USER_HI)
    assert answer["choices"][0]["message"]["content"] == echo_text(prompt, 3)
    assert answer["usage"]["prompt_tokens"] == len(prompt)


async def test_a_requests_chat_template_needs_the_servers_trust():
    """vLLM's chat_template (or chat_template_kwargs' chat_template): refused with vLLM's words
    unless --trust-request-chat-template; then it replaces the model's template (the mock
    writes it as a variable line: it renders no Jinja)."""
    template = "{{ messages[0]['content'] }}"
    plain = {"messages": USER_HI, "max_tokens": 3, "chat_template": template}
    in_kwargs = {"messages": USER_HI, "max_tokens": 3,
                 "chat_template_kwargs": {"chat_template": template, "x": 1}}  # fmt: skip
    async with serve(_fast_mock()) as client:
        for body, param in ((plain, "chat_template"), (in_kwargs, "chat_template_kwargs")):
            response = await client.post(CHAT, json=body)
            error = (await response.json())["error"]
            assert (response.status, error["param"]) == (400, param)
            assert error["message"].startswith("Chat template is passed with request, but")
    async with serve(_fast_mock(), trust_request_chat_template=True) as client:
        answers = [await (await client.post(CHAT, json=b)).json() for b in (plain, in_kwargs)]
    prompt = f"chat_template={template}\n" + chat_prompt(USER_HI)
    assert answers[0]["choices"][0]["message"]["content"] == echo_text(prompt, 3)
    prompt = f"chat_template={template}\nx=1\n" + chat_prompt(USER_HI)
    assert answers[1]["choices"][0]["message"]["content"] == echo_text(prompt, 3)


async def test_continue_final_message_goes_on_with_the_assistants_message():
    """vLLM's continue_final_message: the prompt ends inside the final message (the mock's
    template leaves its line open) instead of opening a new turn; with add_generation_prompt
    also true it is a 400, as in vLLM."""
    messages = [*USER_HI, {"role": "assistant", "content": "Sure"}]
    body = {"messages": messages, "max_tokens": 3, "continue_final_message": True}
    async with serve(_fast_mock()) as client:
        answer = await (await client.post(CHAT, json=body)).json()
        both = await client.post(CHAT, json={**body, "add_generation_prompt": True})
        error = await both.json()
    prompt = "user: Hi\nassistant: Sure"
    assert answer["choices"][0]["message"]["content"] == echo_text(prompt, 3)
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert both.status == 400 and error["error"]["param"] == "continue_final_message"


async def test_chat_stream_role_first_then_content_then_usage():
    prompt = chat_prompt(USER_HI)
    body = {"messages": USER_HI, "max_completion_tokens": 4, "max_tokens": 99,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with serve(_fast_mock()) as client:
        events = await stream_events(client, "/v1/chat/completions", body)
    *chunks, usage_chunk, _ = events
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert _streamed_text(events, key="delta") == echo_text(prompt, 4)  # max_completion_tokens won
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["usage"]["completion_tokens"] == 4


async def test_chat_default_max_tokens_fills_the_context():
    prompt = chat_prompt(USER_HI)
    async with serve(_fast_mock(max_model_len=64)) as client:
        body = await (await client.post("/v1/chat/completions", json={"messages": USER_HI})).json()
    assert body["usage"]["completion_tokens"] == 64 - len(prompt)
    assert body["choices"][0]["finish_reason"] == "length"


async def test_chat_logprobs_shape():
    body = {"messages": USER_HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    async with serve(_fast_mock()) as client:
        full = await (await client.post("/v1/chat/completions", json=body)).json()
        events = await stream_events(client, "/v1/chat/completions", body)
        bare = await (
            await client.post(
                "/v1/chat/completions",
                json={"messages": USER_HI, "max_tokens": 1, "logprobs": True},
            )
        ).json()
    expected = [
        {"token": "u", "logprob": -0.5, "bytes": [117], "top_logprobs": [
            {"token": "u", "logprob": -0.5, "bytes": [117]},
            {"token": "v", "logprob": -1.5, "bytes": [118]}]},
        {"token": "s", "logprob": -0.5, "bytes": [115], "top_logprobs": [
            {"token": "s", "logprob": -0.5, "bytes": [115]},
            {"token": "t", "logprob": -1.5, "bytes": [116]}]},
    ]  # fmt: skip
    assert full["choices"][0]["logprobs"] == {"content": expected}
    streamed = [item for e in events[:-1] for item in e["choices"][0]["logprobs"]["content"]]
    assert streamed == expected
    assert bare["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


async def test_timeout_ends_with_timeout_finish_reason():
    async with serve(MockEngine(token_delay=0.02)) as client:
        body = await (
            await client.post(
                "/v1/completions", json={"prompt": "slow", "max_tokens": 200, "timeout": 0.15}
            )
        ).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "timeout"
    assert 0 < body["usage"]["completion_tokens"] < 200
    assert choice["text"] == echo_text("slow", body["usage"]["completion_tokens"])


async def test_lanes_are_accepted_and_vllms_default_priority_is_harmless():
    async with serve(_fast_mock()) as client:
        for extra in (
            {"lane": "interactive"},
            {"lane": "long"},
            {"lane": "batch"},
            {"priority": 0},
        ):
            response = await client.post(
                "/v1/completions", json={"prompt": "ab", "max_tokens": 2, **extra}
            )
            assert (await response.json())["choices"][0]["text"] == "ab", extra


async def test_models_and_served_model_name():
    async with serve(_fast_mock(), served_model_name="smol") as client:
        models = await (await client.get("/v1/models")).json()
        ok = await client.post("/v1/completions", json={"model": "smol", "prompt": "a"})
        wrong = await client.post("/v1/completions", json={"model": "mock-model", "prompt": "a"})
        assert (await ok.json())["model"] == "smol"
        assert wrong.status == 404
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        ("smol", "model", 256)
    ]


async def test_tokenize_and_detokenize():
    async with serve(_fast_mock()) as client:
        tokens = await (await client.post("/tokenize", json={"prompt": "Hi"})).json()
        chat = await (await client.post("/tokenize", json={"messages": USER_HI})).json()
        held = {"messages": [*USER_HI, {"role": "assistant", "content": "Su"}],
                "continue_final_message": True}  # fmt: skip
        continued = await (await client.post("/tokenize", json=held)).json()
        text = await (await client.post("/detokenize", json={"tokens": [72, 105]})).json()
    assert tokens == {"count": 2, "max_model_len": 256, "tokens": [72, 105]}
    assert chat["tokens"] == [ord(c) for c in chat_prompt(USER_HI)]
    assert continued["tokens"] == [ord(c) for c in "user: Hi\nassistant: Su"]
    assert text == {"prompt": "Hi"}


ECHO_LOGPROBS = {
    "tokens": ["H", "i", "!", "H", "i"],
    "token_logprobs": [None, -0.25, -0.25, -0.5, -0.5],
    "top_logprobs": [
        None, {"i": -0.25, "j": -1.25}, {"!": -0.25, '"': -1.25}, {"H": -0.5, "I": -1.5},
        {"i": -0.5, "j": -1.5},
    ],
    "text_offset": [0, 1, 2, 3, 4],
}  # fmt: skip


async def test_completion_echo_leads_text_and_logprobs_with_the_prompt():
    body = {"prompt": "Hi!", "max_tokens": 2, "logprobs": 2, "echo": True}
    async with serve(_fast_mock()) as client:
        full = await (await client.post("/v1/completions", json=body)).json()
        events = await stream_events(client, "/v1/completions", body)
        plain = await (await client.post("/v1/completions", json={**body, "logprobs": None})).json()
    choice = full["choices"][0]
    assert choice["text"] == "Hi!Hi" == "".join(choice["logprobs"]["tokens"])
    assert choice["logprobs"] == ECHO_LOGPROBS
    assert plain["choices"][0]["text"] == "Hi!Hi" and plain["choices"][0]["logprobs"] is None
    chunks = [event["choices"][0] for event in events[:-1]]
    assert "".join(c["text"] for c in chunks) == "Hi!Hi"
    merged = {key: [] for key in ECHO_LOGPROBS}
    for c in chunks:
        for key in merged:
            merged[key] += c["logprobs"][key]
    assert merged == ECHO_LOGPROBS  # the prompt's in the first chunk, offsets keep counting


async def test_truncate_prompt_tokens_serves_the_prompts_last_tokens():
    """vLLM's truncate_prompt_tokens: only the prompt's last k tokens are served (the mock
    repeats what it was given), counted in usage and echoed; for chat, the last k of the
    rendered template; a prompt past max_model_len (256) is served cut, and -1 cuts to it."""
    cut = {"prompt": "Hello world", "max_tokens": 4, "truncate_prompt_tokens": 5, "echo": True}
    chat = {"messages": USER_HI, "max_tokens": 3, "truncate_prompt_tokens": 4}
    long = {"prompt": "x" * 300, "max_tokens": 2, "truncate_prompt_tokens": 10}
    whole = {"prompt": "y" * 300, "max_tokens": 2, "truncate_prompt_tokens": -1}
    async with serve(_fast_mock()) as client:
        answers = [
            await client.post(path, json=body)
            for path, body in [(COMPLETIONS, cut), (CHAT, chat), (COMPLETIONS, long),
                               (COMPLETIONS, whole)]
        ]  # fmt: skip
        cut_body, chat_body, long_body = [await a.json() for a in answers[:3]]
        whole_error = await answers[3].json()
    assert cut_body["choices"][0]["text"] == "world" + echo_text("world", 4)
    assert cut_body["usage"]["prompt_tokens"] == 5
    assert chat_body["choices"][0]["message"]["content"] == echo_text("ant:", 3)
    assert chat_body["usage"]["prompt_tokens"] == 4
    assert long_body["usage"]["prompt_tokens"] == 10
    # -1 keeps max_model_len tokens, which leaves no room for an output: the usual refusal.
    assert answers[3].status == 400 and "max_model_len" in whole_error["error"]["message"]


class _RecordingMock(MockEngine):
    """The mock, keeping every prompt the server hands it."""

    def __init__(self) -> None:
        super().__init__(token_delay=0.001)
        self.prompts: list = []

    def generate(self, prompt, *args, **kwargs):
        self.prompts.append(prompt)
        return super().generate(prompt, *args, **kwargs)


async def test_cache_salt_reaches_the_engine_with_the_prompt_ids():
    """vLLM's cache_salt goes to the engine in its dict prompt (the engine keys the prompt's
    prefix-cache blocks with it); without one the ids go as they are."""
    engine = _RecordingMock()
    async with serve(engine) as client:
        for path, body in [
            (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1, "cache_salt": "k1"}),
            (CHAT, {"messages": USER_HI, "max_tokens": 1, "cache_salt": "k2"}),
            (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1}),
        ]:
            assert (await client.post(path, json=body)).status == 200
    chat_ids = [ord(c) for c in chat_prompt(USER_HI)]
    assert engine.prompts == [
        {"prompt_token_ids": [72, 105], "cache_salt": "k1"},
        {"prompt_token_ids": chat_ids, "cache_salt": "k2"},
        [72, 105],
    ]


async def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id():
    """vLLM's return_tokens_as_token_ids: every token in logprobs (sampled, alternatives, the
    echoed prompt's) is "token_id:ID", offsets count those names; the text is unchanged."""
    completion = {"prompt": "Hi!", "max_tokens": 2, "logprobs": 2, "echo": True,
                  "return_tokens_as_token_ids": True}  # fmt: skip
    chat = {"messages": USER_HI, "max_tokens": 1, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True}  # fmt: skip
    async with serve(_fast_mock()) as client:
        done = await (await client.post(COMPLETIONS, json=completion)).json()
        said = await (await client.post(CHAT, json=chat)).json()
    logprobs = done["choices"][0]["logprobs"]
    assert done["choices"][0]["text"] == "Hi!Hi"
    names = {c: f"token_id:{ord(c)}" for c in 'Hi!Ij"'}
    assert logprobs["tokens"] == [names[c] for c in "Hi!Hi"]
    assert logprobs["top_logprobs"] == [
        None if top is None else {names[t]: lp for t, lp in top.items()}
        for top in ECHO_LOGPROBS["top_logprobs"]
    ]
    assert logprobs["text_offset"] == [0, 11, 23, 34, 45]  # "token_id:105" is 12 characters
    item = said["choices"][0]["logprobs"]["content"][0]
    assert (item["token"], item["bytes"]) == ("token_id:117", list(b"token_id:117"))
    assert [t["token"] for t in item["top_logprobs"]] == ["token_id:117", "token_id:118"]


async def test_completion_prompt_logprobs_vllm_shape():
    body = {"prompt": "Hi!", "max_tokens": 1, "prompt_logprobs": 1}
    expected = [
        None,
        {"105": {"logprob": -0.25, "rank": 1, "decoded_token": "i"}},
        {"33": {"logprob": -0.25, "rank": 1, "decoded_token": "!"}},
    ]
    async with serve(_fast_mock()) as client:
        full = await (await client.post("/v1/completions", json=body)).json()
        events = await stream_events(client, "/v1/completions", body)
    assert full["choices"][0]["prompt_logprobs"] == expected
    assert full["choices"][0]["text"] == "H" and full["choices"][0]["logprobs"] is None
    firsts = [e["choices"][0].get("prompt_logprobs") for e in events[:-1]]
    assert firsts[0] == expected and all(p is None for p in firsts[1:])


async def test_use_beam_search_returns_the_n_best_beams_streamed_or_not():
    """vLLM's use_beam_search: n beams, best first. The mock's one-token steps put their
    prompt's first token at -0.5 and the next ids at -1.5, -2.5, ...: from "xy" the best
    beams of 3 tokens are "xxx" (-1.5) and then "xxy" (-2.5; "xyx" ties with it and came from
    the worse beam), and every step ran through the engine's generate."""
    body = {"prompt": "xy", "max_tokens": 3, "n": 2, "use_beam_search": True}
    async with serve(_fast_mock()) as client:
        full = await (await client.post(COMPLETIONS, json=body)).json()
        events = await stream_events(client, COMPLETIONS, body)
        # Fields the search does not read, sent at values that ask for nothing, are accepted.
        defaults = {"top_p": 1, "top_k": -1, "skip_special_tokens": True, "logprobs": False,
                    "stop": [], "repetition_penalty": 1.0}  # fmt: skip
        chat = {"messages": USER_HI, "max_tokens": 2, "n": 3, "use_beam_search": True, **defaults}
        answer = await (await client.post(CHAT, json=chat)).json()
    assert [c["text"] for c in full["choices"]] == ["xxx", "xxy"]
    assert [c["finish_reason"] for c in full["choices"]] == ["length", "length"]
    assert full["usage"]["completion_tokens"] == 6
    assert [_streamed_text(events, 0), _streamed_text(events, 1)] == ["xxx", "xxy"]
    first = chat_prompt(USER_HI)[0]  # a step's best token is its prompt's first
    contents = [c["message"]["content"] for c in answer["choices"]]
    assert contents[0] == first * 2 and len(contents) == len(set(contents)) == 3


async def test_a_client_leaving_a_beam_search_aborts_its_steps_in_flight():
    engine = MockEngine(token_delay=0.05)
    body = {"prompt": "xy", "max_tokens": 50, "n": 3, "use_beam_search": True}
    async with serve(engine) as client:
        request = asyncio.ensure_future(client.post(COMPLETIONS, json=body))
        for _ in range(200):  # until a later step's requests (one a beam) are in the engine
            await asyncio.sleep(0.01)
            if _in_flight(engine) == 3:
                break
        assert _in_flight(engine) == 3
        request.cancel()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not _in_flight(engine):
                break
        assert _in_flight(engine) == 0


def _in_flight(engine: MockEngine) -> int:
    stats = engine.stats()
    return stats.num_requests_running + stats.num_requests_waiting


async def test_request_id_names_the_response_as_vllm_does():
    """vLLM's request_id: the response's id is "cmpl-" or "chatcmpl-" and the caller's id, in a
    stream's every chunk too; an X-Request-Id header wins over the body's. Two requests in
    flight at once with the same id are both served: the engine's ids stay unique."""
    completion = {"prompt": "Hi", "max_tokens": 3, "request_id": "trace-7"}
    engine = _IdRecordingMock(token_delay=0.02)
    async with serve(engine) as client:
        first, second = await asyncio.gather(
            client.post(COMPLETIONS, json=completion), client.post(COMPLETIONS, json=completion)
        )
        bodies = [await first.json(), await second.json()]
        chat = {"messages": USER_HI, "max_tokens": 2, "request_id": "body-id"}
        headers = {"X-Request-Id": "gateway-1"}
        headed = await (await client.post(CHAT, json=chat, headers=headers)).json()
        events = await stream_events(client, CHAT, chat)
        plain = await (await client.post(CHAT, json={"messages": USER_HI, "max_tokens": 1})).json()
    assert [b["id"] for b in bodies] == ["cmpl-trace-7", "cmpl-trace-7"]
    assert [b["choices"][0]["text"] for b in bodies] == [echo_text("Hi", 3)] * 2
    assert headed["id"] == "chatcmpl-gateway-1"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks and {c["id"] for c in chunks} == {"chatcmpl-body-id"}
    assert plain["id"].startswith("chatcmpl-") and len(plain["id"]) > len("chatcmpl-")
    assert len(set(engine.request_ids)) == len(engine.request_ids) == 5
    assert plain["id"] in engine.request_ids  # without a caller's id the two are the same


class _IdRecordingMock(MockEngine):
    """The mock, recording the engine request id of each generate call."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.request_ids: list[str] = []

    def generate(self, prompt, params, request_id, **kwargs):
        self.request_ids.append(request_id)
        return super().generate(prompt, params, request_id, **kwargs)


async def test_a_request_id_too_long_empty_or_with_a_newline_is_a_400_naming_its_place():
    long_id = "x" * 257
    async with serve(_fast_mock()) as client:
        in_body = await client.post(COMPLETIONS, json={"prompt": "Hi", "request_id": long_id})
        empty = await client.post(COMPLETIONS, json={"prompt": "Hi", "request_id": ""})
        forged = await client.post(COMPLETIONS, json={"prompt": "Hi", "request_id": "a\nb"})
        in_header = await client.post(
            CHAT, json={"messages": USER_HI}, headers={"X-Request-Id": long_id}
        )
        errors = [
            (r.status, (await r.json())["error"]["param"])
            for r in (in_body, empty, forged, in_header)
        ]
    assert errors == [(400, "request_id")] * 3 + [(400, "X-Request-Id")]
