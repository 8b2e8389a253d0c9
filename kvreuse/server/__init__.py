"""OpenAI-compatible HTTP server: ``kvreuse serve``.

- `protocol`: request models (strict, unknown parameters are a 400) and response / SSE bodies;
- `async_engine`: the engine loop on its own thread, met by asyncio handlers through queues;
- `state`: what every route shares (`ServerState`, `ServerConfig`, `ServedAdapter`): engine, auth,
  adapters, admission and the request checks;
- `openai_routes`, `anthropic`, `cache_routes`, `lora_routes`, `dashboard_routes`: one router per API
  (OpenAI, Anthropic Messages, cache administration, LoRA adapters, the dashboard); each imports
  `state`, never `app`;
- `app`: the app factory (`build_app`), error handlers, health, metrics, models; it includes the routers;
- `auth`: API keys, admin keys and tenant cache namespaces;
- `metrics`: Prometheus registry (``kvreuse:`` names) and the periodic stats log line;
- `serve`: the command (uvicorn with a SIGTERM drain);
- `errors`: OpenAI-shaped errors.

Nothing heavy is imported here, so ``import kvreuse.server.auth`` stays cheap.
"""
