"""Start-up progress: each phase of warm-up (compiling the model step, compiling the sampler,
timing the step buckets) logs every shape it finishes with the phase's name, the shapes done
of the total and the seconds so far. One shape can take long on a slow or busy machine, so
while it runs a line is also logged every HEARTBEAT_SECONDS: start-up is never silent longer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import TypeVar

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10.0
T = TypeVar("T")


class StartupPhase:
    """`with StartupPhase("sampler", total) as phase: for x in phase.each(xs, describe): ...`
    logs "sampler: 3/5 (seqs=8) in 1.2 s" after each item; `seconds` is the phase's time."""

    def __init__(self, name: str, total: int, heartbeat: float = HEARTBEAT_SECONDS) -> None:
        self.name, self.total, self.heartbeat = name, total, heartbeat
        self.done = 0
        self._shape = ""  # what is being worked on now
        self._start = self._shape_start = self._last_line = time.perf_counter()
        self._stopped = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="jserve-startup-log", daemon=True)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start

    def __enter__(self) -> StartupPhase:
        self._start = self._last_line = time.perf_counter()
        self._beats.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stopped.set()
        self._beats.join()

    def each(self, items: Sequence[T], describe: Callable[[T], str]) -> Iterator[T]:
        """Yield `items`, logging each one's end (its shape as `describe` names it)."""
        for item in items:
            self._shape, self._shape_start = describe(item), time.perf_counter()
            yield item
            self.done += 1
            self._line("%s: %d/%d (%s) in %.1f s", self.done, self.total, self._shape)

    def _line(self, message: str, *args: object) -> None:
        self._last_line = time.perf_counter()
        log.info(message, self.name, *args, self.seconds)

    def _beat(self) -> None:
        while not self._stopped.wait(self._last_line + self.heartbeat - time.perf_counter()):
            if time.perf_counter() - self._last_line >= self.heartbeat:
                into = time.perf_counter() - self._shape_start
                self._line(
                    "%s: still on %d/%d (%s), %.1f s into it; %.1f s in all",
                    self.done + 1, self.total, self._shape, into,
                )  # fmt: skip


def describe_bucket(pair: tuple[int, int]) -> str:
    """A (tokens, seqs) step bucket as the progress lines name it."""
    return f"tokens={pair[0]} seqs={pair[1]}"
