"""Prompt logprobs and embeddings against transformers on a tiny random checkpoint it wrote.

Both come from rows the model step computes at prompt positions (jserve.core.plan's
`every_row` chunks, and the step's hidden-state output): a 16-token step budget chunks the
prompts, several requests share steps, and the sizes stay small enough that the engine
compiles its buckets in seconds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.loaders.safetensors_dir import load_safetensors_dir
from jserve.runtime.compilation import forbid_compilation
from jserve.sampling_params import PoolingParams, PoolingType, SamplingParams
from tests.shared_engine import assert_no_blocks_held, run_to_completion

VOCAB = 384  # ids below it decode with the default model's tokenizer
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=17, max_model_len=64)
TOP = 5


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    torch.set_num_threads(1)
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a non-trivial final norm, so pooling after it is what is checked
        model.model.norm.weight.copy_(torch.rand(64) + 0.5)
    path = tmp_path_factory.mktemp("tiny-hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def tiny_engine(hf_tiny, default_model):
    _, path = hf_tiny
    cfg, params = load_safetensors_dir(path)
    loaded = dataclasses.replace(default_model, name="tiny-hf", config=cfg, params=params)
    engine = LLMEngine(EngineArgs(**ENGINE), loaded=loaded)
    yield engine
    assert_no_blocks_held(engine)


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def _hf_logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def _run(engine: LLMEngine, prompts, **kwargs) -> list:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, **kwargs)
    with forbid_compilation():  # prompt rows and hidden states: the buckets' executables
        final = run_to_completion(engine)
    return [final[f"r{i}"] for i in range(len(prompts))]


def test_prompt_logprobs_match_transformers_at_every_position(hf_tiny, tiny_engine):
    model, _ = hf_tiny
    prompts = _prompts((37, 9, 23, 1))  # chunked over several steps, sharing them
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP, ignore_eos=True)
    outs = _run(tiny_engine, prompts, params=params)
    plain = _run(tiny_engine, prompts, params=dataclasses.replace(params, prompt_logprobs=None))
    for ids, out, alone in zip(prompts, outs, plain, strict=True):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids  # generation unchanged
        assert alone.prompt_logprobs is None
        scored = list(out.prompt_logprobs)
        assert len(scored) == len(ids) and scored[0] is None
        ref = _hf_logprobs(model, ids)
        for position in range(1, len(ids)):
            row, token, entry = ref[position - 1], ids[position], scored[position]
            assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
            assert entry[token].rank == 1 + int(np.sum(row > row[token]))
            expected = np.argsort(-row, kind="stable")[:TOP].tolist()
            assert set(entry) == {token, *expected}
            for rank, tid in enumerate(expected, 1):
                assert entry[tid].logprob == pytest.approx(row[tid], abs=1e-4)
                assert entry[tid].rank == rank


def test_prompt_logprobs_skip_the_prefix_cache(tiny_engine):
    (ids,) = _prompts((40,))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    first = _run(tiny_engine, [ids], params=params)[0]
    again = _run(tiny_engine, [ids], params=params)[0]  # its blocks are cached by now
    assert again.num_cached_tokens == 0
    scored = [list(out.prompt_logprobs)[1:] for out in (first, again)]
    assert [e[t].logprob for e, t in zip(scored[1], ids[1:], strict=True)] == [
        e[t].logprob for e, t in zip(scored[0], ids[1:], strict=True)
    ]
    assert all(len(e) == 1 for e in scored[1])  # prompt_logprobs=0: the token alone


def _hf_embedding(model, ids: list[int], pooling: PoolingType) -> np.ndarray:
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    pooled = hidden[-1] if pooling is PoolingType.LAST else hidden.mean(0)
    return pooled / np.linalg.norm(pooled)


@pytest.mark.parametrize("pooling", list(PoolingType))
def test_embeddings_match_transformers_batched_or_alone(hf_tiny, tiny_engine, pooling):
    model, _ = hf_tiny
    prompts = _prompts((45, 3, 20))
    pool = PoolingParams(pooling)
    batched = _run(tiny_engine, prompts, pooling=pool)
    for ids, out in zip(prompts, batched, strict=True):
        expected = _hf_embedding(model, ids, pooling)
        np.testing.assert_allclose(out.embedding, expected, atol=2e-5)
        alone = _run(tiny_engine, [ids], pooling=pool)[0]
        np.testing.assert_allclose(alone.embedding, out.embedding, atol=1e-6)
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
    assert_no_blocks_held(tiny_engine)  # no KV kept once they finish
