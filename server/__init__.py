"""Layer: server (installed as `jserve.server`; no jax). The aiohttp app: the OpenAI protocol,
SSE, errors, metrics, timeouts, admin and worker endpoints, and the `jserve` program. It talks to
the engine only through `jserve.server.engine_client.EngineClient`."""
