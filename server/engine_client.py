"""The narrow interface between the HTTP server and an engine.

The server talks to nothing else, so it can be tested against a mock whose output is computed
by hand, and the real async engine only has to provide these few members.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from jserve.config.scheduler import Lane
from jserve.core.tenants import DEFAULT_TENANT
from jserve.outputs import EngineState, EngineStats, RequestOutput
from jserve.sampling_params import PoolingParams, SamplingParams


class TokenizerLike(Protocol):
    stop_token_ids: frozenset[int]  # the model's own stop tokens (EOS, end of turn)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        continue_final_message: bool = False,  # end inside the final message (transformers')
        chat_template: str | None = None,  # instead of the model's (transformers')
        **variables: Any,
    ) -> str: ...


class EngineClient(Protocol):
    """What the server needs from an engine.

    `generate`'s prompt is text, token ids, or vLLM's dict (`{"prompt_token_ids": ids}` with an
    optional "cache_salt": its prefix-cache blocks are shared only with requests of that salt).
    It yields cumulative RequestOutputs (per CompletionOutput: `text` extends the
    previous text, `token_ids` and `logprobs` grow); the last one has `finished=True`. It raises
    `jserve.errors.RequestRejected` at the first iteration when the request is not admitted,
    `lane` is a jserve.config.scheduler.Lane, `tenant` names who it is served for,
    and `jserve.errors.EngineDeadError` when the engine dies. A request not finished `timeout`
    seconds after `generate` was called, waiting or running, finishes with finish_reason
    "timeout" and keeps the tokens it generated (jserve.core.deadlines states the rule).
    With `pooling` it is an embedding request: `params` are not used, nothing is generated,
    and its one finished output carries the `embedding` (`hidden_size` floats).
    `abort` frees the request's KV blocks at once and ends its stream (finish_reason "abort");
    aborting an unknown or finished request is a no-op. `stats` returns a snapshot;
    `iteration_tokens` is drained by each call.
    """

    model_name: str
    quantization: str  # the weights as served: "none", or "gguf:" and their block formats
    kv_cache_dtype: str  # the KV pool's elements' dtype: "float32" (the model's), "int8", ...
    num_kv_blocks: int  # the KV pool's blocks, the padding sink included
    max_model_len: int
    vocab_size: int  # token ids are in [0, vocab_size)
    hidden_size: int  # an embedding's length
    tokenizer: TokenizerLike
    state: EngineState
    dead_reason: str | None
    num_restarts: int  # in-process restarts after failed steps (each failed its requests)
    # Fixed sizes a router reads (jserve.server.worker_api): sequences run at once, the KV pool in
    # tokens (usable blocks x block size), tokens per block, devices the model is sharded over.
    max_num_seqs: int
    kv_cache_tokens: int
    block_size: int
    tensor_parallel_size: int

    def generate(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        request_id: str,
        *,
        lane: Lane = Lane.INTERACTIVE,
        timeout: float | None = None,
        tenant: str = DEFAULT_TENANT,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def control(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Scheduler settings after applying `changes` (empty: just read them); an
        InvalidSetting (jserve.config.settings) names the field that is wrong and says why
        (then nothing changed): jserve.core.control."""
        ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...
