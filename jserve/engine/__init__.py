"""Layer: engine. The step loop that joins policy (`jserve.core`) and mechanism
(`jserve.runtime`): building the parts (`setup`), the loop and request bookkeeping
(`llm_engine`), per-request output state (`output_processor`), the asyncio front the server uses
(`async_engine`), the offline `LLM`, and the followers of a multi-process run."""
