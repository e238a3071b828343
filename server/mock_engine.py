"""A mock EngineClient whose output can be computed by hand, for server tests and demos.

- Tokenizer: one token per character, token id = ord(char); the vocabulary is every code
  point, [0, 0x110000). Decoding gives valid text, as a real tokenizer's does: an id that is
  not a Unicode scalar value (a surrogate, or past U+10FFFF) decodes to U+FFFD.
- Generation: choice j of a request with prompt ids P emits, at step k, token P[(j + k) % len(P)]
  (the prompt repeated, choice j starting j characters in). Sampling settings other than n,
  max_tokens, min_tokens, stop, stop_token_ids, include_stop_str_in_output and logprobs are
  accepted and ignored.
- Stopping: the engine's own rules (jserve.core.stopping: stop ids, max_tokens, stop strings
  ending after the first min_tokens tokens, held-back text, a stop token's text left out unless
  include_stop_str_in_output asks for it); there is no EOS.
- Logprobs: the sampled token has -0.5; with logprobs=k the alternatives are the next k-1 ids
  after it, with -1.5, -2.5, ... Prompt logprobs (prompt_logprobs=k): None for the first
  prompt token; prompt token t has -0.25 and rank 1, and the next k-1 ids after it -1.25,
  -2.25, ... with ranks 2, 3, ...
- Embeddings (`pooling`): `hidden_size` (8) values, value d being the last prompt id plus d
  (last pooling) or the mean of the prompt ids plus d (mean pooling), L2-normalized; one
  output at once, finished, with no tokens.
- A step loop emits one token per running choice every `token_delay` seconds; at most
  `max_num_seqs` requests run, at most `max_waiting` wait (more -> RequestRejected
  "queue_full"); n above `max_n` is refused ("invalid"), as the engine's --max-n does. Fake
  KV usage counts blocks of `block_size` tokens of running requests.
- Tenants are recorded (`tenants`: request id -> tenant) but do not change scheduling;
  `control` reads and changes the settings of a real (idle) jserve.core scheduler, so the
  admin endpoint is tested against the real validation.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jserve.config.scheduler import LANES, CacheConfig, Lane, SchedulerConfig
from jserve.core.control import apply_changes, current_settings
from jserve.core.scheduler import Scheduler
from jserve.core.stopping import StopConditions, StopStringSearch
from jserve.core.tenants import DEFAULT_TENANT, TenantPolicy
from jserve.errors import EngineDeadError, RejectReason, RequestRejected
from jserve.outputs import (
    CompletionOutput,
    EngineState,
    EngineStats,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from jserve.sampling_params import PoolingParams, PoolingType, SamplingParams


def _is_scalar_value(code_point: int) -> bool:
    return 0 <= code_point < 0xD800 or 0xE000 <= code_point < 0x110000


class CharTokenizer:
    """One token per character; the chat template is "role: content" lines, after a
    "name=value" line for each extra template variable (chat_template_kwargs, and a request's
    own chat_template: the mock renders no Jinja)."""

    stop_token_ids: frozenset[int] = frozenset()  # no EOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) if _is_scalar_value(i) else "\ufffd" for i in ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **variables: Any,
    ) -> str:
        if chat_template is not None:  # the mock renders no Jinja: the template is a variable
            variables = {**variables, "chat_template": chat_template}
        text = "".join(f"{name}={value}\n" for name, value in sorted(variables.items()))
        text += "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if continue_final_message:  # the final message's line left open
            return text.removesuffix("\n")
        return text + ("assistant:" if add_generation_prompt else "")


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: StopConditions
    lane: int
    deadline: float | None
    metrics: RequestMetrics
    choices: list[CompletionOutput]
    stop_searches: list[StopStringSearch]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def num_tokens(self) -> int:
        return len(self.prompt_ids) + sum(len(c.token_ids) for c in self.choices)


class MockEngine:
    def __init__(
        self,
        *,
        model_name: str = "mock-model",
        max_model_len: int = 256,
        token_delay: float = 0.005,
        max_num_seqs: int = 64,
        max_waiting: int = 64,
        max_n: int = 64,
        num_kv_blocks: int = 1024,
        block_size: int = 16,
        quantization: str = "none",
        kv_cache_dtype: str = "float32",
    ) -> None:
        self.model_name = model_name
        self.quantization = quantization
        self.kv_cache_dtype = kv_cache_dtype
        self.max_model_len = max_model_len
        self.vocab_size = 0x110000
        self.hidden_size = 8
        self.tokenizer = CharTokenizer()
        self.state = EngineState.READY
        self.dead_reason: str | None = None
        self.num_restarts = 0
        self.token_delay = token_delay
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.max_n = max_n
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.kv_cache_tokens = num_kv_blocks * block_size
        self.tensor_parallel_size = 1
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._stats = EngineStats()
        self._loop_task: asyncio.Task | None = None
        self.tenants: dict[str, str] = {}
        self._settings = Scheduler(  # never steps: it only validates and keeps settings
            SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=256),
            CacheConfig(16, 64),
            TenantPolicy({"gold": 2.0}),
        )

    async def generate(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        request_id: str,
        *,
        lane: Lane = Lane.INTERACTIVE,
        timeout: float | None = None,
        tenant: str = DEFAULT_TENANT,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.tenants[request_id] = tenant
        if self.state is EngineState.DEAD:
            raise EngineDeadError(self.dead_reason)
        if self.state is not EngineState.READY:
            raise RequestRejected(RejectReason.SHUTTING_DOWN, f"the engine is {self.state}")
        if params.n > self.max_n:
            raise RequestRejected(
                RejectReason.INVALID, f"n must be at most {self.max_n}, got {params.n}", param="n"
            )
        if isinstance(prompt, dict):  # the server's form: ids, and a cache salt (no cache here)
            prompt = prompt["prompt_token_ids"]
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = 1 if pooling else params.max_tokens or self.max_model_len - len(ids)
        if max_tokens < 1 or len(ids) + max_tokens > self.max_model_len:
            raise RequestRejected(
                RejectReason.TOO_LONG,
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                f"({self.max_model_len}); shorten the prompt or lower max_tokens",
            )
        if len(self._waiting) >= self.max_waiting:
            raise RequestRejected(
                RejectReason.QUEUE_FULL, f"{len(self._waiting)} requests are waiting; retry later"
            )
        if pooling is not None:
            self._stats.prompt_tokens += len(ids)
            yield self._embedded(request_id, ids, pooling)
            return
        now = time.monotonic()
        stop = StopConditions.from_params(params, (), max_tokens)
        request = _Request(
            request_id, ids, params, stop, LANES.index(lane),
            None if timeout is None else now + timeout, RequestMetrics(arrival_time=now),
            [CompletionOutput(index=j, logprobs=None if params.logprobs is None else [])
             for j in range(params.n)],
            [stop.stop_string_search() for _ in range(params.n)],
            prompt_logprobs=self._prompt_logprobs(ids, params.prompt_logprobs),
        )  # fmt: skip
        self._waiting.append(request)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._step_loop())
        # Deliberately no cleanup when the caller stops iterating early: like KV blocks in a
        # real engine, the request lives on until abort(), so tests catch a server that forgets.
        while True:
            item = await request.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    def _prompt_logprobs(
        self, ids: list[int], k: int | None
    ) -> list[dict[int, Logprob] | None] | None:
        if k is None:
            return None
        decode = self.tokenizer.decode
        return [None] + [
            {t + r: Logprob(-0.25 - r, decode([t + r]), r + 1) for r in range(max(1, k))}
            for t in ids[1:]
        ]

    def _embedded(self, request_id: str, ids: list[int], pooling: PoolingParams) -> RequestOutput:
        last = pooling.pooling_type is PoolingType.LAST
        base = ids[-1] if last else sum(ids) / len(ids)
        vector = [base + d for d in range(self.hidden_size)]
        norm = math.sqrt(sum(v * v for v in vector))
        now = time.monotonic()
        return RequestOutput(
            request_id, None, ids, [CompletionOutput(0, finish_reason=FinishReason.STOP)], True,
            RequestMetrics(now, now, now, now, now), embedding=[v / norm for v in vector],
        )  # fmt: skip

    async def control(self, changes: dict[str, Any]) -> dict[str, Any]:
        if not changes:
            return current_settings(self._settings)
        limits = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": 512}
        return apply_changes(self._settings, changes, limits)

    async def abort(self, request_id: str) -> None:
        for request in self._waiting + self._running:
            if request.request_id == request_id:
                for choice in request.choices:
                    choice.finish_reason = choice.finish_reason or FinishReason.ABORT
                self._emit(request)

    def stats(self) -> EngineStats:
        snapshot = EngineStats(**{**vars(self._stats), "iteration_tokens": []})
        snapshot.iteration_tokens, self._stats.iteration_tokens = self._stats.iteration_tokens, []
        snapshot.num_requests_running = len(self._running)
        snapshot.num_requests_waiting = len(self._waiting)
        used = sum(math.ceil(r.num_tokens() / self.block_size) for r in self._running)
        snapshot.kv_cache_usage = min(1.0, used / self.num_kv_blocks)
        return snapshot

    async def shutdown(self) -> None:
        self.state = EngineState.STOPPING
        for request in self._waiting + self._running:
            await self.abort(request.request_id)
        if self._loop_task is not None:
            self._loop_task.cancel()

    def kill(self, reason: str) -> None:
        """Simulate a crashed step loop: every in-flight request fails with EngineDeadError."""
        self.state, self.dead_reason = EngineState.DEAD, reason
        for request in self._waiting + self._running:
            request.queue.put_nowait(EngineDeadError(reason))
            self._forget(request)

    def _forget(self, request: _Request) -> None:
        request.done = True
        for queue in (self._waiting, self._running):
            if request in queue:
                queue.remove(request)

    async def _step_loop(self) -> None:
        while self._waiting or self._running:
            await asyncio.sleep(self.token_delay)
            self._step()

    def _step(self) -> None:
        now = time.monotonic()
        scheduled = 0
        for request in self._waiting + self._running:
            if request.deadline is not None and now >= request.deadline:
                for choice in request.choices:
                    choice.finish_reason = choice.finish_reason or FinishReason.TIMEOUT
                self._emit(request)
        self._waiting.sort(key=lambda r: r.lane)  # stable: FIFO within a lane
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting.pop(0)
            request.metrics.first_scheduled_time = now
            self._running.append(request)
            self._stats.prompt_tokens += len(request.prompt_ids)
            scheduled += len(request.prompt_ids)
        for request in list(self._running):
            for choice in request.choices:
                if not choice.finished:
                    self._append_token(request, choice)
                    scheduled += 1
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            self._emit(request)
        self._stats.iteration_tokens.append(scheduled)

    def _append_token(self, request: _Request, choice: CompletionOutput) -> None:
        ids, params = request.prompt_ids, request.params
        token = ids[(choice.index + len(choice.token_ids)) % len(ids)]
        choice.token_ids.append(token)
        self._stats.generation_tokens += 1
        if choice.logprobs is not None:
            width = max(1, params.logprobs or 0)
            choice.logprobs.append(
                {
                    token + r: Logprob(-0.5 - r, self.tokenizer.decode([token + r]))
                    for r in range(width)
                }
            )
        num_tokens = len(choice.token_ids)
        include_stop = params.include_stop_str_in_output
        by_token = request.stop.after_token(token, num_tokens)
        if by_token is FinishReason.STOP and not include_stop:  # a stop token adds no text
            full_text, end, stop_string = self.tokenizer.decode(choice.token_ids[:-1]), 0, None
        else:
            full_text = self.tokenizer.decode(choice.token_ids)
            check = request.stop_searches[choice.index].add_text(chr(token), num_tokens)
            end, stop_string = check.end, check.stop
        decision = request.stop.decide(token, by_token, stop_string, False)
        if decision is None:  # the rest may begin a stop string
            choice.text = full_text[:end]
        elif isinstance(decision.stop_reason, str):  # cut at the stop string, as the engine
            choice.text = full_text[: end + (len(decision.stop_reason) if include_stop else 0)]
        else:  # ended by a token: nothing is held back
            choice.text = full_text
        if decision is not None:
            choice.finish_reason, choice.stop_reason = decision.reason, decision.stop_reason

    def _emit(self, request: _Request) -> None:
        finished = all(c.finished for c in request.choices)
        if finished:
            request.metrics.finished_time = time.monotonic()
            self._forget(request)
        choices = [
            CompletionOutput(
                c.index, c.text, list(c.token_ids),
                None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason,
            )
            for c in request.choices
        ]  # fmt: skip
        metrics = RequestMetrics(**vars(request.metrics))
        request.queue.put_nowait(
            RequestOutput(request.request_id, None, list(request.prompt_ids), choices, finished,
                          metrics, prompt_logprobs=request.prompt_logprobs)
        )  # fmt: skip
