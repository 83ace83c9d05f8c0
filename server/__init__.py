"""OpenAI-compatible HTTP server over the D3D engine (`d3d serve`, `python -m sglang_d3d.server`).

One job per module, in the order a request meets them:

- `main.py`: run_server(argv): flags -> backend check -> uvicorn (graceful drain on shutdown).
- `args.py`: ServerConfig (frozen, wraps EngineConfig) and the argparse that mirrors it.
- `app.py`: create_app(cfg): routes, error handlers, metrics; the engine loads in the background.
- `routes.py`: the endpoints (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).
- `protocol.py`: request and response bodies in OpenAI's shapes (+ the `d3d` stats field).
- `errors.py`: APIError and the handlers that give every error OpenAI's shape.
- `auth.py`: API keys (`--api-key`, D3D_API_KEY) on /v1/*, compared in constant time.
- `body.py`: request bodies read with a size limit (413) and parsed off the event loop.
- `heap.py`: the garbage collector paused, and big lists freed in slices, around big bodies.
- `unsupported.py`: known OpenAI fields the server cannot honour -> a 400 naming the field.
- `openapi.py`: the request schemas of those self-parsing endpoints, back in /openapi.json.
- `serving.py`: the flow both generation endpoints share: read, prepare on a worker thread
  (parse, template, tokenize), submit the `n` choices, stream or collect.
- `prompts.py`, `sampling.py`: request -> prompt ids (chat template, tool history) and
  SamplingParams.
- `generation.py`: one choice through the engine: token events -> text, log-probabilities,
  usage, stats.
- `logprobs_out.py`: log-probabilities in OpenAI's chat and completions shapes; token names.
- `engine_client.py`: background engine loading; the thread -> asyncio bridge for events.
- `detokenize.py`, `stop_strings.py`: incremental detokenisation and stop-string matching.
- `responses.py`, `streaming.py`: whole bodies and SSE chunks for chat and completions.
- `metrics.py`: the Prometheus recorder (names in docs/design.md) and its PromQL.
- `backends.py`: embedded engine or SGLang, with a clear failure when one cannot run.
- `testing.py`: the real server on a thread, over a tiny model pair, for tests.
"""
