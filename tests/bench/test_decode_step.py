"""bench.decode_step: its matmul-only stack holds the model's own projections (bench.roofline's
`projection_shapes`), and its report adds up."""

from __future__ import annotations

import re

from bench.roofline import projection_shapes
from tests.shared_engine import engine_flags

FUSED = {
    "wqkv": ("attn_q", "attn_k", "attn_v"),
    "wo": ("attn_output",),
    "w_gate_up": ("ffn_gate", "ffn_up"),
    "w_down": ("ffn_down",),
}


def test_stack_shapes_are_the_gguf_layer_weights_fused(smollm2):
    reader, config = smollm2
    elements = {t.name.split(".")[2]: int(t.n_elements) for t in reader.tensors
                if t.name.startswith("blk.0.")}  # fmt: skip
    for name, (k, n) in projection_shapes(config).items():
        assert k * n == sum(elements[part] for part in FUSED[name]), name
    assert projection_shapes(config)["wqkv"][0] == config.hidden_size


def test_smoke_report_adds_up_and_its_profile_accounts_for_the_wall_time(
    shared_engine, smoke_report
):
    # One run (one engine build) for both: the alternated rounds and the profile. The shared
    # engine's sizes, and shared_engine is built first (it fills both caches): its model
    # steps come from the persistent compilation cache.
    report, result = smoke_report("decode_step", "--rounds", "2", "--profile", *engine_flags())
    assert len(report["step_ms"]) == len(report["stack_ms"]) == 2
    assert all(ms > 0 for ms in report["step_ms"] + report["stack_ms"])
    share = report["median_stack_ms"] / report["median_step_ms"]
    assert abs(report["share_of_matmul_rate"] - share) < 1e-12
    shares = [b / a for a, b in zip(report["step_ms"], report["stack_ms"], strict=True)]
    assert report["share_range"] == [min(shares), max(shares)]
    assert report["ab"]["ratio"]["ratios"] == shares and report["ab"]["pairs"] == 2
    assert set(report["loadavg_1min"]) == {"before", "after"}
    assert "runs at" in result.stdout

    profile = report["profile_ms"]
    assert profile["matmuls"] > 0 and profile["attention"] > 0
    ops = sum(profile[row] for row in ("matmuls", "attention", "gathers and scatters"))
    assert ops + profile["other XLA ops"] <= 1.05 * profile["wall"]
    assert "| attention |" in result.stdout


def test_op_rows_sort_a_real_module():
    import jax
    import jax.numpy as jnp

    from bench.decode_step import op_rows
    from jserve.pallas.layer_matmul import choose_matmul_impl, layer_matmul, pack_layer_weight

    impl = choose_matmul_impl(dtype=jnp.float32)
    w = pack_layer_weight(jnp.ones((2, 8, 16), jnp.float32), impl)

    def f(x, w, pool, slots):
        def layer(pool, i):
            y = layer_matmul(x, w, i, impl, 16)
            return pool.at[slots].set(y[:, :4]), None

        return jax.lax.scan(layer, pool, jnp.arange(2, dtype=jnp.int32))[0]

    args = (jnp.ones((3, 8)), w, jnp.zeros((10, 4)), jnp.array([1, 5, 7], jnp.int32))
    hlo = jax.jit(f).lower(*args).compile().as_text()
    rows = op_rows(hlo)
    opcodes = dict(re.findall(r"^\s*(?:ROOT\s+)?%?(\S+) = .*? ([a-z][\w-]*)\(", hlo, re.M))
    assert "while" in opcodes.values()
    assert all(opcodes[name] != "while" for name in rows)
    scatters = [name for name, op in opcodes.items() if "scatter" in name + op]
    assert scatters and all(rows[name] == "gathers and scatters" for name in scatters)
    if impl == "native":
        calls = [name for name, op in opcodes.items() if op == "custom-call"]
        assert calls and all(rows[name] == "matmuls" for name in calls)
