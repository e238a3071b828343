"""Turn a StepPlan into one padded StepInputs pytree, built in preallocated numpy buffers.

Buffers are sized once for the largest bucket; each step fills a prefix and hands views of the
bucket's size to the device, so nothing on the host is reallocated per step. Pad lanes are
harmless by construction: pad tokens write to and read from the sink block only, pad sequences
have no query tokens and no context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from jserve.core.block_manager import SINK_BLOCK_ID
from jserve.core.buckets import pick_step_bucket
from jserve.core.plan import StepPlan


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    """One step's device inputs; T is the token bucket, S the sequence bucket."""

    token_ids: np.ndarray  # [T] int32 (pads: 0)
    positions: np.ndarray  # [T] int32 position of each token in its sequence (pads: 0)
    slot_mapping: np.ndarray  # [T] int32 flat KV slot = block * block_size + offset (pads: sink)
    block_tables: np.ndarray  # [S, max_blocks] int32 (unused entries: sink)
    cu_q_lens: np.ndarray  # [S + 1] int32 start of each sequence's tokens (pads: T_real)
    kv_lens: np.ndarray  # [S] int32 context after this step (pads: 0)
    num_seqs: np.ndarray  # [1] int32 real sequences
    # [S] int32 token rows whose next-token logits (and final hidden states) are wanted: each
    # sequence's last, a decode with drafts its last num_drafts + 1, an `every_row` chunk all
    # of its tokens (pads: 0)
    logits_indices: np.ndarray
    num_logits: np.ndarray  # [1] int32 real rows of logits_indices (ScheduledSeq.num_rows)
    num_tokens: int = dataclasses.field(metadata={"static": True})  # T
    max_seqs: int = dataclasses.field(metadata={"static": True})  # S


class StepInputBuilder:
    """Fills StepInputs from plans; owns the staging buffers."""

    def __init__(
        self,
        token_buckets: tuple[int, ...],
        seq_buckets: tuple[int, ...],
        block_size: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.token_buckets = token_buckets
        self.seq_buckets = seq_buckets
        self.block_size = block_size
        t, s = token_buckets[-1], seq_buckets[-1]
        self._token_ids = np.zeros(t, np.int32)
        self._positions = np.zeros(t, np.int32)
        self._slots = np.zeros(t, np.int32)
        self._tables = np.full((s, max_blocks_per_seq), SINK_BLOCK_ID, np.int32)
        self._cu = np.zeros(s + 1, np.int32)
        self._kv_lens = np.zeros(s, np.int32)
        self._logits_idx = np.zeros(s, np.int32)
        self._prev_seqs = s  # rows of _tables that may hold stale entries

    def twin(self) -> StepInputBuilder:
        """A builder of the same shapes with buffers of its own. A step's inputs are views of
        its builder's buffers (the device may read them in place while the step runs), so the
        step planned while it runs (async scheduling) is built in the other of two."""
        return StepInputBuilder(
            self.token_buckets, self.seq_buckets, self.block_size, self._tables.shape[1]
        )

    def example(self, num_tokens: int, max_seqs: int) -> StepInputs:
        """An all-padding StepInputs of one bucket, for precompiling it."""
        return StepInputs(
            token_ids=np.zeros(num_tokens, np.int32),
            positions=np.zeros(num_tokens, np.int32),
            slot_mapping=np.full(num_tokens, SINK_BLOCK_ID * self.block_size, np.int32),
            block_tables=np.full((max_seqs, self._tables.shape[1]), SINK_BLOCK_ID, np.int32),
            cu_q_lens=np.zeros(max_seqs + 1, np.int32),
            kv_lens=np.zeros(max_seqs, np.int32),
            num_seqs=np.zeros(1, np.int32),
            logits_indices=np.zeros(max_seqs, np.int32),
            num_logits=np.zeros(1, np.int32),
            num_tokens=num_tokens,
            max_seqs=max_seqs,
        )

    def build(self, plan: StepPlan) -> StepInputs:
        n_seqs = len(plan.seqs)
        n_tokens = plan.num_batched_tokens
        n_logits = plan.num_rows  # a draft's row of logits verifies it
        t, s = pick_step_bucket(self.token_buckets, self.seq_buckets, n_tokens, n_logits)
        bs = self.block_size
        tok, pos, slots = self._token_ids, self._positions, self._slots
        tables, cu, kv_lens, logits_idx = self._tables, self._cu, self._kv_lens, self._logits_idx
        tables[: self._prev_seqs] = SINK_BLOCK_ID
        self._prev_seqs = n_seqs

        offset = row = 0
        for i, seq in enumerate(plan.seqs):
            n = len(seq.token_ids)
            end = offset + n
            start = seq.start_pos
            tok[offset:end] = seq.token_ids
            p = np.arange(start, start + n, dtype=np.int32)
            pos[offset:end] = p
            blocks = np.asarray(seq.block_ids, np.int32)
            slots[offset:end] = blocks[p // bs] * bs + p % bs
            tables[i, : len(blocks)] = blocks
            cu[i] = offset
            kv_lens[i] = start + n
            rows = seq.num_rows
            if rows > 1:
                logits_idx[row : row + rows] = np.arange(end - rows, end, dtype=np.int32)
                row += rows
            else:
                logits_idx[row] = end - 1
                row += 1
            offset = end
        # Padding: tokens point at the sink block, sequences are empty.
        tok[offset:t] = 0
        pos[offset:t] = 0
        slots[offset:t] = SINK_BLOCK_ID * bs
        cu[n_seqs : s + 1] = offset
        kv_lens[n_seqs:s] = 0
        logits_idx[row:s] = 0
        return StepInputs(
            token_ids=tok[:t],
            positions=pos[:t],
            slot_mapping=slots[:t],
            block_tables=tables[:s],
            cu_q_lens=cu[: s + 1],
            kv_lens=kv_lens[:s],
            num_seqs=np.array([n_seqs], np.int32),
            logits_indices=logits_idx[:s],
            num_logits=np.array([row], np.int32),
            num_tokens=t,
            max_seqs=s,
        )
