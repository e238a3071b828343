"""Start-up is never silent: each warm-up phase (model step, sampler, step-cost timing) logs
every shape it finishes, and a shape that takes long logs a line every heartbeat meanwhile."""

from __future__ import annotations

import itertools
import logging
import time

from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.loaders.model_source import LoadedModel
from jserve.loaders.safetensors_dir import load_safetensors_dir
from jserve.loaders.tokenizer import Tokenizer
from jserve.runtime.startup import StartupPhase
from tests.models.test_tiny_checkpoints import COMMON, _write

STARTUP_LOG = "jserve.runtime.startup"


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == STARTUP_LOG]


def test_a_shape_that_takes_long_is_never_silent(caplog):
    with caplog.at_level(logging.INFO, logger=STARTUP_LOG), StartupPhase("slow", 2, 0.05) as phase:
        for item in phase.each(["a", "b"], str):
            if item == "b":
                time.sleep(0.4)
    lines = _lines(caplog)
    assert lines[0].startswith("slow: 1/2 (a) in ") and lines[-1].startswith("slow: 2/2 (b) in ")
    beats = lines[1:-1]
    assert len(beats) >= 3, lines
    assert all(line.startswith("slow: still on 2/2 (b), ") for line in beats), lines
    times = [r.created for r in caplog.records if r.name == STARTUP_LOG]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.3


def _tiny_tokenizer() -> Tokenizer:
    """A word-level tokenizer over the tiny model's vocabulary (the engine needs one)."""
    vocab = {f"w{i}": i for i in range(COMMON["vocab_size"])}
    backend = Backend(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(backend, bos_token_id=None, eos_token_id=1, chat_template=None, source="test")


def test_every_warm_up_phase_logs_each_shape(tmp_path, caplog):
    _write("llama-tied", tmp_path)  # a tiny transformers checkpoint
    config, params = load_safetensors_dir(tmp_path)
    loaded = LoadedModel("tiny", config, params, _tiny_tokenizer(), tmp_path)
    # A target ITL makes the engine time every bucket at start-up: the third phase.
    args = EngineArgs(
        max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=16,
        target_itl_ms=10_000.0,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger=STARTUP_LOG):
        engine = LLMEngine(args, loaded=loaded)
    pairs = engine.bucket_pairs()
    seqs = sorted({s for _, s in pairs})
    steps = [f"tokens={t} seqs={s}" for t, s in pairs]
    expected = (
        [f"model step: {i}/{len(pairs)} ({shape})" for i, shape in enumerate(steps, 1)]
        + [f"sampler: {i}/{len(seqs)} (seqs={s})" for i, s in enumerate(seqs, 1)]
        + [f"step costs for target_itl_ms: {i}/{len(pairs)} ({shape})"
           for i, shape in enumerate(steps, 1)]
    )  # fmt: skip
    done = [line.rsplit(" in ", 1)[0] for line in _lines(caplog) if "still on" not in line]
    assert done == expected
