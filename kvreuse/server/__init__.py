"""OpenAI-compatible HTTP server: ``kvreuse serve``.

- `protocol`: request models (strict, unknown parameters are a 400) and response / SSE bodies;
- `async_engine`: the engine loop on its own thread, met by asyncio handlers through queues;
- `app`: the app factory (`build_app`, `ServerState`, `ServerConfig`), error handlers, health, models;
- `openai_routes`, `anthropic`, `cache_routes`: one router per API (OpenAI, Anthropic Messages,
  cache administration);
- `auth`: API keys, admin keys and tenant cache namespaces;
- `metrics`: Prometheus registry (``kvreuse:`` names) and the periodic stats log line;
- `serve`: the command (uvicorn with a SIGTERM drain);
- `errors`: OpenAI-shaped errors.

Nothing heavy is imported here, so ``import kvreuse.server.auth`` stays cheap.
"""
