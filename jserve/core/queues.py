"""Waiting queues: one FIFO per lane (and, inside it, one per tenant), strict lane priority
with aging.

Aging bounds a lower lane's wait without giving up priority: a lane whose work has waited
`aging_iterations` steps since its last admission (or since its head arrived, if later) puts
one request ahead of strict order, and its clock restarts. Each lane so gets at least one
admission every `aging_iterations` steps, and no more ahead of its turn: were a lane with an
old backlog to go first while its head is old, it would go first every step of an overload,
and strict priority would turn into first come, first served across lanes.
"""

from __future__ import annotations

from collections import deque

from jserve.config.scheduler import Lane
from jserve.core.request import Request


class WaitingQueues:
    """Requests not running, per lane; `enqueued_step` stamps when each (re-)entered."""

    def __init__(self, aging_iterations: int) -> None:
        self.aging_iterations = aging_iterations
        self._lanes: dict[Lane, deque[Request]] = {lane: deque() for lane in Lane}
        # The same requests per lane and tenant, in the same order (fair share picks a tenant,
        # then its oldest request); a tenant with nothing waiting has no entry.
        self._tenants: dict[Lane, dict[str, deque[Request]]] = {lane: {} for lane in Lane}
        self._last_admitted: dict[str, int] = {}  # lane -> step of its latest admission
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

    def admit(self, request: Request, step: int) -> None:
        """Take `request` out to run in `step`: its lane's aging clock restarts."""
        self.remove(request)
        self._last_admitted[request.lane] = step

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

    def starved_lanes(self, step: int) -> list[Lane]:
        """Lanes whose work has waited `aging_iterations` steps or more since the lane's last
        admission (or since its head arrived, if later), longest first: each may put one
        request ahead of strict lane order."""
        waited = {}
        for lane, queue in self._lanes.items():
            if queue:
                since = max(queue[0].enqueued_step, self._last_admitted.get(lane, -1))
                if step - since >= self.aging_iterations:
                    waited[lane] = since
        return sorted(waited, key=waited.__getitem__)

    def lanes_in_order(self, step: int) -> list[Lane]:
        """Starved lanes first, then the rest by strict priority."""
        starved = self.starved_lanes(step)
        return starved + [lane for lane in Lane if lane not in starved]

    def _note_added(self, request: Request, step: int) -> None:
        request.enqueued_step = step
        self._len += 1
