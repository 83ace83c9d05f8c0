"""OpenAI-compatible HTTP server over the D3D engine (`d3d serve`, `python -m sglang_d3d.server`).

One job per module, in the order a request meets them:

- `main.py`: run_server(argv): flags -> backend check -> uvicorn (graceful drain on shutdown).
- `args.py`: ServerConfig (frozen, wraps EngineConfig) and the argparse that mirrors it.
- `app.py`: create_app(cfg): routes, error handlers, metrics; the engine loads in the background.
- `routes.py`: the endpoints (/v1/chat/completions, /v1/completions, /v1/models, /health,
  /metrics), and the request schemas of the self-parsing ones in /openapi.json.
- `auth.py`: API keys (`--api-key`, D3D_API_KEY) on /v1/*, compared in constant time.
- `serving.py`: the flow both generation endpoints share: read, prepare on a worker thread
  (parse, template, tokenize), compile a grammar, submit the `n` choices, stream or collect.
- `body.py`: request bodies read with a size limit (413) and a time limit (408), parsed off
  the event loop with a nesting limit, the garbage collector paused and big lists freed in
  slices around big bodies.
- `limits.py`: size limits checked before any work: JSON nesting, grammar sources (bytes,
  enum values, properties, brackets, character classes that match nothing).
- `structured.py`: response_format, regex, ebnf and forced calls -> a grammar, compiled in
  worker processes under a time limit and a cap (speculative/grammar_pool.py).
- `protocol.py`: request and response bodies in OpenAI's shapes (+ the `d3d` stats field).
- `unsupported.py`: known OpenAI fields the server cannot honour -> a 400 naming the field.
- `inputs.py`: request -> prompt ids (chat template, tool history) and SamplingParams.
- `generation.py`: one choice through the engine: its events on the serving loop -> text,
  log-probabilities, usage, stats.
- `detokenize.py`: incremental detokenisation and stop-string matching.
- `responses.py`, `streaming.py`: whole bodies and SSE chunks for chat and completions.
- `logprobs_out.py`: log-probabilities in OpenAI's chat and completions shapes; token names.
- `errors.py`: APIError and the handlers that give every error OpenAI's shape.
- `metrics.py`: the Prometheus recorder (names in docs/design.md) and its PromQL.
- `engine_holder.py`: the engine loaded on a thread (/health answers meanwhile).
- `backends.py`: embedded engine or SGLang, with a clear failure when one cannot run.
- `http_layer.py`: uvicorn set up to refuse unparsable requests and huge headers in OpenAI's
  shape (431), and to stop grammar compiles as soon as shutdown begins.
- `testing.py`: the real server on a thread, over a tiny model pair, for tests.
"""
