"""`jserve compile`: the engine's executables compiled for a TPU and an NVIDIA GPU on this CPU.

Each case compiles two of SmolLM2's step buckets (a decode and a mixed one) and holds the
report to what can be known without the chip: the KV pool is never copied around the attention
kernel (a step's scratch stays under 5% of the pool: a copy would be about 200%), the weights
on a chip are the parameter count times the dtype's size, the layer scan is counted per layer
(the step's FLOPs cover its projections' 2 x tokens x parameters) and an in-place update of the
pool is not charged as the whole pool, and bad targets and splits are refused naming the
accepted values. The larger matrix is `slow`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from jserve.aot import host
from jserve.aot.chips import TPU_TOPOLOGIES
from jserve.aot.compiler import compile_engine
from jserve.aot.report import ExecutableReport, HostCost, HostLoad
from jserve.aot.targets import cpu_target, cuda_target, tpu_target
from jserve.config.engine_args import EngineArgs
from jserve.loaders.model_source import load_config
from jserve.models.config import ModelConfig
from jserve.models.int8_weights import int8_matrix_shapes, packed_int8_bytes
from jserve.runtime.params import make_mesh
from jserve.server.cli import main
from jserve.simulate.cli import add_simulate_arguments, run_simulate
from jserve.simulate.costs import CompiledEngine
from jserve.simulate.simulator import simulate
from jserve.simulate.workload import SimRequest

# SmolLM2-135M-Instruct's shape (the default model's GGUF says the same), written out so the
# compile tests need no weights.
SMOLLM2_135M = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)

STEPS = [(8, 8), (16, 8)]  # the largest decode bucket and a mixed one
ARGS = EngineArgs(max_num_seqs=8, max_num_batched_tokens=16)
LLAMA_70B = Path(__file__).resolve().parents[2] / "bench/configs/llama-3-70b/config.json"


def parameter_count(cfg: ModelConfig) -> int:
    """The model's parameters from its config alone (HF's own shapes, not jserve's fused ones)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attention = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * d
    bias = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd if cfg.attention_bias else 0
    layer = 2 * d + attention + bias + 3 * d * f
    head = 0 if cfg.tie_word_embeddings else d * cfg.vocab_size
    return cfg.vocab_size * d + cfg.num_layers * layer + d + head


def _projection_flops(cfg: ModelConfig, tokens: int) -> float:
    """2 x tokens x the layers' projection parameters: what any step of `tokens` computes."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * d + 3 * d * f
    return 2.0 * tokens * cfg.num_layers * per_layer


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M's config (what load_config reads from its GGUF)."""
    return "SmolLM2-135M", SMOLLM2_135M


@pytest.fixture(scope="module")
def v5e_report(smollm2):
    """SmolLM2's two STEPS buckets compiled for one v5e, the pool taking half its HBM."""
    name, cfg = smollm2
    return compile_engine(ARGS, cfg, name, tpu_target("v5e:1x1"), 0.5, steps=STEPS)


@pytest.fixture(scope="module")
def h200_report(smollm2):
    name, cfg = smollm2
    return compile_engine(ARGS, cfg, name, cuda_target("h200", 1), 0.5, steps=STEPS)


@pytest.mark.parametrize("which", ["v5e_report", "h200_report"])
def test_smollm2_steps_compile_with_no_pool_copy(smollm2, which, request):
    _, cfg = smollm2
    report = request.getfixturevalue(which)
    target = tpu_target("v5e:1x1") if which == "v5e_report" else cuda_target("h200", 1)
    assert report.errors == []
    assert report.dtype == "bfloat16" and report.attention_impl in ("mosaic", "triton")
    assert [(r.tokens, r.seqs) for r in report.executables] == STEPS
    memory = report.memory
    assert memory.weights_bytes == parameter_count(cfg) * 2 == 134_515_008 * 2
    assert memory.kv_pool_bytes > 0.45 * target.chip.hbm_bytes
    for row in report.executables:
        assert row.temp_bytes < 0.05 * memory.kv_pool_bytes, (row, memory.kv_pool_bytes)
        assert row.flops >= _projection_flops(cfg, row.tokens), row  # every layer counted
        assert row.bytes < memory.kv_pool_bytes, row  # an in-place pool update moves its rows
        assert row.roofline_ms > 0 and row.compile_s > 0
    assert memory.fits and memory.capacity[2048] > 0
    assert json.loads(json.dumps(report.to_json()))["memory"]["fits"] is True


@pytest.mark.parametrize(("chip", "kv"), [("v5e", "int8"), ("h200", "int8"), ("h200", "fp8_e4m3")])
def test_a_quantized_kv_pool_compiles_for_a_tpu_and_a_gpu_with_its_blocks_and_bytes(
    smollm2, chip, kv
):
    """--kv-cache-dtype int8 (and fp8_e4m3 on the GPU, the only target with float8 storage):
    attention through the Triton kernel on the GPU (compiled here by XLA's GPU compiler) and
    through XLA on the TPU (Mosaic does not read quantized pools yet), each block 2 x 64 / 68
    times smaller than a bfloat16 pool's. XLA's attention copies the pool on a TPU (so does a
    bfloat16 pool's), so the pool takes a tenth of the HBM here."""
    name, cfg = smollm2
    args = dataclasses.replace(ARGS, kv_cache_dtype=kv)
    target = tpu_target("v5e:1x1") if chip == "v5e" else cuda_target("h200", 1)
    report = compile_engine(args, cfg, name, target, 0.1, steps=STEPS[:1])
    assert report.errors == []
    assert report.kv_cache_dtype == kv
    assert report.attention_impl == ("xla" if chip == "v5e" else "triton")
    assert f"--kv-cache-dtype {kv}" in report.serve_flags
    int8_block = 2 * cfg.num_layers * cfg.num_kv_heads * 16 * (64 + 4)  # K and V, with scales
    assert report.num_blocks == int(0.1 * target.chip.hbm_bytes) // int8_block
    assert report.memory.kv_pool_bytes == report.num_blocks * int8_block


@pytest.mark.parametrize("target", ["v5e:1x1", "cpu"])
def test_int8_weights_compile_and_the_report_gives_their_bytes(smollm2, target):
    """--quantization int8: on a TPU, int8 arrays and a scale per 16 inputs of each output
    column (bfloat16) beside the float norms; on CPU, the native kernel's packed INT8 panels
    and float32 norms."""
    name, cfg = smollm2
    args = dataclasses.replace(ARGS, quantization="int8")
    chip = tpu_target(target) if target != "cpu" else cpu_target()
    fraction = 0.5 if target != "cpu" else None
    report = compile_engine(args, cfg, name, chip, fraction, steps=[(8, 8)])
    assert report.errors == []
    assert report.quantization == "int8" and "--quantization int8" in report.serve_flags
    shapes = int8_matrix_shapes(cfg)
    quantized = sum(layers * k * n for layers, k, n in shapes.values())
    norms = parameter_count(cfg) - quantized  # SmolLM2: no biases, the embedding is the head
    if target == "cpu":
        expected = sum(packed_int8_bytes(cfg).values()) + 4 * norms
        assert [r.name for r in report.executables] == ["decode step"]  # nothing to lay out
        assert expected < 0.33 * 4 * parameter_count(cfg)  # float32's (1.25 bytes a weight)
    else:
        scales = sum(layers * k // 16 * n for layers, k, n in shapes.values())
        expected = quantized + 2 * (scales + norms)
        assert expected < 0.57 * 2 * parameter_count(cfg)  # bfloat16's (1.125 bytes a weight)
    assert report.memory.weights_bytes == expected


def test_tensor_parallel_refusals_name_what_fits(smollm2):
    name, cfg = smollm2
    target = tpu_target("v5e:2x2")
    with pytest.raises(
        ValueError, match=r"9 query heads, 3 KV heads.*Sizes that fit this model: \[1, 3\]"
    ):
        compile_engine(dataclasses.replace(ARGS, tensor_parallel_size=2), cfg, name, target)
    with pytest.raises(
        ValueError, match=r"must divide the 4 devices of v5e:2x2; sizes that fit: \[1, 2, 4\]"
    ):
        compile_engine(dataclasses.replace(ARGS, tensor_parallel_size=3), cfg, name, target)


def test_unknown_targets_and_models_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown TPU topology 'v5e:3x3'.*'v5e:2x2'"):
        tpu_target("v5e:3x3")
    with pytest.raises(ValueError, match=r"unknown GPU 'a100'.*\['h100', 'h200'\]"):
        cuda_target("a100", 1)
    with pytest.raises(SystemExit):
        main(["compile", "--target", "tpu", "--topology", "v9:1x1"])
    assert "v6e:2x4" in capsys.readouterr().err
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 8}))
    assert main(["compile", "--target", "tpu", "--model", str(config)]) == 2
    assert "jserve supports ['LlamaForCausalLM'" in capsys.readouterr().err


def test_every_tpu_slice_is_one_device_per_chip_as_a_mesh_needs():
    """A v4's TensorCores are one device ("megacore"), as JAX serves on it: a mesh over a
    slice of two devices per chip is refused by jax.make_mesh."""
    for topology in TPU_TOPOLOGIES:
        target = tpu_target(topology)
        assert len(target.devices) == target.num_chips, topology
    devices = tpu_target("v4:2x2x1").devices
    assert make_mesh(4, devices).devices.size == 4


def test_a_pool_bigger_than_hbm_fails_naming_the_shortfall(smollm2, capsys):
    code = main(
        ["compile", "--target", "tpu", "--topology", "v5e:1x1", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "8", "--steps", "8x8", "--kv-cache-memory", str(20 * 2**30),
         "--host-iterations", "0"]
    )  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "does not fit" in err and "> 16.00 GiB HBM" in err


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("head_dim", "heads"), [(64, (9, 3)), (128, (32, 8)), (256, (16, 8))])
def test_mosaic_reads_the_pool_in_place_slow(topology, dtype, head_dim, heads):
    """The Mosaic kernel alone, compiled for the chip over a pool laid out for it: its scratch
    stays under 5% of the pool for every head_dim and dtype (XLA once copied a head_dim-64
    pool into the kernel's layout around every call: about twice the pool)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jserve.pallas import kv_cache_shape, ragged_paged_attention

    target = tpu_target(topology)
    mesh = jax.sharding.Mesh(target.devices, ("x",))
    num_q_heads, num_kv_heads = heads
    pool_shape = kv_cache_shape(30, 1000, 16, num_kv_heads, head_dim, impl="mosaic")
    tokens, seqs, table = 64, 16, 64

    def arg(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))

    i32 = jnp.int32
    args = (
        arg((tokens, num_q_heads, head_dim), dtype), arg(pool_shape, dtype),
        arg(pool_shape, dtype), arg((seqs, table), i32), arg((seqs + 1,), i32),
        arg((seqs,), i32), arg((1,), i32), arg((), i32),
    )  # fmt: skip

    def attend(*a):
        return ragged_paged_attention(
            *a, sm_scale=head_dim**-0.5, impl="mosaic", interpret=False, platform="tpu"
        )

    with jax.set_mesh(mesh):
        compiled = jax.jit(attend).lower(*args).compile()
    pool_bytes = 2 * jnp.dtype(dtype).itemsize * int(jnp.prod(jnp.array(pool_shape)))
    assert compiled.memory_analysis().temp_size_in_bytes < 0.05 * pool_bytes


@pytest.mark.slow
def test_llama_8b_shape_tensor_parallel_on_v5e_2x2_slow(tmp_path):
    """An 8B-shaped Llama (32 query, 8 KV heads, head_dim 128) split 4 ways over a v5e:2x2:
    the Mosaic kernel runs per KV-head shard under shard_map, and it all fits."""
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rope_theta": 500000.0, "max_position_embeddings": 8192,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    name, cfg = load_config(tmp_path / "config.json")
    args = dataclasses.replace(ARGS, tensor_parallel_size=4)
    report = compile_engine(args, cfg, name, tpu_target("v5e:2x2"), 0.5, steps=STEPS)
    assert report.errors == []
    embedding = cfg.vocab_size * cfg.hidden_size  # replicated; the rest split 4 ways
    split = (parameter_count(cfg) - embedding) * 2 / 4 + embedding * 2
    assert report.memory.weights_bytes == pytest.approx(split, rel=1e-3)
    for row in report.executables:
        assert row.temp_bytes < 0.05 * report.memory.kv_pool_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("topology", "tp", "fraction"), [("v6e:2x4", 8, 0.35), ("v5p:2x2x1", 4, 0.5)]
)
def test_llama_70b_shape_fits_a_single_host_slice_slow(topology, tp, fraction):
    """A Llama-3-70B-shaped model (80 layers, hidden 8192, 64 / 8 heads of 128) in bfloat16
    holds on the single-host slices with enough HBM: 8 v6e chips of 32 GiB, 4 v5p of 95 GiB.
    Its decode bucket compiles, the weights on a chip are its split, and the pool holds over
    a hundred 2,048-token sequences."""
    name, cfg = load_config(LLAMA_70B)
    args = dataclasses.replace(ARGS, tensor_parallel_size=tp)
    report = compile_engine(args, cfg, name, tpu_target(topology), fraction, steps=[(8, 8)])
    assert report.errors == []
    embedding = cfg.vocab_size * cfg.hidden_size  # replicated; the rest split tp ways
    split = (parameter_count(cfg) - embedding) * 2 / tp + embedding * 2
    assert parameter_count(cfg) == pytest.approx(70.55e9, rel=1e-3)
    assert report.memory.weights_bytes == pytest.approx(split, rel=1e-3)
    assert report.memory.fits and report.memory.capacity[2048] > 100
    (row,) = report.executables
    assert row.temp_bytes < 0.05 * report.memory.kv_pool_bytes and row.roofline_ms > 0


@pytest.mark.slow
@pytest.mark.parametrize(("topology", "tp"), [("v5e:2x4", 8), ("v4:2x2x1", 4)])
def test_llama_70b_shape_does_not_fit_the_smaller_slices_slow(topology, tp):
    """8 v5e chips of 16 GiB and 4 v4 chips of 32 GiB hold 128 GiB, less than the 70B
    weights alone (131 GiB): the report says so, with the numbers."""
    name, cfg = load_config(LLAMA_70B)
    args = dataclasses.replace(ARGS, tensor_parallel_size=tp)
    report = compile_engine(args, cfg, name, tpu_target(topology), 0.05, steps=[(8, 8)])
    memory = report.memory
    assert memory.hbm_bytes is not None and memory.weights_bytes > memory.hbm_bytes
    assert any("the weights alone do not fit" in e for e in report.errors), report.errors


def test_everything_compiles_split_over_three_gpus(smollm2):
    """The whole set (one bucket: step, pool init, sampler) with the model split over 3 H100s:
    the sampler compiles for one device of the mesh, as the engine runs it."""
    name, cfg = smollm2
    args = EngineArgs(max_num_seqs=1, max_num_batched_tokens=1, tensor_parallel_size=3)
    report = compile_engine(args, cfg, name, cuda_target("h100", 3), kv_cache_fraction=0.5)
    assert report.errors == []
    assert [r.name for r in report.executables] == ["decode step", "kv pool init", "sample"]
    step = report.executables[0]  # at 1 token XLA writes the pool in place, not by scatter
    assert 0 < step.bytes < report.memory.kv_pool_bytes
    assert report.memory.weights_bytes < parameter_count(cfg) * 2 / 2  # split, embedding whole


def test_a_compile_report_prices_the_simulators_steps(v5e_report, tmp_path, capsys):
    """`jserve simulate --compile-report`: every step costs its bucket's roofline, a bucket
    not compiled the nearest one's (a decode of one token: the 8x8 step's)."""
    path = tmp_path / "report.json"
    v5e_report.write(path)
    engine = CompiledEngine.from_report(str(path))
    roofline = {(r.tokens, r.seqs): r.roofline_ms / 1e3 for r in v5e_report.executables}
    assert engine.step_seconds == roofline and len(roofline) == 2
    assert engine.scheduler_config().max_num_seqs == 8 and engine.num_blocks > 1000
    # A 16-token prompt is one 16x8 step (its first token), then two one-token decodes.
    workload = [SimRequest(0.0, 16, 3)]
    config, model, table = engine.scheduler_config(), engine.cost_model(), engine.fresh_table()
    result = simulate(workload, config, engine.num_blocks, model, table, None, engine.block_size)
    (record,) = result.records
    assert result.steps == 3 and record.success
    assert record.ttft == pytest.approx(roofline[(16, 8)])
    assert record.e2e == pytest.approx(roofline[(16, 8)] + 2 * roofline[(8, 8)])
    args = ["simulate", "--compile-report", str(path), "--num-requests", "4"]
    assert main(args) == 0
    assert "roofline estimate (SmolLM2-135M on v5e:1x1), 4 requests [simulated]" in (
        capsys.readouterr().out
    )


def test_a_compile_report_is_refused_without_rooflines_or_beside_limits(v5e_report, tmp_path):
    path = tmp_path / "report.json"
    v5e_report.write(path)
    with pytest.raises(ValueError, match="--max-num-seqs: a compile report brings its engine"):
        run_simulate_args(["--compile-report", str(path), "--max-num-seqs", "4"])
    data = json.loads(path.read_text())
    for row in data["executables"]:
        row["roofline_ms"] = None  # as a CPU target writes it
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no model step with a roofline time"):
        CompiledEngine.from_report(str(path))
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a `jserve compile --report` JSON"):
        CompiledEngine.from_report(str(path))


def run_simulate_args(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return run_simulate(parser.parse_args(argv))


def _decode(seqs: int, roofline_ms: float) -> ExecutableReport:
    return ExecutableReport("decode step", tokens=seqs, seqs=seqs, roofline_ms=roofline_ms)


@pytest.mark.parametrize(
    "decodes, verdict",
    [
        ([_decode(8, 1.0), _decode(1024, 20.0)], "yes: the p50 is 15.0% of it"),
        ([_decode(1024, 10.0)], "no: the p50 is 30% of it"),
        ([_decode(8, 20.0), _decode(32, 30.0)], "yes: the p50 is 10.0% of it"),  # 32 seqs' step
        ([_decode(32, 10.0)], "not known: the p50 is 30% of a step of 32 sequences"),
        ([], "no roofline (a CPU target) or no decode step compiled"),
    ],
)
def test_the_host_is_set_beside_the_decode_step_of_as_many_sequences(v5e_report, decodes, verdict):
    """At 1,024 running the host keeps the chip busy if an iteration's p50 is under a fifth of
    the decode step of 1,024 sequences; a smaller step compiled can only show that it does."""
    load = HostLoad(running=1024, waiting=1024, iterations=10, p50_ms=3.0, p99_ms=9.0,
                    cpu_p50_ms=2.9)  # fmt: skip
    report = dataclasses.replace(
        v5e_report, executables=decodes, host=HostCost("Some CPU", 0.5, [load])
    )
    line = report.table().splitlines()[-1]
    assert line.startswith("| 1024 | 1024 | 10 | 3.000 | 9.000 | 2.900 |") and verdict in line
    assert "on Some CPU, 1-minute load 0.5" in report.table()


def test_the_host_is_measured_at_each_load(monkeypatch):
    monkeypatch.setattr(host, "LOADS", ((8, 16), (16, 8)))
    cost = host.measure_host(block_size=16, max_model_len=512, iterations=20)
    assert [(x.running, x.waiting, x.iterations) for x in cost.loads] == [(8, 16, 20), (16, 8, 20)]
    assert all(0 < x.p50_ms <= x.p99_ms and x.cpu_p50_ms > 0 for x in cost.loads)
    assert cost.cpu == host.cpu_model() != "" and cost.load_average >= 0
    with pytest.raises(ValueError, match="--host-iterations must be 0"):
        host.measure_host(16, 512, 1)
