"""What an engine step observer sees: one record per model step (`LLMEngine.add_step_observer`).

Observers are for measuring the engine from outside (the benchmarks' step logs), never for
serving: with none registered a step pays one `if`. The runner's time up to its logits needs a
sync point between the model step and the sampler (which otherwise overlaps the grammar work
with the device), so the engine takes it only when an observer asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jserve.core.plan import StepPlan
from jserve.runtime.step_inputs import StepInputs


@dataclass(frozen=True)
class ModelStep:
    """One model step: its bucket, what filled it, and (when asked for) the runner's time.

    Attributes:
        token_bucket: T, the padded token count the step was compiled for.
        seq_bucket: S, the padded sequence count.
        num_tokens: real tokens computed (the plan's batched tokens).
        num_seqs: real sequences.
        num_decodes: sequences that decode one token (the rest are prefill chunks).
        q_lens: new tokens of each real sequence (a copy, int64).
        kv_lens: each real sequence's context after the step, its new tokens included.
        runner_s: seconds from the model step's dispatch to its logits being ready, or None
            when no observer asked for it.
    """

    token_bucket: int
    seq_bucket: int
    num_tokens: int
    num_seqs: int
    num_decodes: int
    q_lens: np.ndarray
    kv_lens: np.ndarray
    runner_s: float | None

    @classmethod
    def of(cls, plan: StepPlan, inputs: StepInputs, runner_s: float | None) -> ModelStep:
        n = int(inputs.num_seqs[0])
        return cls(
            token_bucket=inputs.num_tokens,
            seq_bucket=inputs.max_seqs,
            num_tokens=plan.num_batched_tokens,
            num_seqs=len(plan.seqs),
            num_decodes=plan.num_decodes,
            q_lens=np.diff(inputs.cu_q_lens[: n + 1].astype(np.int64)),
            kv_lens=inputs.kv_lens[:n].astype(np.int64),
            runner_s=runner_s,
        )


StepObserver = Callable[[ModelStep], None]
