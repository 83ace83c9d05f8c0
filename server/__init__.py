"""OpenAI-compatible HTTP server over the D3D engine (`d3d serve`, `python -m server`).

One job per module, in the order a request meets them:

- `main.py`: run_server(argv): flags -> backend check -> uvicorn (graceful drain on shutdown).
- `args.py`: ServerConfig (frozen, wraps EngineConfig) and the argparse that mirrors it.
- `app.py`: create_app(cfg): routes, error handlers, metrics; the engine loads in the background.
- `routes.py`: the endpoints (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).
- `protocol.py`: request and response bodies in OpenAI's shapes (+ the `d3d` stats field).
- `errors.py`: APIError and the handlers that give every error OpenAI's shape.
- `serving.py`: the flow both generation endpoints share: validate, submit, stream or collect.
- `prompts.py`, `sampling.py`: request -> prompt ids (chat template) and SamplingParams.
- `generation.py`: one request through the engine: token events -> text, usage, stats.
- `engine_client.py`: background engine loading; the thread -> asyncio bridge for events.
- `detokenize.py`, `stop_strings.py`: incremental detokenisation and stop-string matching.
- `responses.py`, `streaming.py`: whole bodies and SSE chunks for chat and completions.
- `metrics.py`: the Prometheus recorder (names in docs/design.md) and its PromQL.
- `backends.py`: embedded engine or SGLang, with a clear failure when one cannot run.
- `testing.py`: the real server on a thread, over a tiny model pair, for tests.
"""
