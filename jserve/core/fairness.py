"""Fair share between tenants inside each lane: virtual token counters (VTC).

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Each lane keeps,
per tenant, a counter of the service its requests received: `PREFILL_TOKEN_COST` per prompt
token computed plus `DECODE_TOKEN_COST` per output token sampled, divided by the tenant's
weight (jserve.core.tenants). With `fairness="vtc"` the planner admits, inside a lane, the head
request of the backlogged tenant with the smallest counter (FIFO within a tenant; preempted
requests still go first: they were admitted before), and a tenant whose request must be
preempted is the most-served one of the lowest running lane (its latest request goes first).

Two rules keep the counters honest:
- A tenant that becomes active in a lane again (its first unfinished request there) is lifted
  to the minimum counter of the lane's other active tenants, so idling never banks credit.
- Recomputing prompt tokens after a preemption is not charged (`Request.num_prompt_served`):
  that cost is the scheduler's doing, and charging it would punish the preempted tenant twice.

Bound (the paper's Theorem 4.4, instantiated for jserve): a tenant is admitted only while its
counter (including what this step already scheduled) is the smallest among the lane's
backlogged tenants, and a tenant's admitted, unfinished requests in a lane are at most
`max_num_seqs` (new admissions wait behind preempted ones), each with at most `max_model_len`
tokens still to be served. So while tenants f and g are both backlogged in a lane, their
counters differ by at most U = max_num_seqs * max_model_len * DECODE_TOKEN_COST / min weight,
and the service they receive over any such interval differs by at most 2U (`service_gap_bound`).
The paper's U = max(w_p * L_input, w_q * M) has the same shape: M, the tokens a batch holds,
becomes the tokens a tenant's admitted requests can still be served, since chunked prefill
serves a prompt over several steps. tests/core/test_scheduler_state_machine.py checks it.
"""

from __future__ import annotations

from jserve.config import LANES
from jserve.core.request import Request
from jserve.core.tenants import TenantPolicy

PREFILL_TOKEN_COST = 1.0  # the paper's w_p
DECODE_TOKEN_COST = 2.0  # the paper's w_q: an output token costs about two prompt tokens


def service_of(request: Request, start: int, end: int, sample: bool) -> tuple[int, int]:
    """(prompt tokens, output tokens) newly served by computing positions [start, end) of
    `request` (and sampling a token when `sample`); recomputed prompt tokens are free."""
    new_prompt = min(end, request.num_prompt_tokens) - max(start, request.num_prompt_served)
    return max(0, new_prompt), 1 if sample else 0


def service_gap_bound(max_num_seqs: int, max_model_len: int, min_weight: float) -> float:
    """2U: the most two continuously backlogged tenants' weighted service may differ by."""
    return 2.0 * max_num_seqs * max_model_len * DECODE_TOKEN_COST / min_weight


class FairShare:
    """Per-lane virtual token counters and per-tenant running counts (for caps)."""

    def __init__(self, policy: TenantPolicy) -> None:
        self.policy = policy
        self.counters: dict[str, dict[str, float]] = {lane: {} for lane in LANES}
        self._active: dict[str, dict[str, int]] = {lane: {} for lane in LANES}
        self.num_running: dict[str, int] = {}  # tenant -> its running sequences, all lanes

    def level(self, lane: str, tenant: str) -> float:
        return self.counters[lane].get(tenant, 0.0)

    def cost(self, tenant: str, prompt_tokens: int, output_tokens: int) -> float:
        """Counter units for serving these tokens to `tenant`."""
        tokens = PREFILL_TOKEN_COST * prompt_tokens + DECODE_TOKEN_COST * output_tokens
        return tokens / self.policy.weight(tenant)

    def charge(self, request: Request, start: int, end: int, sample: bool) -> None:
        """Count what a step computed for `request` (positions [start, end))."""
        prompt, output = service_of(request, start, end, sample)
        if prompt:
            request.num_prompt_served = min(end, request.num_prompt_tokens)
        counters = self.counters[request.lane]
        tenant = request.tenant
        counters[tenant] = counters.get(tenant, 0.0) + self.cost(tenant, prompt, output)

    def at_cap(self, tenant: str, extra_running: int = 0) -> bool:
        cap = self.policy.max_running.get(tenant)
        return cap is not None and self.num_running.get(tenant, 0) + extra_running >= cap

    # ---- activity: the scheduler reports every unfinished request's life -------------------

    def on_add(self, request: Request) -> None:
        active = self._active[request.lane]
        tenant = request.tenant
        if tenant not in active:
            counters = self.counters[request.lane]
            others = [counters.get(t, 0.0) for t in active]
            if others:
                counters[tenant] = max(counters.get(tenant, 0.0), min(others))
            active[tenant] = 0
        active[tenant] += 1

    def on_finish(self, request: Request, was_running: bool) -> None:
        if was_running:
            self._stopped_running(request.tenant)
        lane, tenant = request.lane, request.tenant
        active = self._active[lane]
        active[tenant] -= 1
        if active[tenant]:
            return
        del active[tenant]
        counters = self.counters[lane]
        if not active:
            counters.clear()  # nobody to be fair to: only counters of active tenants matter
        elif tenant not in self.policy.weights and counters.get(tenant, 0.0) <= min(
            counters.get(t, 0.0) for t in active
        ):
            # Lifting restores at least this value when it returns: forget it (the names of
            # undeclared tenants come from clients and must not accumulate).
            counters.pop(tenant, None)

    def on_start_running(self, request: Request) -> None:
        self.num_running[request.tenant] = self.num_running.get(request.tenant, 0) + 1

    def on_preempted(self, request: Request) -> None:
        self._stopped_running(request.tenant)

    def _stopped_running(self, tenant: str) -> None:
        left = self.num_running[tenant] - 1
        if left:
            self.num_running[tenant] = left
        else:
            del self.num_running[tenant]
