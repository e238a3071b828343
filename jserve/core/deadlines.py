"""Request deadlines: the one place that says what a deadline means and enforces it.

A request's `deadline` is an absolute time on the `time.monotonic()` clock. If the request has
not finished by then, whatever its state (waiting, preempted or running), the scheduler ends it
with `FinishReason.TIMEOUT` ("timeout" in outputs and HTTP bodies) at the start of the first
`schedule()` whose clock reading is at or past the deadline; tokens already generated are kept
and reported. The HTTP `timeout` field is this deadline minus the time the request arrived.
"""

from __future__ import annotations

import heapq

from jserve.core.request import Request, RequestStatus


class DeadlineHeap:
    """Unfinished requests with a deadline, earliest first."""

    def __init__(self) -> None:
        # (deadline, tie-breaker, request); entries of requests that finished stay until popped.
        self._heap: list[tuple[float, int, Request]] = []
        self._num_pushes = 0

    def push(self, request: Request, num_unfinished: int) -> None:
        """Track `request` (no-op without a deadline); `num_unfinished` bounds the live entries."""
        if request.deadline is None:
            return
        self._num_pushes += 1
        heapq.heappush(self._heap, (request.deadline, self._num_pushes, request))
        if len(self._heap) > 2 * num_unfinished + 64:
            # Entries of requests that finished otherwise pile up (and pin them): rebuild every
            # so often, amortised O(1) per push.
            self._heap = [e for e in self._heap if e[2].status is not RequestStatus.FINISHED]
            heapq.heapify(self._heap)

    def pop_expired(self, now: float) -> list[Request]:
        """Unfinished requests whose deadline is at or before `now`, earliest first."""
        heap = self._heap
        expired = []
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if request.status is not RequestStatus.FINISHED:
                expired.append(request)
        return expired
