"""Pooling an embedding request's final hidden states, on the host, chunk by chunk.

The model step returns the final hidden states (after the final norm) of its logit rows
(jserve.runtime.model_runner.StepOutput). Last-token pooling reads the row of the prompt's
last position (the chunk that ends the prompt); mean pooling has a row at every prompt
position (`Request.prompt_rows`) and sums the chunks' rows here. The result is
L2-normalized, as vLLM's pooling runner gives an embedding model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jserve.sampling_params import PoolingType


@dataclass
class Pooler:
    """One embedding request's running pool over its `num_prompt_tokens` positions."""

    pooling_type: PoolingType
    num_prompt_tokens: int
    total: np.ndarray | None = None  # the last row, or the sum of the rows so far (float64)
    num_pooled: int = 0  # mean: positions 0 .. num_pooled - 1 are in `total`

    def add(self, start: int, rows: np.ndarray) -> None:
        """Hidden states `rows` [k, D] of positions start .. start + k - 1. Positions seen
        before (a chunk recomputed after preemption) are not counted twice."""
        end = start + len(rows)
        if self.pooling_type is PoolingType.LAST:
            if end == self.num_prompt_tokens:
                self.total = np.asarray(rows[-1], np.float64)
            return
        new = rows[max(0, self.num_pooled - start) :]
        if end <= self.num_pooled or start > self.num_pooled:
            return  # seen already, or a gap (never: chunks come in order)
        summed = np.sum(new, axis=0, dtype=np.float64)
        self.total = summed if self.total is None else self.total + summed
        self.num_pooled = end

    def embedding(self) -> list[float]:
        """The pooled, L2-normalized embedding; ValueError if a position is missing."""
        complete = self.num_pooled == self.num_prompt_tokens or (
            self.pooling_type is PoolingType.LAST
        )
        if self.total is None or not complete:
            raise ValueError(
                f"pooling has {self.num_pooled} of {self.num_prompt_tokens} prompt positions"
            )
        mean = self.pooling_type is PoolingType.MEAN
        vector = self.total / (self.num_prompt_tokens if mean else 1)
        norm = np.linalg.norm(vector)
        return (vector / max(norm, 1e-12)).tolist()
