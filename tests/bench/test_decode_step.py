"""bench/decode_step.py: its matmul-only stack holds the model's own projections (roofline's
`projection_shapes`), and its report adds up."""

from __future__ import annotations

import gguf
from roofline import projection_shapes

from jserve.loaders.gguf_file import config_from_gguf
from jserve.loaders.model_source import default_model_path

FUSED = {
    "wqkv": ("attn_q", "attn_k", "attn_v"),
    "wo": ("attn_output",),
    "w_gate_up": ("ffn_gate", "ffn_up"),
    "w_down": ("ffn_down",),
}


def test_stack_shapes_are_the_gguf_layer_weights_fused():
    reader = gguf.GGUFReader(default_model_path())
    config = config_from_gguf(reader, "SmolLM2")
    elements = {t.name.split(".")[2]: int(t.n_elements) for t in reader.tensors
                if t.name.startswith("blk.0.")}  # fmt: skip
    for name, (k, n) in projection_shapes(config).items():
        assert k * n == sum(elements[part] for part in FUSED[name]), name
    assert projection_shapes(config)["wqkv"][0] == config.hidden_size


def test_smoke_report_adds_up(smoke_report):
    report, result = smoke_report("decode_step.py", "--rounds", "2")
    assert len(report["step_ms"]) == len(report["stack_ms"]) == 2
    assert all(ms > 0 for ms in report["step_ms"] + report["stack_ms"])
    share = report["median_stack_ms"] / report["median_step_ms"]
    assert abs(report["share_of_matmul_rate"] - share) < 1e-12
    low, high = report["share_range"]
    assert low <= high
    assert "runs at" in result.stdout
