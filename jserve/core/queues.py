"""Waiting queues: one FIFO per lane (and, inside it, one per tenant), strict lane priority
with aging."""

from __future__ import annotations

from collections import deque

from jserve.config import LANES
from jserve.core.request import Request


class WaitingQueues:
    """Requests not running, per lane; `enqueued_step` stamps when each (re-)entered."""

    def __init__(self, aging_iterations: int) -> None:
        self.aging_iterations = aging_iterations
        self._lanes: dict[str, deque[Request]] = {lane: deque() for lane in LANES}
        # The same requests per lane and tenant, in the same order (fair share picks a tenant,
        # then its oldest request); a tenant with nothing waiting has no entry.
        self._tenants: dict[str, dict[str, deque[Request]]] = {lane: {} for lane in LANES}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def queue(self, lane: str) -> deque[Request]:
        """The lane's FIFO, to read (change it through `remove` and the pushes only)."""
        return self._lanes[lane]

    def tenant_queues(self, lane: str) -> dict[str, deque[Request]]:
        """The lane's requests per tenant (to read), each FIFO in lane order."""
        return self._tenants[lane]

    def push_back(self, request: Request, step: int) -> None:
        self._lanes[request.lane].append(request)
        self._tenants[request.lane].setdefault(request.tenant, deque()).append(request)
        self._note_added(request, step)

    def push_front(self, request: Request, step: int) -> None:
        """For a preempted request: it was admitted before everyone behind it."""
        self._lanes[request.lane].appendleft(request)
        self._tenants[request.lane].setdefault(request.tenant, deque()).appendleft(request)
        self._note_added(request, step)

    def remove(self, request: Request) -> None:
        self._lanes[request.lane].remove(request)
        tenants = self._tenants[request.lane]
        queue = tenants[request.tenant]
        if queue[0] is request:  # the common case: admission takes the oldest
            queue.popleft()
        else:
            queue.remove(request)
        if not queue:
            del tenants[request.tenant]
        self._len -= 1

    def lanes_in_order(self, step: int) -> list[str]:
        """Lanes whose head waited `aging_iterations` or more first (oldest first), then the
        rest by strict priority. This bounds how long any lane's head can wait."""
        aged = [
            lane
            for lane, queue in self._lanes.items()
            if queue and step - queue[0].enqueued_step >= self.aging_iterations
        ]
        aged.sort(key=lambda lane: self._lanes[lane][0].enqueued_step)
        return aged + [lane for lane in LANES if lane not in aged]

    def _note_added(self, request: Request, step: int) -> None:
        request.enqueued_step = step
        self._len += 1
