"""The serving worker's OpenAI-compatible HTTP server (vLLM's, route for route).

    python -m serving.engine.server --model PATH [--port 8100] [--lora-modules name=path ...]

Modules: `cli` (flags), `serve` (uvicorn and signals), `app` (routes), `worker` (engine life
cycle, admission, drain), `completions` / `chat` (the two OpenAI formats over `generation`),
`protocol` (request and response bodies), `errors`, `streaming` (SSE), `adapters` (names served),
`metrics` (Prometheus), `registry_sync` (registry snapshot and deploy events),
`worker_registry` (this worker's entry in Redis), `on_demand` (the gateway's first-request loads),
`auth` (the operator's key), `body_limit` (413), `adapter_roots` (where adapters may be read),
`chat_template_sandbox` / `chat_template_child` (callers' templates in a child process).
Operator guide: docs/serving-worker.md.
"""
