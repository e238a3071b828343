"""--quantization int8 on a tiny random checkpoint, both layouts (the native CPU kernel's
packed INT8 panels, and XLA's int8 dot, which TPU and GPU run): the greedy tokens are exactly
those of a float32 engine serving the dequantized weights `q * scale` (the same math: the
activation-aware scales folded in, then quantized here by the same quantizer), nothing compiles
after warm-up, the engine says it serves int8;
its argmax mostly agrees with the float32 weights'; and a GGUF is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from bench.quality import forward, teacher_forced
from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.engine.setup import quantized_to_int8, weight_bytes
from jserve.loaders.model_source import LoadedModel
from jserve.models.awq import awq_params
from jserve.models.calibration import CALIBRATION_TEXT, calibration_windows
from jserve.models.int8_weights import dequantized, quantize_channels
from jserve.pallas import native_build
from jserve.pallas.layer_matmul import MatmulImpl
from jserve.runtime import model_runner
from jserve.runtime.compilation import forbid_compilation
from jserve.sampling_params import SamplingParams
from tests.parallel.workload import ENGINE, MAX_TOKENS, PROMPT_VOCAB, prompts, tiny_model
from tests.shared_engine import run_to_completion


@pytest.fixture(scope="module")
def tiny(default_model) -> LoadedModel:
    """The parallel tests' random 2-layer model, as if read from a checkpoint directory."""
    return dataclasses.replace(tiny_model(default_model), source=Path("tiny-random"))


def _activation_aware(model: LoadedModel) -> LoadedModel:
    """`model` with the activation-aware scales folded in, calibrated as the engine does."""
    ids = model.tokenizer.encode(CALIBRATION_TEXT.read_text())
    windows = calibration_windows(ids, model.config.vocab_size)
    return dataclasses.replace(model, params=awq_params(model.config, model.params, windows))


def _dequantized(model: LoadedModel) -> LoadedModel:
    """`model` with every weight int8 quantizes replaced by `q * scale` in float32: quantized
    per group of each output column of the loader's own (unfused) weights, which is the same
    per column as quantizing the fused projections."""
    layers = dict(model.params["layers"])
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = layers[name]  # [L, K, ...], wo [L, ..., N]: as [L, K, N]
        matrix = (
            w.reshape(w.shape[0], -1, w.shape[-1]) if name == "wo" else w.reshape(*w.shape[:2], -1)
        )
        layers[name] = dequantized(*quantize_channels(matrix)).reshape(w.shape)
    lm_head = dequantized(*quantize_channels(model.params["lm_head"]))
    params = {**model.params, "layers": layers, "lm_head": lm_head}
    return dataclasses.replace(model, params=params)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts()):
        engine.add_request(f"q{i}", {"prompt_token_ids": ids}, params)
    final = run_to_completion(engine)
    return [final[f"q{i}"].outputs[0].token_ids for i in range(len(prompts()))]


@pytest.fixture(params=[MatmulImpl.NATIVE, MatmulImpl.XLA])
def matmul_impl(request, monkeypatch) -> MatmulImpl:
    """Where the projections run: the native kernel, or XLA's dot (forced on this CPU)."""
    if request.param == MatmulImpl.NATIVE and native_build.load() is None:
        pytest.skip("the native CPU kernels cannot be built here (see the log)")
    monkeypatch.setattr(model_runner, "choose_matmul_impl", lambda *a: request.param)
    return request.param


def test_int8_gives_the_tokens_of_its_dequantized_weights(tiny, matmul_impl):
    int8 = LLMEngine(EngineArgs(**ENGINE, quantization="int8"), loaded=tiny)
    assert int8.runner.matmul_impl == matmul_impl
    assert int8.quantization == "int8"
    with forbid_compilation():  # the recompile guard: warm-up compiled every step
        tokens = _greedy(int8)
    reference = LLMEngine(EngineArgs(**ENGINE), loaded=_dequantized(_activation_aware(tiny)))
    assert tokens == _greedy(reference)
    # Less the untied embedding, which stays float: the packed panels take 1.25 bytes a weight,
    # XLA's int8 arrays 1 and their scales.
    embed = tiny.params["embed"].nbytes
    int8_bytes, float_bytes = (weight_bytes(e.runner.state) - embed for e in (int8, reference))
    assert int8_bytes < 0.35 * float_bytes, (int8_bytes, float_bytes)


def test_int8_mostly_agrees_with_the_float_weights_teacher_forced(tiny):
    """Every position's argmax over random windows, int8 against float32 (bench.quality's
    measure; its figures on SmolLM2 are in docs/quantization.md). A random model's argmax
    margins are small beside its logits' spread and its errors compound through the layers,
    so the bound is loose; greedy continuations are not compared at all (one flipped argmax
    sends a continuation elsewhere). Its queries and keys are scaled back to unit gain here:
    the parallel tests' model scales them up 4x, which makes attention sharp enough to
    amplify any rounding."""
    if native_build.load() is None:
        pytest.skip("the native CPU kernels cannot be built here (see the log)")
    layers = dict(tiny.params["layers"])
    layers["wq"], layers["wk"] = layers["wq"] / 4, layers["wk"] / 4
    model = dataclasses.replace(tiny, params={**tiny.params, "layers": layers})
    rng = np.random.default_rng(2)
    windows = [rng.integers(3, PROMPT_VOCAB, 64) for _ in range(4)]
    int8 = forward(quantized_to_int8(model, native=True), 64)
    scores = teacher_forced(int8, forward(model, 64), windows)
    assert scores["top1_agreement"] >= 0.85, scores
    assert scores["mean_kl"] < 0.1, scores


def test_a_gguf_is_refused_with_what_to_serve_instead(tiny):
    with pytest.raises(ValueError, match=r"holds quantized weights already.*--quantization auto"):
        LLMEngine(EngineArgs(**ENGINE, quantization="int8"))  # the default model, a GGUF
    with pytest.raises(ValueError, match=r"model.gguf holds quantized weights already"):
        quantized_to_int8(tiny, native=True, model=Path("model.gguf"))
