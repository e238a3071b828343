"""Fair share between tenants inside each lane: virtual token counters (VTC).

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Each lane keeps,
per tenant, a counter of the service its requests received: `PREFILL_TOKEN_COST` per prompt
token computed plus `DECODE_TOKEN_COST` per output token sampled, divided by the tenant's
weight (jserve.core.tenants). With `fairness="vtc"` the planner admits, inside a lane, the head
request of the backlogged tenant with the smallest counter (FIFO within a tenant; preempted
requests still go first: they were admitted before), and a tenant whose request must be
preempted is the most-served one of the lowest running lane (its latest request goes first).

Two rules keep the counters honest:
- A tenant that becomes active (backlogged: it has a request waiting in the lane) is lifted to
  the smallest counter of the lane's backlogged tenants (none: to the counter of the last one
  that stopped being backlogged, as the paper does), so idling never banks credit.
- Recomputing prompt tokens after a preemption is not charged (`Request.num_prompt_served`):
  that cost is the scheduler's doing, and charging it would punish the preempted tenant twice.

Bound (the paper's Theorem 4.4, instantiated for jserve). A tenant is admitted only while its
counter, including what this step already scheduled, is the smallest among the lane's
backlogged tenants; its admitted, unfinished requests in a lane number at most `max_num_seqs`
(new admissions wait behind preempted ones), and each can still be served at most
`max_model_len * DECODE_TOKEN_COST / weight` units: call their sum B_f. So after f's last
admission its counter exceeds any backlogged g's by at most B_f, and if f was not admitted its
service is at most B_f. Hence for f and g continuously backlogged in a lane over an interval,
the service they receive differs by at most max(B_f, B_g) plus the counter difference they
started with (zero for tenants with equal history, which the lift brings level).
B = max_num_seqs * max_model_len * DECODE_TOKEN_COST / weight. The paper's
2 * max(w_p * L_input, w_q * M) has the same shape: M, the tokens a batch holds, becomes the
tokens a tenant's admitted requests can still be served, since chunked prefill serves a prompt
over several steps.
tests/core/test_scheduler_state_machine.py checks it on random workloads.
"""

from __future__ import annotations

from jserve.config.scheduler import Lane
from jserve.core.request import Request
from jserve.core.tenants import TenantPolicy

PREFILL_TOKEN_COST = 1.0  # the paper's w_p
DECODE_TOKEN_COST = 2.0  # the paper's w_q: an output token costs about two prompt tokens


def service_of(request: Request, start: int, end: int, sample: bool) -> tuple[int, int]:
    """(prompt tokens, output tokens) newly served by computing positions [start, end) of
    `request` (and sampling a token when `sample`); recomputed prompt tokens are free."""
    new_prompt = min(end, request.num_prompt_tokens) - max(start, request.num_prompt_served)
    return max(0, new_prompt), 1 if sample else 0


class FairShare:
    """Per-lane virtual token counters and per-tenant running counts (for caps)."""

    def __init__(self, policy: TenantPolicy) -> None:
        self.policy = policy
        self.counters: dict[Lane, dict[str, float]] = {lane: {} for lane in Lane}
        self._backlog: dict[Lane, dict[str, int]] = {lane: {} for lane in Lane}  # waiting
        self._unfinished: dict[Lane, dict[str, int]] = {lane: {} for lane in Lane}
        self._last_left: dict[str, float] = {}  # lane -> counter of the last to leave backlog
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

    def charge_decodes(self, decodes: dict[tuple[str, str], int]) -> None:
        """Count one output token (no prompt token) for each decode, by (lane, tenant)."""
        for (lane, tenant), count in decodes.items():
            counters = self.counters[lane]
            counters[tenant] = counters.get(tenant, 0.0) + self.cost(tenant, 0, count)

    def at_cap(self, tenant: str, extra_running: int = 0) -> bool:
        cap = self.policy.max_running.get(tenant)
        return cap is not None and self.num_running.get(tenant, 0) + extra_running >= cap

    # ---- activity: the scheduler reports every unfinished request's moves ----------------

    def on_add(self, request: Request) -> None:
        unfinished = self._unfinished[request.lane]
        unfinished[request.tenant] = unfinished.get(request.tenant, 0) + 1
        self._enter_backlog(request)

    def on_start_running(self, request: Request) -> None:
        self.num_running[request.tenant] = self.num_running.get(request.tenant, 0) + 1
        self._leave_backlog(request)

    def on_preempted(self, request: Request) -> None:
        self._stopped_running(request.tenant)
        self._enter_backlog(request)

    def on_finish(self, request: Request, was_running: bool) -> None:
        if was_running:
            self._stopped_running(request.tenant)
        else:
            self._leave_backlog(request)
        lane, tenant = request.lane, request.tenant
        unfinished = self._unfinished[lane]
        unfinished[tenant] -= 1
        if unfinished[tenant]:
            return
        del unfinished[tenant]
        counters = self.counters[lane]
        if not unfinished:  # nobody left to be fair to in this lane: forget its history
            counters.clear()
            self._last_left.pop(lane, None)
        elif tenant not in self.policy.weights and counters.get(tenant, 0.0) <= self._floor(lane):
            # The floor only rises (until the lane idles), so lifting restores at least this
            # value when the tenant returns: forget it. Undeclared tenants' names come from
            # clients and must not accumulate.
            counters.pop(tenant, None)

    def _floor(self, lane: str) -> float:
        """What a tenant that becomes backlogged is lifted to: the smallest counter of the
        lane's backlogged tenants, or (none) the counter of the last one to leave."""
        backlog = self._backlog[lane]
        if backlog:
            counters = self.counters[lane]
            return min(counters.get(t, 0.0) for t in backlog)
        return self._last_left.get(lane, 0.0)

    def _enter_backlog(self, request: Request) -> None:
        backlog = self._backlog[request.lane]
        tenant = request.tenant
        count = backlog.get(tenant, 0)
        if not count:
            counters = self.counters[request.lane]
            counters[tenant] = max(counters.get(tenant, 0.0), self._floor(request.lane))
        backlog[tenant] = count + 1

    def _leave_backlog(self, request: Request) -> None:
        backlog = self._backlog[request.lane]
        tenant = request.tenant
        count = backlog[tenant] - 1
        if count:
            backlog[tenant] = count
        else:
            del backlog[tenant]
            self._last_left[request.lane] = self.counters[request.lane].get(tenant, 0.0)

    def _stopped_running(self, tenant: str) -> None:
        left = self.num_running[tenant] - 1
        if left:
            self.num_running[tenant] = left
        else:
            del self.num_running[tenant]
