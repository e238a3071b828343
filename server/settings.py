"""ServerSettings: every setting of the HTTP server, declared like EngineArgs.

Each setting is documented once, in its field's metadata (jserve.config.settings): its help,
vLLM's name for it, its default and its valid range. `jserve serve --help` and the class
docstring are generated from it, and both the flag parser and the constructor check the range,
so a bad value fails the same way from the command line or from Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from jserve.config.settings import Bounds, check_settings, documented, setting
from jserve.config.validation import INT32_MAX
from jserve.sampling_params import MAX_LOGPROBS, PoolingType

_SECONDS = Bounds(0.0, 86_400.0, lo_open=True)  # a timeout: more than 0, at most a day


class ToolCallParser(StrEnum):
    """The tool-call formats jserve parses (server/tools.py): Hermes-style <tool_call> blocks
    of JSON, vLLM's `hermes` parser."""

    HERMES = "hermes"


class LogLevel(StrEnum):
    """Log levels, as uvicorn names them (trace logs as debug)."""

    CRITICAL = "critical"
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"
    DEBUG = "debug"
    TRACE = "trace"


@documented
@dataclass(frozen=True)
class ServerSettings:
    """How the HTTP server listens, authenticates, limits clients and shuts down."""

    host: str = setting("127.0.0.1", "address to bind", vllm="--host")
    port: int = setting(
        8000, "port to bind; 0 picks a free one", vllm="--port", bounds=Bounds(0, 65535)
    )
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on every endpoint except /health and /metrics "
        "(and enable /admin/scheduler)",
        vllm="--api-key",
        default_text="none: no authentication, admin endpoints off",
    )
    served_model_name: str | None = setting(
        None,
        "model id clients send and /v1/models lists",
        vllm="--served-model-name",
        default_text="the engine's model name",
    )
    shutdown_timeout: float = setting(
        30.0,
        "seconds in-flight requests may take to finish after SIGTERM or SIGINT; then each "
        "still running is cut, its stream ending with an error event and [DONE] (a second "
        "SIGINT cuts them at once)",
        vllm="--shutdown-timeout",
        bounds=Bounds(0.0, 86_400.0),
    )
    max_body_bytes: int = setting(
        4 * 1024 * 1024,
        "larger request bodies are refused with 413",
        bounds=Bounds(1, INT32_MAX),
    )
    header_timeout: float = setting(
        10.0,
        "seconds a new connection may take to send its first complete request head before it "
        "is closed",
        bounds=_SECONDS,
    )
    keepalive_timeout: float = setting(
        75.0,
        "seconds an idle keep-alive connection stays open; keep it longer than clients' "
        "connection pools keep theirs, or they lose requests sent as it closes",
        bounds=_SECONDS,
    )
    body_timeout: float = setting(
        30.0,
        "seconds a client may take to send a request body; a stalled body gets 408",
        bounds=_SECONDS,
    )
    stream_idle_timeout: float = setting(
        120.0,
        "seconds a streaming client may stop reading before its request is aborted and its KV "
        "freed; 0 = wait forever",
        bounds=Bounds(0.0, 86_400.0),
    )
    max_tenant_labels: int = setting(
        32,
        "tenants (besides those of --tenants-file) with their own metric label; later ones are "
        "reported as 'other'",
        bounds=Bounds(0, 100_000),
    )
    max_half_open_connections: int = setting(
        512,
        "connections that have not yet sent a complete request head; a new one past this "
        "closes the oldest",
        bounds=Bounds(1, 1_000_000),
    )
    enable_auto_tool_choice: bool = setting(
        True,
        'serve tool_choice "auto" (the default with tools): calls the model writes are parsed '
        "into tool_calls; --no-enable-auto-tool-choice refuses it with a 400, as vLLM does "
        "without --enable-auto-tool-choice",
        vllm="--enable-auto-tool-choice",
    )
    tool_call_parser: ToolCallParser = setting(
        ToolCallParser.HERMES,
        "format of the tool calls the model writes, which the tool prompt asks for",
        vllm="--tool-call-parser",
        choices=ToolCallParser,
    )
    trust_request_chat_template: bool = setting(
        False,
        "render a chat request's own chat_template (Jinja, in the sandbox the model's template "
        "runs in) instead of refusing it with a 400, as vLLM's flag does: a template runs on "
        "the server's CPU, so set it only for clients you trust",
        vllm="--trust-request-chat-template",
    )
    max_logprobs: int = setting(
        MAX_LOGPROBS,
        "most logprobs (completions) or top_logprobs (chat) a request may ask for; more is a 400",
        vllm="--max-logprobs",
        bounds=Bounds(0, MAX_LOGPROBS),
    )
    generation_config: str = setting(
        "auto",
        "default sampling parameters of requests that leave them out: auto reads "
        "generation_config.json in the model's directory (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens as max_tokens; a GGUF has none), vllm uses "
        "jserve's own defaults, a folder reads that folder's generation_config.json",
        vllm="--generation-config",
    )
    enable_log_requests: bool = setting(
        False,
        "log each request (id, prompt tokens, sampling parameters) at INFO",
        vllm="--enable-log-requests",
    )
    log_level: LogLevel = setting(
        LogLevel.INFO,
        "level of the server's log (trace logs as debug)",
        vllm="--uvicorn-log-level",
        choices=LogLevel,
    )

    pooling_type: PoolingType = setting(
        PoolingType.LAST,
        "how /v1/embeddings pools the prompt's final hidden states before L2-normalizing: the "
        "last token's, or their mean (the pooling_type of vLLM's pooler config)",
        vllm="--override-pooler-config '{\"pooling_type\": ...}'",
        choices=PoolingType,
    )

    def __post_init__(self) -> None:
        check_settings(self)
