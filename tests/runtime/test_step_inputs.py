"""A plan becomes step inputs: a decode with drafts is one sequence of 1 + k query tokens
with a row of logits at each, and those rows pick the sequence bucket."""

from __future__ import annotations

from array import array

from jserve.core.plan import ScheduledSeq, StepPlan
from jserve.runtime.step_inputs import StepInputBuilder


def _seq(request_id, start, tokens, blocks, num_drafts=0):
    return ScheduledSeq(
        request_id, start, array("q", tokens), blocks, True, (), array("q"), num_drafts
    )


def test_a_verify_step_has_a_row_of_logits_per_draft():
    builder = StepInputBuilder((1, 2, 4, 8, 16), (8, 16), block_size=4, max_blocks_per_seq=8)
    plan = StepPlan(
        seqs=[
            _seq("a", 6, [11, 12, 13, 14, 15], [3, 4, 5], num_drafts=4),  # positions 6..10
            _seq("b", 2, [21], [7]),
            _seq("c", 0, [31, 32, 33], [9]),  # a prefill chunk: its last row only
        ],
        num_decodes=2,
        num_batched_tokens=9,
        num_drafts=4,
    )
    inputs = builder.build(plan)
    assert (inputs.num_tokens, inputs.max_seqs) == (16, 8)
    assert inputs.token_ids[:9].tolist() == [11, 12, 13, 14, 15, 21, 31, 32, 33]
    assert inputs.positions[:9].tolist() == [6, 7, 8, 9, 10, 2, 0, 1, 2]
    # Position p of a lives in block a[p // 4], slot p % 4.
    assert inputs.slot_mapping[:5].tolist() == [4 * 4 + 2, 4 * 4 + 3, 5 * 4, 5 * 4 + 1, 5 * 4 + 2]
    assert inputs.cu_q_lens[:4].tolist() == [0, 5, 6, 9]
    assert inputs.kv_lens[:3].tolist() == [11, 3, 3]
    assert int(inputs.num_seqs[0]) == 3
    assert int(inputs.num_logits[0]) == 7
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 8, 0]
    # Three more decodes: 6 sequences and 4 drafts need 10 rows, past the bucket of 8.
    plan.seqs += [_seq(r, 1, [41], [10 + i]) for i, r in enumerate("def")]
    plan.num_batched_tokens = 12
    inputs = builder.build(plan)
    assert int(inputs.num_logits[0]) == 10 and inputs.max_seqs == 16
