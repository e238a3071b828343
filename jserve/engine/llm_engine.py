"""LLMEngine: the step loop that joins policy (jserve.core) and mechanism (jserve.runtime).

Its parts are built by jserve.engine.setup; this module holds the loop and the bookkeeping of
requests (user request -> `n` scheduler requests, seeds, output states).

`step()` reads as a sentence: schedule -> build inputs -> run -> sample -> postprocess.
- schedule: the scheduler alone changes request states, block tables and queues;
- build inputs: reads the plan, writes only the input builder's staging buffers;
- run / sample: changes only the runner's KV pool;
- postprocess: appends tokens (through the scheduler), finishes requests (the rules:
  jserve.core.stopping), and updates the per-request output states, which are the only thing
  returned.

With async scheduling (`EngineArgs.async_scheduling`) one step is in flight between calls, and
a call reads: schedule N+1 -> build its inputs (both while N runs on the device) -> sample N ->
write N's tokens into N+1's inputs -> run N+1 -> postprocess N (while N+1 runs). See
`_step_async` and docs/scheduling.md.
"""

from __future__ import annotations

import collections
import gc
import json
import logging
import random
import time
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import llguidance
import numpy as np

from jserve.config.engine_args import EngineArgs
from jserve.config.scheduler import Lane
from jserve.config.validation import check_int, check_token_ids, show
from jserve.core.bad_words import NO_BAD_WORDS, BadWords
from jserve.core.control import apply_changes, current_settings
from jserve.core.plan import PLACEHOLDER_TOKEN, ScheduledSeq, StepPlan
from jserve.core.request import Request
from jserve.core.step_costs import learned_report
from jserve.core.stopping import StopConditions
from jserve.core.tenants import DEFAULT_TENANT
from jserve.engine.output_processor import RequestState
from jserve.engine.setup import build_engine_parts, measure_step_costs
from jserve.engine.spec_decode import SpecDecodeCounters, may_speculate, num_accepted
from jserve.engine.step_observer import ModelStep, StepObserver
from jserve.errors import RejectReason, RequestRejected, invalid_param
from jserve.kv_events.publisher import ZmqEventPublisher
from jserve.kv_events.records import AllBlocksCleared
from jserve.loaders.model_source import LoadedModel
from jserve.outputs import EngineStats, FinishReason, RequestOutput
from jserve.runtime.compilation import (
    cache_hit_count,
    compilation_count,
    expect_compilation,
    mark_serving,
    serving_compilation_count,
)
from jserve.runtime.model_runner import StepOutput
from jserve.runtime.sampler import NEUTRAL_ROW, SampledTokens
from jserve.runtime.sampling_tensors import SamplingRow, token_bitmask
from jserve.runtime.step_inputs import StepInputBuilder, StepInputs
from jserve.sampling_params import PoolingParams, SamplingParams, truncate_prompt
from jserve.structured.decoding import SequenceMatcher, StructuredDecoding

log = logging.getLogger(__name__)

# A prompt: its text, its token ids, or vLLM's dict ({"prompt": text} or {"prompt_token_ids":
# ids}, with an optional "cache_salt": jserve.core.prefix_cache).
Prompt = str | list[int] | dict
# An embedding request's sampling: its one sampled token (from its last prompt row) ends it
# and is dropped; the embedding is its output.
_POOLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def child_ids(request_id: str, n: int) -> list[str]:
    """Scheduler ids of a request's `n` samples. Always suffixed, so distinct (request id,
    index) pairs give distinct ids: the engine's one check of its users' ids covers them."""
    return [f"{request_id}#{i}" for i in range(n)]


@dataclass
class _Child:
    """Maps a scheduler Request back to its user request and sample index."""

    state: RequestState
    index: int
    seed: int
    matcher: SequenceMatcher | None = None  # its grammar state, if the request is constrained
    allowed: np.ndarray | None = None  # the packed mask of its allowed_token_ids, if it has any
    bad_words: BadWords = NO_BAD_WORDS  # its bad_words as token sequences


@dataclass
class _InFlight:
    """A dispatched step whose tokens have not reached the host yet (async scheduling)."""

    plan: StepPlan
    output: StepOutput
    started: float  # time.perf_counter() at its dispatch
    builder: StepInputBuilder  # whose buffers its inputs are views of


def _sampling_rows(
    seq: ScheduledSeq, child: _Child, allowed_tokens: np.ndarray | None
) -> list[SamplingRow]:
    """The sampler's rows of one seq: one; for a decode with drafts one per draft plus
    one, each with the drafts before it in its output (penalties, min_tokens see them); for
    an `every_row` chunk its prompt rows (`_prompt_rows`), then the sampled one if it ends
    the prompt. `allowed_tokens` (a grammar's mask, or the fixed one of allowed_token_ids:
    never both) applies to every row that samples."""
    params, prompt, output = child.state.params, seq.prompt_token_ids, seq.output_token_ids
    if seq.every_row:
        rows = _prompt_rows(seq, child)
        if seq.sample:
            banned = _banned_ids(child, output)
            rows.append(SamplingRow(params, child.seed, prompt, output, banned, allowed_tokens))
        return rows
    if not seq.num_drafts:
        banned = _banned_ids(child, output)
        return [SamplingRow(params, child.seed, prompt, output, banned, allowed_tokens)]
    drafts = seq.token_ids[1:]
    histories = [output, *(output + drafts[:j] for j in range(1, seq.num_drafts + 1))]
    return [
        SamplingRow(params, child.seed, prompt, h, _banned_ids(child, h), allowed_tokens)
        for h in histories
    ]


def _banned_ids(child: _Child, output: Sequence[int]) -> Sequence[int]:
    """Ids the token after `output` must not be: min_tokens' stop ids, then bad words'."""
    banned = child.state.stop.banned_ids(len(output))
    if not child.bad_words.sequences:  # most requests: no list to build for every row
        return banned
    return [*banned, *child.bad_words.banned(output)]


def _prompt_rows(seq: ScheduledSeq, child: _Child) -> list[SamplingRow]:
    """An `every_row` chunk's rows before its sampled one: with prompt logprobs, each scores
    the prompt's next token (the sampler's forced token); otherwise (mean pooling) neutral."""
    num = len(seq.token_ids) - seq.sample
    params = child.state.prompt_row_params
    if params is None:
        return [NEUTRAL_ROW] * num
    prompt, start = seq.prompt_token_ids, seq.start_pos
    return [SamplingRow(params, 0, (), (), forced_token=prompt[start + j + 1]) for j in range(num)]


class LLMEngine:
    @expect_compilation()  # building an engine compiles; serving with it must not
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        """Build the parts (jserve.engine.setup), then compile every step shape."""
        t0 = time.perf_counter()
        self.args = args
        parts = build_engine_parts(args, loaded)
        self.model_name = parts.model_name
        self.quantization = parts.quantization
        self.kv_cache_dtype = parts.kv_cache_dtype
        self.tokenizer = parts.tokenizer
        self.model_config = parts.model_config
        self.vocab_size = parts.model_config.vocab_size
        self.max_model_len = parts.max_model_len
        self.scheduler = parts.scheduler
        self.inputs_builder = parts.inputs_builder
        self.async_scheduling = args.async_scheduling
        # Async scheduling: the step dispatched by the last call, not yet sampled, and the
        # second builder the next step's inputs go to while that one's are read.
        self._in_flight: _InFlight | None = None
        self._spare_builder = self.inputs_builder.twin()
        self.runner = parts.runner
        self.sampler = parts.sampler
        self._bucket_pairs = parts.bucket_pairs
        self.structured = StructuredDecoding(
            self.tokenizer, self.vocab_size, max(s for _, s in self._bucket_pairs)
        )
        self._states: dict[str, RequestState] = {}
        self._children: dict[str, _Child] = {}  # scheduler request id -> child
        self._rng = random.Random(args.seed)
        # Appended by the step thread, drained by stats() on the server's: a deque is safe.
        self._iteration_tokens: collections.deque[int] = collections.deque()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self.num_restarts = 0  # in-process restarts after a failed step (LLMEngine.recover)
        self.spec_decode = SpecDecodeCounters()
        # When the last model step's tokens reached the host, while requests keep running
        # (None when the engine may go idle): the time to the next step is part of every
        # running decode's inter-token latency, which target_itl_ms prices.
        self._last_step_end: float | None = None
        self._kv_events: ZmqEventPublisher | None = None
        self._step_observers: list[tuple[StepObserver, bool]] = []  # (observer, runner_time)
        if args.kv_events_endpoint:
            self._kv_events = ZmqEventPublisher(
                args.kv_events_endpoint, args.kv_events_replay_endpoint
            )
            self.scheduler.record_kv_events()
        self.precompile()
        measure_step_costs(self.scheduler, self.runner, self.inputs_builder, self._bucket_pairs)
        # Everything allocated so far lives for the engine's lifetime: keep it out of the
        # collector's full passes, which otherwise stall a step every ~50 at 1,000 requests.
        gc.collect()
        gc.freeze()
        log.info("engine ready in %.1f s", time.perf_counter() - t0)

    # ---- start-up ------------------------------------------------------------------------

    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) step shape, each precompiled."""
        return list(self._bucket_pairs)

    def precompile(self) -> None:
        """Compile every bucket now, so serving never compiles (see runtime.compilation); each
        phase logs its progress (runtime.startup)."""

        before, loaded = compilation_count(), cache_hit_count()
        secs = self.runner.precompile(self.inputs_builder.example, self._bucket_pairs)
        secs += self.sampler.precompile(self.runner.logits_sharding)
        log.info(
            "precompiled %d executables in %.1f s (%d loaded from the compilation cache)",
            compilation_count() - before, secs, cache_hit_count() - loaded,
        )  # fmt: skip
        mark_serving()

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        lane: Lane | str = Lane.INTERACTIVE,
        deadline: float | None = None,
        arrival_time: float | None = None,
        tenant: str = DEFAULT_TENANT,
        grammar: llguidance.LLMatcher | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a request; raises RequestRejected (reason + message) if it cannot be served.

        `deadline` (time.monotonic() clock) ends it with "timeout": see jserve.core.deadlines;
        a deadline the scheduler estimates it cannot meet is refused ("deadline"). `tenant`
        is who it is served for (jserve.core.fairness). `grammar` is the request's output
        constraint already compiled (`self.structured.grammars.submit`, off this thread);
        without it a constrained request's grammar is compiled here, through the same cache.
        With `pooling` it is an embedding request: `params` are not used, its prompt is
        prefilled and pooled (jserve.engine.pooling), and its output's `embedding` is set.
        The params' (or the pooling's) `truncate_prompt_tokens` cuts the prompt's ids first.
        """
        params = _POOLING_PARAMS if pooling is not None else params or SamplingParams()
        if request_id in self._states:
            raise RequestRejected(
                RejectReason.INVALID,
                f"request id {request_id!r} is already in use; use a unique id",
            )
        text, ids, salt = self.prompt_ids(prompt, (pooling or params).truncate_prompt_tokens)
        stop = self._stop_conditions(params, len(ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        matchers, (allowed, bad) = self._matchers(params, grammar), self._token_rules(params, stop)
        state = RequestState.create(
            request_id, text, ids, params, stop, self.tokenizer, arrival, pooling
        )
        self._check_prompt_rows(state)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        speculate = may_speculate(params) and pooling is None  # its rows are its prompt's
        children = []
        for i, child_id in enumerate(child_ids(request_id, params.n)):
            req = Request(
                child_id, ids, stop=stop, arrival_time=arrival, lane=lane, deadline=deadline,
                group_id=request_id if params.n > 1 else None, tenant=tenant,
                can_speculate=speculate, prompt_rows=state.wants_prompt_rows, cache_salt=salt,
            )  # fmt: skip
            try:
                self.scheduler.add_request(req, now=arrival)
            except RequestRejected:
                for added in children:  # all samples or none
                    self.scheduler.abort(added)
                    self._children.pop(added)
                raise
            children.append(child_id)
            seed = (base_seed + 7919 * i) & 0x7FFFFFFF
            self._children[child_id] = _Child(state, i, seed, matchers[i], allowed, bad)
        self._states[request_id] = state
        self._num_prompt_tokens += len(ids)

    def _stop_conditions(self, params: SamplingParams, num_prompt_tokens: int) -> StopConditions:
        """The request's stop rules, its params checked against this engine."""
        max_tokens = params.max_tokens or max(1, self.max_model_len - num_prompt_tokens)
        with invalid_param("n"):
            check_int("n", params.n, 1, self.args.max_n)  # --max-n
        with invalid_param("stop_token_ids"):
            check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)
            stop = StopConditions.from_params(params, self.tokenizer.stop_token_ids, max_tokens)
            self.sampler.check_banned_ids(stop.banned_ids(0))
        return stop

    def _token_rules(
        self, params: SamplingParams, stop: StopConditions
    ) -> tuple[np.ndarray | None, BadWords]:
        """What every row the request samples applies: the packed mask of its allowed_token_ids
        (each checked against the vocabulary, as logit_bias's ids are; None without them), and
        its bad words, whose bans must fit the sampler's beside min_tokens' (checked here, at
        admission)."""
        allowed = None
        if params.allowed_token_ids is not None:
            with invalid_param("allowed_token_ids"):
                ids = check_token_ids(
                    "allowed_token_ids", params.allowed_token_ids, self.vocab_size
                )
            allowed = token_bitmask(ids, self.vocab_size)
        outside = sorted(t for t in params.logit_bias or () if t >= self.vocab_size)
        if outside:
            raise RequestRejected(
                RejectReason.INVALID,
                f"logit_bias has token ids outside the vocabulary [0, {self.vocab_size}): "
                f"{show(outside)}",
                param="logit_bias",
            )
        bad = BadWords.from_words(
            params.bad_words or (),
            lambda word: self.tokenizer.encode(word, add_special_tokens=False),
        )
        room = self.sampler.builder.max_banned_ids - len(stop.banned_ids(0))
        if len(bad.sequences) > room:
            raise RequestRejected(
                RejectReason.INVALID,
                f"bad_words make {len(bad.sequences)} token sequences to ban; the sampler has "
                f"room for {room} beside min_tokens' bans: send fewer words",
                param="bad_words",
            )
        return allowed, bad

    def _check_prompt_rows(self, state: RequestState) -> None:
        """A request with a row at every prompt position (prompt logprobs, mean pooling)
        takes at most max_num_seqs rows a step: without chunked prefill, its whole prompt
        must fit in them."""
        num, config = len(state.prompt_token_ids), self.scheduler.config
        chunked = config.enable_chunked_prefill
        if state.wants_prompt_rows and not chunked and num > config.max_num_seqs:
            raise RequestRejected(
                RejectReason.INVALID,
                f"prompt_logprobs and mean pooling compute a row of logits per prompt "
                f"token, at most max_num_seqs ({config.max_num_seqs}) a step; this "
                f"prompt has {num} tokens: enable chunked prefill or send a shorter one",
            )

    def _matchers(
        self, params: SamplingParams, grammar: llguidance.LLMatcher | None
    ) -> list[SequenceMatcher | None]:
        """One grammar matcher per sample of a constrained request (compiled once, cached)."""
        if params.structured_outputs is None:
            return [None] * params.n
        with invalid_param("structured_outputs"):  # a GrammarError is a ValueError
            template = (
                grammar
                if grammar is not None
                else self.structured.grammars.template(params.structured_outputs)
            )
        return [self.structured.new_matcher(template) for _ in range(params.n)]

    def prompt_ids(
        self, prompt: Prompt, keep: int | None = None
    ) -> tuple[str | None, list[int], str | None]:
        """(text, ids, cache salt) of a prompt: its text, its token ids, or vLLM's dict of
        either ("prompt" or "prompt_token_ids") with an optional "cache_salt"; the ids cut to
        the last `keep` (truncate_prompt_tokens), the text left as given (as vLLM leaves it)."""
        given, salt = self._prompt_dict(prompt) if isinstance(prompt, dict) else (prompt, None)
        if isinstance(given, str):
            text, ids = given, self.tokenizer.encode(given)
        else:
            with invalid_param("prompt"):
                text, ids = None, check_token_ids("prompt", list(given), self.vocab_size)
        with invalid_param("truncate_prompt_tokens"):
            return text, truncate_prompt(ids, keep, self.max_model_len), salt

    @staticmethod
    def _prompt_dict(prompt: dict) -> tuple[str | list[int], str | None]:
        """(text or token ids, cache salt) of vLLM's dict prompt."""
        forms = [key for key in ("prompt", "prompt_token_ids") if key in prompt]
        if len(forms) != 1:
            raise RequestRejected(
                RejectReason.INVALID,
                "a dict prompt needs exactly one of 'prompt' and 'prompt_token_ids'",
                param="prompt",
            )
        salt = prompt.get("cache_salt")
        if salt is not None and not (isinstance(salt, str) and salt):
            raise RequestRejected(
                RejectReason.INVALID, "cache_salt must be a non-empty string", param="cache_salt"
            )
        return prompt[forms[0]], salt

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput | None:
        """End a request in any state (finish reason `reason`); its KV blocks are freed now."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        for i, child_id in enumerate(child_ids(request_id, len(state.samples))):
            self.scheduler.finish_request(child_id, reason)
            self._children.pop(child_id, None)
            state.finish_sample(i, reason)
        return state.to_output()

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work: requests, or a step in flight (async scheduling) whose
        rows all belong to requests that ended while it ran."""
        return bool(self._states) or self._in_flight is not None

    # ---- one iteration -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of the requests that changed."""
        changed: dict[str, RequestState] = {}
        if self.async_scheduling or self._in_flight is not None:
            self._step_async(changed)
        else:
            plan = self._schedule(changed)
            if not plan.is_empty:
                started = self._dispatching()
                output = self._run(plan, self.inputs_builder.build(plan))
                sampled = self._sample(plan, output, changed)
                self._sampled(plan, started)
                self._postprocess(plan, sampled, changed)
        outputs = [state.to_output() for state in changed.values()]
        for state in changed.values():
            if state.finished:
                self._states.pop(state.request_id, None)
        if not self._states:
            self._last_step_end = None
        return outputs

    def _step_async(self, changed: dict) -> None:
        """One call with async scheduling: plan and build step N+1 while step N, dispatched by
        the previous call, runs; wait for N's tokens; write them over N+1's placeholder inputs
        and dispatch N+1; then postprocess N (detokenize, stops, outputs) while N+1 runs, and
        the next call fills N+1's grammar masks while it still does.

        The inputs are staged on the host rather than gathered on the device from N's sampled
        array: the host needs N's tokens before N+1's sampling anyway (stops, grammar masks,
        the seeds' step), the patch is one write per decode, and the compiled steps keep their
        inputs. A request N finished wastes its row of N+1 (its logits are not sampled); its
        blocks may be handed out by the plan of N+2 at once, since steps run in order on the
        device, each taking the KV pool the one before returned.
        """
        # Switched off with a step in flight: finish that one, dispatch nothing.
        plan = self._schedule(changed) if self.async_scheduling else StepPlan()
        previous, self._in_flight = self._in_flight, None
        inputs = builder = None
        if not plan.is_empty:
            busy = previous.builder if previous is not None else None
            builder = self._spare_builder if busy is self.inputs_builder else self.inputs_builder
            inputs = builder.build(plan)
        sampled: dict[str, list[tuple[int, list | None]]] = {}
        if previous is not None:
            sampled = self._sample(previous.plan, previous.output, changed)
            self._sampled(previous.plan, previous.started)
        if inputs is not None and builder is not None:
            _write_pending_tokens(plan, inputs, sampled)
            started = self._dispatching()
            self._in_flight = _InFlight(plan, self._run(plan, inputs), started, builder)
        if previous is not None:
            self._postprocess(previous.plan, sampled, changed)

    def _schedule(self, changed: dict) -> StepPlan:
        """The scheduler's next plan; ends the requests it ended (deadline expiry)."""
        plan = self.scheduler.schedule()
        if self._kv_events is not None:  # planning stored and evicted blocks; nothing else does
            self._kv_events.publish(self.scheduler.take_kv_events())
        for child_id, reason in plan.finished.items():
            self._finish_child(child_id, reason, None, changed)
        if not plan.is_empty:
            self._iteration_tokens.append(plan.num_batched_tokens)
        return plan

    def _dispatching(self) -> float:
        """The time a step is dispatched; the host's time since the last step's tokens
        arrived is part of every running decode's inter-token latency."""
        started = time.perf_counter()
        if self._last_step_end is not None:
            self.scheduler.step_costs.observe_between_steps(started - self._last_step_end)
        return started

    def _sampled(self, plan: StepPlan, started: float) -> None:
        """The sampler brought `plan`'s tokens to the host: its device work is done."""
        self._last_step_end = time.perf_counter()
        # A draft's (or prompt token's) row of logits counts as a sequence: the step ran in
        # that bucket.
        self.scheduler.step_costs.observe(
            plan.num_batched_tokens, plan.num_rows, self._last_step_end - started
        )

    def _run(self, plan: StepPlan, inputs: StepInputs) -> StepOutput:
        if self._step_observers:
            return self._run_observed(plan, inputs)
        return self.runner.run(inputs)

    def add_step_observer(self, observer: StepObserver, *, runner_time: bool = False) -> None:
        """Call `observer` with a ModelStep once per model step (after the model ran, before
        sampling), from the stepping thread. `runner_time` asks for the runner's time up to its
        logits, which syncs each step there (jserve.engine.step_observer); with no observer a
        step pays one `if` for them."""
        self._step_observers.append((observer, runner_time))

    def remove_step_observer(self, observer: StepObserver) -> None:
        kept = [(o, timed) for o, timed in self._step_observers if o != observer]
        if len(kept) == len(self._step_observers):
            raise ValueError(f"{observer!r} is not a step observer of this engine")
        self._step_observers = kept

    def _run_observed(self, plan: StepPlan, inputs: StepInputs) -> StepOutput:
        started = time.perf_counter()
        output = self.runner.run(inputs)
        runner_s = None
        if any(timed for _, timed in self._step_observers):
            jax.block_until_ready(output.logits)
            runner_s = time.perf_counter() - started
        step = ModelStep.of(plan, inputs, runner_s)
        for observer, _ in self._step_observers:
            observer(step)
        return output

    def _sample(
        self, plan: StepPlan, output: StepOutput, changed: dict
    ) -> dict[str, list[tuple[int, list | None]]]:
        """Each sampled seq's new tokens with their logprobs: one, or for a decode with
        drafts its accepted drafts and the target's next token. Records the prompt rows'
        logprobs and pools embedding requests' hidden states on the way."""
        # None: the request ended while its step ran (async scheduling); its rows are not wanted.
        children = [self._children.get(seq.request_id) for seq in plan.seqs]
        firsts = []  # each seq's first row of logits (drafts and prompt rows make several)
        num_rows = 0
        for seq in plan.seqs:
            firsts.append(num_rows)
            num_rows += seq.num_rows
        # Computed while the model step dispatched above runs (see jserve.structured.decoding).
        masks, mask_failed = self.structured.fill_masks(
            [
                (firsts[i] + seq.sample_row, child.matcher, seq.output_token_ids)
                for i, (seq, child) in enumerate(zip(plan.seqs, children, strict=True))
                if child is not None and child.matcher is not None and seq.sample
            ]
        )
        rows = []
        kept = []  # seqs whose rows serve more than sampling: prompt logprobs, pooling
        for i, (seq, child) in enumerate(zip(plan.seqs, children, strict=True)):
            if child is None:
                rows.extend([NEUTRAL_ROW] * seq.num_rows)
                continue
            mask = masks.get(firsts[i] + seq.sample_row, child.allowed)
            rows.extend(_sampling_rows(seq, child, mask))
            if seq.every_row or child.state.pooler is not None:
                kept.append((i, firsts[i], child))
        result = self.sampler.sample(output.logits, rows)
        row_failed = {**mask_failed, **result.failed}
        failed = {bisect_right(firsts, r) - 1: e for r, e in row_failed.items()}
        for i, error in failed.items():
            self._fail(plan.seqs[i].request_id, error, changed)
        if kept:
            self._keep_rows(plan, kept, result, output)
        sampled = {}
        for i, seq in enumerate(plan.seqs):
            if not seq.sample or children[i] is None or i in failed:
                continue
            first = firsts[i] + seq.sample_row
            targets = [result.row(first + j) for j in range(1 + seq.num_drafts)]
            if seq.num_drafts:
                drafts = seq.token_ids[1:]
                accepted = num_accepted(drafts, [token for token, _ in targets])
                self.spec_decode.record(seq.num_drafts, accepted)
                del targets[accepted + 1 :]
            sampled[seq.request_id] = targets
        return sampled

    def _keep_rows(
        self,
        plan: StepPlan,
        kept: list[tuple[int, int, _Child]],
        result: SampledTokens,
        output: StepOutput,
    ) -> None:
        """Record the prompt rows' scored tokens (row j of a chunk starting at position p
        scores the prompt token at p + j + 1), and add embedding requests' rows of final
        hidden states to their pools (which brings the hidden states to the host)."""
        hidden = None
        for i, first, child in kept:
            seq, state = plan.seqs[i], child.state
            if seq.every_row and state.prompt_row_params is not None:
                for j in range(len(seq.token_ids) - seq.sample):
                    _, logprob, rank, top = result.scored(first + j)
                    state.add_prompt_logprob(seq.start_pos + j + 1, logprob, rank, top)
            if state.pooler is not None:
                if hidden is None:
                    hidden = np.asarray(jax.device_get(output.hidden))
                start = seq.start_pos + len(seq.token_ids) - seq.num_rows
                state.pooler.add(start, hidden[first : first + seq.num_rows])

    def _postprocess(self, plan: StepPlan, sampled: dict, changed: dict) -> None:
        now = time.monotonic()
        for seq in plan.seqs:
            child = self._children.get(seq.request_id)
            if child is None:
                continue  # failed while its step was prepared
            state = child.state
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                # Its first chunk starts after the tokens its admission found cached.
                state.num_cached_tokens = seq.start_pos
        before = {seq.request_id: len(seq.output_token_ids) for seq in plan.seqs if seq.num_drafts}
        tokens = {rid: toks[-1][0] for rid, toks in sampled.items()}
        accepted = {rid: len(toks) - 1 for rid, toks in sampled.items() if len(toks) > 1}
        finished = {
            r.request_id: r for r in self.scheduler.update_from_output(plan, tokens, accepted)
        }
        for rid, toks in sampled.items():
            child = self._children.get(rid)
            if child is None:
                continue
            changed[child.state.request_id] = child.state
            if child.state.pooler is not None:
                self._finish_pooled(rid, child, rid in finished, changed)
                continue
            request = finished.get(rid)
            if request is not None and rid in before:  # the stop rules may end it early
                del toks[request.num_output_tokens - before[rid] :]
            by_token = request.finish_reason if request is not None else None
            self._add_tokens(rid, child, toks, by_token, changed)

    def _add_tokens(
        self,
        rid: str,
        child: _Child,
        tokens: list[tuple[int, list | None]],
        by_token: FinishReason | None,
        changed: dict,
    ) -> None:
        """Feed a sequence's new tokens (all kept by the scheduler, which ended it on the
        last with `by_token`, if given) to its output state and grammar, in order, finishing
        it on the first that a stop rule ends it on."""
        for j, (token, top) in enumerate(tokens):
            self._num_generation_tokens += 1
            last = by_token if j == len(tokens) - 1 else None
            try:
                stop_string = child.state.add_token(
                    child.index, token, top, stop_token=last is FinishReason.STOP
                )
                complete = child.matcher is not None and self.structured.advance(
                    child.matcher, token
                )
            except Exception as e:  # detokenizing, a stop check or the grammar of it failed
                self._fail(rid, f"{type(e).__name__}: {e}", changed)
                return
            decision = child.state.stop.decide(token, last, stop_string, complete)
            if decision is None:
                continue
            if last is None:  # the scheduler ended it already otherwise
                self.scheduler.finish_request(rid, decision.reason)
            self._finish_child(rid, decision.reason, decision.stop_reason, changed)
            return

    def _finish_pooled(self, rid: str, child: _Child, finished: bool, changed: dict) -> None:
        """End an embedding request whose prompt is computed; its sampled token is dropped."""
        if not finished:  # its one token ends it (max_tokens=1): this is a safety net
            self.scheduler.finish_request(rid, FinishReason.STOP)
        try:
            child.state.finish_pooled()
        except ValueError as e:
            self._fail(rid, str(e), changed)
            return
        self._children.pop(rid, None)

    def _fail(self, child_id: str, error: str, changed: dict) -> None:
        """End the request owning `child_id` with finish reason "error": a host-side part of
        its step failed. Only this request fails; the rest of the batch goes on."""
        child = self._children.get(child_id)
        if child is None:
            return
        log.error("request %s failed: %s", child.state.request_id, error)
        child.state.error = error
        self.abort_request(child.state.request_id, FinishReason.ERROR)
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
            outputs.append(self.abort_request(request_id, FinishReason.ERROR))
        self._in_flight = None  # its rows' requests failed above; its pool is re-made
        self._fresh_scheduler()
        self.runner.reset_kv_cache()
        self.num_restarts += 1
        return [out for out in outputs if out is not None]

    def reset(self) -> None:
        """Start over as a freshly built engine would, keeping the compiled steps: a fresh
        scheduler (empty prefix cache, zeroed counters; the same settings, tenants and learned
        step costs). For benchmarks and tests that reuse one engine; only while idle."""
        if self.has_unfinished_requests():
            raise RuntimeError("reset() while requests are unfinished; abort them first")
        self._fresh_scheduler()

    def _fresh_scheduler(self) -> None:
        """An empty scheduler like the old one; KV-event listeners hear the old prefix cache's
        last changes, then that it is gone."""
        if self._kv_events is not None:
            self._kv_events.publish([*self.scheduler.take_kv_events(), AllBlocksCleared()])
        self.scheduler = self.scheduler.fresh()

    def _finish_child(
        self, child_id: str, reason: FinishReason, stop: int | str | None, changed: dict
    ) -> None:
        child = self._children.pop(child_id, None)
        if child is None:
            return
        child.state.finish_sample(child.index, reason, stop)
        changed[child.state.request_id] = child.state

    def close(self) -> None:
        """Release what outlives a step: the KV-events sockets (queued batches are sent); and
        write the learned step costs where `save_step_costs` says."""
        if self._kv_events is not None:
            self._kv_events.close()
        if self.args.save_step_costs:
            report = learned_report(self.scheduler.step_costs)
            Path(self.args.save_step_costs).write_text(json.dumps(report, indent=1))
            log.info("wrote the learned step costs to %s", self.args.save_step_costs)

    # ---- operators' view -----------------------------------------------------------------

    def scheduler_settings(self) -> dict:
        """The scheduler settings run-time control may change, and their values."""
        return current_settings(self.scheduler)

    def control(self, changes: dict) -> dict:
        """Change scheduler settings between steps (ValueError: nothing changed); within
        what was precompiled. Returns the settings after (see jserve.core.control)."""
        limits = {
            "max_num_batched_tokens": self.args.max_num_batched_tokens,
            "max_num_seqs": self.args.max_num_seqs,
        }
        return apply_changes(self.scheduler, changes, limits)

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
            serving_compilations=serving_compilation_count(),
            num_restarts=self.num_restarts,
            iteration_tokens=iteration_tokens,
            spec_decode_num_drafts=self.spec_decode.num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decode.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(
                self.spec_decode.num_accepted_tokens_per_pos
            ),
        )


def _write_pending_tokens(
    plan: StepPlan, inputs: StepInputs, sampled: dict[str, list[tuple[int, list | None]]]
) -> None:
    """Write the tokens the previous step sampled over `plan`'s placeholder inputs (decodes
    come first, one token each). A row whose token did not come (its request failed or ended)
    gets 0: its request is gone, and its row is never sampled."""
    token_ids, seqs = inputs.token_ids, plan.seqs
    for i in range(plan.num_decodes):
        seq = seqs[i]
        if seq.token_ids[0] == PLACEHOLDER_TOKEN:
            got = sampled.get(seq.request_id)
            token_ids[i] = 0 if got is None else got[-1][0]
