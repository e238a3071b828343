"""LLMEngine: the one module that joins policy (jserve.core) and mechanism (jserve.runtime).

`step()` reads as a sentence: schedule -> build inputs -> run -> sample -> postprocess.
- schedule: the scheduler alone changes request states, block tables and queues;
- build inputs: reads the plan, writes only the input builder's staging buffers;
- run / sample: changes only the runner's KV pool;
- postprocess: appends tokens (through the scheduler), finishes requests, and updates the
  per-request output states, which are the only thing returned.
"""

from __future__ import annotations

import collections
import gc
import logging
import math
import random
import time
from dataclasses import dataclass

import jax

from jserve.config import CacheConfig, SchedulerConfig
from jserve.core.buckets import make_seq_buckets, make_token_buckets, step_buckets
from jserve.core.plan import StepPlan
from jserve.core.request import FinishReason, Request
from jserve.core.scheduler import Scheduler
from jserve.engine_args import EngineArgs
from jserve.errors import RequestRejected
from jserve.loaders.model_source import LoadedModel, default_cache_dir, load_model
from jserve.output_processor import RequestState
from jserve.outputs import EngineStats, RequestOutput
from jserve.runtime.compilation import compilation_count, enable_persistent_cache
from jserve.runtime.model_runner import ModelRunner, kv_block_bytes
from jserve.runtime.params import make_mesh, place_model, resolve_dtype
from jserve.runtime.sampler import Sampler
from jserve.runtime.sampling_tensors import SamplingRow
from jserve.runtime.step_inputs import StepInputBuilder
from jserve.sampling_params import SamplingParams
from jserve.validation import check_int, check_token_ids

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048
_FINISH_REASONS = {
    FinishReason.STOPPED: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORTED: "abort",
    FinishReason.DEADLINE: "timeout",
    FinishReason.REJECTED: "abort",
}
Prompt = str | list[int] | dict


@dataclass
class _Child:
    """Maps a scheduler Request back to its user request and sample index."""

    state: RequestState
    index: int
    seed: int


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        t0 = time.perf_counter()
        cache_dir = args.cache_dir or default_cache_dir()
        enable_persistent_cache(args.compilation_cache_dir or f"{cache_dir}/xla")
        loaded = loaded or load_model(args.model, cache_dir=cache_dir)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        cfg = self.model_config = loaded.config
        self.vocab_size = cfg.vocab_size
        dtype = resolve_dtype(args.dtype)
        mesh = make_mesh(args.tensor_parallel_size)
        graphdef, state = place_model(cfg, loaded.params, dtype, mesh)

        self.max_model_len = args.max_model_len or min(
            cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
        )
        block_bytes = kv_block_bytes(cfg, args.block_size, dtype)
        num_blocks = args.num_kv_blocks or args.kv_cache_memory // block_bytes
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                long_prompt_threshold=args.long_prompt_threshold,
                max_waiting_requests=args.max_waiting_requests,
                policy=args.scheduling,
                enable_chunked_prefill=args.enable_chunked_prefill,
                enable_prefix_caching=args.enable_prefix_caching,
            ),
            CacheConfig(block_size=args.block_size, num_blocks=num_blocks),
        )
        # Token buckets start at 1 so small decode steps do not pay for 16 tokens.
        self.token_buckets = make_token_buckets(args.max_num_batched_tokens, smallest=1)
        self.seq_buckets = make_seq_buckets(args.max_num_seqs)
        max_blocks_per_seq = math.ceil(self.max_model_len / args.block_size)
        self.builder = StepInputBuilder(
            self.token_buckets, self.seq_buckets, args.block_size, max_blocks_per_seq
        )
        self.runner = ModelRunner(
            cfg, graphdef, state, mesh, num_blocks=num_blocks, block_size=args.block_size,
            dtype=dtype, attn_impl=args.attention_impl,
        )  # fmt: skip
        self._states: dict[str, RequestState] = {}
        self._children: dict[str, _Child] = {}  # scheduler request id -> child
        self._deadlines: dict[str, float] = {}  # request id -> time.monotonic() deadline
        self._rng = random.Random(args.seed)
        # Appended by the step thread, drained by stats() on the server's: a deque is safe.
        self._iteration_tokens: collections.deque[int] = collections.deque()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self.num_restarts = 0
        log.info(
            "model %s: %d KV blocks of %d tokens (%.0f MiB), token buckets %s, seq buckets %s",
            self.model_name, num_blocks, args.block_size,
            num_blocks * block_bytes / 2**20,
            self.token_buckets, self.seq_buckets,
        )  # fmt: skip
        self.precompile()
        # Everything allocated so far lives for the engine's lifetime: keep it out of the
        # collector's full passes, which otherwise stall a step every ~50 at 1,000 requests.
        gc.collect()
        gc.freeze()
        log.info("engine ready in %.1f s", time.perf_counter() - t0)

    # ---- start-up ------------------------------------------------------------------------

    def bucket_pairs(self) -> list[tuple[int, int]]:
        return step_buckets(self.token_buckets, self.seq_buckets)

    def precompile(self) -> None:
        """Compile every bucket now, so serving never compiles (see runtime.compilation)."""
        pairs = self.bucket_pairs()

        def progress(done: int, total: int, seconds: float) -> None:
            log.info("precompiled model step %d/%d (%.1f s)", done, total, seconds)

        before = compilation_count()
        secs = self.runner.precompile(self.builder.example, pairs, progress)
        self.sampler = Sampler(
            self.model_config.vocab_size, sorted({s for _, s in pairs}), self.max_model_len,
            self.tokenizer.stop_token_ids, logits_sharding=self.runner.logits_sharding,
        )  # fmt: skip
        secs += self.sampler.precompile()
        log.info("precompiled %d executables in %.1f s", compilation_count() - before, secs)

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        lane: str = "interactive",
        deadline: float | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises RequestRejected (reason + message) if it cannot be served."""
        params = params or SamplingParams()
        try:
            self.sampler.check(params)
            check_int("n", params.n, 1, self.args.max_n)  # --max-n
            check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)
        except ValueError as e:
            raise RequestRejected("invalid", str(e)) from None
        if request_id in self._states:
            raise RequestRejected("invalid", f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        max_tokens = params.max_tokens or max(1, self.max_model_len - len(ids))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.stop_token_ids
        state = RequestState.create(request_id, text, ids, params, self.tokenizer, arrival)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                child_id, ids, max_tokens=max_tokens, min_tokens=params.min_tokens,
                stop_token_ids=stop_ids, arrival_time=arrival, lane=lane, deadline=deadline,
                group_id=request_id if params.n > 1 else None,
            )  # fmt: skip
            try:
                self.scheduler.add_request(req)
            except RequestRejected:
                for added in children:  # all samples or none
                    self.scheduler.abort(added)
                    self._children.pop(added)
                raise
            children.append(child_id)
            self._children[child_id] = _Child(state, i, (base_seed + 7919 * i) & 0x7FFFFFFF)
        self._states[request_id] = state
        if deadline is not None:
            self._deadlines[request_id] = deadline
        self._num_prompt_tokens += len(ids)

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise RequestRejected("invalid", "a dict prompt needs 'prompt_token_ids'")
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        try:
            return None, check_token_ids("prompt", list(prompt), self.vocab_size)
        except ValueError as e:
            raise RequestRejected("invalid", str(e)) from None

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """End a request in any state (finish reason `reason`); its KV blocks are freed now."""
        state = self._states.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        if state is None:
            return None
        for i in range(len(state.samples)):
            child_id = request_id if len(state.samples) == 1 else f"{request_id}#{i}"
            self.scheduler.abort(child_id)
            self._children.pop(child_id, None)
            state.finish_sample(i, reason)
        return state.to_output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    # ---- one iteration -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of the requests that changed."""
        expired = self._expire_deadlines()
        plan = self.scheduler.schedule()
        changed: dict[str, RequestState] = {}
        for child_id, reason in plan.finished.items():
            self._finish_child(child_id, _FINISH_REASONS[reason], None, changed)
        if not plan.is_empty:
            self._iteration_tokens.append(plan.num_batched_tokens)
            logits = self.runner.run(self.builder.build(plan))
            sampled = self._sample(plan, logits, changed)
            self._postprocess(plan, sampled, changed)
        outputs = expired + [state.to_output() for state in changed.values()]
        for state in changed.values():
            if state.finished:
                self._states.pop(state.request_id, None)
                self._deadlines.pop(state.request_id, None)
        return outputs

    def _expire_deadlines(self) -> list[RequestOutput]:
        """Requests past their deadline, waiting or running, end with reason "timeout"."""
        if not self._deadlines:
            return []
        now = time.monotonic()
        late = [rid for rid, deadline in self._deadlines.items() if now >= deadline]
        return [out for rid in late if (out := self.abort_request(rid, "timeout")) is not None]

    def _sample(
        self, plan: StepPlan, logits: jax.Array, changed: dict
    ) -> dict[str, tuple[int, list | None]]:
        rows = []
        for seq in plan.seqs:
            child = self._children[seq.request_id]
            req = self.scheduler.get_request(seq.request_id)
            rows.append(
                SamplingRow(
                    child.state.params, child.seed, req.prompt_token_ids, req.output_token_ids
                )
            )
        result = self.sampler.sample(logits, rows)
        for i, error in result.failed.items():
            self._fail(plan.seqs[i].request_id, error, changed)
        return {
            seq.request_id: result.row(i)
            for i, seq in enumerate(plan.seqs)
            if seq.sample and i not in result.failed
        }

    def _postprocess(self, plan: StepPlan, sampled: dict, changed: dict) -> None:
        now = time.monotonic()
        for seq in plan.seqs:
            child = self._children.get(seq.request_id)
            if child is None:
                continue  # failed while its step was prepared
            state = child.state
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                req = self.scheduler.get_request(seq.request_id)
                state.num_cached_tokens = req.num_cached_tokens if req else 0
        tokens = {rid: tok for rid, (tok, _) in sampled.items()}
        finished = {r.request_id: r for r in self.scheduler.update_from_output(plan, tokens)}
        self._num_generation_tokens += len(tokens)
        for rid, (token, top) in sampled.items():
            child = self._children.get(rid)
            if child is None:
                continue
            changed[child.state.request_id] = child.state
            try:
                stop_string = child.state.add_token(child.index, token, top)
            except Exception as e:  # detokenizing or a stop check of this request failed
                self._fail(rid, f"{type(e).__name__}: {e}", changed)
                continue
            if rid in finished:
                req = finished[rid]
                reason = _FINISH_REASONS[req.finish_reason]
                stop = token if req.finish_reason is FinishReason.STOPPED else None
                self._finish_child(rid, reason, stop, changed)
            elif stop_string is not None:
                self.scheduler.finish_request(rid, FinishReason.STOPPED)
                self._finish_child(rid, "stop", stop_string, changed)

    def _fail(self, child_id: str, error: str, changed: dict) -> None:
        """End the request owning `child_id` with finish reason "error": a host-side part of
        its step failed. Only this request fails; the rest of the batch goes on."""
        child = self._children.get(child_id)
        if child is None:
            return
        log.error("request %s failed: %s", child.state.request_id, error)
        child.state.error = error
        self.abort_request(child.state.request_id, "error")
        changed[child.state.request_id] = child.state

    def recover(self, error: BaseException) -> list[RequestOutput]:
        """After a step raised: fail every unfinished request with a clear error, re-make the KV
        pool and a fresh scheduler (its prefix cache described the lost pool), count a restart.

        Compiled executables are kept, so the engine serves again at once.
        """
        message = f"the engine step failed ({type(error).__name__}: {error}); engine restarted"
        outputs = []
        for request_id, state in list(self._states.items()):
            state.error = message
            outputs.append(self.abort_request(request_id, "error"))
        cache = CacheConfig(self.args.block_size, self.scheduler.block_manager.num_blocks)
        self.scheduler = Scheduler(self.scheduler.config, cache)
        self.runner.reset_kv_cache()
        self.num_restarts += 1
        return [out for out in outputs if out is not None]

    def _finish_child(self, child_id: str, reason: str, stop, changed: dict) -> None:
        child = self._children.pop(child_id, None)
        if child is None:
            return
        child.state.finish_sample(child.index, reason, stop)
        changed[child.state.request_id] = child.state

    # ---- operators' view -----------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        drained = self._iteration_tokens
        iteration_tokens = [drained.popleft() for _ in range(len(drained))]
        return EngineStats(
            num_requests_running=s.num_running,
            num_requests_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self._num_generation_tokens,
            compilations=compilation_count(),
            num_restarts=self.num_restarts,
            iteration_tokens=iteration_tokens,
        )
