"""Config and SamplingParams validation: defaults like vLLM's, and errors that say what is wrong."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from jserve.config.engine_args import (
    AttentionImpl,
    Dtype,
    EngineArgs,
    add_engine_arguments,
    engine_args_from_namespace,
)
from jserve.config.scheduler import (
    CacheConfig,
    FairnessPolicy,
    Lane,
    SchedulerConfig,
    SchedulingPolicy,
)
from jserve.config.settings import InvalidSetting
from jserve.sampling_params import (
    PoolingParams,
    SamplingParams,
    StructuredOutputsParams,
    truncate_prompt,
)

from .helpers import make_request, make_scheduler


def test_scheduler_config_defaults_are_valid_and_frozen():
    config = SchedulerConfig()
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (
        32,
        512,
        2048,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer in [1, 2**31-1], got 0"),
        ({"max_model_len": -1}, "max_model_len must be an integer in [1, 2**31-1], got -1"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "(32) must be >= max_num_seqs (64)"),
        ({"long_prefill_token_threshold": 600}, "long_prefill_token_threshold must be in [0, "),
        (
            {"long_prompt_threshold": 0},
            "long_prompt_threshold must be an integer in [1, 2**31-1], got 0",
        ),
        (
            {"long_lane_max_share": 0.0},
            "long_lane_max_share must be a finite number in (0, 1], got 0.0",
        ),
        (
            {"long_lane_max_share": 1.5},
            "long_lane_max_share must be a finite number in (0, 1], got 1.5",
        ),
        (
            {"max_waiting_requests": 0},
            "max_waiting_requests must be an integer in [1, 2**31-1], got 0",
        ),
        (
            {"free_block_watermark": 1.0},
            "free_block_watermark must be a finite number in [0, 1), got 1.0",
        ),
        ({"aging_iterations": 0}, "aging_iterations must be an integer in [1, 2**31-1], got 0"),
        (
            {"kv_reject_watermark": 0.0},
            "kv_reject_watermark must be a finite number in (0, 1], got 0.0",
        ),
        (
            {"kv_reject_watermark": 1.2},
            "kv_reject_watermark must be a finite number in (0, 1], got 1.2",
        ),
        ({"fairness": "random"}, "fairness must be one of vtc, fcfs, got 'random'"),
        ({"target_itl_ms": -1.0}, "target_itl_ms must be a finite number >= 0, got -1.0"),
        (
            {"enable_chunked_prefill": False, "max_model_len": 512, "target_itl_ms": 100.0},
            "target_itl_ms adapts the prefill chunk and needs enable_chunked_prefill=True",
        ),
        ({"scheduling": "fifo"}, "scheduling must be one of continuous, static, got 'fifo'"),
        (
            {"enable_chunked_prefill": False},
            "max_num_batched_tokens (512) must be >= max_model_len (2048)",
        ),
        (
            {
                "enable_chunked_prefill": False,
                "max_model_len": 512,
                "long_prefill_token_threshold": 64,
            },
            "needs enable_chunked_prefill=True",
        ),
    ],
)
def test_scheduler_config_rejects(kwargs, message):
    with pytest.raises(InvalidSetting) as error:
        SchedulerConfig(**kwargs)
    assert message in str(error.value)
    assert error.value.name in str(error.value)  # it names the setting its message is about


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"num_blocks": 1}, "num_blocks must be >= 2 (block 0 is the padding sink), got 1"),
    ],
)
def test_cache_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CacheConfig(**kwargs)


def test_scheduler_rejects_a_pool_too_small_for_one_request():
    with pytest.raises(ValueError, match=r"needs 32 blocks of 4 tokens plus 0 watermark"):
        make_scheduler(block_size=4, num_blocks=32, max_model_len=128)
    make_scheduler(block_size=4, num_blocks=33, max_model_len=128)  # 32 usable: exactly enough


def test_sampling_params_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.max_tokens, params.min_tokens) == (16, 0)
    assert (params.seed, params.logprobs) == (None, None)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == ([], [], False)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert params.skip_special_tokens is True


def test_sampling_params_normalises_stop_and_top_k():
    params = SamplingParams(stop="###", stop_token_ids=(5, 6), top_k=-1, max_tokens=None)
    assert params.stop == ["###"]
    assert params.stop_token_ids == [5, 6]
    assert params.top_k == 0
    assert params.max_tokens is None
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be an integer in [1, 2147483647], got 0"),
        ({"n": True}, "n must be an integer in [1, 2147483647], got True"),
        (
            {"temperature": -1.0},
            "temperature must be a finite number in [0, 3.40282e+38] (as float32), got -1.0",
        ),
        (
            {"temperature": float("inf")},
            "temperature must be a finite number in [0, 3.40282e+38] (as float32), got inf",
        ),
        (
            {"temperature": 1e39},
            "temperature must be a finite number in [0, 3.40282e+38] (as float32), got 1e+39",
        ),
        ({"top_p": 0.0}, "top_p must be a finite number in (0, 1] (as float32), got 0.0"),
        ({"top_p": 1e-300}, "top_p must be a finite number in (0, 1] (as float32), got 1e-300"),
        ({"top_p": 1.5}, "top_p must be a finite number in (0, 1] (as float32), got 1.5"),
        ({"top_k": -2}, "top_k must be an integer in [0, 2147483647], got -2"),
        ({"top_k": 2**31}, "top_k must be an integer in [0, 2147483647], got 2147483648"),
        ({"min_p": 1.5}, "min_p must be a finite number in [0, 1] (as float32), got 1.5"),
        ({"min_p": float("nan")}, "min_p must be a finite number in [0, 1] (as float32), got nan"),
        (
            {"seed": 1.5},
            "seed must be an integer in [-9223372036854775808, 9223372036854775807], got 1.5",
        ),
        (
            {"seed": 2**64},
            "seed must be an integer in [-9223372036854775808, 9223372036854775807], "
            "got 18446744073709551616",
        ),
        ({"max_tokens": 0}, "max_tokens must be an integer in [1, 2147483647], got 0"),
        ({"max_tokens": 2**31}, "max_tokens must be an integer in [1, 2147483647], got 2147483648"),
        ({"min_tokens": -1}, "min_tokens must be an integer in [0, 2147483647], got -1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens (20) must be <= max_tokens (10)"),
        ({"stop": ""}, "stop must be a non-empty string or a list of non-empty strings"),
        ({"stop": ["x"] * 129}, "stop has 129 strings; at most 128 are allowed"),
        # Issue case 5: 10,000 strings of 380 characters stalled every other request.
        ({"stop": ["y" * 380] * 10_000}, "stop has 10000 strings; at most 128 are allowed"),
        (
            {"stop": ["ok", "z" * 513]},
            "stop strings must be at most 512 characters long, got one of 513: 'zzz",
        ),
        (
            {"stop": ["w" * 512] * 4 + ["v"]},
            "stop strings must be at most 2048 characters long in all, got 2049",
        ),
        (
            {"stop_token_ids": [-3]},
            "stop_token_ids[0] must be an integer in [0, 2147483647], got -3",
        ),
        (
            {"stop_token_ids": [2, 2**31]},
            "stop_token_ids[1] must be an integer in [0, 2147483647], got 2147483648",
        ),
        ({"logprobs": 21}, "logprobs must be an integer in [0, 20], got 21"),
        (
            {"presence_penalty": 2.5},
            "presence_penalty must be a finite number in [-2, 2] (as float32), got 2.5",
        ),
        (
            {"frequency_penalty": -3.0},
            "frequency_penalty must be a finite number in [-2, 2] (as float32), got -3.0",
        ),
        (
            {"repetition_penalty": 0.0},
            "repetition_penalty must be a finite number in (0, 2] (as float32), got 0.0",
        ),
        (
            {"repetition_penalty": 1e-300},
            "repetition_penalty must be a finite number in (0, 2] (as float32), got 1e-300",
        ),
        (
            {"truncate_prompt_tokens": 0},
            "truncate_prompt_tokens must be -1 (the model's max_model_len) or an integer >= 1, "
            "got 0",
        ),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be -1"),
        ({"allowed_token_ids": []}, "allowed_token_ids must hold at least one token id"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids[1] must be an integer in [0, "),
        (
            {"allowed_token_ids": [3], "structured_outputs": StructuredOutputsParams(regex="a")},
            "allowed_token_ids cannot be combined with structured outputs",
        ),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens must be -1"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id must be an integer in [0, "),
        ({"logit_bias": {"7": 1.0}}, "logit_bias token id must be an integer in [0, "),
        ({"logit_bias": {7: 100.5}}, "logit_bias[7] must be a finite number in [-100, 100]"),
        ({"logit_bias": {7: float("nan")}}, "logit_bias[7] must be a finite number"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "at most 300 are served"),
    ],
)
def test_sampling_params_rejects(kwargs, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert message in str(error.value)


def test_sampling_params_accepts_edges():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, logprobs=0, seed=-5)
    SamplingParams(logprobs=20, presence_penalty=-2.0, repetition_penalty=2.0, min_tokens=16)
    SamplingParams(stop=["w" * 512] * 4)  # the total cap, reached by the longest strings
    SamplingParams(stop=[f"{i:03d}" for i in range(128)])  # the count cap


def test_scheduler_config_takes_every_shared_setting_from_engine_args_by_name():
    engine_fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    shared = [f for f in dataclasses.fields(SchedulerConfig) if f.name in engine_fields]
    assert {f.name for f in shared} >= {"max_num_seqs", "scheduling", "enable_prefix_caching"}
    # A non-default value for each shared setting must arrive in the scheduler's config.
    changed = {
        "max_num_seqs": 3, "max_num_batched_tokens": 300, "long_prefill_token_threshold": 7,
        "long_prompt_threshold": 9, "max_waiting_requests": 5, "scheduling": "static",
        "enable_chunked_prefill": False, "enable_prefix_caching": False,
        "long_lane_max_share": 0.25, "free_block_watermark": 0.1, "aging_iterations": 3,
        "kv_reject_watermark": 0.9, "fairness": "fcfs", "deadline_admission": False,
        "speculative_config": '{"method": "ngram"}',
    }  # fmt: skip
    changed = {name: value for name, value in changed.items() if name in engine_fields}
    changed["long_prefill_token_threshold"] = 0  # chunked prefill is off
    # target_itl_ms needs chunked prefill: checked separately below.
    assert set(changed) == {f.name for f in shared} - {"max_model_len", "target_itl_ms"}
    config = EngineArgs(**changed, max_n=2).scheduler_config(max_model_len=200)
    assert config.max_model_len == 200
    for name, value in changed.items():
        assert getattr(config, name) == value, name
    assert EngineArgs(target_itl_ms=150.0).scheduler_config(200).target_itl_ms == 150.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_n": 0}, "max_n must be in [1, max_waiting_requests // 2 = 512]"),
        ({"max_n": 513}, "max_n must be in [1, max_waiting_requests // 2 = 512]"),
        ({"max_waiting_requests": 100}, "so one request cannot fill the waiting queue, got 64"),
    ],
)
def test_engine_args_keep_one_request_from_filling_the_queue(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(**kwargs)
    assert EngineArgs().max_n == 64
    assert EngineArgs(max_waiting_requests=100, max_n=50).max_n == 50


@pytest.mark.parametrize(
    ("flag", "value", "field", "member"),
    [
        ("--fairness", "fcfs", "fairness", FairnessPolicy.FCFS),
        ("--scheduling", "static", "scheduling", SchedulingPolicy.STATIC),
        ("--attention-impl", "xla", "attention_impl", AttentionImpl.XLA),
        ("--dtype", "bfloat16", "dtype", Dtype.BFLOAT16),
    ],
)
def test_a_vocabulary_setting_holds_its_enum_member_from_a_flag_or_text(flag, value, field, member):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = engine_args_from_namespace(parser.parse_args([flag, value]))
    assert getattr(args, field) is member
    assert getattr(EngineArgs(**{field: value}), field) is member
    assert getattr(EngineArgs(), field) is type(member)(parser.get_default(field))
    default = getattr(EngineArgs(), field)
    assert f"(default: '{default}'" in EngineArgs.__doc__  # the docs show the value, no repr
    assert f"<{type(member).__name__}" not in EngineArgs.__doc__


def test_an_unknown_attention_impl_is_a_usage_error_naming_the_choices(capsys):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-impl", "flash"])
    err = capsys.readouterr().err
    assert "invalid choice: 'flash'" in err
    assert "'auto', 'reference', 'xla', 'native', 'interpret', 'triton', 'mosaic'" in err
    with pytest.raises(InvalidSetting, match="attention_impl must be one of auto, reference"):
        EngineArgs(attention_impl="flash")


def test_a_lane_given_by_name_becomes_its_member_and_long_prompts_move_lane():
    scheduler = make_scheduler(long_prompt_threshold=8)
    short, long = make_request("s", 4, lane="interactive"), make_request("l", 9)
    batch = make_request("b", 4, lane="batch")
    for request in (short, long, batch):
        scheduler.add_request(request)
    assert (short.lane, long.lane, batch.lane) == (Lane.INTERACTIVE, Lane.LONG, Lane.BATCH)
    assert all(type(r.lane) is Lane for r in (short, long, batch))


def test_truncate_prompt_keeps_the_last_tokens():
    """vLLM's left truncation: the last k ids, all of a shorter prompt, -1 = max_model_len."""
    ids = list(range(10))
    assert truncate_prompt(ids, None, 8) == ids
    assert truncate_prompt(ids, 3, 8) == [7, 8, 9]
    assert truncate_prompt(ids, 8, 8) == ids[2:]
    assert truncate_prompt(ids, -1, 4) == [6, 7, 8, 9]
    assert truncate_prompt(ids[:2], 5, 8) == [0, 1]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(9\) must be at most "):
        truncate_prompt(ids, 9, 8)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
        truncate_prompt(ids, 0, 8)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
        PoolingParams(truncate_prompt_tokens=-5)
