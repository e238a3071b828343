"""jserve: a JAX/XLA LLM inference engine.

`from jserve import LLM, SamplingParams` is the offline API. LLM is imported lazily so that
`import jserve.core` (the pure-Python scheduler) never pulls in JAX.
"""

from jserve.sampling_params import (
    BeamSearchParams,
    PoolingParams,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["LLM", "BeamSearchParams", "PoolingParams", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    if name == "LLM":
        from jserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'jserve' has no attribute {name!r}")
