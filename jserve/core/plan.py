"""The scheduler's answer for one iteration: which tokens of which sequences to compute."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from jserve.outputs import FinishReason

# The input id of a decode whose token the step before it samples (async scheduling): the
# engine writes the real id over it once that step's tokens reach the host, before dispatch.
PLACEHOLDER_TOKEN = -1


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    `token_ids` are positions `start_pos .. start_pos + len(token_ids) - 1` of the request's
    tokens (prompt then output), as an int64 `array` (`np.frombuffer` reads it without a copy).
    `block_ids` is the request's whole block table, covering at least
    `start_pos + len(token_ids)` positions. It is the scheduler's own list, not a copy (copies
    doubled the host cost at 1,024 sequences): tables only ever grow by appending, and a freed
    table is replaced rather than cleared, so the entries this step needs never change - but
    read it before the next `schedule()`, after which it may hold more entries. When `sample`
    is True the chunk ends at the last known token, so its last position's logits produce the
    next token. A decode planned before its input token is known (async scheduling: the step in
    flight samples it) holds PLACEHOLDER_TOKEN.

    A decode may carry `num_drafts` draft tokens after its last known token (speculative
    decoding): `token_ids` ends with them, the step computes logits at its last
    `num_drafts + 1` positions, and `Scheduler.update_from_output` keeps the drafts the
    engine accepted. Drafts are never among the request's tokens until accepted.

    A prefill chunk with `every_row` (its request has `Request.prompt_rows`: prompt logprobs,
    mean pooling) has the step compute a row of logits and hidden state at each of its
    positions, not only its last.

    `prompt_token_ids` and `output_token_ids` are what the engine needs to sample without
    asking the scheduler (penalties, the seed's step): `output_token_ids` is the request's own
    array, so read it before `update_from_output` appends this step's token.
    """

    request_id: str
    start_pos: int
    token_ids: array
    block_ids: list[int]
    sample: bool
    prompt_token_ids: tuple[int, ...]
    output_token_ids: array
    num_drafts: int = 0
    every_row: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_rows(self) -> int:
        """Rows of logits (and hidden states) the step computes for it, its last positions'."""
        return len(self.token_ids) if self.every_row else self.num_drafts + 1

    @property
    def sample_row(self) -> int:
        """Which of its rows (0-based, of `num_rows`) the next token is sampled from."""
        return len(self.token_ids) - 1 if self.every_row else 0


@dataclass(slots=True)
class StepPlan:
    """Everything one iteration computes, plus what changed since the previous plan.

    `seqs` holds the `num_decodes` decodes first (one token each, plus any drafts), then
    prefill chunks. `num_drafts` counts the drafts of all its decodes, `num_prompt_rows` the
    rows its `every_row` chunks take beyond one each.
    `preempted_ids` lost their KV this step and wait to recompute (their tokens are kept).
    `finished` lists requests the scheduler ended by itself before planning (deadline expiry)
    with the reason; those the sampled tokens end come from `Scheduler.update_from_output`,
    and those a caller ends (abort, stop string) are not reported back.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_decodes: int = 0
    num_batched_tokens: int = 0
    num_drafts: int = 0
    num_prompt_rows: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    finished: dict[str, FinishReason] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        """Rows of logits the step computes: one a seq, plus drafts and prompt rows; at most
        the largest sequence bucket (max_num_seqs), which the planner keeps to."""
        return len(self.seqs) + self.num_drafts + self.num_prompt_rows

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (the engine still reports `finished`)."""
        return not self.seqs
