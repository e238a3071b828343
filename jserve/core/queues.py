"""Waiting queues: one FIFO per lane, strict lane priority with aging, and deadline expiry."""

from __future__ import annotations

import heapq
from collections import deque

from jserve.core.request import LANES, Request, RequestStatus

_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class WaitingQueues:
    """Requests not running, per lane; `enqueued_step` stamps when each (re-)entered."""

    def __init__(self, aging_iterations: int) -> None:
        self.aging_iterations = aging_iterations
        self._lanes: dict[str, deque[Request]] = {lane: deque() for lane in LANES}
        # (deadline, tie-breaker, request); entries of requests that left stay until popped.
        self._deadlines: list[tuple[float, int, Request]] = []
        self._num_deadline_pushes = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def queue(self, lane: str) -> deque[Request]:
        """The lane's FIFO; a caller that deletes from it must call `note_removed`."""
        return self._lanes[lane]

    def note_removed(self) -> None:
        self._len -= 1

    def push_back(self, request: Request, step: int) -> None:
        self._lanes[request.lane].append(request)
        self._note_added(request, step)

    def push_front(self, request: Request, step: int) -> None:
        """For a preempted request: it was admitted before everyone behind it."""
        self._lanes[request.lane].appendleft(request)
        self._note_added(request, step)

    def remove(self, request: Request) -> None:
        self._lanes[request.lane].remove(request)
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

    def pop_expired(self, now: float) -> list[Request]:
        """Remove and return waiting requests whose deadline is at or before `now`."""
        expired = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if request.status in _WAITING_STATES and request not in expired:
                self.remove(request)
                expired.append(request)
        return expired

    def _note_added(self, request: Request, step: int) -> None:
        request.enqueued_step = step
        self._len += 1
        if request.deadline is None:
            return
        self._num_deadline_pushes += 1
        heapq.heappush(self._deadlines, (request.deadline, self._num_deadline_pushes, request))
        if len(self._deadlines) > 2 * self._len + 64:
            # Entries of requests that already left pile up (and pin them): rebuild from the
            # queues every so often, amortised O(1) per push.
            self._deadlines = [
                entry for entry in self._deadlines if entry[2].status in _WAITING_STATES
            ]
            heapq.heapify(self._deadlines)
