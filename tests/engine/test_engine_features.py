"""Engine behaviour on the real model: caching, seeds, stop strings, n, logprobs, no compiles."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from jserve.core.step_costs import load_bucket_report
from jserve.errors import RequestRejected
from jserve.runtime.compilation import forbid_compilation
from jserve.sampling_params import PoolingParams, SamplingParams
from tests.shared_engine import make_engine, run_to_completion

SYSTEM = (
    "You are a helpful assistant for a bakery. You answer questions about bread, cakes and "
    "opening hours politely and briefly. The bakery opens at seven and closes at six. "
)


def _generate(engine, prompts, params, prefix="r") -> list:
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    final = run_to_completion(engine)
    return [final[f"{prefix}{i}"] for i in range(len(prompts))]


def test_prefix_caching_on_and_off_give_identical_tokens(default_model, engine):
    prompts = [SYSTEM + q for q in ("When do you open?", "Do you sell rye bread?", "Cake?")]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cached = _generate(engine, prompts[:1], greedy, "on")  # fills the cache
    before = engine.stats()
    cached += _generate(engine, prompts[1:], greedy, "on+")
    after = engine.stats()
    assert after.prefix_cache_hits > before.prefix_cache_hits  # the shared system prompt hit
    uncached_engine = make_engine(default_model, enable_prefix_caching=False)
    uncached = _generate(uncached_engine, prompts, greedy, "off")
    assert uncached_engine.stats().prefix_cache_hits == 0
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in uncached]


def test_seeded_sampling_is_batch_invariant(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16)
    alone = _generate(engine, ["Tell me a story about a dragon."], params, "alone")[0]
    others = SamplingParams(temperature=1.0, max_tokens=16)
    engine.add_request("noise0", "The weather today", others)
    engine.add_request("noise1", "def main():", others)
    together = _generate(engine, ["Tell me a story about a dragon."], params, "batch")[0]
    assert alone.outputs[0].token_ids == together.outputs[0].token_ids
    unseeded = [
        _generate(
            engine, ["Tell me a story about a dragon."], SamplingParams(max_tokens=16), f"u{i}"
        )
        for i in range(2)
    ]
    assert unseeded[0][0].outputs[0].token_ids != unseeded[1][0].outputs[0].token_ids


def test_stop_string_cuts_text_and_stream_deltas_concatenate(engine):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = _generate(engine, ["Count: 1, 2, 3,"], greedy, "full")[0].outputs[0].text
    assert " 5," in full
    stop = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[" 5,"])
    engine.add_request("s", "Count: 1, 2, 3,", stop)
    streamed, previous = [], ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            assert text.startswith(previous)  # cumulative text only grows
            streamed.append(text[len(previous) :])
            previous = text
    result = out.outputs[0]
    assert result.text == full[: full.index(" 5,")]
    assert "".join(streamed) == result.text
    assert result.finish_reason == "stop" and result.stop_reason == " 5,"


def test_stop_strings_wait_for_min_tokens(engine):
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=8, stop=[" 5,"])
    out = _generate(engine, ["Count: 1, 2, 3,"], params, "min")[0].outputs[0]
    assert " 5," in out.text and out.finish_reason == "length"


def test_a_stop_string_the_last_allowed_token_completes_still_cuts_the_text(engine):
    """max_tokens ends the sequence on the token that completes a stop string: the text ends
    before the string and the finish is a stop, as vLLM's output processor answers."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = _generate(engine, ["Count: 1, 2, 3,"], greedy, "full")[0].outputs[0]
    ids = list(full.token_ids)
    k = next(k for k in range(1, len(ids) + 1) if " 5," in engine.tokenizer.decode(ids[:k]))
    params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, stop=[" 5,"])
    out = _generate(engine, ["Count: 1, 2, 3,"], params, "cut")[0].outputs[0]
    assert list(out.token_ids) == ids[:k]
    assert out.text == full.text[: full.text.index(" 5,")]
    assert (out.finish_reason, out.stop_reason) == ("stop", " 5,")


def test_a_stop_tokens_text_and_a_stop_string_are_left_out_unless_asked_for(engine):
    """As vLLM: neither the text of the stop token that ends a sample nor the stop string is
    in its text; include_stop_str_in_output keeps both."""
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)
    full = _generate(engine, ["Count: 1, 2, 3,"], SamplingParams(**greedy), "full")[0].outputs[0]
    ids, decode = list(full.token_ids), engine.tokenizer.decode
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # stops there, not before
    for include, text in ((False, decode(ids[:k])), (True, decode(ids[: k + 1]))):
        params = SamplingParams(
            **greedy, stop_token_ids=[ids[k]], include_stop_str_in_output=include
        )
        out = _generate(engine, ["Count: 1, 2, 3,"], params, f"id{include}")[0].outputs[0]
        assert list(out.token_ids) == ids[: k + 1]
        assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", ids[k])
    params = SamplingParams(**greedy, stop=[" 5,"], include_stop_str_in_output=True)
    out = _generate(engine, ["Count: 1, 2, 3,"], params, "str")[0].outputs[0]
    assert (out.text, out.stop_reason) == (full.text[: full.text.index(" 5,") + 3], " 5,")


def test_n_samples_share_the_prompt(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    out = _generate(engine, [SYSTEM + "Say something."], params, "n")[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # distinct samples


def test_greedy_logprobs_match_transformers(engine, hf_default_model):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    out = _generate(engine, ["The capital of France is"], params, "lp")[0].outputs[0]
    ids = engine.tokenizer.encode("The capital of France is") + out.token_ids
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1).numpy()
    n_prompt = len(ids) - len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[n_prompt - 1 + i]
        assert token in entry and len(entry) == 5  # sampled (greedy = top 1) plus top 5
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid]) < 1e-3
        top5 = np.argsort(-row)[:5]
        assert list(entry)[:5] == top5.tolist() or set(entry) == set(top5.tolist())


def test_allowed_token_ids_restrict_every_sampled_token(engine, hf_default_model):
    """vLLM's allowed_token_ids: greedy takes, at every step, transformers' argmax over the
    allowed ids alone; a seeded sample (two samples, n=2) only ever takes allowed ids; the
    logprobs stay the model's own (raw)."""
    prompt = "The capital of France is"
    allowed = [11, 12, 13, 314, 2761, 9284]  # mostly tokens the model would not pick here
    params = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, allowed_token_ids=allowed, logprobs=0
    )
    out = _generate(engine, [prompt], params, "al")[0].outputs[0]
    ids = engine.tokenizer.encode(prompt) + list(out.token_ids)
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([ids])).logits[0].double()
    n_prompt = len(ids) - len(out.token_ids)
    ref = torch.log_softmax(logits, -1).numpy()
    for i, token in enumerate(out.token_ids):
        row = ref[n_prompt - 1 + i]
        assert token == allowed[int(np.argmax(row[allowed]))]
        assert abs(out.logprobs[i][token].logprob - row[token]) < 1e-3  # raw, not renormalized
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed)
    for sample in _generate(engine, [prompt], sampled, "as")[0].outputs:
        assert set(sample.token_ids) <= set(allowed)
    with pytest.raises(RequestRejected, match=r"allowed_token_ids\[0\] must be") as refused:
        engine.add_request("big", prompt, SamplingParams(allowed_token_ids=[10**6]))
    assert refused.value.param == "allowed_token_ids"


def test_logit_bias_moves_greedy_as_it_moves_transformers_logits(engine, hf_default_model):
    """OpenAI's logit_bias: greedy takes, at every step, the argmax of transformers' logits
    plus the bias; logprobs stay the model's own (raw); an id outside the vocabulary is
    refused naming the field."""
    prompt = "The capital of France is"
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    free = _generate(engine, [prompt], SamplingParams(**greedy), "lb0")[0].outputs[0]
    bias = {free.token_ids[0]: -100.0, 314: 4.0, 2761: 6.0, 11: -1.5}
    params = SamplingParams(**greedy, logit_bias=bias, logprobs=0)
    out = _generate(engine, [prompt], params, "lb1")[0].outputs[0]
    assert out.token_ids != free.token_ids
    ids = engine.tokenizer.encode(prompt) + list(out.token_ids)
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([ids])).logits[0].double().numpy()
    n_prompt = len(ids) - len(out.token_ids)
    shift = np.zeros(logits.shape[1])
    shift[list(bias)] = list(bias.values())
    for i, token in enumerate(out.token_ids):
        row = logits[n_prompt - 1 + i]
        assert token == int(np.argmax(row + shift))
        raw = row - np.logaddexp.reduce(row)
        assert abs(out.logprobs[i][token].logprob - raw[token]) < 1e-3  # raw, not biased
    with pytest.raises(RequestRejected, match=r"logit_bias has token ids outside") as refused:
        engine.add_request("big", prompt, SamplingParams(logit_bias={10**6: 1.0}))
    assert refused.value.param == "logit_bias"


def test_bad_words_are_never_generated(engine, hf_default_model):
    """vLLM's bad_words: greedy is transformers' greedy with, at every step, each word's last
    token banned where the output ends with the rest of it (the word as it stands and after a
    space, vLLM's rule, worked out here from the tokenizer); the words never appear."""
    prompt, words = "The capital of France is", ["Paris", "the city"]
    greedy = dict(temperature=0, max_tokens=10, ignore_eos=True)
    free = _generate(engine, [prompt], SamplingParams(**greedy), "bw0")[0].outputs[0]
    assert "Paris" in free.text  # the ban has something to remove
    out = _generate(engine, [prompt], SamplingParams(**greedy, bad_words=words), "bw1")[0]
    assert not any(w in out.outputs[0].text for w in words)

    def encode(text: str) -> list[int]:
        return engine.tokenizer.encode(text, add_special_tokens=False)

    sequences = []
    for word in words:
        plain, spaced = encode(word), encode(" " + word)
        sequences += [plain] + (
            [spaced] if len(spaced) == len(plain) != 0 and spaced[0] != plain[0] else []
        )
    ids, output = engine.tokenizer.encode(prompt), []
    with torch.no_grad():
        for _ in range(10):
            logits = hf_default_model(torch.tensor([ids + output])).logits[0, -1].double()
            for seq in sequences:
                if len(seq) == 1 or output[len(output) - len(seq) + 1 :] == seq[:-1]:
                    logits[seq[-1]] = -torch.inf
            output.append(int(logits.argmax()))
    assert list(out.outputs[0].token_ids) == output


def test_abort_frees_blocks_and_is_not_reported_again(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("a", "Once upon a time", params)
    for _ in range(3):
        engine.step()
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.abort_request("a") is None
    assert not engine.has_unfinished_requests()
    assert engine.step() == []  # the abort does not come back through the scheduler


def test_a_deadline_the_engine_cannot_meet_is_refused_at_arrival(engine):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("warm", "Once upon a time", params)
    run_to_completion(engine)  # two measured steps: the step-cost table is no longer empty
    with pytest.raises(RequestRejected, match="the deadline cannot be met") as info:
        engine.add_request("late", "Once upon a time", params, deadline=time.monotonic())
    assert info.value.reason == "deadline" and info.value.retry_after >= 1
    assert not engine.has_unfinished_requests()


def test_deadline_ends_a_waiting_and_a_running_request_with_timeout(engine):
    engine.control({"deadline_admission": False})  # deadlines only expire
    try:
        expire_waiting_and_running(engine)
    finally:
        engine.control({"deadline_admission": True})


def expire_waiting_and_running(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("late", "Once upon a time", params, deadline=0.0)  # already past
    (out,) = engine.step()
    assert out.request_id == "late" and out.finished
    assert out.outputs[0].finish_reason == "timeout" and out.outputs[0].token_ids == []

    deadline = time.monotonic() + 2.0  # room for one short prefill, then a wait to expire it
    engine.add_request("running", "Once upon a time", params, deadline=deadline)
    streamed: list[int] = []
    while not streamed:
        for out in engine.step():
            assert not out.finished
            streamed = out.outputs[0].token_ids
    assert time.monotonic() < deadline  # it got tokens before its deadline...
    time.sleep(max(0.0, deadline - time.monotonic()))
    final = run_to_completion(engine)["running"].outputs[0]
    assert final.finish_reason == "timeout"  # ...and was ended while running
    assert final.token_ids[: len(streamed)] == streamed and len(final.token_ids) < 200


def test_a_truncated_prompt_is_served_as_its_last_tokens(engine):
    """truncate_prompt_tokens (vLLM's): the prompt's last k ids are served, token for token as
    if they had been sent; a prompt past max_model_len is served cut instead of refused; the
    output keeps the prompt text as given; embeddings are cut the same way."""
    text = SYSTEM * 16  # past max_model_len (512)
    ids = engine.tokenizer.encode(text)
    assert len(ids) > engine.max_model_len
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    cut = _generate(engine, [text], SamplingParams(**greedy, truncate_prompt_tokens=40), "t")[0]
    sent = _generate(engine, [{"prompt_token_ids": ids[-40:]}], SamplingParams(**greedy), "s")[0]
    assert cut.prompt_token_ids == ids[-40:] and cut.prompt == text
    assert cut.outputs[0].token_ids == sent.outputs[0].token_ids
    with pytest.raises(RequestRejected, match=r"at most max_model_len \(512\)") as refused:
        engine.add_request("over", text, SamplingParams(truncate_prompt_tokens=513))
    assert refused.value.param == "truncate_prompt_tokens"
    engine.add_request("e0", text, pooling=PoolingParams(truncate_prompt_tokens=40))
    engine.add_request("e1", {"prompt_token_ids": ids[-40:]}, pooling=PoolingParams())
    final = run_to_completion(engine)
    assert final["e0"].embedding == final["e1"].embedding


def test_a_cache_salt_hits_only_its_own_salts_blocks(engine):
    """vLLM's cache_salt (a dict prompt's): the same prompt under another salt, or none, hits
    nothing cached; under its own salt it hits; the tokens are the same every time."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = SYSTEM + "When do you open?"

    def run(tag: str, salt: str | None) -> tuple[int, list[int]]:
        before = engine.stats().prefix_cache_hits
        form = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        out = _generate(engine, [form], greedy, tag)[0]
        return engine.stats().prefix_cache_hits - before, list(out.outputs[0].token_ids)

    runs = [run(tag, salt) for tag, salt in [("a", "alice"), ("b", "bob"), ("n", None),
                                             ("a2", "alice"), ("n2", None)]]  # fmt: skip
    assert [hits > 0 for hits, _ in runs] == [False, False, False, True, True]
    assert all(tokens == runs[0][1] for _, tokens in runs)
    with pytest.raises(RequestRejected, match="cache_salt must be a non-empty string"):
        engine.add_request("bad", {"prompt": prompt, "cache_salt": ""})


def test_request_ids_are_checked_once_and_sample_ids_never_collide(engine):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("dup", "Hi", params)
    with pytest.raises(RequestRejected, match="'dup' is already in use"):
        engine.add_request("dup", "Hi", params)
    engine.add_request("g", "Hi", SamplingParams(n=2, temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request("g#1", "Hi", params)  # spelled like a sample of "g", but its own request
    final = run_to_completion(engine)
    assert sorted(final) == ["dup", "g", "g#1"]
    assert [len(o.token_ids) for rid in sorted(final) for o in final[rid].outputs] == [2] * 4


def test_64_requests_after_warmup_compile_nothing(engine):
    rng = np.random.default_rng(0)
    words = ["bread", "cake", "oven", "flour", "sugar", "salt", "water", "yeast", "honey"]
    with forbid_compilation():
        for i in range(64):
            prompt = " ".join(rng.choice(words, size=int(rng.integers(1, 120))))
            params = SamplingParams(
                temperature=float(rng.choice([0.0, 0.8])),
                max_tokens=int(rng.integers(1, 24)),
                logprobs=int(rng.choice([0, 3])) if i % 3 == 0 else None,
                presence_penalty=0.5 if i % 5 == 0 else 0.0,
                ignore_eos=True,
            )
            engine.add_request(f"c{i}", prompt, params)
        final = run_to_completion(engine)
    assert len(final) == 64


def test_the_step_costs_learned_while_serving_are_saved_at_close(default_model, tmp_path):
    path = tmp_path / "learned.json"
    engine = make_engine(default_model, save_step_costs=str(path))
    for i in range(3):
        engine.add_request(f"r{i}", list(range(100 + i, 140 + i)), SamplingParams(max_tokens=4))
    run_to_completion(engine)
    learned = dict(engine.scheduler.step_costs.seconds)
    engine.close()
    assert learned and load_bucket_report(str(path)) == pytest.approx(learned)


def test_stop_reason_is_null_for_the_models_eos_and_the_id_for_a_requested_stop_token(engine):
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    prompt = {"prompt_token_ids": engine.tokenizer.encode(chat, add_special_tokens=False)}
    ended = _generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=64), "eos")[0]
    out = ended.outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.tokenizer.stop_token_ids
    assert out.stop_reason is None  # vLLM's rule for EOS, whichever stop token the model has
    k = next(i for i, t in enumerate(out.token_ids) if i > 0 and t not in out.token_ids[:i])
    params = SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[out.token_ids[k]])
    asked = _generate(engine, [prompt], params, "ids")[0].outputs[0]
    assert asked.token_ids == out.token_ids[: k + 1]
    assert (asked.finish_reason, asked.stop_reason) == ("stop", out.token_ids[k])
