"""AsyncLLMEngine: the asyncio front of LLMEngine, for the server.

How a request flows (two threads, two kinds of queue):
1. `generate()` runs on the event loop. It makes an asyncio.Queue for the request, registers
   it, awaits the request's grammar if it has an output constraint (compiled in the grammar
   pool, jserve.structured.grammar: the step thread never compiles one, and a constraint that
   cannot be served is refused here with RequestRejected "invalid"), then puts an "add"
   command carrying it in the inbox (a thread-safe deque) and wakes the step thread.
2. The step thread (one, started by `start()`) loops: it drains the inbox (adds, aborts) into
   the LLMEngine, runs `engine.step()` while there is work (a step also ends requests past
   their deadline: jserve.core.deadlines), and hands each RequestOutput to its request's
   asyncio.Queue with `loop.call_soon_threadsafe`.
   JAX releases the GIL while a step computes, so the event loop stays responsive. With no
   work it sleeps on a condition variable until the next command. With async scheduling one
   step stays in flight between loop turns (LLMEngine._step_async): commands are applied
   while it runs, and the loop keeps stepping until it has been sampled.
3. `generate()` awaits its queue and yields outputs. Outputs are cumulative, so when several
   are queued it skips to the newest one: a slow reader never falls behind the engine.
4. A rejected add (RequestRejected) or a dead engine (EngineDeadError) arrives in the queue as
   an exception and is raised from `generate()`.
5. Abort (client gone, or the consumer stops iterating): an "abort" command frees the request's
   KV blocks at the next loop turn, at most one step later.
6. A request whose own host-side work fails (adding it, building its sampling row,
   detokenizing) fails alone: its output ends with finish_reason "error" and `error` set.
7. A command that raises while the step thread applies it (an add, an abort, a scheduler
   control) is reported to its caller where it has one and logged; it never ends the loop.
8. If a step itself raises (the device step), the engine restarts in-process
   (`LLMEngine.recover`): the requests in flight end with an error output, the KV pool is
   re-made, the compiled executables are kept, and serving goes on. After
   MAX_FAILED_STEPS_IN_A_ROW failed steps with no good one between, or if recovering raises,
   the engine is dead: `state` becomes "dead", every in-flight request gets EngineDeadError,
   and new requests are refused with it. Nothing hangs.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Any

import llguidance

from jserve.config.engine_args import EngineArgs
from jserve.config.scheduler import Lane
from jserve.config.validation import show
from jserve.core.tenants import DEFAULT_TENANT
from jserve.engine.llm_engine import LLMEngine, Prompt
from jserve.errors import EngineDeadError, RejectReason, RequestRejected, invalid_param
from jserve.outputs import EngineState, EngineStats, RequestOutput
from jserve.sampling_params import PoolingParams, SamplingParams

log = logging.getLogger(__name__)

# Restarts allowed without a good step in between; past that the engine is dead, and the server
# exits non-zero so a supervisor can restart the process.
MAX_FAILED_STEPS_IN_A_ROW = 3


class _Command(StrEnum):
    """What the event loop asks of the step thread, through its inbox."""

    ADD = "add"
    ABORT = "abort"
    CONTROL = "control"


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.quantization = engine.quantization
        self.kv_cache_dtype = engine.kv_cache_dtype
        self.num_kv_blocks = engine.scheduler.cache_config.num_blocks
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.hidden_size = engine.model_config.hidden_size
        self.tokenizer = engine.tokenizer
        self.max_num_seqs = engine.scheduler.config.max_num_seqs
        self.block_size = engine.args.block_size
        self.kv_cache_tokens = engine.scheduler.num_usable_blocks * self.block_size
        self.tensor_parallel_size = engine.args.tensor_parallel_size
        self.state = EngineState.READY
        self.dead_reason: str | None = None
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._inbox: collections.deque[tuple[_Command, Any]] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jserve-step-loop", daemon=True)
        self._thread.start()

    @classmethod
    async def start(cls, args: EngineArgs) -> AsyncLLMEngine:
        """Load and precompile off the event loop, then start the step thread."""
        engine = await asyncio.to_thread(LLMEngine, args)
        return cls(engine)

    # ---- the server's interface ----------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        *,
        lane: Lane | str = Lane.INTERACTIVE,
        timeout: float | None = None,
        tenant: str = DEFAULT_TENANT,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self.state is not EngineState.READY:
            raise EngineDeadError(self.dead_reason or f"engine is {self.state}")
        # Not the uniqueness rule (the engine owns that): outputs are routed by id, so a second
        # stream under a live id would take the first one's outputs before the engine, a
        # thread hop later, could refuse it.
        if request_id in self._queues:
            raise RequestRejected(
                RejectReason.INVALID, f"request id {request_id!r} is already in use"
            )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, queue)
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = added = False
        try:
            grammar = await self._compile_grammar(params)
            add = (request_id, prompt, params, lane, deadline, tenant, grammar, pooling)
            self._send(_Command.ADD, add)
            added = True
            while not finished:
                item = await queue.get()
                while not queue.empty() and not isinstance(item, BaseException):
                    item = queue.get_nowait()  # cumulative outputs: the newest says it all
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if added and not finished:
                self._send(_Command.ABORT, request_id)

    async def _compile_grammar(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """The request's output constraint, compiled in the grammar pool (never on the step
        thread); a constraint that cannot be served is refused here, before it is queued."""
        if params.structured_outputs is None:
            return None
        future = self.engine.structured.grammars.submit(params.structured_outputs)
        with invalid_param("structured_outputs"):  # a GrammarError, or llguidance refusing it
            return await asyncio.wrap_future(future)

    async def abort(self, request_id: str) -> None:
        self._send(_Command.ABORT, request_id)

    async def control(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Read (no changes) or change scheduler settings, between steps on the step thread;
        raises InvalidSetting naming the field that is wrong (then nothing changed)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._send(_Command.CONTROL, (changes, loop, future))
        return await future

    @property
    def num_restarts(self) -> int:
        return self.engine.num_restarts

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.to_thread(self._thread.join)
        self.engine.close()
        if self.state is EngineState.READY:
            self.state = EngineState.STOPPING

    # ---- the step thread -----------------------------------------------------------------

    def _send(self, kind: _Command, payload: Any) -> None:
        with self._wake:
            self._inbox.append((kind, payload))
            self._wake.notify()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._queues.get(request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _drain_inbox(self) -> None:
        engine = self.engine
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind is _Command.ABORT:
                out = engine.abort_request(payload)
                if out is not None:
                    self._deliver(payload, out)
                continue
            if kind is _Command.CONTROL:
                self._control(*payload)
                continue
            request_id, prompt, params, lane, deadline, tenant, grammar, pooling = payload
            try:
                engine.add_request(
                    request_id, prompt, params, lane=lane, deadline=deadline, tenant=tenant,
                    grammar=grammar, pooling=pooling,
                )  # fmt: skip
            except Exception as e:  # a bad request fails alone, never the step loop
                if isinstance(e, ValueError) and not isinstance(e, RequestRejected):
                    e = RequestRejected(RejectReason.INVALID, str(e))
                elif not isinstance(e, RequestRejected):
                    log.exception("adding request %s failed", request_id)
                    engine.abort_request(request_id)
                self._deliver(request_id, e)

    def _control(
        self, changes: dict[str, Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future
    ) -> None:
        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():
                return  # the caller went away
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        try:
            result = self.engine.control(changes) if changes else self.engine.scheduler_settings()
        except Exception as exc:  # the caller gets it; the step loop goes on
            if not isinstance(exc, ValueError):
                log.exception("applying the scheduler control %s failed", show(changes))
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    def _run(self) -> None:
        engine = self.engine
        failures_in_a_row = 0
        try:
            while True:
                with self._wake:
                    while not self._inbox and not engine.has_unfinished_requests():
                        if self._stopping:
                            return
                        self._wake.wait()
                    if self._stopping and not engine.has_unfinished_requests():
                        return
                while self._inbox:  # a command that raises is consumed and logged, never fatal
                    try:
                        self._drain_inbox()
                    except Exception:
                        log.exception("an engine command failed; the step loop goes on")
                try:
                    outputs = engine.step()
                    failures_in_a_row = 0
                except Exception as e:
                    failures_in_a_row += 1
                    if failures_in_a_row > MAX_FAILED_STEPS_IN_A_ROW:
                        raise
                    log.exception("engine step failed; restarting the engine in-process")
                    outputs = engine.recover(e)
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as e:  # a dead engine must fail its requests, never hang them
            log.exception("engine step loop failed for good; failing all in-flight requests")
            self.state = EngineState.DEAD
            self.dead_reason = f"{type(e).__name__}: {e}"
            error = EngineDeadError(self.dead_reason)
            for request_id in list(self._queues):
                self._deliver(request_id, error)
