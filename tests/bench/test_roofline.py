"""bench.roofline: its counts against the model file and against closed forms of a workload."""

from __future__ import annotations

import pytest

from bench.roofline import projection_flops_per_token, roofline_table, step_cost
from bench.workloads import peer_workloads
from tests.shared_engine import engine_flags

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def test_projection_flops_are_twice_the_gguf_layer_weights(smollm2):
    reader, config = smollm2
    layer_weights = [
        t
        for t in reader.tensors
        if t.name.split(".")[0] == "blk" and t.name.split(".")[2] in PROJECTIONS
    ]
    assert len(layer_weights) == len(PROJECTIONS) * config.num_layers
    elements = sum(int(t.n_elements) for t in layer_weights)
    assert projection_flops_per_token(config) == 2 * elements


def test_step_cost_of_a_decode_step_by_hand(smollm2):
    _, config = smollm2  # SmolLM2-135M: 30 layers, 9 x 64 query and 3 x 64 KV dims, 49,152 tokens
    step = {"tokens": 2, "seqs": 2, "attended": 100 + 200, "context": 300}
    flops, nbytes = step_cost(config, step)
    per_token = 2 * 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    assert flops == 2 * per_token + 2 * (2 * 576 * 49152) + 300 * (4 * 30 * 9 * 64)
    weights = 4 * (per_token // 2 + 576 * 49152)
    assert nbytes == weights + 300 * (2 * 4 * 30 * 3 * 64)


def test_table_floor_is_the_slower_of_compute_and_memory(smollm2):
    _, config = smollm2
    small = {"kind": "decode", "T": 1, "tokens": 1, "seqs": 1, "attended": 10, "context": 10}
    large = {"kind": "prefill", "T": 512, "tokens": 512, "seqs": 1, "attended": 512 * 513 // 2,
             "context": 512}  # fmt: skip
    steps = [{**small, "wall_s": 0.05}, {**small, "wall_s": 0.07}, {**large, "wall_s": 1.0}]
    peak, bandwidth = 200e9, 30e9
    rows = {r["steps"]: r for r in roofline_table(config, steps, peak, bandwidth)}
    f, b = step_cost(config, small)
    assert b / bandwidth > f / peak  # one token: bound by reading the weights
    decode = rows["decode T=1"]
    assert decode["n"] == 2 and decode["compute_bound"] == 0
    assert decode["floor_s"] == pytest.approx(2 * b / bandwidth)
    assert decode["of_floor"] == pytest.approx(2 * b / bandwidth / 0.12)
    f, b = step_cost(config, large)
    assert rows["prefill T=512"]["floor_s"] == pytest.approx(f / peak)
    assert rows["prefill T=512"]["compute_bound"] == 1


def test_smoke_counts_add_up_to_the_requests_closed_forms(shared_engine, smoke_report):
    # shared_engine is built first: it fills both caches, and the run takes its sizes, so
    # its model steps come from the persistent compilation cache.
    report, result = smoke_report("roofline", "--workload", "batch-1", *engine_flags())
    (request,) = next(w for w in peer_workloads(True) if w["name"] == "batch-1")["requests"]
    prompt, outputs = len(request["prompt_token_ids"]), request["max_tokens"]
    fed = prompt + outputs - 1  # the last output token is never fed back
    steps = report["steps"]
    assert sum(s["tokens"] for s in steps) == fed
    assert sum(s["attended"] for s in steps) == fed * (fed + 1) // 2
    # Each step reads the context it has after writing its own tokens.
    assert [s["context"] for s in steps] == list(range(prompt, fed + 1))
    assert sum(s["seqs"] for s in steps) == len(steps)
    assert report["total"]["floor_s"] == pytest.approx(sum(g["floor_s"] for g in report["groups"]))
    assert sum(g["n"] for g in report["groups"]) == len(steps)
    assert "batch-1:" in result.stdout
