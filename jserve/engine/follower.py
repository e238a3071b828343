"""A process of a multi-process run other than process 0: build the same engine, then follow.

It loads, places and precompiles exactly what process 0 does (same EngineArgs), so both hold
the same executables, then runs whatever process 0 announces (jserve.runtime.multihost) until
process 0 stops the run or a process is lost. It serves nothing and schedules nothing.
"""

from __future__ import annotations

import logging

from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.loaders.model_source import LoadedModel
from jserve.runtime.compilation import expect_compilation
from jserve.runtime.multihost import StepChannel, follow

log = logging.getLogger(__name__)


def run_follower(args: EngineArgs, loaded: LoadedModel | None = None) -> int:
    """Returns the exit code: 0 when process 0 stopped the run, 1 when a process was lost.

    `loaded` is as for LLMEngine: the model, if already in memory (it must be process 0's)."""
    if args.num_processes < 2 or args.process_id < 1:
        raise ValueError(
            f"run_follower is for processes 1..{args.num_processes - 1} of a multi-process run; "
            f"got process_id={args.process_id} of num_processes={args.num_processes}"
        )
    engine = LLMEngine(args, loaded)
    with expect_compilation():  # process 0 compiles the same broadcasts inside its engine's
        channel = StepChannel(engine.inputs_builder.example, engine.bucket_pairs())
    log.info("process %d ready; following process 0", args.process_id)
    return follow(engine.runner, channel)
