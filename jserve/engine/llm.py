"""The offline API, shaped like vLLM's `LLM` because users already write that code.

from jserve import LLM, SamplingParams
llm = LLM()  # the default SmolLM2-135M-Instruct
outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from jserve.config.engine_args import EngineArgs
from jserve.engine.beam_search import BeamSearchOutput, beam_search_offline
from jserve.engine.llm_engine import LLMEngine, Prompt
from jserve.outputs import RequestOutput
from jserve.sampling_params import BeamSearchParams, PoolingParams, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {sorted(unknown)}; "
                f"known: {sorted(EngineArgs.field_names())}"
            )
        if isinstance(engine_args.get("speculative_config"), dict):  # vLLM's spelling here
            engine_args["speculative_config"] = json.dumps(engine_args["speculative_config"])
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.

        A prompt is a string, or vLLM's dict: {"prompt": text} or {"prompt_token_ids": [...]},
        with an optional "cache_salt" (prefix-cache blocks shared only with its salt's
        requests); `sampling_params` is one for all or a list with one per prompt.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                    "give one, or one per prompt"
                )
        ids = []
        for prompt, params in zip(prompts, params_list, strict=True):
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_request(request_id, prompt, params)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Each prompt's embedding (`RequestOutput.embedding`: its final hidden states pooled
        by `pooling_params`, last token by default, L2-normalized), in prompt order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        pooling = pooling_params or PoolingParams()
        ids = []
        for prompt in prompts:
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_request(request_id, prompt, pooling=pooling)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate; with
        `continue_final_message` each goes on with its final message (a prefilled answer)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [
            {
                "prompt_token_ids": tok.encode(
                    tok.apply_chat_template(
                        conv,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                    ),
                    add_special_tokens=False,
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Each prompt's best `params.beam_width` beams (jserve.engine.beam_search), best
        first, as vLLM's `LLM.beam_search`; every prompt's beams run together, a step a token.
        A prompt is one `generate` takes (text, ids, or vLLM's dict with an optional
        "cache_salt"); a beam's `tokens` start with its prompt's."""
        return beam_search_offline(
            self.engine, prompts, params, lambda ids: self._run(ids, use_tqdm=False)
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        bar = tqdm(
            total=len(request_ids), desc="Processed prompts", file=sys.stderr, disable=not use_tqdm
        )
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return [final[rid] for rid in request_ids]
